"""What a message does while its identity is BUSY: another attempt holds a live lease.

DESIGN §3, "A waiting duplicate gets its answer" and "One answer per task id":

- A duplicate under its own task id (a group holding one keyed call twice, a send_task duplicate)
  looks again until the running attempt settles, then replays its outcome. ``on_busy="wait"``
  polls the store for ``busy_wait_seconds`` first; either way it then goes back to the broker
  for ``lease_seconds`` (a Celery retry: state RETRY) and looks again when it returns, as often as
  it takes. Waiting for another attempt is not failing: those trips neither count against nor are
  bounded by the task's own ``max_retries``, and the body never sees them in ``request.retries``.
  It ends when the attempt settles (replay), or when the attempt's lease runs out unrenewed (its
  holder died): the duplicate then takes over and runs, as at-least-once delivery must.
- A copy of the running task id (a broker redelivery) waits the same way and ends quietly once
  that attempt settles: the attempt owns its id's result.

Every look tells the store how long the message may take to look again (``next_look_seconds``):
the store keeps the record, once settled, at least that long, so a TTL shorter than the wait never
lets the outcome vanish between two looks (which would run the body a second time). A trip through
the broker may come back late (every pool slot busy, a backlog): it is promised within its
countdown plus ``pending_timeout_seconds``, the bound the policy already sets on a message's wait in
the queue (a claim lasts that long too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Retry

from . import outage, telemetry
from .errors import DuplicateTaskError, StoreUnavailableError
from .owners import holder_process
from .protocol import BUSY_TRIPS_HEADER
from .records import IdempotencyRecord, Identity, State
from .timing import broker_countdown

if TYPE_CHECKING:
    from .config import IdempotencyPolicy
    from .stores.base import Store

__all__ = ["BusyWait"]

logger = logging.getLogger("celery_idem.handler")

_FIRST_PAUSE, _MAX_PAUSE = 0.02, 1.0  # seconds between looks while waiting in the worker (doubling)
_SLACK_SECONDS = 1.0  # scheduling, a GC pause: what a look may run late by, past its store calls
# No look is promised further out than this: a lease of "forever" (float("inf")) must not make
# every acquire refuse its next look; a message that waits that long is past any promise anyway.
_LONGEST_LOOK_SECONDS = 7 * 86400.0

Republish = Callable[..., None]


class BusyWait:
    """One message's wait for the attempt that holds its identity.

    Args:
        task: The Celery task whose message this is (its request, and ``retry`` when eager).
        identity: The identity the message is for.
        policy: The task's policy (``on_busy``, ``busy_wait_seconds``, ``lease_seconds``,
            ``pending_timeout_seconds``).
        store: Gives the store (``get``, ``timeout_seconds``), opened at the first look: a store that
            cannot be opened is an outage of that look, handled where the look is made.
        republish: Sends this very message back to the broker: ``republish(args, kwargs, countdown=...)``.
        count: Bumps a metric by name.
    """

    def __init__(
        self,
        task: Any,
        identity: Identity,
        policy: IdempotencyPolicy,
        store: Callable[[], Store],
        republish: Republish,
        count: Callable[[str], None],
    ) -> None:
        self.task, self.identity, self.policy, self._store = task, identity, policy, store
        self.task_id: str = task.request.id
        self._republish, self._count = republish, count
        self.copy_of_running = False  # this message carries the id of an attempt that is running now
        self._deadline: float | None = None  # monotonic; set at the first BUSY
        self._pause = _FIRST_PAUSE
        self._last = False  # whether the current look is the last before going back to the broker

    # ---- before each look ------------------------------------------------------------------------

    def next_look_seconds(self) -> float:
        """How long this message may take to look again should the look about to be made answer
        BUSY: the store keeps the record for that long (stores/base.py). The last look before a
        trip back to the broker promises the trip (its countdown); the others, the next pause."""
        if self._deadline is None:
            self._last = self.policy.on_busy != "wait" or self.policy.busy_wait_seconds == 0
        else:
            self._last = time.monotonic() >= self._deadline
        policy = self.policy
        gap = broker_countdown(policy.lease_seconds) + policy.pending_timeout_seconds if self._last else self._pause
        # Two store calls' worth of time (this look's reply, the next look's request) and some slack.
        return min(gap + 2 * self._store().timeout_seconds + _SLACK_SECONDS, _LONGEST_LOOK_SECONDS)

    # ---- after a look answered ---------------------------------------------------------------------

    def replayed(self, record: IdempotencyRecord) -> Ignore | None:
        """The record is settled: None (replay it), or the quiet ending of a copy of the settled task
        id (one seen running, or one that finds its own id settled: a redelivery, a re-publish),
        which must neither run the message's link or chain again nor rewrite the id's state. An
        eager call has no message to copy: it is answered."""
        if self.copy_of_running:
            return self._quiet("the running attempt settled")
        if record.task_id == self.task_id and not self.task.request.is_eager:
            return self._quiet("its task id is settled")
        return None

    def mismatched(self, record: IdempotencyRecord) -> Ignore | None:
        """The record holds other arguments: None (refuse the message), or, when the record names this
        message's own task id, the quiet ending: a message under another call's id (a send_task with
        a chosen id, a forged copy) must not write that id's state or result."""
        if record.task_id == self.task_id and not self.task.request.is_eager:
            logger.warning(
                "task %s (%s) carries other arguments than its own record: refused, ending quietly",
                self.task_id,
                telemetry.shown(self.identity),
            )
            return Ignore(f"task {self.task_id} with other arguments than its record's: refused")
        return None

    def busy(self, record: IdempotencyRecord, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """The look answered BUSY: return after a pause (look again), or raise to leave the worker.

        Raises:
            Ignore: a copy of the running task id ends quietly (that attempt settled, or the copy was
                sent back to the broker to wait there).
            Retry: a duplicate was sent back to the broker to look again in ``lease_seconds``.
            DuplicateTaskError: an eager call still BUSY past its retries (no broker keeps it).
        """
        self.copy_of_running = self.copy_of_running or record.task_id == self.task_id
        if self._deadline is None:
            self._count("busy_waits")
            waits = self.policy.on_busy == "wait" or self.copy_of_running
            self._deadline = time.monotonic() + (self.policy.busy_wait_seconds if waits else 0)
        if _queued(record):
            # Handed to a replacement still in a queue (at this look or since the first one): nothing
            # runs it yet, and the worker slot this message waits in may be the one that replacement
            # needs. The next look is the last: it promises the trip back (next_look_seconds).
            self._deadline = min(self._deadline, time.monotonic())
        if self.copy_of_running and not self._still_running():
            raise self._quiet("the running attempt settled")
        if self._last and time.monotonic() >= self._deadline:
            self._go_back(record, args, kwargs)
        time.sleep(self._pause)
        self._pause = min(self._pause * 2, _MAX_PAUSE)

    def _go_back(self, record: IdempotencyRecord, args: Sequence[Any], kwargs: Mapping[str, Any]) -> NoReturn:
        countdown, headers = self.policy.lease_seconds, None
        if _queued(record):
            # Back soon, then less often (1 s doubling, never past the lease): a queued replacement
            # usually runs within moments; the trips are counted on this message alone.
            trips = outage.trips(self.task.request, BUSY_TRIPS_HEADER)
            countdown = min(outage.countdown(trips), countdown)
            headers = {BUSY_TRIPS_HEADER: min(trips + 1, outage.MAX_TRIPS)}
        countdown = broker_countdown(countdown)  # as it is sent (celery_idem.send_back)
        if self.copy_of_running:
            # Still held under this id: the attempt may be alive (it owns the outcome) or dead with
            # a lease nobody renews. The copy goes back to the broker, never dropped: it ends quietly
            # once that attempt settles, or takes over once its lease runs out.
            self._republish(args, kwargs, countdown=countdown, headers=headers)
            raise self._quiet("the running attempt still runs; the copy waits in the queue")
        task, identity = self.task, self.identity
        error = DuplicateTaskError(
            f"task {task.name!r} with idempotency key {identity.key!r} is still running as task "
            f"{record.task_id}; retrying later",
            key=identity.key,
            task_name=task.name,
            task_id=record.task_id,
        )
        if task.request.is_eager:
            raise task.retry(countdown=countdown, exc=error)
        logger.info(
            "%s (task %s) is BUSY with task %s: back to the broker for %gs",
            telemetry.shown(identity),
            self.task_id,
            record.task_id,
            countdown,
        )
        self._republish(args, kwargs, countdown=countdown, headers=headers)
        raise Retry(exc=error, when=countdown)

    def _still_running(self) -> bool:
        """True while the record is unsettled under this task id: its attempt runs (a copy waits; if
        that attempt's lease runs out, the copy's next acquire takes over, as a redelivery should),
        or it went back to PENDING for a Celery retry, which may be this very message (Task.retry
        publishes before the attempt releases): the next acquire takes it."""
        try:
            record = self._store().get(self.identity)
        except StoreUnavailableError:
            return True
        return record is not None and not record.state.settled and record.task_id == self.task_id

    def _quiet(self, why: str) -> Ignore:
        """A copy of a running task id ends without writing that id's state or result."""
        logger.info(
            "copy of running task %s (%s) acknowledged quietly: %s", self.task_id, telemetry.shown(self.identity), why
        )
        return Ignore(f"copy of running task {self.task_id}: {why}")


def _queued(record: IdempotencyRecord) -> bool:
    """Whether ``record`` is held for a message still in a queue (a token naming no worker process:
    replace() handed it to its replacement), not by an attempt that runs."""
    return record.state is State.IN_PROGRESS and holder_process(record.owner) is None
