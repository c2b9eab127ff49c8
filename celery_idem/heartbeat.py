"""One heartbeat thread per extension and process renews the lease of every attempt that runs in it.

A task shorter than a third of its lease never costs a renewal; a long one renews every lease/3.
The thread is started lazily, and again whenever it is found not running: after a fork (prefork
children do not inherit threads), if it ever died, or after :meth:`Heartbeat.stop`. No error of one
renewal, whatever its class (a Redis ``BUSY`` or ``READONLY``, a read-only PostgreSQL transaction),
stops the renewals: it is logged and counted, and the lease is tried again at its next beat.
``Idempotency.disconnect()`` stops its extension's thread, never before the last running attempt
in it is over: stopping never drops a live lease.

The same thread finishes what a store outage interrupted: an outcome an attempt could not write
while its lease lasted is handed over (:meth:`Heartbeat.defer`) and tried again every second until
it lands, is refused (another attempt owns the record) or the record's TTL is over. The first write
after the store comes back is then, almost always, this one, not a duplicate's takeover of the
lease that ran out during the outage.

The same thread beats the process's liveness record (:mod:`celery_idem.liveness`) every
``liveness_seconds / 3`` from the first attempt on, in the store of the attempts' leases.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from . import telemetry
from .liveness import ProcessLiveness
from .records import Identity, Transition
from .stores.base import Store

__all__ = ["Heartbeat", "Lease", "Settlement"]

SETTLE_RETRY_SECONDS = 1.0  # how often a deferred outcome is tried again
FLUSH_SECONDS = 5.0  # how long a process about to exit keeps trying its deferred outcomes

logger = logging.getLogger("celery_idem.heartbeat")


@dataclass(eq=False)
class Lease:
    """One running attempt's lease, as the heartbeat keeps it."""

    store: Store
    identity: Identity
    owner: str
    seconds: float
    due: float = field(default=0.0)
    lost: bool = False  # a renewal answered LOST: another attempt holds the record now


@dataclass(eq=False)
class Settlement:
    """An outcome write the store did not answer while its attempt's lease lasted."""

    identity: Identity
    write: Callable[[], Transition]
    landed: Callable[[], bool]  # whether an earlier try was written and only its reply was lost
    until: float  # monotonic: past it the record has expired anyway
    due: float = field(default=0.0)
    tries: int = 0


def _forget_after_fork(ref: weakref.ref[Heartbeat]) -> None:
    heartbeat = ref()
    if heartbeat is not None:
        heartbeat._forget_after_fork()


