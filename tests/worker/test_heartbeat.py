"""The heartbeat keeps every running attempt's lease, on every store, whatever one renewal raises;
outcomes deferred through an outage never starve those renewals; a forked process never runs its
parent's leases or deferred writes.

The heartbeat beats in real time (lease/3); the store judges leases by the injected fake clock, which
each beat moves on by lease/3, as real time would. So "the lease outlived its length" is read off the
store's own clock, never slept for. Through a worker: tests/worker/test_worker_running.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import redis
from conftest import FakeClock

import celery_idem.heartbeat as heartbeat_module
from celery_idem.errors import StoreUnavailableError
from celery_idem.heartbeat import Heartbeat
from celery_idem.records import Identity, State
from celery_idem.stores import Store
from celery_idem.stores.base import Transition
from celery_idem.stores.memory import MemoryStore

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


class Manual(Heartbeat):
    """A heartbeat without a thread: the test calls :meth:`Heartbeat.tick` at the times it chooses."""

    def _start(self, due: float) -> None:
        pass


def test_a_tick_renews_exactly_the_leases_due_at_a_third_of_their_lease() -> None:
    # Given a heartbeat on an injected clock (no thread) and two attempts of 3 s and 30 s leases
    clock, store = FakeClock(1000.0), MemoryStore()
    heartbeat = Manual(clock=clock)
    renewals: list[str] = []
    short, long_ = running(store), running(store)
    original = store.renew

    def counted(identity: Identity, owner: str, *, lease_seconds: float) -> Transition:
        renewals.append(identity.key)
        return original(identity, owner, lease_seconds=lease_seconds)

    store.renew = counted  # type: ignore[method-assign]
    heartbeat.add(store, short[0], short[1], 3.0)
    heartbeat.add(store, long_[0], long_[1], 30.0)
    # When the clock stands just before, then at, a third of the short lease, then of the long one
    assert heartbeat.tick() is False
    clock.advance(0.99)
    assert heartbeat.tick() is False
    clock.advance(0.01)
    assert heartbeat.tick() is True
    # Then only the lease due was renewed, and it is due again a third of its lease later
    assert renewals == [short[0].key]
    clock.advance(0.5)
    assert heartbeat.tick() is False
    clock.advance(9.0)
    heartbeat.tick()
    assert renewals.count(long_[0].key) == 1


def test_a_tick_tries_a_deferred_outcome_once_a_second_until_the_store_takes_it_then_forgets_it() -> None:
    # Given a deferred write the store refuses twice (an outage), on an injected clock
    clock, store = FakeClock(1000.0), MemoryStore()
    heartbeat = Manual(clock=clock)
    identity, owner = running(store)
    tries: list[float] = []

    def write() -> Transition:
        tries.append(clock())
        if len(tries) <= 2:
            raise StoreUnavailableError("down")
        return store.complete(identity, owner, b"1", content_type="application/json", content_encoding="utf-8")

    heartbeat.defer(identity, write, lambda: False, seconds=60)
    # When the clock moves on a second at a time
    for _ in range(5):
        clock.advance(1.0)
        heartbeat.tick()
    # Then it was tried once a second until it landed, and never again after
    assert tries == [1001.0, 1002.0, 1003.0]
    assert heartbeat.deferred == 0
    assert store.get(identity).state is State.COMPLETED


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
    heartbeat.defer(identity, down, lambda: False, seconds=1.0)  # many tries (0.05 s apart) even on a loaded machine
    deadline = time.monotonic() + 10
    while heartbeat.deferred and time.monotonic() < deadline:
        time.sleep(0.02)
    assert heartbeat.deferred == 0
    assert tries["lost"] == 1 and tries["down"] >= 2
    record = store.get(identity)
    assert record is not None and record.state is State.IN_PROGRESS  # neither write changed it
    heartbeat.stop()


# ---- deferred outcomes never starve the renewals of live leases --------------------------------------

# Found by an attacker: deferred outcome writes starve the renewals of live leases (same thread, serial calls).
#
# Heartbeat._run renews the leases due, then tries every settlement due, one after the other, with
# no renewal in between; each try of a settlement whose store does not answer costs up to the store's
# timeout (2 s by default: a black-holed node, the connect timeout). Settlements are due again
# SETTLE_RETRY_SECONDS (1 s) after each try, so as soon as the timeout is longer than the retry period
# the settlements bunch up into one batch per pass, and a pass lasts about K * timeout: a live lease
# is renewed at most once per pass. When the node that does not answer is not the one a live lease is
# on (redis+cluster with one master down and the other shards up, which is exactly when outcomes are
# deferred while other attempts keep running), a live attempt's lease runs out while its body still
# runs: a redelivered copy or a new message with its key is told RUN and the side effect happens twice.
# It lasts as long as the partial outage (a settlement is retried for the record's whole TTL).
#
# Scaled 4x down, same ratios: store timeout 0.5 s (2 s), retry period 0.25 s (1 s), lease 1.5 s
# (a beat every 0.5 s; 6 s real), 8 deferred outcomes. At real scale, lease 30 s: ~15 deferred
# outcomes in one process (a threads/gevent pool) are enough.
LIVE_LEASE = 1.5  # the live attempt's lease here (LEASE above is the fake-clock tests')
STORE_TIMEOUT = 0.5


def test_deferred_writes_do_not_starve_live_renewals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat_module, "SETTLE_RETRY_SECONDS", 0.25)
    store = MemoryStore()  # the healthy shard the live attempt's record is on
    heartbeat = Heartbeat()

    def dead_shard() -> Transition:  # outcomes of attempts whose records are on the dead shard
        time.sleep(STORE_TIMEOUT)
        raise StoreUnavailableError("node down: timed out")

    for _ in range(8):
        heartbeat.defer(Identity("", "t", f"dead-{uuid.uuid4().hex}"), dead_shard, lambda: False, seconds=600)
        time.sleep(0.01)
    live = Identity("", "t", "live")
    taken = store.acquire(live, FP, "task-1", lease_seconds=LIVE_LEASE, ttl_seconds=600)
    assert taken.decision.value == "RUN" and taken.record is not None
    lease = heartbeat.add(store, live, taken.record.owner, LIVE_LEASE)
    try:
        deadline = time.monotonic() + 4.5  # the body runs on, 3 leases long; the heartbeat should hold it
        while time.monotonic() < deadline:
            other = store.acquire(live, FP, f"copy-{uuid.uuid4().hex}", lease_seconds=LIVE_LEASE, ttl_seconds=600)
            assert other.decision.value == "BUSY", (
                "a live attempt's lease ran out while its heartbeat was busy retrying deferred outcomes: "
                f"another attempt was told {other.decision.value}"
            )
            time.sleep(0.05)
    finally:
        heartbeat.remove(lease)


# ---- a forked process runs none of its parent's leases or deferred writes --------------------------

# Found by an attacker: a forked process inherits the heartbeat's leases and deferred settlements, and runs
# them from its own thread as soon as it adds a lease or defers a write of its own.
#
# Heartbeat keeps _leases/_settlements across fork (no os.register_at_fork reset, no pid check on the
# sets); _start() in the child starts a new thread over the parent's sets. The child then renews the
# parent's leases (a parent that dies keeps its record IN_PROGRESS for as long as the child lives)
# and repeats the parent's outcome writes. Celery's prefork parent runs no attempts, so a plain prefork
# worker is not hit; a body that forks (multiprocessing 'fork' context) and whose child runs an
# idempotent task eagerly is. Run in a fresh interpreter (a fork inside pytest's threads can deadlock
# on an unrelated lock, which is the other half of the same hazard).
SCRIPT = textwrap.dedent(
    """
    import os, sys, time, uuid
    from celery_idem.errors import StoreUnavailableError
    from celery_idem.heartbeat import Heartbeat
    from celery_idem.records import Identity
    from celery_idem.stores.rules import OK
    from celery_idem.stores.memory import MemoryStore

    marker = sys.argv[1]
    parent = os.getpid()
    heartbeat = Heartbeat()

    def parents_outcome():
        if os.getpid() == parent:
            raise StoreUnavailableError("still down in the parent")
        with open(marker, "w") as f:
            f.write(str(os.getpid()))  # the child wrote the parent's outcome
        return OK

    heartbeat.defer(Identity("", "t", "parent-outcome"), parents_outcome, lambda: False, seconds=600)
    pid = os.fork()
    if pid == 0:  # the child runs an idempotent attempt of its own
        try:
            store = MemoryStore()
            mine = Identity("", "t", "child-" + uuid.uuid4().hex)
            taken = store.acquire(mine, "f" * 64, "c", lease_seconds=30, ttl_seconds=60)
            heartbeat.add(store, mine, taken.record.owner, 30)
            time.sleep(2.5)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_child_does_not_run_the_parents_deferred_write(tmp_path) -> None:
    marker = tmp_path / "child-wrote"
    subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], check=True, timeout=30)
    assert not marker.exists(), f"child {marker.read_text()} wrote the parent's deferred outcome"


