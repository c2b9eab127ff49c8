"""The memory store's transitions, each one step under the lock: the rules of
:mod:`celery_idem.stores.rules`, stated plainly."""

from __future__ import annotations

from ...records import Decision, IdempotencyRecord, Identity, State, Transition
from ..rules import LOST, OK, UNSETTLED, classify, taken_over
from ..spi import Fence, Settlement
from .records import MemoryRecords

__all__ = ["MemoryStore"]


class MemoryStore(MemoryRecords):
    """A dict of records under a lock. ``memory://`` (every URL makes a new, empty store)."""

    def _claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        settled_is_free: bool,
    ) -> Transition:
        with self._lock:
            now = self._clock_now()
            record = self._live(identity, now)
            if record is not None and settled_is_free and record.state.settled and record.task_id != task_id:
                # The ended run's record, kept for its own messages (a claim under its own task id
                # is that call again, answered as usual): a new call takes the key afresh, with
                # nothing of it, no earlier attempt to read evidence of, no waiter's mark.
                self._linger.pop(identity, None)
                record = None
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
                call=None,  # the reconciler requeues unsettled records only: a settled one needs no call
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
