"""The heartbeat keeps every running attempt's lease, on every store, whatever one renewal raises.

The heartbeat beats in real time (lease/3); the store judges leases by the injected fake clock, which
each beat moves on by lease/3, as real time would. So "the lease outlived its length" is read off the
store's own clock, never slept for. Through a worker: tests/test_worker.py.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis
from conftest import FakeClock

from celery_idem.heartbeat import Heartbeat
from celery_idem.records import Identity, State
from celery_idem.stores import Store
from celery_idem.stores.base import Transition

LEASE = 0.3  # seconds: a beat every 0.1 s
FP = "f" * 64


class Beating:
    """The store as the heartbeat sees it: each renewal moves the fake clock on by one beat, and
    raises ``errors[n]`` (when set) at the n-th renewal instead of renewing."""

    def __init__(self, store: Store, clock: FakeClock, errors: dict[int, BaseException]) -> None:
        self.store, self.clock, self.errors = store, clock, errors
        self.calls = 0
        self.renewed = threading.Event()
        self.after_errors = 0

    def renew(self, identity: Identity, owner: str, *, lease_seconds: float) -> Transition:
        self.calls += 1
        self.clock.advance(LEASE / 3)
        error = self.errors.get(self.calls)
        if error is not None:
            raise error
        answer = self.store.renew(identity, owner, lease_seconds=lease_seconds)
        if self.calls > max(self.errors, default=0):
            self.after_errors += 1
            if self.after_errors >= 9:
                self.renewed.set()
        return answer


def running(store: Store) -> tuple[Identity, str]:
    identity = Identity("", "hb.task", f"k-{uuid.uuid4().hex}")
    taken = store.acquire(identity, FP, str(uuid.uuid4()), lease_seconds=LEASE, ttl_seconds=600)
    assert taken.decision.value == "RUN" and taken.record is not None
    return identity, taken.record.owner


def assert_still_held(store: Store, identity: Identity, start: float, clock: FakeClock) -> None:
    # The store's clock is past the lease the attempt started with, and the lease is still live:
    # another attempt is told BUSY, not RUN.
    assert clock() - start > 2 * LEASE
    record = store.get(identity)
    assert record is not None and record.state is State.IN_PROGRESS
    other = store.acquire(identity, FP, str(uuid.uuid4()), lease_seconds=LEASE, ttl_seconds=600)
    assert other.decision.value == "BUSY"


@pytest.mark.parametrize(
    "error",
    [
        redis.exceptions.ResponseError("BUSY Redis is busy running a script"),
        RuntimeError("a read-only transaction"),
        ValueError("anything at all"),
    ],
    ids=["redis-busy", "runtime", "value"],
)
def test_one_failed_renewal_never_stops_renewals(store: Store, clock: FakeClock, error: Exception) -> None:
    errors: list[int] = []
    heartbeat = Heartbeat(on_error=lambda: errors.append(1))
    identity, owner = running(store)
    start = clock()
    beating = Beating(store, clock, {1: error})
    # When the first renewal raises an error that is not ours
    lease = heartbeat.add(beating, identity, owner, LEASE)  # type: ignore[arg-type]
    try:
        # Then renewals go on after it, and the lease outlives its length
        assert beating.renewed.wait(timeout=20), f"renewals stopped after {beating.calls} call(s)"
        assert heartbeat.running
        assert errors == [1]
        assert_still_held(store, identity, start, clock)
    finally:
        heartbeat.remove(lease)


class ThreadKiller(BaseException):
    """Ends the thread it is raised in: no loop catches a BaseException that is not an Exception."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_heartbeat_whose_thread_died_is_restarted_by_the_next_add(store: Store, clock: FakeClock) -> None:
    heartbeat = Heartbeat()
    identity, owner = running(store)
    # Given a heartbeat thread that died
    dying = Beating(store, clock, {1: ThreadKiller()})
    first = heartbeat.add(dying, identity, owner, LEASE)  # type: ignore[arg-type]
    deadline = time.monotonic() + 20
    while heartbeat.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not heartbeat.running
    heartbeat.remove(first)
    # When the next attempt adds its lease
    start = clock()
    beating = Beating(store, clock, {})
    lease = heartbeat.add(beating, identity, owner, LEASE)  # type: ignore[arg-type]
    try:
        # Then a new thread runs and renews it past its length
        assert heartbeat.running
        assert beating.renewed.wait(timeout=20), "the dead heartbeat was not restarted"
        assert_still_held(store, identity, start, clock)
    finally:
        heartbeat.remove(lease)