class Heartbeat:
    """Renews the registered leases; a lease whose renewal comes back LOST is dropped (the attempt's
    next write is refused by its token, which is where the loss is reported).

    Args:
        on_error: Called once per failed renewal (the extension counts it as a store error).
        liveness_seconds: The lifetime of this process's liveness record (read at its first use);
            None keeps no liveness record.
        clock: Monotonic seconds, when each lease, outcome and beat is due (tests inject one and
            drive :meth:`tick` themselves).
    """

    def __init__(
        self,
        on_error: Callable[[], None] | None = None,
        liveness_seconds: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._leases: set[Lease] = set()
        self._settlements: set[Settlement] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._wakes_at = -math.inf  # when the waiting thread wakes by itself; -inf while it is awake
        self._pid = 0
        self._stopping = False
        self._on_error = on_error
        self._liveness_seconds = liveness_seconds
        self._liveness: ProcessLiveness | None = None
        self._store: Store | None = None  # where the liveness record lives: the leases' store
        # A forked child has none of this process's attempts: it must neither renew their leases nor
        # write their outcomes (a prefork parent runs none, but a body may fork).
        os.register_at_fork(after_in_child=functools.partial(_forget_after_fork, weakref.ref(self)))

    def _forget_after_fork(self) -> None:
        self._leases = set()
        self._settlements = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread = None
        self._wakes_at = -math.inf
        self._liveness = None  # a child is a process of its own, with a record of its own

    @property
    def process_id(self) -> str | None:
        """This process's liveness id, for the owner tokens it mints (None: no liveness kept)."""
        if self._liveness_seconds is None:
            return None
        with self._lock:
            if self._liveness is None:
                self._liveness = ProcessLiveness(self._liveness_seconds())
            return self._liveness.id

    def add(self, store: Store, identity: Identity, owner: str, seconds: float) -> Lease:
        lease = Lease(store, identity, owner, seconds, due=self._clock() + seconds / 3)
        with self._lock:
            self._store = store
            self._leases.add(lease)
            self._start(lease.due)
        return lease

    def defer(
        self, identity: Identity, write: Callable[[], Transition], landed: Callable[[], bool], *, seconds: float
    ) -> Settlement:
        """Keep trying ``write`` (an attempt's outcome) for up to ``seconds``, from this thread."""
        now = self._clock()
        settlement = Settlement(identity, write, landed, until=now + seconds, due=now + SETTLE_RETRY_SECONDS)
        with self._lock:
            self._settlements.add(settlement)
            self._start(settlement.due)
        return settlement

    def flush(self, timeout_seconds: float = FLUSH_SECONDS) -> int:
        """Try every deferred outcome now and again until it lands or ``timeout_seconds`` pass: this
        process is about to exit (a pool child recycled, a warm shutdown), and its heartbeat thread
        with it. Each one that could not land is logged; how many are left.

        What does not land is not lost for good: the attempt left its value in the result backend
        (and the ledger holds a committed effect), and the next attempt that takes the record over
        past its lease reads that evidence before it runs anything (:mod:`celery_idem.evidence`).
        """
        deadline = time.monotonic() + timeout_seconds
        while True:
            with self._lock:
                left = list(self._settlements)
            if not left or time.monotonic() >= deadline:
                break
            for item in left:
                self._settle(item)
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
        for item in left:
            logger.error(
                "exiting with the outcome of %s not stored (no answer in %gs): the next attempt settles "
                "it from the result backend or the ledger",
                telemetry.shown(item.identity),
                timeout_seconds,
            )
        return len(left)

    @property
    def deferred(self) -> int:
        """How many outcomes wait for the store to answer."""
        with self._lock:
            return len(self._settlements)

    def _start(self, due: float) -> None:
        """With the lock held: (re)start this process's thread if it is not running, and wake it if it
        sleeps past ``due``. A task that ends before its first renewal does not wake it at all."""
        self._stopping = False
        if not self.running:
            if self._thread is not None and self._pid == os.getpid():
                logger.error("the heartbeat thread had stopped; restarting it")
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="celery-idem-heartbeat", daemon=True)
            self._thread.start()
        if due < self._wakes_at:
            self._wake.notify()

    def remove(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)
            if self._stopping and not self._leases:
                self._wake.notify()  # a stopping thread ends with the last lease (and late outcome)

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """End the thread once no attempt is running in this process, waiting up to
        ``timeout_seconds`` for it when none is; a lease still registered keeps it beating until
        that attempt removes it, and a deferred outcome until it lands or its record expires. The
        next :meth:`add` starts it again."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
            thread, busy = self._thread, bool(self._leases or self._settlements)
        if busy:
            logger.info("heartbeat stops once the attempts still running are over")
        elif thread is not None and thread is not threading.current_thread() and self._pid == os.getpid():
            thread.join(timeout_seconds)

    @property
    def running(self) -> bool:
        """Whether this process's heartbeat thread is alive (a forked child's is not: it has none)."""
        thread = self._thread
        return thread is not None and self._pid == os.getpid() and thread.is_alive()

    def tick(self) -> bool:
        """One pass of the thread, at the clock's now: beat the liveness record and renew the leases
        that are due, then try one deferred outcome (a try may wait out the store's timeout, and the
        leases due meanwhile are renewed before the next one: never starved by them). False when
        nothing was due."""
        with self._lock:
            now = self._clock()
            due = [lease for lease in self._leases if lease.due <= now]
            settle = [item for item in self._settlements if item.due <= now]
            liveness = self._liveness if self._store is not None else None
            beat = liveness is not None and liveness.due <= now
        if beat and liveness is not None:
            self._keep_alive(liveness)
        for lease in due:
            self._renew(lease)
        if settle:
            self._settle(min(settle, key=lambda item: item.due))
        return bool(due or settle or beat)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                if self.tick():
                    continue
                with self._lock:
                    if self._thread is not me or self._pid != os.getpid():
                        return  # replaced, or a forked child runs its own thread
                    if self._stopping and not self._leases and not self._settlements:
                        self._thread = None  # stopped: the next add() starts a thread, quietly
                        return
                    # What was added since the tick is counted here: its wake-up is never missed.
                    now = self._clock()
                    upcoming = [lease.due for lease in self._leases] + [item.due for item in self._settlements]
                    upcoming += [self._liveness.due] if self._liveness is not None and self._store is not None else []
                    wakes_at = max(min(upcoming, default=now + 60), now + 0.01)
                    self._wakes_at = wakes_at
                    self._wake.wait(timeout=wakes_at - now)
                    self._wakes_at = -math.inf
            except Exception:  # noqa: BLE001 - the loop outlives any one bad iteration
                logger.exception("heartbeat iteration failed; renewals go on")
                time.sleep(0.1)

    def _settle(self, item: Settlement) -> None:
        item.due = self._clock() + SETTLE_RETRY_SECONDS
        item.tries += 1
        try:
            answer = item.write()
            ok = answer.ok or item.landed()
        except Exception as exc:  # noqa: BLE001 - the store is still down: try again at the next second
            if self._clock() < item.until:
                return
            logger.error(
                "gave up settling %s: the store did not answer before its record expired (%r)",
                telemetry.shown(item.identity),
                exc,
            )
            ok = None
        with self._lock:
            self._settlements.discard(item)
        if ok:
            logger.warning("settled %s after the store came back (try %d)", telemetry.shown(item.identity), item.tries)
        elif ok is not None:
            logger.warning(
                "late outcome of %s was LOST: another attempt owns the record", telemetry.shown(item.identity)
            )

    def _keep_alive(self, liveness: ProcessLiveness) -> None:
        assert self._store is not None
        try:
            kept = liveness.beat(self._store, self._clock())
        except Exception as exc:  # noqa: BLE001 - a missed beat; the record lives on until its lifetime
            logger.warning("liveness beat %s failed: %r; retrying at the next beat", liveness.id, exc)
            if self._on_error is not None:
                self._on_error()
            return
        if kept is not liveness:
            with self._lock:
                if self._liveness is liveness:
                    self._liveness = kept

    def _renew(self, lease: Lease) -> None:
        lease.due = self._clock() + lease.seconds / 3
        try:
            answer = lease.store.renew(lease.identity, lease.owner, lease_seconds=lease.seconds)
        except Exception as exc:  # noqa: BLE001 - any failed beat is only a missed beat
            # A missed beat is not a lost lease: the next one may get through before expiry.
            logger.warning(
                "heartbeat for %s failed: %r; retrying at the next beat", telemetry.shown(lease.identity), exc
            )
            if self._on_error is not None:
                self._on_error()
            return
        if not answer.ok:
            lease.lost = True
            self.remove(lease)
            logger.warning("lease of %s was lost: another attempt took over", telemetry.shown(lease.identity))
