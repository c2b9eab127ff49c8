"""A duplicate's continuation runs once per message, however many copies of the message come.

A duplicate that carries a continuation (a link or errback, the rest of a chain, the chord or group
it is a member of) is published anyway (:mod:`celery_idem.publish`) under a task id of its own, and
the worker replays the key's outcome into it. The key's record names the original's task id, so it
cannot tell a copy of that message (a broker's redelivery, a caller sending it again) from the
message itself: each copy would run the continuation again, or count again towards its chord.

So that replay is fenced by a record of its own, keyed by the message's task id (DESIGN, "Rules at
the task level": a message is the unit a copy repeats). The first copy acquires it and settles it
once Celery has applied the continuation (``task_postrun``); a copy that finds it held or settled
ends quietly. Its key holds a space, which no caller's key can (:mod:`celery_idem.keys`): no call
can be taken for it, nor it for a call. A process that dies between the two leaves it to its lease:
a copy after that replays again (at least once, as plain Celery would run the link again), so a
continuation is never lost; a store that cannot be asked does not stop the replay, for that reason.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore

from . import telemetry
from .errors import IdempotencyError, StoreUnavailableError
from .records import Decision, IdempotencyRecord, Identity
from .stores.base import new_token

if TYPE_CHECKING:
    from .calling import TaskCalls
    from .runtime import Runtime
    from .stores.base import Store

__all__ = ["replay", "settled"]

logger = logging.getLogger("celery_idem.continuations")

# The fences this process holds until Celery has applied the continuation: task id -> the store,
# the fence's identity and its owner token. Task ids are unique per message, whatever the pool.
_held: dict[str, tuple[Store, Identity, str]] = {}
_lock = threading.Lock()


def replay(calls: TaskCalls, idem: Runtime, identity: Identity, fp: str, record: IdempotencyRecord) -> Any:
    """The settled ``record``'s outcome for the running message, once per message.

    Raises:
        Ignore: a copy of a duplicate whose continuation another copy applies or applied.
    """
    request = calls.task.request
    task_id = request.id
    if request.is_eager or record.task_id == task_id or not _continues(request):
        return idem.replay(record)
    fence = Identity(identity.scope, identity.task_name, f"{task_id} continuation")
    owner = new_token()
    policy = calls.policy
    try:
        taken = idem.store.acquire(
            fence, fp, task_id, lease_seconds=policy.lease_seconds, ttl_seconds=policy.ttl_seconds, owner=owner
        )
    except StoreUnavailableError as exc:
        logger.warning(
            "task %s (%s): the store could not fence its continuation (%s); replayed into it anyway",
            task_id,
            telemetry.shown(identity),
            exc,
        )
        return idem.replay(record)
    if taken.decision is not Decision.RUN:
        logger.info(
            "task %s (%s): a copy of a duplicate already answered: ends quietly", task_id, telemetry.shown(identity)
        )
        raise Ignore(f"task {task_id}: its continuation was applied by another copy of its message")
    with _lock:
        _held[task_id] = (idem.store, fence, owner)
    return idem.replay(record)


def settled(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """``task_postrun``: Celery has applied the message's continuation; the fence it took is settled."""
    if task_id is None:
        return
    with _lock:
        held = _held.pop(task_id, None)
    if held is None:
        return
    store, fence, owner = held
    try:
        store.complete(fence, owner, b"null")
    except IdempotencyError as exc:
        logger.warning("task %s: its continuation's fence was left to its lease: %s", task_id, exc)


def _continues(request: Any) -> bool:
    """Whether the message carries a continuation Celery applies after the body (or a chord counts)."""
    return any(getattr(request, name, None) for name in ("callbacks", "errbacks", "chain", "chord", "group"))
