"""The reconciler against the truth: a real PostgreSQL ledger, a real Redis store and result backend,
and real worker processes that are SIGKILLed before and after their business commit.

Executions are counted outside the library: business rows in PostgreSQL, and the INCR each body
and each ledger function makes (tests/shop.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from addresses import REDIS_BROKER_URL
from celery import Celery, chain, chord, states
from conftest import POSTGRES_URL, REDIS_URL, require_server, wipe
from shop import COUNTER_URL, effects_key, make_app, payments_table
from workers import BACKEND, Worker, wait_for

from celery_idem import (
    Idempotency,
    IdempotentTask,
    LockLostError,
    MemoryStore,
    ReconcileReport,
    State,
    StoreUnavailableError,
    store_from_url,
)
from celery_idem.calls import MAX_CALL_BYTES, encode_call
from celery_idem.liveness import ProcessLiveness
from celery_idem.outcome import replay
from celery_idem.owners import OWNER_MAX_LENGTH, holder_node, holder_process, node_tag, worker_token
from celery_idem.reconciler import BEAT_ENTRY, TASK_NAME
from celery_idem.records import Decision, Identity
from celery_idem.stores import Store

BROKER = REDIS_BROKER_URL
GET = 30
LIVE_PAST_THE_SKEW = 7200  # a worker's liveness record outlives the reconcilers' hour ahead below
FP = "e" * 64


@pytest.fixture
def prefix() -> Iterator[str]:
    require_server("redis")
    name = f"r{uuid.uuid4().hex[:10]}"
    yield name
    wipe(store_from_url(REDIS_URL, key_prefix=name))


@pytest.fixture
def counter() -> redis.Redis:
    return redis.Redis.from_url(COUNTER_URL)


# ---- with the ledger: workers killed before and after their commit -----------------------------------


@pytest.fixture
def bank(prefix: str) -> Iterator[tuple[Any, sa.Engine]]:
    """A producer app whose tasks record payments with the ledger, and the business database."""
    require_server("postgresql")
    app = make_app(
        broker=BROKER,
        backend=BACKEND,
        store=REDIS_URL,
        prefix=prefix,
        queue=prefix,
        ledger_url=POSTGRES_URL,
        inspect_timeout_seconds=1.0,
    )
    engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
    Idempotency.of(app).settings.ledger.create_schema()
    payments_table(prefix).metadata.create_all(engine)
    yield app, engine
    with engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE IF EXISTS payments_{prefix}, ledger_{prefix}")
    engine.dispose()


@pytest.fixture
def workers(tmp_path: Path, prefix: str) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(**settings: Any) -> Worker:
        worker = Worker(tmp_path, BROKER, REDIS_URL, prefix, ledger_url=POSTGRES_URL, **settings)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def _payments(engine: sa.Engine, prefix: str, order_id: int) -> int:
    table = payments_table(prefix)
    query = sa.select(sa.func.count()).select_from(table).where(table.c.order_id == order_id)
    with engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


@pytest.mark.slow
def test_killed_after_commit_is_completed_from_the_ledger_and_never_runs_again(bank, workers, prefix, counter) -> None:
    app, engine = bank
    idem = Idempotency.of(app)
    key = f"k-{uuid.uuid4().hex}"
    worker = workers()
    # Given a payment whose business transaction committed, and whose worker dies before the store write
    result = app.tasks["shop.pay"].apply_async((1, 100), {"hold_after_commit": 60}, idempotency_key=key)
    wait_for(lambda: counter.get(effects_key(prefix, "shop.pay", key)), "commit")
    worker.kill()
    assert _payments(engine, prefix, 1) == 1
    record = idem.get("shop.pay", key)
    assert record is not None and record.state is State.IN_PROGRESS
    # When its lease has run out and the reconciler runs
    time.sleep(max(0.0, record.lease_expires_at - time.time()) + 0.2)
    report = idem.reconcile()
    # Then the record is COMPLETED with the ledger's outcome...
    assert (report.scanned, report.completed) == (1, 1)
    settled = idem.get("shop.pay", key)
    assert settled is not None and settled.state is State.COMPLETED
    # ...a later duplicate replays it, and nothing ran twice
    again = app.tasks["shop.pay"].apply_async((1, 100), idempotency_key=key)
    assert again.deduplicated and again.id == result.id and again.get(timeout=GET) == {"paid": 100, "order": 1}
    assert _payments(engine, prefix, 1) == 1
    assert int(counter.get(effects_key(prefix, "shop.pay.fn", key))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("task", ["shop.pay", "shop.pay_requeue"])
def test_killed_before_commit_is_released_or_requeued_and_then_runs_exactly_once(
    bank, workers, prefix, counter, task: str
) -> None:
    app, engine = bank
    idem = Idempotency.of(app)
    key = f"k-{uuid.uuid4().hex}"
    doomed = workers()
    # Given a payment killed inside its transaction, before the commit
    result = app.tasks[task].apply_async((2, 200), {"hold_before_commit": 60}, idempotency_key=key)
    wait_for(lambda: counter.get(effects_key(prefix, f"{task}.fn", key)), "the business write")
    doomed.kill()
    stale = idem.get(task, key)
    assert stale is not None and stale.state is State.IN_PROGRESS
    # and its worker back under the same node name (as a restarted worker is), answering without the task
    workers(name=doomed.name)
    time.sleep(max(0.0, stale.lease_expires_at - time.time()) + 0.2)
    report = idem.reconcile()
    assert report.scanned == 1
    if task == "shop.pay":
        # Then the dead attempt is released, and the retried call runs once
        assert report.released == 1 and idem.get(task, key) is None
        retried = app.tasks[task].apply_async((2, 200), idempotency_key=key)
        assert not retried.deduplicated
        assert retried.get(timeout=GET) == {"paid": 200, "order": 2}
    else:
        # Then the original call is re-published under the same key and task id, and runs once
        assert report.requeued == 1
        assert result.get(timeout=GET) == {"paid": 200, "order": 2}
        assert idem.get(task, key).task_id == result.id
    assert _payments(engine, prefix, 2) == 1  # the killed attempt's write was rolled back
    assert int(counter.get(effects_key(prefix, task, key))) == 1  # one finished body


# ---- requeue: the call is delivered again as it was sent -----------------------------------------------


@pytest.fixture
def shop_app(prefix: str) -> Celery:
    return make_app(
        broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix, inspect_timeout_seconds=1.0
    )


def _kill_and_reconcile(
    app: Celery,
    doomed: Worker,
    workers: Callable[..., Worker],
    key: str,
    counter: redis.Redis,
    prefix: str,
    queue: str | None = None,
) -> ReconcileReport:
    """SIGKILL ``doomed`` while it holds shop.requeued under ``key``, restart it under its node name
    (so it answers without the task: provably dead), and reconcile once the lease has run out."""
    wait_for(lambda: counter.get(effects_key(prefix, "shop.requeued.started", key)), "the stuck attempt")
    doomed.kill()
    stale = Idempotency.of(app).get("shop.requeued", key)
    assert stale is not None and stale.state is State.IN_PROGRESS
    workers(name=doomed.name, queue=queue)
    time.sleep(max(0.0, stale.lease_expires_at - time.time()) + 0.2)
    return Idempotency.of(app).reconcile()


def _runs(counter: redis.Redis, prefix: str, key: str) -> tuple[int, int]:
    """(attempts that started, bodies that finished) of shop.requeued under ``key``."""
    started, finished = (
        counter.get(effects_key(prefix, name, key)) for name in ("shop.requeued.started", "shop.requeued")
    )
    return int(started or 0), int(finished or 0)


@pytest.mark.slow
def test_a_requeued_call_goes_back_to_its_own_queue_with_its_link_priority_and_time_limits(
    shop_app, workers, prefix, counter
) -> None:
    app, special, key = shop_app, f"{prefix}-special", f"k-{uuid.uuid4().hex}"
    doomed = workers(queue=special)  # nothing consumes the default queue
    # Given a call sent to a special queue, with a link, a priority and time limits, killed mid-body
    link = app.tasks["shop.noted"].s(key).set(queue=special)
    result = app.tasks["shop.requeued"].apply_async(
        (7,), idempotency_key=key, queue=special, priority=3, soft_time_limit=100, time_limit=120, link=link
    )
    # When the reconciler finds it provably dead
    report = _kill_and_reconcile(app, doomed, workers, key, counter, prefix, queue=special)
    # Then it is delivered again to that queue, with its options, and runs there once; its link once
    assert report.requeued == 1
    answer = result.get(timeout=GET)
    assert answer == {"amount": 7, "retries": 0, "time_limits": [120, 100], "queue": special, "priority": 3}
    wait_for(lambda: counter.get(effects_key(prefix, "shop.noted", key)), "the link")
    assert _runs(counter, prefix, key) == (2, 1)
    assert int(counter.get(effects_key(prefix, "shop.noted", key))) == 1
    assert redis.Redis.from_url(BROKER).llen(prefix) == 0  # nothing was sent where nothing consumes


@pytest.mark.slow
def test_a_requeued_chain_head_continues_its_chain(shop_app, workers, prefix, counter) -> None:
    app, key = shop_app, f"k-{uuid.uuid4().hex}"
    doomed = workers()
    # Given the head of a chain killed mid-body
    workflow = chain(app.tasks["shop.requeued"].s(8).set(idempotency_key=key), app.tasks["shop.noted"].s(key))
    result = workflow.apply_async()
    # When it is requeued
    assert _kill_and_reconcile(app, doomed, workers, key, counter, prefix).requeued == 1
    # Then the chain continues: the tail runs, once
    result.get(timeout=GET)
    assert result.parent.get(timeout=GET)["amount"] == 8
    assert _runs(counter, prefix, key) == (2, 1)
    assert int(counter.get(effects_key(prefix, "shop.noted", key))) == 1


@pytest.mark.slow
def test_a_requeued_chord_member_counts_and_the_chord_body_runs_once(shop_app, workers, prefix, counter) -> None:
    app, key, other = shop_app, f"k-{uuid.uuid4().hex}", f"k-{uuid.uuid4().hex}"
    doomed = workers()
    # Given a chord whose first member is killed mid-body (the second runs through)
    members = [
        app.tasks["shop.requeued"].s(9).set(idempotency_key=key),
        app.tasks["shop.requeued"].s(1, hold=0).set(idempotency_key=other),
    ]
    result = chord(members)(app.tasks["shop.noted"].s(key))
    wait_for(lambda: counter.get(effects_key(prefix, "shop.requeued", other)), "the second member")
    # When the killed member is requeued
    assert _kill_and_reconcile(app, doomed, workers, key, counter, prefix).requeued == 1
    # Then it counts as a member of its chord: the chord body runs, once, after both members
    result.get(timeout=GET)
    assert int(counter.get(effects_key(prefix, "shop.noted", key))) == 1
    assert _runs(counter, prefix, key) == (2, 1)
    assert [answer["amount"] for answer in result.parent.get(timeout=GET)] == [9, 1]


@pytest.mark.slow
def test_a_requeued_retry_carries_the_arguments_and_retries_count_the_attempt_ran_with(
    shop_app, workers, prefix, counter
) -> None:
    app, key = shop_app, f"k-{uuid.uuid4().hex}"
    doomed = workers()
    # Given a call whose first attempt retried with other arguments (amount + 1), and whose retry
    # was killed mid-body
    result = app.tasks["shop.requeued"].apply_async((10,), {"retry_first": True}, idempotency_key=key)
    # When it is requeued
    assert _kill_and_reconcile(app, doomed, workers, key, counter, prefix).requeued == 1
    # Then it runs as the retry ran: its arguments, and its retries count (so it does not retry again)
    answer = result.get(timeout=GET)
    assert (answer["amount"], answer["retries"]) == (11, 1)
    assert _runs(counter, prefix, key) == (2, 1)


@pytest.mark.slow
def test_a_claim_whose_message_was_lost_is_requeued_with_its_publish_options(prefix, workers, counter) -> None:
    app = make_app(
        broker=BROKER,
        backend=BACKEND,
        store=REDIS_URL,
        prefix=prefix,
        queue=prefix,
        inspect_timeout_seconds=1.0,
        pending_timeout_seconds=2,
    )
    special, key = f"{prefix}-special", f"k-{uuid.uuid4().hex}"
    # Given a call to a special queue, with a link, whose message is lost before any worker took it
    link = app.tasks["shop.noted"].s(key).set(queue=special)
    result = app.tasks["shop.requeued"].apply_async((5,), {"hold": 0}, idempotency_key=key, queue=special, link=link)
    assert redis.Redis.from_url(BROKER).delete(special) == 1
    workers(queue=special)
    claim = Idempotency.of(app).get("shop.requeued", key)
    assert claim is not None and claim.state is State.PENDING
    # When its PENDING lease has run out and the reconciler runs
    time.sleep(max(0.0, claim.lease_expires_at - time.time()) + 0.2)
    assert Idempotency.of(app).reconcile().requeued == 1
    # Then it is delivered to its queue, with its link, as the producer sent it, and runs once
    answer = result.get(timeout=GET)
    assert (answer["amount"], answer["queue"]) == (5, special)
    wait_for(lambda: counter.get(effects_key(prefix, "shop.noted", key)), "the link")
    assert _runs(counter, prefix, key) == (1, 1)
    assert int(counter.get(effects_key(prefix, "shop.noted", key))) == 1


# ---- the result backend ---------------------------------------------------------------------------------


def _stale(store: Store, key: str, task_id: str, task_name: str = "shop.charge", lease: float = 0.2) -> Identity:
    identity = Identity("", task_name, key)
    taken = store.acquire(identity, FP, task_id, lease_seconds=lease, ttl_seconds=600)
    assert taken.record is not None
    return identity


def _quiet_app(prefix: str, **settings: Any) -> Celery:
    """An app whose broker has no workers (nobody answers inspect) and a real result backend."""
    app = Celery("rec", broker="memory://", backend=BACKEND, set_as_current=False)
    Idempotency(app, store=REDIS_URL, key_prefix=prefix, inspect_timeout_seconds=0.2, **settings)

    @app.task(base=IdempotentTask, shared=False, name="shop.charge", idempotency={"permanent": (KeyError,)})
    def charge(order_id: int) -> None: ...

    return app


def test_success_in_the_backend_with_a_lost_store_write_is_completed(prefix: str) -> None:
    app = _quiet_app(prefix)
    idem = Idempotency.of(app)
    task_id = str(uuid.uuid4())
    identity = _stale(idem.store, "lost-write", task_id)
    app.backend.store_result(task_id, {"charged": 5}, "SUCCESS")
    time.sleep(0.3)
    report = idem.reconcile()
    assert (report.scanned, report.completed) == (1, 1)
    record = idem.store.get(identity)
    assert record is not None and record.state is State.COMPLETED
    assert replay(record) == {"charged": 5}


def test_failure_in_the_backend_is_failed_when_permanent_and_released_when_retryable(prefix: str) -> None:
    app = _quiet_app(prefix)
    idem = Idempotency.of(app)
    permanent, retryable = str(uuid.uuid4()), str(uuid.uuid4())
    kept = _stale(idem.store, "permanent", permanent)
    freed = _stale(idem.store, "retryable", retryable)
    app.backend.store_result(permanent, KeyError("no such card"), "FAILURE")
    app.backend.store_result(retryable, ConnectionError("provider down"), "FAILURE")
    time.sleep(0.3)
    report = idem.reconcile()
    assert (report.failed, report.released) == (1, 1)
    record = idem.store.get(kept)
    assert record is not None and record.state is State.FAILED and record.error.type == "KeyError"
    assert idem.store.get(freed) is None
    assert idem.metrics()["reconciled_failed"] == 1 and idem.metrics()["reconciled_released"] == 1


def test_a_failure_that_says_the_body_may_have_run_is_no_evidence_for_release(prefix: str) -> None:
    # A FAILURE(StoreUnavailableError) or FAILURE(LockLostError) in the backend: the body may have
    # run (its outcome could not be written), so releasing would let the key run twice.
    app = _quiet_app(prefix)
    idem = Idempotency.of(app)
    outage, lost = str(uuid.uuid4()), str(uuid.uuid4())
    kept = [_stale(idem.store, "outage", outage), _stale(idem.store, "lost", lost)]
    app.backend.store_result(outage, StoreUnavailableError("store down while completing"), "FAILURE")
    app.backend.store_result(lost, LockLostError("lease lost"), "FAILURE")
    before = [idem.store.get(identity) for identity in kept]
    time.sleep(0.3)
    report = idem.reconcile()
    assert (report.scanned, report.left, report.released, report.failed) == (2, 2, 0, 0)
    assert [idem.store.get(identity) for identity in kept] == before


def test_a_failure_that_says_the_body_may_have_run_is_settled_once_its_holder_is_dead(prefix: str) -> None:
    # Given two attempts that ended with FAILURE(StoreUnavailableError) (a replace() or a write during
    # an outage), past their leases: one held by a process whose liveness record lives (its
    # heartbeat may still land the outcome), one by a process whose liveness record expired
    app = _quiet_app(prefix)
    idem = Idempotency.of(app)
    live, dead = ProcessLiveness(60.0), ProcessLiveness(0.2)
    records = {}
    for name, process in (("live", live), ("dead", dead)):
        process.beat(idem.store)
        task_id = str(uuid.uuid4())
        identity = Identity("", "shop.charge", name)
        owner = worker_token("w1@host", process.id)
        taken = idem.store.acquire(identity, FP, task_id, lease_seconds=0.2, ttl_seconds=600, owner=owner)
        assert taken.decision is Decision.RUN
        app.backend.store_result(task_id, StoreUnavailableError("store down while replacing"), "FAILURE")
        records[name] = identity
    time.sleep(0.4)
    assert idem.store.alive([live.id, dead.id]) == {live.id}
    # When the reconciler runs (nobody answers inspect; the grace period is an hour)
    report = idem.reconcile()
    # Then the dead holder's record is released at once (no outcome can land any more), and the live
    # holder's is left: before, both were left until their TTL, whatever became of their holders
    assert (report.scanned, report.released, report.left) == (2, 1, 1)
    assert idem.store.get(records["dead"]) is None
    assert idem.store.get(records["live"]) is not None


def _kept(args: list[Any], options: dict[str, Any] | None = None) -> bytes:
    return encode_call("shop.charge", args, {}, options or {}, serializer="json")


@pytest.mark.parametrize(
    ("call", "requeued"),
    [
        pytest.param(_kept([1], {"queue": "billing"}), True, id="kept"),
        pytest.param(b'{"args": [1], "kwargs": {}}', True, id="kept-before-options-were"),
        pytest.param(_kept(["x" * MAX_CALL_BYTES]), False, id="too-large-to-keep"),
        pytest.param(_kept([object()]), False, id="not-json"),
        pytest.param(_kept([1], {"expires": "2000-01-01T00:00:00+00:00"}), False, id="message-expired"),
    ],
)
def test_a_dead_attempt_is_requeued_only_when_its_call_can_be_delivered_again(
    prefix: str, call: bytes, requeued: bool
) -> None:
    # Given a dead attempt of a requeue task (nobody answers; no grace period) with its kept call
    idem = Idempotency.of(_quiet_app(prefix, stale_grace_seconds=0, stale_action="requeue"))
    identity = Identity("", "shop.charge", "dead")
    idem.store.acquire(identity, FP, str(uuid.uuid4()), lease_seconds=0.2, ttl_seconds=600, call=call)
    time.sleep(0.3)
    # When the reconciler runs
    report = idem.reconcile()
    # Then a call that can be delivered again is (back to PENDING); a refused or expired one is released
    assert (report.requeued, report.released) == ((1, 0) if requeued else (0, 1))
    record = idem.store.get(identity)
    assert (record is not None and record.state is State.PENDING) if requeued else record is None


# ---- leaving alone what is alive or unknown --------------------------------------------------------------


def test_records_with_a_live_lease_are_not_even_scanned(prefix: str) -> None:
    app = _quiet_app(prefix, stale_grace_seconds=0)
    idem = Idempotency.of(app)
    identity = _stale(idem.store, "live", str(uuid.uuid4()), lease=60)
    before = idem.store.get(identity)
    report = idem.reconcile()
    assert report.model_dump(exclude={"seconds"}) == ReconcileReport().model_dump(exclude={"seconds"})
    assert idem.store.get(identity) == before


def test_unknown_liveness_is_left_until_the_grace_period_has_passed(prefix: str) -> None:
    identity = Identity("", "shop.charge", "unknown")
    patient = Idempotency.of(_quiet_app(prefix, stale_grace_seconds=3600))
    _stale(patient.store, "unknown", str(uuid.uuid4()))
    time.sleep(0.3)
    report = patient.reconcile()
    assert (report.scanned, report.left, report.released) == (1, 1, 0)
    assert patient.store.get(identity) is not None
    # past the grace period (here: none), a record with no evidence either way is released
    impatient = Idempotency.of(_quiet_app(prefix, stale_grace_seconds=0))
    assert impatient.reconcile().released == 1
    assert impatient.store.get(identity) is None


def test_the_grace_period_is_timed_by_the_store_server_not_the_reconcilers_clock(prefix: str) -> None:
    # Given a stale record with no evidence either way, well inside the grace period
    idem = Idempotency.of(_quiet_app(prefix, stale_grace_seconds=3600))
    identity = _stale(idem.store, "skewed", str(uuid.uuid4()))
    time.sleep(0.3)
    # When the reconciler's own clock runs two hours ahead (the clock its store would read)
    idem.store.clock = lambda: time.time() + 7200
    report = idem.reconcile()
    # Then the grace period has not passed: the record is left, and the report says which and why
    assert (report.scanned, report.left, report.released) == (1, 1, 0)
    assert idem.store.get(identity) is not None
    (left,) = report.left_records
    assert (left.task_name, left.key, left.state) == (identity.task_name, identity.key, "IN_PROGRESS")
    assert "grace 3600s" in left.why


@pytest.mark.slow
def test_a_task_active_on_a_live_worker_is_left_alone_even_past_its_lease(workers, prefix, counter) -> None:
    # Given a task running on a live worker (its heartbeat keeps the lease; a reconciler whose
    # clock runs an hour ahead sees the lease as long expired; the worker's liveness record lives
    # two hours, so that reconciler sees it live, as a true clock would)
    app = make_app(broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    workers(liveness_seconds=LIVE_PAST_THE_SKEW)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.slow"].apply_async((3,), idempotency_key=key)
    wait_for(lambda: counter.get(effects_key(prefix, "shop.slow", key)), "task start")
    ahead = store_from_url(REDIS_URL, key_prefix=prefix, clock=lambda: time.time() + 3600)
    skewed = Celery("skewed", broker=BROKER, backend=BACKEND, set_as_current=False)
    reconciler = Idempotency(skewed, store=ahead, stale_grace_seconds=0, inspect_timeout_seconds=2)
    # When the reconciler runs
    report = reconciler.reconcile()
    # Then it asks the workers, learns the task is alive, and leaves it
    assert (report.scanned, report.left) == (1, 1)
    assert result.get(timeout=GET) == "slept 3"
    assert int(counter.get(effects_key(prefix, "shop.slow", key))) == 1
    assert Idempotency.of(app).get("shop.slow", key).state is State.COMPLETED


def _reconciler_ahead(seconds: float, **settings: Any) -> Idempotency:
    """A reconciler whose store clock runs ``seconds`` ahead: every live lease looks long expired."""
    ahead = store_from_url(REDIS_URL, key_prefix=settings.pop("prefix"), clock=lambda: time.time() + seconds)
    app = Celery("ahead", broker=BROKER, backend=BACKEND, set_as_current=False)
    return Idempotency(app, store=ahead, inspect_timeout_seconds=1, **settings)


@pytest.mark.slow
def test_absence_is_evidence_only_when_the_worker_holding_the_attempt_answered(workers, prefix, counter) -> None:
    # Given an attempt running on a solo-pool worker, which answers no inspect while its task runs,
    # and another worker that answers (on another queue: it never holds the task)
    app = make_app(broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    busy = workers(pool="solo", liveness_seconds=LIVE_PAST_THE_SKEW)  # alive to a reconciler an hour ahead
    idle = workers(queue=f"{prefix}-idle")
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.slow"].apply_async((5,), idempotency_key=key)
    wait_for(lambda: counter.get(effects_key(prefix, "shop.slow", key)), "task start")
    record = Idempotency.of(app).get("shop.slow", key)
    assert record.state is State.IN_PROGRESS and record.owner.endswith(f"@{busy.name}")
    # When a reconciler that sees its lease an hour expired runs (grace not yet over)
    report = _reconciler_ahead(3600, prefix=prefix, stale_grace_seconds=7200).reconcile()
    # Then the silence of the busy worker is no proof of death: the attempt is left, and finishes once
    assert (report.scanned, report.left, report.released) == (1, 1, 0)
    assert result.get(timeout=GET) == "slept 5"
    assert int(counter.get(effects_key(prefix, "shop.slow", key))) == 1
    assert Idempotency.of(app).get("shop.slow", key).state is State.COMPLETED
    # And an attempt held by the worker that answered, which does not have it, is provably dead
    dead = Identity("", "shop.slow", f"k-{uuid.uuid4().hex}")
    store = store_from_url(REDIS_URL, key_prefix=prefix)
    store.acquire(dead, FP, str(uuid.uuid4()), lease_seconds=60, ttl_seconds=86400, owner=worker_token(idle.name))
    report = _reconciler_ahead(3600, prefix=prefix, stale_grace_seconds=7200).reconcile()
    assert (report.scanned, report.released, report.left) == (1, 1, 0)
    assert store.get(dead) is None


# ---- liveness: death is a fact, not a silence ----------------------------------------------------------


def _holder_of(app: Celery, task: str, key: str) -> tuple[Any, str]:
    record = Idempotency.of(app).get(task, key)
    assert record is not None and record.state is State.IN_PROGRESS
    process = holder_process(record.owner)
    assert process is not None, f"the token {record.owner!r} names no liveness record"
    return record, process


@pytest.mark.slow
@pytest.mark.parametrize("stale_action", ["release", "requeue"])
def test_a_worker_killed_for_good_is_settled_once_its_lease_is_past(workers, prefix, counter, stale_action) -> None:
    # Given a prefork worker running a call, and a second worker that answers inspect (another queue:
    # it never holds the call); the reconciler's grace period is an hour
    app = make_app(
        broker=BROKER,
        backend=BACKEND,
        store=REDIS_URL,
        prefix=prefix,
        queue=prefix,
        inspect_timeout_seconds=1.0,
        stale_action=stale_action,
    )
    doomed = workers(liveness_seconds=2)
    workers(queue=f"{prefix}-idle", liveness_seconds=2)
    key = f"k-{uuid.uuid4().hex}"
    app.tasks["shop.slow"].apply_async((60,), idempotency_key=key)
    wait_for(lambda: counter.get(effects_key(prefix, "shop.slow", key)), "task start")
    record, process = _holder_of(app, "shop.slow", key)
    store = Idempotency.of(app).store
    assert store.alive([process]) == {process}
    # When the whole worker is SIGKILLed (a node that never comes back under its name)
    doomed.kill()
    wait_for(lambda: not store.alive([process]), "the holder's liveness record to expire", 30)
    stale = Idempotency.of(app).get("shop.slow", key)
    time.sleep(max(0.0, stale.lease_expires_at - time.time()) + 0.2)
    # Then one reconcile run settles it, long before stale_grace_seconds
    report = Idempotency.of(app).reconcile()
    assert report.scanned == 1
    if stale_action == "release":
        assert report.released == 1
        assert Idempotency.of(app).get("shop.slow", key) is None
    else:
        assert report.requeued == 1
        assert Idempotency.of(app).get("shop.slow", key).state is State.PENDING


@pytest.mark.slow
def test_a_frozen_holder_past_its_lease_is_settled_and_its_writes_are_fenced_when_it_wakes(
    workers, prefix, counter
) -> None:
    # Given a worker running a call (nobody else answers inspect)
    app = make_app(
        broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix, inspect_timeout_seconds=0.5
    )
    frozen = workers(liveness_seconds=2)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.slow"].apply_async((4,), idempotency_key=key)
    wait_for(lambda: counter.get(effects_key(prefix, "shop.slow", key)), "task start")
    _, process = _holder_of(app, "shop.slow", key)
    store = Idempotency.of(app).store
    # When every process of it is frozen past its liveness and its lease (a zombie)
    os.killpg(frozen.process.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not store.alive([process]), "the holder's liveness record to expire", 30)
        stale = Idempotency.of(app).get("shop.slow", key)
        time.sleep(max(0.0, stale.lease_expires_at - time.time()) + 0.2)
        report = Idempotency.of(app).reconcile()
    finally:
        os.killpg(frozen.process.pid, signal.SIGCONT)
    # Then the reconciler released it, on the evidence of the expired record alone
    assert (report.scanned, report.released) == (1, 1)
    # And the zombie, woken, writes nothing: its outcome is refused by its token
    with pytest.raises(LockLostError):
        result.get(timeout=GET)
    assert Idempotency.of(app).get("shop.slow", key) is None
    assert not store.alive([process])  # dead under that id for good
    assert int(counter.get(effects_key(prefix, "shop.slow", key))) == 1


def test_an_owner_token_names_its_worker_within_the_owner_column() -> None:
    long_a, long_b = "w" * 40 + "-a@host", "w" * 40 + "-b@host"
    for name in ("celery@host", long_a, long_b):
        token = worker_token(name)
        assert len(token) <= OWNER_MAX_LENGTH and holder_node(token) == node_tag(name)
    assert node_tag(long_a) != node_tag(long_b)
    assert holder_node(worker_token(None)) is None
    # ...and the process that holds it, whose liveness record the reconciler reads
    token = worker_token("w" * 80 + "@host", "0123456789abcdef")
    assert len(token) <= OWNER_MAX_LENGTH and holder_process(token) == "0123456789abcdef"
    assert holder_process(worker_token("celery@host")) is None and holder_process(uuid.uuid4().hex) is None


# ---- concurrency -------------------------------------------------------------------------------------------


def test_two_reconcilers_at_once_settle_each_record_once(prefix: str) -> None:
    app = _quiet_app(prefix, stale_grace_seconds=0)
    idem = Idempotency.of(app)
    identities = []
    for n in range(40):
        task_id = str(uuid.uuid4())
        identities.append(_stale(idem.store, f"k{n}", task_id))
        if n % 2 == 0:
            app.backend.store_result(task_id, {"n": n}, "SUCCESS")
    time.sleep(0.3)
    reports: list[ReconcileReport] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        own = Idempotency.of(_quiet_app(prefix, stale_grace_seconds=0))  # its own app, store client and counters
        barrier.wait()
        reports.append(own.reconcile())

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(r.completed for r in reports) == 20
    assert sum(r.released for r in reports) == 20
    for n, identity in enumerate(identities):
        record = idem.store.get(identity)
        assert (record is not None and record.state is State.COMPLETED) if n % 2 == 0 else record is None


def test_a_worker_that_finishes_during_the_run_wins_over_the_reconciler(prefix: str) -> None:
    app = _quiet_app(prefix, stale_grace_seconds=0)
    idem = Idempotency.of(app)
    identity = _stale(idem.store, "late", str(uuid.uuid4()))
    owner = idem.store.get(identity).owner
    time.sleep(0.3)
    # Given the worker completes once the reconciler has read the stale record, while it waits for
    # workers to answer (at that point, not after a timer: a timer raced the read on a loaded machine)
    read = idem.store.expired_leases

    def read_then_the_worker_completes(*args: Any, **kwargs: Any) -> Any:
        stale = read(*args, **kwargs)
        assert idem.store.complete(identity, owner, b'{"late":true}').ok
        return stale

    idem.store.expired_leases = read_then_the_worker_completes  # type: ignore[method-assign]
    report = idem.reconcile()
    # Then the reconciler's compare-and-set loses, and the worker's outcome stands
    assert (report.scanned, report.released, report.left) == (1, 0, 1)
    record = idem.store.get(identity)
    assert record is not None and record.state is State.COMPLETED and record.result == b'{"late":true}'


def test_dry_run_counts_and_changes_nothing(prefix: str) -> None:
    app = _quiet_app(prefix, stale_grace_seconds=0)
    idem = Idempotency.of(app)
    identity = _stale(idem.store, "dry", str(uuid.uuid4()))
    time.sleep(0.3)
    before = idem.store.get(identity)
    report = idem.reconcile(dry_run=True)
    assert report.dry_run and (report.scanned, report.released) == (1, 1)
    assert idem.store.get(identity) == before
    assert idem.metrics()["reconciled_released"] == 0


def test_a_run_over_selected_records_settles_only_those_whose_lease_ran_out(prefix: str) -> None:
    app = _quiet_app(prefix, stale_grace_seconds=0)
    idem = Idempotency.of(app)
    chosen = _stale(idem.store, "chosen", str(uuid.uuid4()))
    other = _stale(idem.store, "other", str(uuid.uuid4()))
    running = _stale(idem.store, "running", str(uuid.uuid4()), lease=60)
    time.sleep(0.3)
    # When an operator reconciles two records, one of them still running under its lease
    report = idem.reconcile(identities=[chosen, running, Identity("", "shop.charge", "never-claimed")])
    # Then only the stale one is settled; the running one and the unselected stale one stand
    assert (report.scanned, report.released, report.purged) == (1, 1, 0)
    assert idem.store.get(chosen) is None
    assert idem.store.get(other) is not None and idem.store.get(running) is not None


# ---- the beat task ---------------------------------------------------------------------------------------------


def test_the_reconcile_task_and_its_beat_entry_are_registered(prefix: str) -> None:
    app = Celery("beat", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    Idempotency(app, store=REDIS_URL, key_prefix=prefix, reconcile_interval_seconds=300)
    assert app.conf.beat_schedule[BEAT_ENTRY] == {"task": TASK_NAME, "schedule": 300}
    report = app.tasks[TASK_NAME].delay(dry_run=True).get()
    # The counts; the left records' keys stay out of the result a worker logs and a backend keeps.
    assert set(report) == set(ReconcileReport.model_fields) - {"left_records"}
    without = Celery("nobeat", broker="memory://", set_as_current=False)
    Idempotency(without, store=REDIS_URL, key_prefix=prefix)
    assert BEAT_ENTRY not in (without.conf.beat_schedule or {})


# ---- one bad record never stops the run ------------------------------------------------------------


def test_oversized_evidence_is_stored_as_a_failure_and_never_blocks_the_records_behind_it() -> None:
    now = [1_700_000_000.0]
    store = MemoryStore(clock=lambda: now[0], max_result_bytes=64)
    app = Celery("reconcile-oversized", set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store=store)
    big, small = Identity("", "t.t", "big"), Identity("", "t.t", "small")
    # Given two stale claims whose bodies ran: the first's SUCCESS is larger than the store takes
    store.claim(big, "f" * 64, "task-big", pending_seconds=10, ttl_seconds=3600)
    now[0] += 1
    store.claim(small, "e" * 64, "task-small", pending_seconds=10, ttl_seconds=3600)
    app.backend.store_result("task-big", "x" * 1000, states.SUCCESS)
    app.backend.store_result("task-small", "ok", states.SUCCESS)
    now[0] += 60
    # When the reconciler runs
    report = idem.reconcile()
    # Then the oversized one is FAILED with ResultTooLargeError, as a worker stores it (the body ran:
    # the key is never freed), and the one behind it is completed in the same run
    assert (report.failed, report.completed) == (1, 1)
    failed, done = store.get(big), store.get(small)
    assert failed is not None and failed.state is State.FAILED and failed.error is not None
    assert failed.error.type == "ResultTooLargeError" and "over max_result_bytes (64)" in failed.error.message
    assert done is not None and done.state is State.COMPLETED


def test_a_record_whose_settling_raises_is_left_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_700_000_000.0]
    store = MemoryStore(clock=lambda: now[0])
    app = Celery("reconcile-raises", set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store=store)
    for name in ("bad", "good"):
        store.claim(Identity("", "t.t", name), "f" * 64, f"task-{name}", pending_seconds=10, ttl_seconds=3600)
        app.backend.store_result(f"task-{name}", name, states.SUCCESS)
        now[0] += 1
    now[0] += 60
    real_get_task_meta = app.backend.get_task_meta

    def get_task_meta(task_id: str, *args: Any, **kwargs: Any) -> Any:
        if task_id == "task-bad":
            raise ValueError("a result the backend cannot decode")
        return real_get_task_meta(task_id, *args, **kwargs)

    monkeypatch.setattr(app.backend, "get_task_meta", get_task_meta)
    report = idem.reconcile()
    assert (report.left, report.completed) == (1, 1)
