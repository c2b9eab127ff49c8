"""Owner tokens that name their worker: which node holds an attempt.

A worker mints its attempt's owner token as ``<uuid hex>@<node>``, the node being the worker's
name as ``inspect`` replies carry it (``celery@host``). The reconciler reads the node back to tell
"the worker that holds this attempt answered and does not have it" (dead) from "the worker that
holds it did not answer" (busy, a solo pool, a slow network: unknown). A claim's token, a retry's
and an older token carry no node.
"""

from __future__ import annotations

import hashlib
import uuid

__all__ = ["OWNER_MAX_LENGTH", "holder_node", "node_tag", "worker_token"]

OWNER_MAX_LENGTH = 64  # the SQL store's owner column
_NODE_ROOM = OWNER_MAX_LENGTH - 33  # after the uuid's 32 hex digits and the "@"


def node_tag(hostname: str) -> str:
    """A worker's name as a token carries it: whole if it fits, else cut and suffixed with a hash of
    the whole name, so two long names that share a prefix still differ."""
    if len(hostname) <= _NODE_ROOM:
        return hostname
    digest = hashlib.sha256(hostname.encode("utf-8")).hexdigest()[:8]
    return f"{hostname[: _NODE_ROOM - 9]}~{digest}"


def worker_token(hostname: str | None) -> str:
    """A fresh owner token for an attempt on the worker ``hostname`` (a bare uuid without one)."""
    token = uuid.uuid4().hex
    return f"{token}@{node_tag(hostname)}" if hostname else token


def holder_node(owner: str) -> str | None:
    """The node tag of the worker whose attempt minted ``owner``; None for a token without one."""
    return owner.partition("@")[2] or None
