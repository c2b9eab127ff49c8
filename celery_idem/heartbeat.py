"""One heartbeat thread per process renews the lease of every attempt that runs in it.

A task shorter than a third of its lease never costs a renewal; a long one renews every lease/3.
The thread is started lazily, and again after a fork (prefork children do not inherit threads).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from .errors import IdempotencyError
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
    next write is refused by its token, which is where the loss is reported)."""

    def __init__(self) -> None:
        self._leases: set[Lease] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pid = 0

    def add(self, store: Store, identity: Identity, owner: str, seconds: float) -> Lease:
        lease = Lease(store, identity, owner, seconds)
        with self._lock:
            self._leases.add(lease)
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="celery-idem-heartbeat", daemon=True).start()
            self._wake.notify()
        return lease

    def remove(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._lock:
                if self._pid != pid:
                    return  # a forked child runs its own thread
                now = time.monotonic()
                due = [lease for lease in self._leases if lease.due <= now]
                if not due:
                    wait = min((lease.due for lease in self._leases), default=now + 60) - now
                    self._wake.wait(timeout=max(wait, 0.01))
                    continue
            for lease in due:
                self._renew(lease)

    def _renew(self, lease: Lease) -> None:
        lease.due = time.monotonic() + lease.seconds / 3
        try:
            answer = lease.store.renew(lease.identity, lease.owner, lease_seconds=lease.seconds)
        except IdempotencyError as exc:
            # A missed beat is not a lost lease: the next one may get through before expiry.
            logger.warning("heartbeat for %s failed: %s", lease.identity, exc)
            return
        if not answer.ok:
            self.remove(lease)
            logger.warning("lease of %s was lost: another attempt took over", lease.identity)
