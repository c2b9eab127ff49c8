"""How an attempt ends, and what each ending does to its record: one table (DESIGN §3).

Every way a task can end is an :class:`Ending`; :func:`ending_of` names the ending an exception
means, and a :class:`Mode` says, in its ``after`` table, which store transition (a :class:`Step`)
each ending takes. The handler settles an attempt by looking its ending up here, never by a branch
of its own, and the signal hooks do the same for the endings only the worker's parent sees. The
endings matrix (``tests/endings.py``, run through real workers) names the ending of each of its
rows, and a test holds the two together: a new ending is a row of both.

A mode (DESIGN §7) is an ``after`` table (which step each ending takes), a ``duplicate`` table
(what a duplicate gets) and whether a settled record answers new calls: the state machine,
the stores, leases, fencing, the reconciler and outage handling are the same for every mode.
:data:`IDEMPOTENT` (the default) and :data:`UNTIL_DONE` exist; a task picks one by its policy's
``mode`` (:data:`MODES`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from celery.exceptions import Ignore, Reject, Retry, TimeLimitExceeded, WorkerLostError

from .records import Decision

__all__ = [
    "HARD_KILLS",
    "IDEMPOTENT",
    "MODES",
    "UNTIL_DONE",
    "Answer",
    "Ending",
    "Mode",
    "Step",
    "ending_of",
]

# What the worker's parent reports (task_failure) when the process that ran the body is gone.
HARD_KILLS: tuple[type[BaseException], ...] = (WorkerLostError, TimeLimitExceeded)


class Ending(enum.Enum):
    """How one attempt ended."""

    RETURNED = "returned"  # the body returned a value: the effect happened
    RETRIED = "retried"  # self.retry(): the retry message carries the call on, under the same id
    REPLACED = "replaced"  # replace(): the replacement carries the call on
    REQUEUED = "requeued"  # Reject(requeue=True) with acks_late: the broker keeps the message
    DROPPED = "dropped"  # nothing carries the call on: Reject(requeue=True) of an early-acked (or eager)
    # message, which Celery drops; a Retry raised by hand, which sends no retry
    PERMANENT = "permanent"  # a final failure (classified so, DESIGN §3)
    RETRYABLE = "retryable"  # a transient failure, and any BaseException that is not an Exception
    KILLED = "killed"  # the process that ran the body is gone (seen by the parent: HARD_KILLS)
    REVOKED = "revoked"  # revoked, before or while it ran (seen by the parent)


class Step(enum.Enum):
    """The store transition an ending takes."""

    COMPLETE = "complete"  # store the value under the owner token
    FAIL = "fail"  # store the failure under the owner token (the ledger may complete it instead)
    RELEASE = "release"  # free the key (the ledger may complete it instead)
    REQUEUE = "requeue"  # back to PENDING for the message that carries the call on
    HAND_OVER = "hand over"  # keep it for the replacement, which takes it by its token
    RELEASE_STALE = "release stale"  # by task id: only a PENDING claim or a lease that ran out


class Answer(enum.Enum):
    """What a duplicate delivery gets for the store's decision on its acquire."""

    REPLAY = "replay"  # the stored outcome, without running
    WAIT = "wait"  # look again until the running attempt settles (celery_idem.busy)
    REFUSE = "refuse"  # PayloadMismatchError: the key is held by other arguments


@dataclass(frozen=True)
class Mode:
    """A deduplication mode: when its records are released and what a duplicate gets."""

    name: str
    after: Mapping[Ending, Step]
    duplicate: Mapping[Decision, Answer]
    # Whether a settled record answers new calls (REPLAY). Either way it is kept ttl_seconds for the
    # messages of the run that ended (copies, duplicates carrying a continuation, waiters) and the
    # reconciler; a mode that keeps no outcome lets a new call's claim take it (settled_is_free).
    keeps_outcome: bool = True

    def __post_init__(self) -> None:
        missing = [e.name for e in Ending if e not in self.after]
        if missing:
            raise ValueError(f"mode {self.name!r} says nothing of the endings {', '.join(missing)}")


IDEMPOTENT = Mode(
    "idempotent",
    after=MappingProxyType(
        {
            Ending.RETURNED: Step.COMPLETE,
            Ending.RETRIED: Step.REQUEUE,
            Ending.REPLACED: Step.HAND_OVER,
            Ending.REQUEUED: Step.REQUEUE,
            Ending.DROPPED: Step.RELEASE,
            Ending.PERMANENT: Step.FAIL,
            Ending.RETRYABLE: Step.RELEASE,
            Ending.KILLED: Step.RELEASE_STALE,
            Ending.REVOKED: Step.RELEASE_STALE,
        }
    ),
    duplicate=MappingProxyType(
        {Decision.REPLAY: Answer.REPLAY, Decision.BUSY: Answer.WAIT, Decision.MISMATCH: Answer.REFUSE}
    ),
)

# celery-singleton's (and celery-once's default): one call per key from its publish to the end of its
# run. The same steps as the idempotent mode (a retry or a replacement keeps the key, a failure
# frees it), and its settled records are kept as long, but for the run's own messages only: a call
# made after the run ended claims the key afresh and runs.
UNTIL_DONE = Mode("until_done", after=IDEMPOTENT.after, duplicate=IDEMPOTENT.duplicate, keeps_outcome=False)

MODES: Mapping[str, Mode] = MappingProxyType({mode.name: mode for mode in (IDEMPOTENT, UNTIL_DONE)})


def ending_of(
    exc: BaseException,
    *,
    permanent: Callable[[BaseException], bool],
    replaced: bool = False,
    acks_late: bool = False,
    eager: bool = False,
) -> Ending:
    """The ending an exception raised (or a Retry returned) by an attempt means. ``KILLED`` and
    ``REVOKED`` are never an attempt's own: only the worker's parent sees them (celery_idem.signals).

    Args:
        exc: What the attempt raised.
        permanent: The task's failure classification (``settle.Settler.permanent``).
        replaced: The attempt called ``replace()`` (its ``Ignore`` is the handover).
        acks_late: The message is acknowledged after the task (a requeue really goes back).
        eager: The call runs in the caller's process (no broker keeps a message of it).
    """
    if isinstance(exc, Retry):
        # self.retry() sent its retry (or, eager, runs it next) and says so by its signature.
        return Ending.RETRIED if getattr(exc, "sig", None) is not None else Ending.DROPPED
    if isinstance(exc, Ignore) and replaced:
        return Ending.REPLACED
    if isinstance(exc, Reject) and exc.requeue:
        return Ending.REQUEUED if acks_late and not eager else Ending.DROPPED
    if isinstance(exc, Exception) and permanent(exc):
        return Ending.PERMANENT
    return Ending.RETRYABLE
