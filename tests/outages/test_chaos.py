"""Chaos against real services: private Redis and PostgreSQL servers killed, restarted, slowed down and
cut off, worker processes frozen and shut down, a worker whose clock runs ahead, while real ``celery
worker`` processes run the tasks.

Every server a test breaks is its own (tests/services.py), never the machine's shared ones; the
broker, the result backend and the counter stay on the shared Redis, the ledger on the shared
PostgreSQL. Effects are counted outside the library: business rows written through the ledger, and
INCRs on the counter Redis (tests/chaos_shop.py). Leases are 2 s, so every scenario ends in seconds.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from addresses import REDIS_BROKER_URL
from celery.result import AsyncResult
from chaos_shop import make_chaos_app
from conftest import POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_rabbitmq, require_server
from proxy import Proxy
from services import PostgresServer, RedisServer
from shop import COUNTER_URL, effects_key, payments_table
from workers import BACKEND, Worker, wait_for

from celery_idem import Idempotency, LockLostError, State, StoreUnavailableError

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

BROKER = REDIS_BROKER_URL  # shared: the tests break the store, never the broker
GET = 30  # seconds a caller waits for a result


@pytest.fixture
def prefix() -> str:
    return f"x{uuid.uuid4().hex[:10]}"


@pytest.fixture
def counter() -> Iterator[redis.Redis]:
    require_server("redis")
    client = redis.Redis.from_url(COUNTER_URL)
    yield client
    client.close()


@pytest.fixture
def business(prefix: str) -> Iterator[sa.Engine]:
    """The business database: the ledger and the payments table on the shared PostgreSQL."""
    require_server("postgresql")
    engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
    yield engine
    with engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE IF EXISTS payments_{prefix}, ledger_{prefix}")
    engine.dispose()


@pytest.fixture
def workers(tmp_path: Path, prefix: str) -> Iterator[Callable[..., Worker]]:
    """Start ``celery -A chaos_shop worker`` subprocesses; ``conf`` goes to app.conf (CHAOS_CONF)."""
    started: list[Worker] = []

    def start(store: str, *, broker: str = BROKER, conf: dict[str, Any] | None = None, **options: Any) -> Worker:
        env = {"CHAOS_CONF": json.dumps(conf or {}), **options.pop("env", {})}
        worker = Worker(tmp_path, broker, store, prefix, app="chaos_shop", env=env, **options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


# The callers' apps live as long as the session, as other test modules' apps do: the shop's counter
# client is not reachable to close, and its sockets must not be collected unclosed mid-session.
_APPS: list[Any] = []


def producer(
    store: str,
    prefix: str,
    *,
    broker: str = BROKER,
    conf: dict[str, Any] | None = None,
    ledger: bool = False,
    **settings: Any,
) -> Any:
    """The test's own app (the callers' side)."""
    app = make_chaos_app(
        conf=conf,
        broker=broker,
        backend=BACKEND,
        store=store,
        prefix=prefix,
        queue=prefix,
        ledger_url=POSTGRES_URL if ledger else None,
        **settings,
    )
    if ledger:
        engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
        Idempotency.of(app).settings.ledger.create_schema()
        payments_table(prefix).metadata.create_all(engine)
        engine.dispose()
    _APPS.append(app)
    return app


def close_backends(results: list[Any]) -> None:
    """Celery's app.backend is one per thread: close those the caller threads made, whose sockets
    would otherwise be collected unclosed once their thread is gone. The results go first (an
    AsyncResult's __del__ unsubscribes, which would reconnect a closed backend)."""
    backends = {id(r.backend): r.backend for r in results}.values()
    results.clear()
    gc.collect()
    for backend in backends:
        backend.result_consumer.stop()
        backend.client.connection_pool.disconnect()


def server_time_after_restart(store: Any) -> float:
    """The store server's time once it answers again: each pooled connection to the old server
    fails once (StoreUnavailableError) before the pool reconnects."""
    for _ in range(20):
        try:
            return float(store.now())
        except StoreUnavailableError:
            time.sleep(0.05)
    return float(store.now())


def rows(engine: sa.Engine, prefix: str) -> dict[int, int]:
    """Business rows per order id."""
    table = payments_table(prefix)
    query = sa.select(table.c.order_id, sa.func.count()).group_by(table.c.order_id)
    with engine.connect() as connection:
        return {int(order): int(n) for order, n in connection.execute(query)}


def count(counter: redis.Redis, prefix: str, task: str, key: str, suffix: str = "") -> int:
    return int(counter.get(effects_key(prefix, task, key) + suffix) or 0)


def publish_through_outage(task: Any, args: tuple[Any, ...], key: str, seconds: float = 20) -> Any:
    """A caller that retries while the store is down (fail closed raises StoreUnavailableError)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return task.apply_async(args, idempotency_key=key)
        except StoreUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# ---- 1. the Redis store SIGKILLed and restarted mid-storm -----------------------------------------


@pytest.mark.parametrize("persistent", [True, False], ids=["appendfsync-always", "no-persistence"])
def test_redis_store_killed_and_restarted_mid_storm_leaves_one_business_row_per_key(
    tmp_path, prefix, counter, business, workers, persistent
) -> None:
    # Given a private Redis store (with or without an fsynced AOF), a real worker, a ledger
    server = RedisServer(tmp_path, persistent=persistent)
    try:
        app = producer(server.url(), prefix, ledger=True)
        workers(server.url(), ledger_url=POSTGRES_URL)
        pay = app.tasks["chaos.pay"]
        keys = {f"k{order}-{uuid.uuid4().hex[:8]}": order for order in range(4)}
        results: list[tuple[str, Any]] = []
        go = threading.Event()

        def caller(offset: int) -> None:
            go.wait()
            for n in range(8):
                key = list(keys)[(n + offset) % len(keys)]
                results.append((key, publish_through_outage(pay, (keys[key], 100, 0.0, 0.3), key)))
                time.sleep(0.05)

        # When 6 callers storm the 4 keys and the store is SIGKILLed mid-storm, then restarted
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        go.set()
        wait_for(lambda: any(count(counter, prefix, "chaos.pay", k, ":entered") for k in keys), "a first execution")
        server.kill()
        time.sleep(1.0)
        server.start()
        for t in threads:
            t.join(timeout=60)
        # Then every caller got the committed outcome (or, where the store forgot a running attempt,
        # that attempt's LockLostError), and the ledger kept one business row per key
        for key, result in results:
            try:
                assert result.get(timeout=GET) == {"paid": 100, "order": keys[key]}
            except LockLostError:
                assert not persistent, f"a durable store lost the lease of {key}"
        ids = {result.id for _, result in results}
        close_backends([result for _, result in results])
        results.clear()
        assert rows(business, prefix) == {order: 1 for order in keys.values()}
        idem = Idempotency.of(app)
        settled = {k: getattr(idem.get("chaos.pay", k), "state", None) for k in keys}
        if persistent:
            # The records survived the kill: one task id per key, and the body went past the
            # ledger once per key
            assert set(settled.values()) == {State.COMPLETED}
            assert len(ids) == len(keys)
            assert {count(counter, prefix, "chaos.pay", k) for k in keys} == {1}
        else:
            # A record the restart forgot is COMPLETED by a later call, or absent: never stuck
            assert set(settled.values()) <= {State.COMPLETED, None}
    finally:
        server.stop()


# ---- 2. a worker child frozen past its lease, then resumed ----------------------------------------


@pytest.mark.parametrize("inside", [False, True], ids=["before-its-transaction", "inside-its-transaction"])
def test_child_frozen_past_its_lease_is_fenced_out_and_the_takeover_outcome_stands(
    prefix, counter, business, workers, inside
) -> None:
    # Given a worker child that SIGSTOP froze before its payment (or inside its open transaction,
    # holding the ledger's row), and that stayed frozen past its lease
    app = producer(REDIS_URL, prefix, ledger=True)
    workers(REDIS_URL, ledger_url=POSTGRES_URL)
    idem, pay, key = Idempotency.of(app), app.tasks["chaos.pay"], f"k-{uuid.uuid4().hex}"
    first = pay.apply_async((1, 100, 1.0), {"inside": inside}, idempotency_key=key)
    marker = ":in_tx" if inside else ":entered"
    wait_for(lambda: count(counter, prefix, "chaos.pay", key, marker), "the first attempt to get there")
    frozen = count(counter, prefix, "chaos.pay", key, ":pid")
    os.kill(frozen, signal.SIGSTOP)
    try:
        held = idem.get("chaos.pay", key)
        assert held is not None and held.state is State.IN_PROGRESS and held.task_id == first.id
        wait_for(lambda: idem.store.now() > held.lease_expires_at + 0.1, "the frozen attempt's lease to run out")
        # When the call comes again and takes over (completing while the first child is frozen, or
        # waiting on the frozen transaction's row until it is resumed)
        second = pay.apply_async((1, 100), idempotency_key=key)
        assert not second.deduplicated and second.id != first.id
        if inside:
            wait_for(lambda: count(counter, prefix, "chaos.pay", key, ":entered") == 2, "the takeover to start")
            time.sleep(0.3)  # into run_once, where the frozen transaction's row holds it
        else:
            assert second.get(timeout=GET) == {"paid": 100, "order": 1}
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert second.get(timeout=GET) == {"paid": 100, "order": 1}
    # Then the resumed attempt is fenced out: its completion is LOST and its task ends with
    # LockLostError (the ledger answered its run_once with the committed payment), while its caller,
    # like every caller of the key, gets the takeover's stored outcome
    fenced = AsyncResult(first.id, app=app)
    wait_for(fenced.ready, "the resumed attempt to end")
    assert isinstance(fenced.result, LockLostError)
    assert first.get(timeout=GET) == {"paid": 100, "order": 1}
    assert rows(business, prefix) == {1: 1}
    record = idem.get("chaos.pay", key)
    assert record is not None and record.state is State.COMPLETED and record.task_id == second.id
    assert idem.replay(record) == {"paid": 100, "order": 1}
    assert count(counter, prefix, "chaos.pay", key, ":entered") == 2


# ---- 3. the Redis broker redelivers a long acks_late task past its visibility timeout ---------------

VISIBILITY = {"visibility_timeout": 2, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}


def test_visibility_timeout_redelivery_of_a_long_task_runs_once_and_its_id_ends_success(
    tmp_path, prefix, counter, workers
) -> None:
    # Given a private Redis broker that redelivers an unacked message after 2 s, and a task of 4.5 s
    broker_server = RedisServer(tmp_path)
    try:
        broker, conf = broker_server.url(), {"broker_transport_options": VISIBILITY}
        app = producer(REDIS_URL, prefix, broker=broker, conf=conf)
        workers(REDIS_URL, broker=broker, conf=conf)
        key = f"k-{uuid.uuid4().hex}"
        result = app.tasks["chaos.work"].apply_async((4.5,), idempotency_key=key)
        watched = AsyncResult(result.id, app=app)
        seen: list[str] = []
        # When the broker redelivers it (more than once) while it runs
        while not seen or seen[-1] not in ("SUCCESS", "FAILURE"):
            seen.append(watched.state)
            time.sleep(0.1)
        time.sleep(VISIBILITY["visibility_timeout"] + 1)  # a copy restored late gets its turn too
        seen.append(AsyncResult(result.id, app=app).state)
        # Then the body ran once, and the task id went to SUCCESS and stayed there, never FAILURE
        assert count(counter, prefix, "chaos.work", key) == 1
        assert "FAILURE" not in seen and seen[-1] == "SUCCESS", seen
        assert result.get(timeout=GET) == "worked 4.5"
        record = Idempotency.of(app).get("chaos.work", key)
        assert record is not None and record.state is State.COMPLETED and record.attempt == 1
    finally:
        broker_server.stop()


def test_redis_broker_restarted_mid_run_loses_no_call_and_runs_none_twice(tmp_path, prefix, counter, workers) -> None:
    # Given a private Redis broker (AOF: its queues survive a kill), two calls running and two queued
    broker_server = RedisServer(tmp_path, persistent=True)
    try:
        broker, conf = broker_server.url(), {"broker_transport_options": VISIBILITY}
        app = producer(REDIS_URL, prefix, broker=broker, conf=conf)
        workers(REDIS_URL, broker=broker, conf=conf)
        idem, work = Idempotency.of(app), app.tasks["chaos.work"]
        keys = [f"k{n}-{uuid.uuid4().hex}" for n in range(4)]
        results = [work.apply_async((1.5,), idempotency_key=key) for key in keys]
        wait_for(lambda: any(count(counter, prefix, "chaos.work", k) for k in keys), "a first body")
        # When the broker is SIGKILLed mid-run and restarted a second later
        broker_server.kill()
        time.sleep(1.0)
        broker_server.start()
        # Then every call completes (the worker reconnects; the running calls' acks were lost with
        # the connection, so the broker delivers them again: their copies replay, never run)
        assert [r.get(timeout=GET) for r in results] == ["worked 1.5"] * 4
        time.sleep(VISIBILITY["visibility_timeout"] + 2)  # redelivered copies get their turn
        assert [count(counter, prefix, "chaos.work", k) for k in keys] == [1, 1, 1, 1]
        idem.reconcile()
        assert [getattr(idem.get("chaos.work", k), "state", None) for k in keys] == [State.COMPLETED] * 4
        assert list(idem.store.expired_leases(limit=100)) == []
    finally:
        broker_server.stop()


# ---- 4. the PostgreSQL store restarted while long tasks run --------------------------------------


def test_postgresql_store_restarted_under_long_tasks_renews_again_and_nothing_runs_twice(
    tmp_path, prefix, counter, workers
) -> None:
    # Given a private PostgreSQL store and two long tasks running on a real worker
    server = PostgresServer()
    try:
        app = producer(server.url, prefix)
        workers(server.url, concurrency=4)
        idem, work = Idempotency.of(app), app.tasks["chaos.work"]
        keys = [f"k{n}-{uuid.uuid4().hex}" for n in range(2)]
        results = [work.apply_async((6.0,), idempotency_key=key) for key in keys]
        wait_for(lambda: all(count(counter, prefix, "chaos.work", k) for k in keys), "both tasks to start")
        # When the server is killed mid-run (every connection cut) and started again
        server.kill()
        time.sleep(1.0)
        server.start()
        restarted = server_time_after_restart(idem.store)
        # Then each running attempt's heartbeat renews its lease again on the new server
        wait_for(lambda: all(idem.get("chaos.work", k).updated_at > restarted for k in keys), "a renewal", 10)
        # and a copy of each call sent now waits for the running attempt instead of running again
        copies = [app.send_task("chaos.work", (6.0,), headers={"idempotency_key": k}) for k in keys]
        assert [r.get(timeout=GET) for r in results] == ["worked 6.0"] * 2
        assert [AsyncResult(c.id, app=app).get(timeout=GET) for c in copies] == ["worked 6.0"] * 2
        assert [count(counter, prefix, "chaos.work", k) for k in keys] == [1, 1]
        records = [idem.get("chaos.work", k) for k in keys]
        assert [(r.state, r.attempt) for r in records] == [(State.COMPLETED, 1)] * 2
    finally:
        server.stop()


# ---- 5. warm and cold shutdown of a worker mid-task -----------------------------------------------


@pytest.mark.parametrize("shutdown", ["warm", "cold"])
def test_worker_shut_down_mid_task_runs_the_payment_once_and_leaves_nothing_stuck(
    prefix, counter, business, workers, shutdown
) -> None:
    # RabbitMQ gives an unacked (acks_late) message back as soon as the worker's connection drops.
    require_rabbitmq()
    conf = {"task_reject_on_worker_lost": True}
    app = producer(REDIS_URL, prefix, broker=RABBITMQ_URL, conf=conf, ledger=True)
    idem, key = Idempotency.of(app), f"k-{uuid.uuid4().hex}"
    worker = workers(REDIS_URL, broker=RABBITMQ_URL, conf=conf, ledger_url=POSTGRES_URL)
    # Given a payment held mid-task on a real worker
    result = app.tasks["chaos.pay"].apply_async((1, 100, 1.5), idempotency_key=key)
    wait_for(lambda: count(counter, prefix, "chaos.pay", key, ":entered"), "the payment to start")
    # When the worker gets a warm shutdown (SIGTERM: finish what runs) or a cold one (SIGQUIT: now)
    worker.process.send_signal(signal.SIGTERM if shutdown == "warm" else signal.SIGQUIT)
    worker.process.wait(timeout=30)
    if shutdown == "cold":
        # and another worker takes the message the broker got back
        workers(REDIS_URL, broker=RABBITMQ_URL, conf=conf, ledger_url=POSTGRES_URL)
    # Then the payment ran to completion once (warm) or was redelivered and ran once (cold)
    assert result.get(timeout=GET) == {"paid": 100, "order": 1}
    assert rows(business, prefix) == {1: 1}
    assert count(counter, prefix, "chaos.pay", key) == 1
    assert count(counter, prefix, "chaos.pay", key, ":entered") == (1 if shutdown == "warm" else 2)
    # and one reconcile leaves no record stuck
    idem.reconcile()
    record = idem.get("chaos.pay", key)
    assert record is not None and record.state is State.COMPLETED
    assert list(idem.store.expired_leases(limit=100)) == []


# ---- 7. a slow store link, and a cut one --------------------------------------------------------


@pytest.fixture
def linked_store(tmp_path: Path) -> Iterator[tuple[RedisServer, Proxy]]:
    """A private Redis store behind a TCP proxy the test slows down or cuts."""
    server = RedisServer(tmp_path)
    proxy = Proxy(server.port)
    yield server, proxy
    proxy.close()
    server.stop()


def test_store_link_of_300ms_per_round_trip_runs_every_call_once(prefix, counter, workers, linked_store) -> None:
    # Given a store 300 ms of round trip away from the worker and the callers
    _, proxy = linked_store
    proxy.delay = 0.15
    app = producer(proxy.url(), prefix)
    workers(proxy.url())
    work, keys = app.tasks["chaos.work"], [f"k{n}-{uuid.uuid4().hex}" for n in range(2)]
    # When each call is made twice (its attempt, round trips included, outlasts its lease: renewed)
    results = [work.apply_async((1.0,), idempotency_key=key) for key in keys for _ in range(2)]
    # Then each body ran once and both calls of a key got its one outcome
    assert [r.get(timeout=GET) for r in results] == ["worked 1.0"] * 4
    assert [r.deduplicated for r in results] == [False, True] * 2
    assert [count(counter, prefix, "chaos.work", k) for k in keys] == [1, 1]


def test_store_link_cut_for_3s_keeps_every_message_and_no_caller_hangs(
    prefix, counter, business, workers, linked_store
) -> None:
    _, proxy = linked_store
    app = producer(proxy.url(), prefix, ledger=True)
    workers(proxy.url(), ledger_url=POSTGRES_URL)
    idem, pay = Idempotency.of(app), app.tasks["chaos.pay"]
    keys = {f"k{order}-{uuid.uuid4().hex}": order for order in range(4)}
    # Given four payments published, more than the worker runs at once
    results = [pay.apply_async((order, 100, 0.0, 1.0), idempotency_key=key) for key, order in keys.items()]
    wait_for(lambda: count(counter, prefix, "chaos.pay", next(iter(keys)), ":entered"), "the first payment to start")
    # When the store link is cut for 3 s, longer than a lease (2 s)
    proxy.cut(3.0)
    # Then a caller meanwhile is refused (fail closed) instead of hanging
    refused: list[BaseException] = []

    def call() -> None:
        try:
            pay.apply_async((9, 100), idempotency_key=f"late-{uuid.uuid4().hex}")
        except StoreUnavailableError as exc:
            refused.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(timeout=idem.settings.store_timeout_seconds + 10)  # a hang, not a performance bound
    assert not caller.is_alive() and len(refused) == 1
    # and no message is lost: each payment runs once the link is back, and its callers calling
    # again get the one payment. The attempts that ran through the cut could not settle their
    # records while their lease lasted, so a call again may run the body again: the ledger holds
    # the business effect to one row per key.
    assert [r.get(timeout=GET) for r in results] == [{"paid": 100, "order": o} for o in keys.values()]
    again = [pay.apply_async((order, 100), idempotency_key=key) for key, order in keys.items()]
    assert [r.get(timeout=GET) for r in again] == [{"paid": 100, "order": o} for o in keys.values()]
    assert rows(business, prefix) == {order: 1 for order in keys.values()}
    idem.reconcile()
    assert [idem.get("chaos.pay", k).state for k in keys] == [State.COMPLETED] * 4


def test_an_outcome_the_cut_kept_from_the_store_lands_when_the_link_is_back_and_no_call_runs_twice(
    prefix, counter, workers, linked_store
) -> None:
    # Given bodies with no ledger that run through a cut longer than their lease (2 s): they could
    # not store their outcome while the lease lasted
    _, proxy = linked_store
    app = producer(proxy.url(), prefix)
    workers(proxy.url())
    idem, work = Idempotency.of(app), app.tasks["chaos.work"]
    keys = [f"k{n}-{uuid.uuid4().hex}" for n in range(2)]
    results = [work.apply_async((1.0,), idempotency_key=key) for key in keys]
    wait_for(lambda: all(count(counter, prefix, "chaos.work", k) for k in keys), "both bodies to start")
    proxy.cut(3.5)
    time.sleep(3.6)
    # When the link is back, Then each outcome lands within a few seconds (the worker's heartbeat
    # thread kept trying it), not only when the reconciler runs: before, a call in between ran the
    # body again on the lease that ran out during the cut
    wait_for(
        lambda: all((r := idem.get("chaos.work", k)) is not None and r.state is State.COMPLETED for k in keys),
        "the deferred outcomes to land",
        seconds=8,
    )
    again = [work.apply_async((1.0,), idempotency_key=key) for key in keys]
    assert [r.get(timeout=GET) for r in results + again] == ["worked 1.0"] * 4
    assert all(r.deduplicated for r in again)
    assert [count(counter, prefix, "chaos.work", k) for k in keys] == [1, 1]


@pytest.mark.parametrize("cut", [4.0, 12.0], ids=["flushed-as-the-child-exits", "read-back-by-the-next-attempt"])
def test_a_deferred_outcome_does_not_die_with_its_recycled_child(prefix, counter, workers, linked_store, cut) -> None:
    # Given a worker whose pool children run one task each (--max-tasks-per-child=1), and a body
    # with no ledger
    _, proxy = linked_store
    app = producer(proxy.url(), prefix)
    workers(proxy.url(), conf={"worker_max_tasks_per_child": 1})
    idem, work, key = Idempotency.of(app), app.tasks["chaos.work"], f"k-{uuid.uuid4().hex}"
    result = work.apply_async((1.0,), idempotency_key=key)
    wait_for(lambda: count(counter, prefix, "chaos.work", key), "the body to start")
    # When the store is cut as the task returns, for longer than its lease (2 s): its outcome is
    # deferred, and its child exits right after the task. A 4 s cut ends within the child's flush
    # at exit; a 12 s cut outlasts it (the write is then lost with the child)
    back = time.monotonic() + cut
    proxy.cut(cut)
    assert result.get(timeout=GET) == "worked 1.0"
    time.sleep(max(0.0, back - time.monotonic()) + 0.2)
    # Then a second call with the same key, once the store is back, gets the first call's outcome
    # (landed at exit, or read from the result backend for the first call's task id before the
    # takeover runs anything), and the body ran once
    again = work.apply_async((1.0,), idempotency_key=key)
    assert again.get(timeout=GET) == "worked 1.0"
    assert count(counter, prefix, "chaos.work", key) == 1
    record = idem.get("chaos.work", key)
    assert record is not None and record.state is State.COMPLETED
    if cut < 5:  # the exiting child stored the first call's outcome itself
        assert record.task_id == result.id and again.id == result.id
    else:  # the second call's attempt took the record over and settled it from the first's evidence
        assert record.task_id == again.id != result.id and record.previous_task_id == result.id


def test_a_takeover_keeps_its_lease_while_it_reads_the_earlier_attempts_evidence(prefix, counter, workers) -> None:
    # Given a call whose first attempt died mid-body (its whole worker SIGKILLed), past its lease
    require_server("redis")
    app = producer(REDIS_URL, prefix)
    idem, key = Idempotency.of(app), f"k-{uuid.uuid4().hex}"
    backend_link = Proxy(int(BACKEND.rsplit(":", 1)[1].split("/")[0]))
    try:
        doomed = workers(REDIS_URL, queue=f"{prefix}-0")
        slow_backend = workers(REDIS_URL, queue=f"{prefix}-a", env={"SHOP_BACKEND": backend_link.url(13)})
        workers(REDIS_URL, queue=f"{prefix}-b")

        def send(queue: str) -> Any:
            return app.send_task("chaos.work", (3.0,), headers={"idempotency_key": key}, queue=f"{prefix}-{queue}")

        first = send("0")
        wait_for(lambda: count(counter, prefix, "chaos.work", key), "the first body to start")
        doomed.kill()
        wait_for(lambda: idem.store.now() > idem.get("chaos.work", key).lease_expires_at, "its lease to run out")
        # When a copy takes the record over on a worker whose result backend stalls (its read of the
        # first attempt's evidence hangs) for longer than the lease, and another copy comes meanwhile
        backend_link.hold(6.0)
        taker = send("a")
        wait_for(lambda: idem.get("chaos.work", key).task_id == taker.id, "the takeover")
        time.sleep(3.0)
        record = idem.get("chaos.work", key)
        assert record.lease_expires_at > idem.store.now(), "the takeover's lease was not renewed while it read"
        other = send("b")
        # Then the other copy waits for the takeover instead of taking the record too: one more run
        assert taker.get(timeout=GET) == other.get(timeout=GET) == "worked 3.0"
        assert count(counter, prefix, "chaos.work", key) == 2, "the body ran again beside the takeover"
        assert first.id != taker.id and slow_backend.process.poll() is None
    finally:
        backend_link.close()


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_warm_shutdown_stores_the_deferred_outcome_before_the_process_exits(
    prefix, counter, workers, linked_store, pool
) -> None:
    # Given a solo (or threads) pool, whose tasks run in the worker's main process
    _, proxy = linked_store
    app = producer(proxy.url(), prefix)
    worker = workers(proxy.url(), pool=pool)
    idem, work, key = Idempotency.of(app), app.tasks["chaos.work"], f"k-{uuid.uuid4().hex}"
    result = work.apply_async((1.0,), idempotency_key=key)
    wait_for(lambda: count(counter, prefix, "chaos.work", key), "the body to start")
    # When the store is cut as the task returns, longer than its lease (its outcome is deferred),
    # and the worker is shut down warm before the store is back
    back = time.monotonic() + 6.0
    proxy.cut(6.0)
    assert result.get(timeout=GET) == "worked 1.0"
    worker.stop()
    time.sleep(max(0.0, back - time.monotonic()) + 0.2)
    # Then the process stored its outcome before it exited (within its flush bound): the record is
    # the first call's, COMPLETED, and a second call replays it
    record = idem.get("chaos.work", key)
    assert record is not None and record.state is State.COMPLETED and record.task_id == result.id
    again = work.apply_async((1.0,), idempotency_key=key)
    assert again.deduplicated and again.get(timeout=GET) == "worked 1.0"
    assert count(counter, prefix, "chaos.work", key) == 1


def test_a_claim_whose_reply_is_lost_does_not_hand_later_calls_an_unpublished_task_id(
    prefix, counter, workers, linked_store
) -> None:
    # Given a store link that carries the claim to the server but loses its reply
    _, proxy = linked_store
    app = producer(proxy.url(), prefix)
    work, key = app.tasks["chaos.work"], f"k-{uuid.uuid4().hex}"
    workers(proxy.url())
    # (a first call opens the caller's connection and loads the claim script: only a reply goes)
    assert work.apply_async((0.1,), idempotency_key=f"{key}-first").get(timeout=GET) == "worked 0.1"
    proxy.mute(1.0)
    # When the caller's apply_async fails closed (nothing published) and the caller calls again
    with pytest.raises(StoreUnavailableError):
        work.apply_async((0.1,), idempotency_key=key)
    again = work.apply_async((0.1,), idempotency_key=key)
    # Then the second call is not handed the task id of the first, never published: it runs
    assert not again.deduplicated
    assert again.get(timeout=GET) == "worked 0.1"
    assert count(counter, prefix, "chaos.work", key) == 1


# ---- 6. a worker whose clock runs 45 s ahead --------------------------------------------------------

TESTS = Path(__file__).resolve().parents[1]  # tests/: the apps workers import, and skewed_clock/
SKEWED_CLOCK = TESTS / "skewed_clock"  # its sitecustomize shifts time.time()


@pytest.mark.parametrize("kind", ["redis", "postgresql"])
def test_a_worker_45s_ahead_neither_takes_over_a_live_lease_nor_expires_a_record_early(
    prefix, counter, workers, kind
) -> None:
    # Given records that live 30 s, a worker on the true clock and one whose clock is 45 s ahead
    require_server(kind)
    store = {"redis": REDIS_URL, "postgresql": POSTGRES_URL}[kind]
    app = producer(store, prefix, ttl_seconds=30)
    workers(store, ttl_seconds=30)
    path = os.pathsep.join([str(SKEWED_CLOCK), str(TESTS), str(TESTS.parent)])
    ahead = workers(
        store, queue=f"{prefix}-ahead", ttl_seconds=30, env={"PYTHONPATH": path, "CHAOS_CLOCK_SHIFT_SECONDS": "45"}
    )
    logged = re.search(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", ahead.output(), re.M)
    assert logged and datetime.fromisoformat(logged[1]).timestamp() > time.time() + 30, "the clock is not ahead"
    work, key = app.tasks["chaos.work"], f"k-{uuid.uuid4().hex}"
    first = work.apply_async((3.0,), idempotency_key=key)
    wait_for(lambda: count(counter, prefix, "chaos.work", key), "the call to start on the true clock")
    # When the worker ahead gets a copy of the call while it runs, and another once it is done
    running = app.send_task("chaos.work", (3.0,), headers={"idempotency_key": key}, queue=f"{prefix}-ahead")
    assert first.get(timeout=GET) == "worked 3.0"
    done = app.send_task("chaos.work", (3.0,), headers={"idempotency_key": key}, queue=f"{prefix}-ahead")
    # Then by the store's clock the lease was live and the record is not expired: both copies are
    # answered with the one outcome, and the body ran once
    assert [AsyncResult(r.id, app=app).get(timeout=GET) for r in (running, done)] == ["worked 3.0"] * 2
    assert count(counter, prefix, "chaos.work", key) == 1
    assert "BUSY" in ahead.output() and "REPLAY" in ahead.output()
    record = Idempotency.of(app).get("chaos.work", key)
    assert record is not None and record.state is State.COMPLETED and record.attempt == 1
    assert record.expires_at - record.updated_at == pytest.approx(30, abs=1)
