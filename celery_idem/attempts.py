"""What the library knows about the attempt running on this thread: never a request attribute.

Celery copies every message header into the task request, so nothing internal may ride on the
request: a producer could set it (DESIGN, "Headers are input"). The handler opens an
:class:`Attempt` when a message of an idempotent task starts (``IdempotentTask.__call__``), fills
it as the attempt goes (identity, fingerprint, owner token), and the ledger, ``replace()`` and the
failure settling read it from here. It lives in a context variable for the duration of the call, so
a body that runs another idempotent task inline (``apply()``) gets that task's attempt inside it and
its own back after.

The request keeps only what the library sets there for the user: ``request.idempotency_key`` and
``request.idempotency_scope``, written before the body (or anything else) reads them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .records import Identity

__all__ = ["Attempt", "begin", "current", "running"]


@dataclass
class Attempt:
    """One message of an idempotent task on this worker, as the handler runs it."""

    task_name: str
    task_id: str
    identity: Identity
    fingerprint: str  # the caller's call (a retry with changed arguments keeps the first one's)
    owner: str | None = None  # the owner token once the record is acquired (None: unprotected run)
    ledger_nonce: str | None = None  # Ledger.run_once: the nonce of its row, or "committed"
    ledger: Any = None  # ...and the Ledger it wrote to
    replaced: bool = False  # replace() sent a replacement under this task id (its Ignore is no failure)
    handed_over: bool = False  # ...and handed the record to it (the same call); else callbacks settle it
    replacement_wait: float = 0.0  # how long the replacement may wait to run (its countdown or ETA included)
    lease: Any = None  # the heartbeat's Lease of this attempt, while it holds one


_current: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar("celery_idem_attempt", default=None)


@contextlib.contextmanager
def running() -> Iterator[None]:
    """The scope of one message's call: an attempt begun inside it ends with it."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def begin(task: Any, identity: Identity, fingerprint: str) -> Attempt:
    """Open the attempt of ``task``'s running message (inside :func:`running`)."""
    attempt = Attempt(task.name, task.request.id, identity, fingerprint)
    _current.set(attempt)
    return attempt


def current(task: Any) -> Attempt | None:
    """The attempt of ``task``'s running message on this thread, or None (no idempotent attempt runs,
    or the one that runs is another task's or another message's)."""
    attempt = _current.get()
    if attempt is None or attempt.task_name != task.name or attempt.task_id != task.request.id:
        return None
    return attempt
