"""MemoryStore: one process, thread-safe, injectable clock. For tests and eager mode.

It is a real store (every rule of :mod:`celery_idem.stores.rules` holds, under one lock) and the
plainest statement of those rules; the Lua scripts and SQL statements do the same thing atomically
on their servers.
"""

from __future__ import annotations

import bisect
import threading

from ..records import Decision, IdempotencyRecord, Identity, State, Transition
from .base import Store
from .rules import LOST, OK, UNSETTLED, classify, taken_over
from .spi import Clock, Fence, Settlement

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """A dict of records under a lock. ``memory://`` (every URL makes a new, empty store)."""

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
        return record

    def _claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
    ) -> Transition:
        with self._lock:
            now = self._clock_now()
            record = self._live(identity, now)
            if record is not None:
                decision = classify(record, fingerprint, claiming=True, task_id=task_id)
                if decision is not Decision.DUPLICATE:
                    return Transition(decision, record)
                assert record.lease_expires_at is not None
                if record.lease_expires_at > now:
                    return Transition(decision, record)
            new = self._put(
                identity,
                now,
                None,
                fingerprint=fingerprint,
                state=State.PENDING,
                task_id=task_id,
                owner=owner,
                lease_expires_at=now + lease,
                expires_at=now + lease + ttl,
                ttl_seconds=ttl,
                call=call,
                previous_task_id=taken_over(record),
            )
            return Transition(Decision.NEW, new)

    def _acquire(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        next_look: float,
        retry: bool,
    ) -> Transition:
        with self._lock:
            now = self._clock_now()
            record = self._live(identity, now)
            if record is not None:
                decision = classify(record, fingerprint, claiming=False, task_id=task_id, retry=retry)
                if decision is not Decision.BUSY:
                    return Transition(decision, record)
                assert record.lease_expires_at is not None
                if record.state is State.IN_PROGRESS and record.lease_expires_at > now:
                    self._linger[identity] = max(self._linger.get(identity, now), now + next_look)
                    return Transition(Decision.BUSY, record)
            taken = self._put(
                identity,
                now,
                record,
                fingerprint=record.fingerprint if record else fingerprint,
                state=State.IN_PROGRESS,
                task_id=task_id,
                owner=owner,
                attempt=(record.attempt if record else 0) + 1,
                lease_expires_at=now + lease,
                expires_at=now + lease + ttl,
                ttl_seconds=ttl,
                call=call if call is not None else (record.call if record else None),
                previous_task_id=taken_over(record),
            )
            return Transition(Decision.RUN, taken)

    def _owned(self, identity: Identity, fence: Fence, token: str, now: float) -> IdempotencyRecord | None:
        record = self._live(identity, now)
        if record is None or record.state not in UNSETTLED or getattr(record, fence) != token:
            return None
        return record

    def _settle(self, identity: Identity, token: str, outcome: Settlement) -> Transition:
        with self._lock:
            now = self._clock_now()
            record = self._owned(identity, "owner", token, now)
            if record is None:
                return LOST
            self._put(
                identity,
                now,
                record,
                state=outcome.state,
                result=outcome.result,
                content_type=outcome.content_type,
                content_encoding=outcome.content_encoding,
                error=outcome.error,
                lease_expires_at=None,
                expires_at=max(now + record.ttl_seconds, self._linger.get(identity, now)),
            )
            return OK

    def _release(
        self, identity: Identity, fence: Fence, token: str, lease: float | None, new_owner: str, expired_only: bool
    ) -> Transition:
        with self._lock:
            now = self._clock_now()
            record = self._owned(identity, fence, token, now)
            if record is None:
                return LOST
            live = (record.lease_expires_at or 0) > now
            # By task id only what that delivery may still hold: a claim, or an attempt past its lease.
            if live and (expired_only or (fence == "task_id" and record.state is State.IN_PROGRESS)):
                return LOST
            if lease is None:
                self._drop(identity)
            else:
                self._put(
                    identity,
                    now,
                    record,
                    state=State.PENDING,
                    owner=new_owner,
                    lease_expires_at=now + lease,
                    expires_at=now + lease + record.ttl_seconds,
                )
            return OK

    def _renew(self, identity: Identity, token: str, lease: float) -> Transition:
        with self._lock:
            now = self._clock_now()
            record = self._owned(identity, "owner", token, now)
            if record is None or record.state is not State.IN_PROGRESS:
                return LOST
            lease_end = max(record.lease_expires_at or 0.0, now + lease)  # extends, never shortens
            self._put(identity, now, record, lease_expires_at=lease_end, expires_at=lease_end + record.ttl_seconds)
            return OK

    def _hand_over(self, identity: Identity, token: str, new_owner: str, lease: float) -> Transition:
        with self._lock:
            now = self._clock_now()
            record = self._owned(identity, "owner", token, now)
            if record is None or record.state is not State.IN_PROGRESS:
                return LOST
            self._put(
                identity,
                now,
                record,
                owner=new_owner,
                lease_expires_at=now + lease,
                expires_at=now + lease + record.ttl_seconds,
            )
            return OK

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
