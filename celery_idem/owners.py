"""Owner tokens that name their holder: which worker node and which process hold an attempt.

A worker mints its attempt's owner token as ``<15 hex>.<liveness id>@<node>``: a random part of its
own, the liveness id of the process that runs the attempt (:mod:`celery_idem.liveness`), and the
node, the worker's name as ``inspect`` replies carry it (``celery@host``). The reconciler reads the
liveness id back to ask the store whether the holder process is alive (positive evidence of death,
whoever answers ``inspect``), and the node to tell "the worker that holds this attempt answered and
does not have it" from "it did not answer". A claim's token, a retry's and an older token
(``<uuid hex>@<node>``, a bare uuid) carry neither or only the node.
"""

from __future__ import annotations

import hashlib
import uuid

__all__ = ["OWNER_MAX_LENGTH", "holder_node", "holder_process", "node_tag", "worker_token"]

OWNER_MAX_LENGTH = 64  # the SQL store's owner column
_NODE_ROOM = OWNER_MAX_LENGTH - 33  # after 15 hex digits, ".", a 16-digit liveness id and "@" (as a uuid's 32)
PROCESS_ID_LENGTH = 16


def node_tag(hostname: str) -> str:
    """A worker's name as a token carries it: whole if it fits, else cut and suffixed with a hash of
    the whole name, so two long names that share a prefix still differ."""
    if len(hostname) <= _NODE_ROOM:
        return hostname
    digest = hashlib.sha256(hostname.encode("utf-8")).hexdigest()[:8]
    return f"{hostname[: _NODE_ROOM - 9]}~{digest}"


def worker_token(hostname: str | None, process: str | None = None) -> str:
    """A fresh owner token for an attempt run by the process ``process`` (its liveness id) on the
    worker ``hostname``; a bare uuid without either."""
    if process is None:
        token = uuid.uuid4().hex
    else:
        if len(process) != PROCESS_ID_LENGTH or "." in process or "@" in process:
            raise ValueError(f"a liveness id in a token is {PROCESS_ID_LENGTH} characters without '.' or '@'")
        token = f"{uuid.uuid4().hex[:15]}.{process}"
    return f"{token}@{node_tag(hostname)}" if hostname else token


def holder_node(owner: str) -> str | None:
    """The node tag of the worker whose attempt minted ``owner``; None for a token without one."""
    return owner.partition("@")[2] or None


def holder_process(owner: str) -> str | None:
    """The liveness id of the process whose attempt minted ``owner``; None for a token without one."""
    _, dot, process = owner.partition("@")[0].partition(".")
    return process if dot and len(process) == PROCESS_ID_LENGTH else None
