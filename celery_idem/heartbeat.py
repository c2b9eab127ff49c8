"""One heartbeat thread per extension and process renews the lease of every attempt that runs in it.

A task shorter than a third of its lease never costs a renewal; a long one renews every lease/3.
The thread is started lazily, and again whenever it is found not running: after a fork (prefork
children do not inherit threads), if it ever died, or after :meth:`Heartbeat.stop`. No error of one
renewal, whatever its class (a Redis ``BUSY`` or ``READONLY``, a read-only PostgreSQL transaction),
stops the renewals: it is logged and counted, and the lease is tried again at its next beat.
``Idempotency.disconnect()`` stops its extension's thread, never before the last running attempt
in it is over: stopping never drops a live lease.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .records import Identity
from .stores.base import Store

__all__ = ["Heartbeat", "Lease"]

logger = logging.getLogger("celery_idem.heartbeat")


@dataclass(eq=False)
class Lease:
    """One running attempt's lease, as the heartbeat keeps it."""

    store: Store
    identity: Identity
    owner: str
    seconds: float
    due: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.due = time.monotonic() + self.seconds / 3


class Heartbeat:
    """Renews the registered leases; a lease whose renewal comes back LOST is dropped (the attempt's
    next write is refused by its token, which is where the loss is reported).

    Args:
        on_error: Called once per failed renewal (the extension counts it as a store error).
    """

    def __init__(self, on_error: Callable[[], None] | None = None) -> None:
        self._leases: set[Lease] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._stopping = False
        self._on_error = on_error

    def add(self, store: Store, identity: Identity, owner: str, seconds: float) -> Lease:
        lease = Lease(store, identity, owner, seconds)
        with self._lock:
            self._leases.add(lease)
            self._stopping = False
            if not self.running:
                if self._thread is not None and self._pid == os.getpid():
                    logger.error("the heartbeat thread had stopped; restarting it")
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="celery-idem-heartbeat", daemon=True)
                self._thread.start()
            self._wake.notify()
        return lease

    def remove(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)
            if self._stopping and not self._leases:
                self._wake.notify()  # a stopping thread ends with the last lease

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """End the thread once no attempt is running in this process, waiting up to
        ``timeout_seconds`` for it when none is; a lease still registered keeps it beating until
        that attempt removes it. The next :meth:`add` starts it again."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
            thread, busy = self._thread, bool(self._leases)
        if busy:
            logger.info("heartbeat stops once the attempts still running are over")
        elif thread is not None and thread is not threading.current_thread() and self._pid == os.getpid():
            thread.join(timeout_seconds)

    @property
    def running(self) -> bool:
        """Whether this process's heartbeat thread is alive (a forked child's is not: it has none)."""
        thread = self._thread
        return thread is not None and self._pid == os.getpid() and thread.is_alive()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                with self._lock:
                    if self._thread is not me or self._pid != os.getpid():
                        return  # replaced, or a forked child runs its own thread
                    if self._stopping and not self._leases:
                        self._thread = None  # stopped: the next add() starts a thread, quietly
                        return
                    now = time.monotonic()
                    due = [lease for lease in self._leases if lease.due <= now]
                    if not due:
                        wait = min((lease.due for lease in self._leases), default=now + 60) - now
                        self._wake.wait(timeout=max(wait, 0.01))
                        continue
                for lease in due:
                    self._renew(lease)
            except Exception:  # noqa: BLE001 - the loop outlives any one bad iteration
                logger.exception("heartbeat iteration failed; renewals go on")
                time.sleep(0.1)

    def _renew(self, lease: Lease) -> None:
        lease.due = time.monotonic() + lease.seconds / 3
        try:
            answer = lease.store.renew(lease.identity, lease.owner, lease_seconds=lease.seconds)
        except Exception as exc:  # noqa: BLE001 - any failed beat is only a missed beat
            # A missed beat is not a lost lease: the next one may get through before expiry.
            logger.warning("heartbeat for %s failed: %r; retrying at the next beat", lease.identity, exc)
            if self._on_error is not None:
                self._on_error()
            return
        if not answer.ok:
            self.remove(lease)
            logger.warning("lease of %s was lost: another attempt took over", lease.identity)