class CountedWake(threading.Condition):
    """The heartbeat's wake-up, counting how often a registration woke the thread."""

    notified = 0

    def notify(self, n: int = 1) -> None:
        CountedWake.notified += 1
        super().notify(n)


def test_short_tasks_in_a_row_do_not_wake_the_thread_each() -> None:
    """A task that ends before its lease's first renewal needs nothing of the thread: only a lease due
    before the thread's own wake-up wakes it, never one per task."""
    store = MemoryStore()
    heartbeat = Heartbeat()
    heartbeat._wake = CountedWake(heartbeat._lock)
    CountedWake.notified = 0
    try:
        first = heartbeat.add(store, *running(store), 30.0)
        # The thread is up and sleeps until the first lease is due (on a loaded machine, not at once).
        deadline = time.monotonic() + 10
        while heartbeat._wakes_at == -math.inf:
            assert time.monotonic() < deadline, "the heartbeat thread never went to sleep"
            time.sleep(0.01)
        woken = CountedWake.notified
        for _ in range(50):
            heartbeat.remove(heartbeat.add(store, *running(store), 30.0))
        assert CountedWake.notified == woken, f"woken {CountedWake.notified - woken} times by 50 short tasks"
        # A lease due before the thread wakes by itself still wakes it at once.
        soon = heartbeat.add(store, *running(store), 0.3)
        assert CountedWake.notified == woken + 1
        heartbeat.remove(soon)
        heartbeat.remove(first)
    finally:
        heartbeat.stop()
