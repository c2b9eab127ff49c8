"""A duplicate's continuation runs once per message, however many copies of the message come.

A duplicate that carries a continuation (a link or errback, the rest of a chain, the chord or group
it is a member of) is published anyway (:mod:`celery_idem.publish`) under a task id of its own, and
the worker replays the key's outcome into it. The key's record names the original's task id, so it
cannot tell a copy of that message (a broker's redelivery, a caller sending it again) from the
message itself: each copy would run the continuation again, or count again towards its chord.

So that replay is fenced by a record of the message's own: task ``celery_idem.continuation``, keyed
by the message's task id. It is an attempt like any other: the first copy acquires it under the
heartbeat and settles it once Celery has applied the continuation (``task_postrun``); a copy that
finds it settled ends quietly, and one that finds it held waits as a copy of a running task id does
(:mod:`celery_idem.busy`): in the worker, then back in the broker, until it settles (quietly) or its
lease runs out unrenewed (its holder died: the copy takes over and replays, as at least once must).
A fence is settled only when Celery applied what the replay handed it (the value, or the stored
failure into the errbacks); when Celery could not (the broker refused the link) it is released, so
that a copy of the message applies it. A store that cannot be asked keeps the message, as the
acquire of any message does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import states

from . import outage
from .busy import BusyWait, Republish
from .errors import IdempotencyError, StoreUnavailableError
from .records import Decision, IdempotencyRecord, Identity

if TYPE_CHECKING:
    from .calling import TaskCalls
    from .heartbeat import Lease
    from .runtime import Runtime

__all__ = ["FENCES", "replay", "settled"]

logger = logging.getLogger("celery_idem.continuations")

#: The task name the fences of duplicates' continuations are kept under (key: the message's task id).
FENCES = "celery_idem.continuation"


@dataclass
class _Held:
    """A fence this process holds until Celery has applied the continuation."""

    idem: Runtime
    owner: str
    lease: Lease
    raised: BaseException | None = None  # the stored failure the replay raised, if it was one


# By task id and thread: two copies of one message may run side by side (a threads pool), and the
# one that ends quietly must not settle the fence of the one that holds it.
_held: dict[tuple[str, int], _Held] = {}
_lock = threading.Lock()


def replay(
    calls: TaskCalls,
    idem: Runtime,
    record: IdempotencyRecord,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    owner: str,
    republish: Republish,
) -> Any:
    """The settled ``record``'s outcome for the running message (counted as a replay), into its
    continuation once.

    Raises:
        Ignore: a copy of a duplicate whose continuation another copy applied (or waits to).
        Retry: the store could not be asked: the message went back to the broker.
    """
    task = calls.task
    request = task.request
    task_id = request.id
    if request.is_eager or record.task_id == task_id or not _continues(request):
        idem.count("replays")
        return idem.replay(record)
    fence, policy = Identity("", FENCES, task_id), calls.policy
    wait = BusyWait(task, fence, policy, lambda: idem.store, republish, idem.count)
    while True:
        try:
            taken = idem.store.acquire(
                fence,
                record.fingerprint,  # whichever release binds the message, every copy fences alike
                task_id,
                lease_seconds=policy.lease_seconds,
                ttl_seconds=policy.ttl_seconds,
                owner=owner,
                next_look_seconds=wait.next_look_seconds(),
            )
        except StoreUnavailableError as exc:
            if idem.proceed_unprotected("acquire", fence, task_id):
                idem.count("replays")
                return idem.replay(record)
            if outage.gives_up(request, exc):
                raise
            raise outage.keep_message(task, args, kwargs, exc, republish) from None
        held = taken.record
        assert held is not None
        if taken.decision is Decision.RUN:
            break
        if taken.decision is not Decision.BUSY:
            raise wait.replayed(held) or wait.mismatched(held) or AssertionError(taken.decision)
        wait.busy(held, args, kwargs)  # a copy of this message applies it now: wait, or go back
    held_here = _Held(idem, owner, idem.heartbeat.add(idem.store, fence, owner, policy.lease_seconds))
    with _lock:
        _held[task_id, threading.get_ident()] = held_here
    idem.count("replays")  # a copy that ended quietly above replayed nothing
    try:
        return idem.replay(record)
    except BaseException as exc:
        held_here.raised = exc
        raise


def settled(
    sender: Any = None, task_id: str | None = None, state: str | None = None, retval: Any = None, **_: Any
) -> None:
    """``task_postrun``: settle the fence this message's replay took, once Celery applied what the
    replay handed it; release it when Celery could not (a copy of the message then applies it)."""
    if task_id is None:
        return
    with _lock:
        held = _held.pop((task_id, threading.get_ident()), None)
    if held is None:
        return
    applied = state == states.SUCCESS if held.raised is None else retval is held.raised
    fence, store = Identity("", FENCES, task_id), held.idem.store
    try:
        if applied:
            store.complete(fence, held.owner, b"null")
        else:
            store.release(fence, held.owner)
            logger.warning("task %s: its continuation was not applied (%s); a copy of it may apply it", task_id, state)
    except IdempotencyError as exc:
        # Left to its lease: a copy that comes after it runs out replays again (at least once).
        logger.warning("task %s: its continuation's fence was not settled: %s", task_id, exc)
    finally:
        held.idem.heartbeat.remove(held.lease)


def _continues(request: Any) -> bool:
    """Whether the message carries a continuation Celery applies after the body (or a chord counts)."""
    return any(getattr(request, name, None) for name in ("callbacks", "errbacks", "chain", "chord", "group"))
