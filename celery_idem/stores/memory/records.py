"""The memory store's records: a dict under a lock, read as live or absent by the store's clock, and
every operation that only reads or drops them (get, forget, the reconciler's and the operators'
reads), with the worker processes' liveness records beside them."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ...records import IdempotencyRecord, Identity, State, Transition
from ..base import Store
from ..rules import LOST, OK, UNSETTLED
from ..spi import Clock, Wait

__all__ = ["MemoryRecords"]


class MemoryRecords(Store):
    """The records of a :class:`~celery_idem.stores.memory.MemoryStore`, which takes and settles them."""

    def __init__(
        self,
        *,
        key_prefix: str = "idem",
        timeout_seconds: float = 2.0,
        max_result_bytes: int = 1_048_576,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            key_prefix=key_prefix, timeout_seconds=timeout_seconds, max_result_bytes=max_result_bytes, clock=clock
        )
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # every write wakes the watchers
        self._writes = 0  # counts them, so a write between a watcher's read and its wait is seen
        self._by_identity: dict[Identity, IdempotencyRecord] = {}
        # The hidden "keep until" a BUSY answer promised a waiter (stores/rules.py); only live
        # records have one: it is dropped with the record.
        self._linger: dict[Identity, float] = {}
        self._liveness: dict[str, tuple[str, float]] = {}  # process id -> (token, expires at)

    def __len__(self) -> int:
        with self._lock:
            now = self._clock_now()
            return sum(1 for r in self._by_identity.values() if r.expires_at > now)

    def _live(self, identity: Identity, now: float) -> IdempotencyRecord | None:
        record = self._by_identity.get(identity)
        if record is not None and record.expires_at <= now:
            self._drop(identity)
            return None
        if record is None:
            self._linger.pop(identity, None)  # an absent record starts without a waiter's mark
        return record

    def _drop(self, identity: Identity) -> None:
        del self._by_identity[identity]
        self._linger.pop(identity, None)
        self._wrote()

    def _put(
        self, identity: Identity, now: float, base: IdempotencyRecord | None, **fields: object
    ) -> IdempotencyRecord:
        if base is None:
            record = IdempotencyRecord(
                scope=identity.scope,
                task_name=identity.task_name,
                key=identity.key,
                created_at=now,
                updated_at=now,
                **fields,  # type: ignore[arg-type]
            )
        else:
            record = base.model_copy(update={"updated_at": now, **fields})
        self._by_identity[identity] = record
        self._wrote()
        return record

    def _wrote(self) -> None:
        self._writes += 1
        self._changed.notify_all()

    @contextmanager
    def watch(self, identity: Identity) -> Iterator[Wait]:
        with self._lock:
            seen = self._writes

        def wait(seconds: float) -> None:
            nonlocal seen
            with self._changed:
                if self._writes == seen:
                    self._changed.wait(seconds)
                seen = self._writes

        yield Wait(wait, notices=True)

    def _get(self, identity: Identity) -> IdempotencyRecord | None:
        with self._lock:
            return self._live(identity, self._clock_now())

    def _forget(self, identity: Identity) -> bool:
        with self._lock:
            if self._live(identity, self._clock_now()) is None:
                return False
            self._drop(identity)
            return True

    def _expired_leases(self, limit: int) -> list[IdempotencyRecord]:
        with self._lock:
            now = self._clock_now()
            due: list[tuple[float, str, IdempotencyRecord]] = []
            for record in list(self._by_identity.values()):
                if record.expires_at <= now:
                    self._drop(record.identity)
                elif record.state in UNSETTLED and record.lease_expires_at is not None:
                    if record.lease_expires_at <= now:
                        bisect.insort(due, (record.lease_expires_at, str(record.identity), record))
            return [r for _, _, r in due[:limit]]

    def _purge_expired(self, limit: int) -> int:
        with self._lock:
            now = self._clock_now()
            gone = [identity for identity, r in self._by_identity.items() if r.expires_at <= now][:limit]
            for identity in gone:
                self._drop(identity)
            return len(gone)

    def _records(self, state: State | None, task_name: str | None, limit: int) -> list[IdempotencyRecord]:
        with self._lock:
            now = self._clock_now()
            found = [
                r
                for r in self._by_identity.values()
                if r.expires_at > now and state in (None, r.state) and task_name in (None, r.task_name)
            ]
            return sorted(found, key=lambda r: r.updated_at, reverse=True)[:limit]

    def _count_by_state(self) -> dict[State, int]:
        with self._lock:
            now = self._clock_now()
            counts = dict.fromkeys(State, 0)
            for record in self._by_identity.values():
                if record.expires_at > now:
                    counts[record.state] += 1
            return counts

    def _count_by_task(self) -> dict[tuple[str, State], int]:
        with self._lock:
            now = self._clock_now()
            counts: dict[tuple[str, State], int] = {}
            for record in self._by_identity.values():
                if record.expires_at > now:
                    counts[record.task_name, record.state] = counts.get((record.task_name, record.state), 0) + 1
            return counts

    def _ping(self) -> None:
        return None

    def _keep_alive(self, process: str, token: str, seconds: float, create: bool) -> Transition:
        with self._lock:
            now = self._clock_now()
            held = self._liveness.get(process)
            live = held is not None and held[1] > now
            if (live and held is not None and held[0] != token) or (not live and not create):
                return LOST
            expires = max(held[1] if live and held is not None else 0.0, now + seconds)  # never shortened
            self._liveness[process] = (token, expires)
            return OK

    def _alive(self, processes: list[str]) -> set[str]:
        with self._lock:
            now = self._clock_now()
            for process in [p for p, (_, expires) in self._liveness.items() if expires <= now]:
                del self._liveness[process]  # dead for good: ids are never reused
            return {process for process in processes if process in self._liveness}