def test_stop_keeps_a_running_attempts_lease_then_ends_and_the_next_add_starts_again(
    store: Store, clock: FakeClock
) -> None:
    heartbeat = Heartbeat()
    identity, owner = running(store)
    start = clock()
    beating = Beating(store, clock, {})
    # Given an attempt still running when the heartbeat is told to stop (Idempotency.disconnect)
    lease = heartbeat.add(beating, identity, owner, LEASE)  # type: ignore[arg-type]
    first = heartbeat._thread
    heartbeat.stop(timeout_seconds=0.01)
    try:
        # Then its lease is still renewed past its length: stopping never drops a live lease
        assert beating.renewed.wait(timeout=20), "stop dropped a running attempt's lease"
        assert_still_held(store, identity, start, clock)
    finally:
        heartbeat.remove(lease)
    # And the thread ends once that attempt is over
    deadline = time.monotonic() + 20
    while heartbeat.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not heartbeat.running and first is not None and not first.is_alive()
    # When the next attempt adds its lease, a new thread beats for it; stop() with none left joins it
    lease = heartbeat.add(store, identity, owner, LEASE)
    second = heartbeat._thread
    assert heartbeat.running and second is not first
    heartbeat.remove(lease)
    heartbeat.stop()
    assert not heartbeat.running and second is not None and not second.is_alive()


# ---- outcomes deferred through a store outage -----------------------------------------------------


def test_an_outcome_the_store_did_not_take_lands_from_the_heartbeat_once_the_store_answers(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_idem import StoreUnavailableError
    from celery_idem import heartbeat as heartbeat_module

    monkeypatch.setattr(heartbeat_module, "SETTLE_RETRY_SECONDS", 0.05)
    identity, owner = running(store)
    down = {"left": 3}

    def complete() -> Transition:
        if down["left"]:
            down["left"] -= 1
            raise StoreUnavailableError("the store is down")
        return store.complete(identity, owner, b'"done"', content_type="application/json", content_encoding="utf-8")

    heartbeat = Heartbeat()
    # When an attempt hands over the outcome it could not write while its lease lasted
    heartbeat.defer(identity, complete, lambda: False, seconds=60)
    # Then the heartbeat keeps trying, and it lands once the store answers
    deadline = time.monotonic() + 10
    while heartbeat.deferred and time.monotonic() < deadline:
        time.sleep(0.02)
    record = store.get(identity)
    assert heartbeat.deferred == 0 and down["left"] == 0
    assert record is not None and record.state is State.COMPLETED and record.result == b'"done"'
    heartbeat.stop()


def test_a_deferred_outcome_refused_by_the_owner_token_is_dropped_and_one_past_its_deadline_is_given_up(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_idem import StoreUnavailableError
    from celery_idem import heartbeat as heartbeat_module

    monkeypatch.setattr(heartbeat_module, "SETTLE_RETRY_SECONDS", 0.05)
    identity, _ = running(store)
    tries = {"lost": 0, "down": 0}

    def lost() -> Transition:  # another attempt took the record over meanwhile
        tries["lost"] += 1
        return store.complete(identity, "not-the-owner", b"1", content_type="application/json")

    def down() -> Transition:
        tries["down"] += 1
        raise StoreUnavailableError("the store is down")

    heartbeat = Heartbeat()
    heartbeat.defer(identity, lost, lambda: False, seconds=60)
    heartbeat.defer(identity, down, lambda: False, seconds=0.3)
    deadline = time.monotonic() + 10
    while heartbeat.deferred and time.monotonic() < deadline:
        time.sleep(0.02)
    assert heartbeat.deferred == 0
    assert tries["lost"] == 1 and tries["down"] >= 2
    record = store.get(identity)
    assert record is not None and record.state is State.IN_PROGRESS  # neither write changed it
    heartbeat.stop()
