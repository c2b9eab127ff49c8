"""A waiting duplicate gets its answer (DESIGN §3): a second message for a running identity under
its own task id (a group holding one keyed call twice, a send_task duplicate) never runs the body
and ends with the running attempt's outcome, however short the TTL and however long the attempt;
if that attempt's holder died, it takes over once the lease has run out (at-least-once).

Real ``celery worker`` subprocesses (prefork, two children) on the Redis and the PostgreSQL
stores, in both ``on_busy`` modes; the body's executions are counted by its INCR (tests/shop.py).
``shop.nap`` has a 1 s lease (a BUSY duplicate goes back to the broker a second later) and
``max_retries=1``; the workers wait 0.5 s before sending a BUSY duplicate back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import group
from conftest import MARIADB_URL, POSTGRES_URL, REDIS_URL, require_server
from shop import COUNTER_URL, effects_key, make_app
from shop_worker import BACKEND, BROKERS
from workers import Worker, wait_for

from celery_idem import Idempotency
from celery_idem.records import Decision, Identity

pytestmark = pytest.mark.slow
GET = 30
STORES = {"redis": REDIS_URL, "postgresql": POSTGRES_URL, "mariadb": MARIADB_URL}
SETTINGS = [(store, on_busy, ttl) for store in STORES for on_busy in ("wait", "retry") for ttl in (0.2, 0.05)]


class Shop:
    """A worker subprocess and a producer app on one store, prefix and queue."""

    def __init__(self, tmp: Path, store: str, on_busy: str, ttl: float) -> None:
        self.prefix = f"b{uuid.uuid4().hex[:10]}"
        settings: dict[str, Any] = {"on_busy": on_busy, "ttl_seconds": ttl, "busy_wait_seconds": 0.5}
        self.worker = Worker(tmp, BROKERS["redis"], STORES[store], self.prefix, **settings)
        self.app = make_app(
            broker=BROKERS["redis"],
            backend=BACKEND,
            store=STORES[store],
            prefix=self.prefix,
            queue=self.prefix,
            **settings,
        )
        self.counter = redis.Redis.from_url(COUNTER_URL)

    def runs(self, key: str) -> int:
        return int(self.counter.get(effects_key(self.prefix, "shop.nap", key)) or 0)

    def twice(self, seconds: float, key: str) -> list[Any]:
        """One keyed call of shop.nap held twice by a group; what each member ended with."""
        nap = self.app.tasks["shop.nap"]
        both = group(nap.s(seconds).set(idempotency_key=key), nap.s(seconds).set(idempotency_key=key))
        result = both.apply_async()
        try:
            values: list[Any] = result.get(timeout=GET, propagate=False)
        except Exception as exc:
            raise AssertionError(f"{exc!r}\n{self.worker.output()[-6000:]}") from exc
        return values


@pytest.fixture(scope="module", params=SETTINGS, ids=[f"{s}-{b}-ttl{t}" for s, b, t in SETTINGS])
def shop(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    store, on_busy, ttl = request.param
    require_server(store)
    require_server("redis")
    made = Shop(tmp_path_factory.mktemp("busy"), store, on_busy, ttl)
    yield made
    made.worker.stop()


@pytest.fixture
def key() -> str:
    return f"k-{uuid.uuid4().hex}"


def test_a_groups_duplicate_member_outlasting_its_retries_gets_the_originals_outcome(shop: Shop, key: str) -> None:
    # Given a group holding one keyed call twice, whose body runs far longer than the duplicate's
    # busy wait (0.5 s) and its task's one retry (1 s apart)
    # When both members are delivered at once
    values = shop.twice(3, key)
    # Then both end with the one execution's value: the duplicate neither fails nor runs
    assert values == ["napped 3", "napped 3"], shop.worker.output()[-6000:]
    assert shop.runs(key) == 1


def test_a_busy_duplicate_replays_an_outcome_whose_ttl_ran_out_while_it_waited(shop: Shop, key: str) -> None:
    # Given a keyed call held twice by a group, the body done in 0.3 s, the TTL shorter still
    # When the duplicate, BUSY while the body ran, looks again after the outcome's TTL ran out
    # (its next poll, or its trip back to the broker a second later)
    values = shop.twice(0.3, key)
    # Then the record it saw was kept for that look: it replays, and the body ran once
    assert values == ["napped 0.3", "napped 0.3"], shop.worker.output()[-6000:]
    assert shop.runs(key) == 1


def test_a_busy_duplicate_takes_over_once_a_dead_attempts_lease_runs_out(shop: Shop, key: str) -> None:
    # Given an attempt that took the identity and died (its 4 s lease is never renewed)
    nap = shop.app.tasks["shop.nap"]
    identity = Identity("", "shop.nap", key)
    fp = nap.idempotency_handler.fingerprint((0.1,), {})
    dead_id = f"dead-{uuid.uuid4().hex}"  # its own: another test's evidence under a shared id would answer it
    dead = Idempotency.of(shop.app).store.acquire(identity, fp, dead_id, lease_seconds=4, ttl_seconds=60)
    assert dead.decision is Decision.RUN
    # When a message for the identity arrives under its own task id: BUSY, and back to the broker
    # a second later, more often than the task's max_retries (1) allows
    result = shop.app.send_task("shop.nap", (0.1,), headers={"idempotency_key": key})
    # Then those trips never fail it: once the lease has run out it takes over and runs, once
    assert result.get(timeout=GET) == "napped 0.1", shop.worker.output()[-6000:]
    assert shop.runs(key) == 1


def test_a_busy_duplicate_back_from_the_broker_later_than_its_countdown_still_replays(tmp_path: Path) -> None:
    # Given a worker with two pool slots, a 0.2 s TTL, and duplicates sent back to the broker at once
    require_server("redis")
    prefix = f"b{uuid.uuid4().hex[:10]}"
    settings: dict[str, Any] = {"on_busy": "retry", "ttl_seconds": 0.2}
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, **settings)
    try:
        app = make_app(
            broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix, **settings
        )
        counter, key = redis.Redis.from_url(COUNTER_URL), f"k-{uuid.uuid4().hex}"
        nap, slow = app.tasks["shop.nap"], app.tasks["shop.slow"]
        first = nap.apply_async((1.5,), idempotency_key=key)
        wait_for(lambda: counter.get(effects_key(prefix, "shop.nap", key)), "the body to start")
        # When a duplicate is told BUSY and goes back to the broker (countdown: the 1 s lease), and
        # the pool fills with long work meanwhile, so it looks again long after its countdown
        duplicate = app.send_task("shop.nap", (1.5,), headers={"idempotency_key": key}, queue=prefix)
        wait_for(lambda: f"(task {duplicate.id}) is BUSY" in worker.output(), "the duplicate's trip to the broker")
        blockers = [slow.apply_async((8,), idempotency_key=f"{key}-{n}") for n in range(2)]
        # Then, back 8 s later, it still finds the outcome it waited for (the record outlived its
        # TTL for the trip) and replays it: the body ran once
        assert first.get(timeout=GET) == duplicate.get(timeout=GET) == "napped 1.5", worker.output()[-4000:]
        assert int(counter.get(effects_key(prefix, "shop.nap", key)) or 0) == 1
        assert [b.get(timeout=GET) for b in blockers] == ["slept 8", "slept 8"]
    finally:
        worker.stop()


def test_a_duplicate_of_a_call_replaced_by_a_queued_replacement_waits_through_the_broker(tmp_path: Path) -> None:
    # Given a worker with one process slot, and a group holding one call twice whose first member
    # replaces itself with a group (the replacement's members queue behind the duplicate)
    require_server("redis")
    prefix = f"b{uuid.uuid4().hex[:10]}"
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, concurrency=1)
    try:
        app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
        to_all = app.tasks["shop.to_all"]
        started = time.monotonic()
        result = group(to_all.s([2, 1], 1), to_all.s([2, 1], 1)).apply_async()
        # Then the duplicate member does not hold the only slot waiting (its busy wait is 60 s) for a
        # replacement that needs that slot: the record names no running process, so it waits through
        # the broker, and both members answer within seconds, as plain Celery's would
        assert result.get(timeout=GET) == [[3, 2], [3, 2]], worker.output()[-4000:]
        assert time.monotonic() - started < 15, worker.output()[-4000:]
    finally:
        worker.stop()


def test_a_duplicate_waiting_in_its_slot_leaves_it_once_the_call_it_waits_for_replaced_itself(tmp_path: Path) -> None:
    # Given a worker of two slots, a group holding one call twice whose first member works 1.5 s and
    # then replaces itself, and a 12 s job queued behind them (it takes the first slot when freed)
    require_server("redis")
    prefix = f"b{uuid.uuid4().hex[:10]}"
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, concurrency=2)
    try:
        app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
        counter = redis.Redis.from_url(COUNTER_URL)
        moving, slow = app.tasks["shop.moving_slowly"], app.tasks["shop.slow"]
        started = time.monotonic()
        result = group(moving.s(7), moving.s(7)).apply_async()
        wait_for(lambda: "] BUSY " in worker.output(), "the duplicate member to meet the running call")
        blocker = slow.apply_async((12,), idempotency_key=f"{prefix}-blocker")
        # When the call replaces itself while its duplicate waits in the other slot
        # Then the duplicate leaves its slot for the replacement (the record names no running
        # process now) instead of waiting there for its busy wait (60 s): both answer within seconds
        # (before: after the 12 s job), and the body ran twice (the call, then its replacement)
        answers = result.get(timeout=GET)
        assert time.monotonic() - started < 9, worker.output()[-4000:]
        assert answers == [{"order": 7, "runs": 2}, {"order": 7, "runs": 2}]
        (runs,) = [k for k in counter.keys(effects_key(prefix, "shop.moving_slowly", "*")) if k.count(b":") == 3]
        assert int(counter.get(runs) or 0) == 2
        assert blocker.get(timeout=GET) == "slept 12"
    finally:
        worker.stop()
