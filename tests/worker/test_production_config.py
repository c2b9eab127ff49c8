"""The recommended production configuration (examples/production, docs/guides/production.md), run
for real: ``celery worker`` processes with exactly that configuration, on RabbitMQ (quorum queues,
Celery's native delayed delivery) and on Redis, and the Celery 5.5+ features it turns on.

Only durations (and the ETA limit, to be reached by a few calls) are shortened (:data:`OVERRIDES`),
so that a dead attempt's lease and a soft shutdown run out in seconds. The effect of ``prod.pay``
(tests/production_app.py) is a row of a payments table written through the ledger, counted there.

Per broker, three workers start at once and stay for the module: ``main`` (prefork, 3 children)
runs every call, ``soft`` and ``cold`` are shut down by the shutdown tests, which then hand their
queues to ``main`` (``add_consumer``) so that what went back to the broker runs there.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult
from conftest import POSTGRES_URL, REDIS_URL, require_rabbitmq, require_server, wipe
from kombu import Connection
from production_app import PAY, build, ledger_table, payments_table, runs_key
from shop import COUNTER_URL
from shop_worker import BACKEND
from shop_worker import BROKERS as BROKER_URLS
from workers import Worker, wait_for

from celery_idem import Idempotency, InvalidKeyError, PayloadMismatchError, State
from celery_idem.ledger import Ledger
from celery_idem.records import Identity
from celery_idem.telemetry import key_hash

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "production" / "celeryconfig.py"
# What the test changes of the configuration: durations, so that they run out within the test, and
# the ETA limit, so that a few calls reach it. Nothing else.
OVERRIDES: dict[str, Any] = {
    "idempotency_lease_seconds": 2.0,  # 30
    "idempotency_liveness_seconds": 2.0,  # unset: 10
    "worker_soft_shutdown_timeout": 3.0,  # 20
    "worker_eta_task_limit": 4,  # 100
}
GET = 40
ROLES = {"main": 3, "soft": 2, "cold": 1}  # worker -> concurrency


def load_config(env: dict[str, str]) -> ModuleType:
    """examples/production/celeryconfig.py as a process whose environment holds ``env`` imports it
    (read afresh: each broker's run has its own)."""
    spec = importlib.util.spec_from_file_location(f"celeryconfig_{uuid.uuid4().hex}", CONFIG)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        spec.loader.exec_module(module)
    return module


@dataclass
class Deployment:
    broker: str
    prefix: str
    queues: dict[str, str]
    app: Celery
    idem: Idempotency
    workers: dict[str, Worker]
    engine: sa.Engine
    counter: redis.Redis
    shutdowns: dict[str, Future[dict[str, Any]]] = field(default_factory=dict)

    def pay(self, key: str, order_id: int, amount: int = 100, *, queue: str = "main", **options: Any) -> Any:
        kwargs = {name: options.pop(name) for name in ("hold", "hold_at") if name in options}
        return self.app.tasks[PAY].apply_async(
            (order_id, amount), kwargs, idempotency_key=key, queue=self.queues[queue], **options
        )

    def runs(self, key: str) -> int:
        return int(self.counter.get(runs_key(self.prefix, key)) or 0)

    def seen(self, key: str, what: str) -> list[str]:
        return [v.decode() for v in self.counter.lrange(f"{runs_key(self.prefix, key)}:{what}", 0, -1)]

    def pid(self, key: str) -> int:
        return int(self.counter.get(f"{runs_key(self.prefix, key)}:pid") or 0)

    def rows(self, key: str) -> list[int]:
        table = payments_table(self.prefix)
        with self.engine.connect() as connection:
            return list(connection.execute(sa.select(table.c.id).where(table.c.key == key)).scalars())

    def state(self, key: str) -> State | None:
        record = self.idem.get(PAY, key)
        return None if record is None else record.state

    def hand_over(self, role: str) -> None:
        """``main`` consumes the queue of a worker that is gone: what it sent back runs there."""
        replies = self.app.control.add_consumer(
            self.queues[role], destination=[self.workers["main"].name], reply=True, timeout=10
        )
        assert replies, f"{self.workers['main'].name} did not answer add_consumer"


@pytest.fixture(scope="module", params=sorted(BROKER_URLS))
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    require_server("redis")
    require_server("postgresql")
    if request.param == "rabbitmq":
        require_rabbitmq()
    prefix = f"p{uuid.uuid4().hex[:10]}"
    queues = {role: f"{prefix}-{role}" for role in ROLES}
    env = {
        "CELERY_BROKER_URL": BROKER_URLS[request.param],
        "CELERY_RESULT_BACKEND": BACKEND,
        "IDEMPOTENCY_STORE": REDIS_URL,
        "IDEMPOTENCY_KEY_PREFIX": prefix,
        "CELERY_QUEUES": ",".join(queues.values()),
        "DATABASE_URL": POSTGRES_URL,
        "PROD_PREFIX": prefix,
        "PROD_OVERRIDES": json.dumps(OVERRIDES),
    }
    engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
    payments = payments_table(prefix)
    payments.create(engine)
    Ledger(engine, table_name=ledger_table(prefix)).create_schema()
    app = build(POSTGRES_URL, prefix, OVERRIDES, config=load_config(env))
    tmp = tmp_path_factory.mktemp(request.param)
    workers: dict[str, Worker] = {}

    def start(role: str) -> None:
        workers[role] = Worker(
            tmp,
            BROKER_URLS[request.param],
            REDIS_URL,
            prefix,
            app="production_app",
            queue=queues[role],
            concurrency=ROLES[role],
            env=env,
        )

    try:
        with ThreadPoolExecutor(len(ROLES)) as pool:
            list(pool.map(start, ROLES))
        deployment = Deployment(
            request.param, prefix, queues, app, Idempotency.of(app), workers, engine, redis.Redis.from_url(COUNTER_URL)
        )
        # The shutdown scenarios take a while (a soft shutdown, a lease to run out): they run while
        # the other tests do, and their tests judge what they saw.
        with ThreadPoolExecutor(2) as scenarios:
            deployment.shutdowns = {
                "soft": scenarios.submit(soft_shutdown, deployment),
                "cold": scenarios.submit(cold_shutdown, deployment),
            }
            yield deployment
    finally:
        with ThreadPoolExecutor(len(ROLES)) as pool:
            list(pool.map(lambda w: w.stop(), workers.values()))
        idem = Idempotency.of(app)
        wipe(idem.store)
        idem.settings.ledger.engine.dispose()
        app.close()
        counter = redis.Redis.from_url(COUNTER_URL)
        for key in counter.scan_iter(match=f"prod:{prefix}:*", count=1000):
            counter.delete(key)
        with engine.begin() as connection:
            connection.execute(sa.text(f'DROP TABLE IF EXISTS "{payments.name}", "{ledger_table(prefix)}"'))
        engine.dispose()
        if request.param == "rabbitmq":  # durable quorum queues
            with Connection(BROKER_URLS[request.param]) as connection:
                for queue in queues.values():
                    connection.default_channel.queue_delete(queue)


def key(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def alive(pid: int) -> bool:
    """Whether the process runs: a zombie (dead, its parent has not reaped it yet) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_the_test_changes_only_durations_of_the_configuration() -> None:
    # The configuration run here is the one the docs give: only the overridden names differ.
    config = load_config({})
    assert set(OVERRIDES) <= {*vars(config), "idempotency_liveness_seconds"}
    for name, value in OVERRIDES.items():
        assert isinstance(value, (int, float)) and value <= getattr(config, name, float("inf"))


def test_duplicate_calls_are_deduplicated(deployment: Deployment) -> None:
    keys = [key("dup") for _ in range(3)]
    calls = [k for k in keys for _ in range(3)]
    # When three callers send each key at once
    with ThreadPoolExecutor(len(calls)) as pool:
        handles = list(pool.map(lambda k: deployment.pay(k, 42), calls))
    # Then each key is published once, every handle names that task and gets its one outcome
    for k in keys:
        mine = [h for h, c in zip(handles, calls, strict=True) if c == k]
        assert len({h.id for h in mine}) == 1
        assert sorted(h.deduplicated for h in mine) == [False, True, True]
        values = [h.get(timeout=GET) for h in mine]
        assert values[0] == values[1] == values[2]
        assert deployment.rows(k) == [values[0]["payment_id"]]
        assert deployment.runs(k) == 1
    # The same key with other arguments is refused, and so is a call without a key (require_key)
    with pytest.raises(PayloadMismatchError):
        deployment.pay(keys[0], 42, 999)
    with pytest.raises(InvalidKeyError):
        deployment.app.tasks[PAY].apply_async((42, 100))


def test_a_child_killed_after_its_commit_charges_once(deployment: Deployment) -> None:
    k = key("kill")
    # Given a charge, sent with a countdown (on RabbitMQ: a message of the delayed delivery queues),
    # whose child is SIGKILLed after the ledger's commit, before its outcome is stored
    handle = deployment.pay(k, 7, hold=60, hold_at="after", countdown=1)
    wait_for(lambda: deployment.counter.get(f"{runs_key(deployment.prefix, k)}:committed"), "the commit", GET)
    os.kill(deployment.pid(k), signal.SIGKILL)
    # Then the broker delivers the message again (task_reject_on_worker_lost); the copy finds the committed payment
    # in the ledger and settles the record with it instead of running the body again: one row, one
    # run, and every caller gets that payment
    value = handle.get(timeout=GET)  # (the ledger may answer it before the copy is delivered)
    wait_for(lambda: deployment.state(k) is State.COMPLETED, "the copy to settle the record", GET)
    assert deployment.rows(k) == [value["payment_id"]]
    assert deployment.runs(k) == 1
    hashed = key_hash(Identity("", PAY, k))  # log lines name a key by its hash (docs/operations.md, Logs)
    assert (
        f"{PAY} (key_hash={hashed}): the earlier attempt {handle.id} completed (ledger)"
        in deployment.workers["main"].output()
    )
    assert AsyncResult(handle.id, app=deployment.app).get(timeout=GET) == value
    again = deployment.pay(k, 7, hold=60, hold_at="after")
    assert again.deduplicated and again.id == handle.id and again.get(timeout=GET) == value


def test_countdown_and_eta_calls_are_claimed_at_publish_and_run_once(deployment: Deployment) -> None:
    by_countdown, by_eta = key("countdown"), key("eta")
    sent = time.time()
    eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3)
    first = deployment.pay(by_countdown, 1, countdown=3)
    second = deployment.pay(by_eta, 2, eta=eta)
    # While the messages wait (on RabbitMQ: in the celery_delayed_* queues), a duplicate is handed
    # the original and nothing is published; the claim lasts the delay plus pending_timeout_seconds
    for k, original, order in ((by_countdown, first, 1), (by_eta, second, 2)):
        duplicate = deployment.pay(k, order)
        assert duplicate.deduplicated and duplicate.id == original.id
        record = deployment.idem.get(PAY, k)
        assert record is not None and record.state is State.PENDING and record.task_id == original.id
        pending = deployment.idem.policy_for(deployment.app.tasks[PAY]).pending_timeout_seconds
        assert record.lease_expires_at is not None
        assert record.lease_expires_at - deployment.idem.store.now() > pending + 1
    # A copy of the countdown message (same task id and key), delivered after the original ran: a
    # broker's redelivery. Sent by name, past the claim, through the same delayed delivery.
    deployment.app.send_task(PAY, (1, 100), task_id=first.id, headers={"idempotency_key": by_countdown}, countdown=5)
    values = [first.get(timeout=GET), second.get(timeout=GET)]
    main = deployment.workers["main"]

    def decisions() -> list[str]:  # the worker's decision lines about the countdown call's task id
        lines = main.output().splitlines()
        return [line for line in lines if f" task_id={first.id} " in line and "] ENDED " not in line]

    wait_for(lambda: len(decisions()) >= 2, "the copy to be delivered", GET)
    # The copy found its task id settled: it replayed the outcome quietly, without running the body
    hashed = key_hash(Identity("", PAY, by_countdown))
    assert f"] RUN {PAY} (key_hash={hashed})" in decisions()[0], decisions()
    assert f"] REPLAY {PAY} (key_hash={hashed})" in decisions()[-1], decisions()
    # Then each body ran once, not before its time, and one payment each
    for k, value in ((by_countdown, values[0]), (by_eta, values[1])):
        assert deployment.runs(k) == 1, f"{k} ran {deployment.runs(k)} times"
        assert deployment.rows(k) == [value["payment_id"]]
        assert float(deployment.seen(k, "at")[0]) >= sent + 2.5
        if deployment.broker == "rabbitmq":  # dead-lettered to it by the last celery_delayed_* level
            [exchange] = deployment.seen(k, "exchange")
            assert exchange.startswith("celery_delayed_"), exchange
    assert AsyncResult(first.id, app=deployment.app).state == "SUCCESS"


def test_eta_calls_beyond_worker_eta_task_limit_wait_in_the_broker_and_run_once(deployment: Deployment) -> None:
    limit = OVERRIDES["worker_eta_task_limit"]
    keys = [key("limit") for _ in range(2 * limit)]
    eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=4)
    handles = [deployment.pay(k, i, eta=eta) for i, k in enumerate(keys)]
    main = deployment.workers["main"]
    held = 0
    while dt.datetime.now(dt.timezone.utc) < eta - dt.timedelta(seconds=0.5):
        replies = deployment.app.control.inspect(destination=[main.name], timeout=1, limit=1).scheduled() or {}
        held = max(held, sum(len(s) for s in replies.values()))
    # Duplicates meanwhile are handed the originals, whether the worker holds the message or not
    duplicates = [deployment.pay(k, i) for i, k in enumerate(keys)]
    assert [d.id for d in duplicates] == [h.id for h in handles]
    assert all(d.deduplicated for d in duplicates)
    # The worker held at most the limit (on RabbitMQ none: the broker holds them until their time)
    assert held <= limit
    if deployment.broker == "redis":
        assert held >= 1
    values = [h.get(timeout=GET) for h in handles]
    assert [d.get(timeout=GET) for d in duplicates] == values
    for k, value in zip(keys, values, strict=True):
        assert deployment.runs(k) == 1
        assert deployment.rows(k) == [value["payment_id"]]


def soft_shutdown(deployment: Deployment) -> dict[str, Any]:
    """The worker ``soft`` runs a body that ends within the soft shutdown timeout and one that does
    not, and is shut down warm (SIGTERM), then cold (SIGQUIT): the soft shutdown."""
    worker = deployment.workers["soft"]
    short, long = key("short"), key("long")
    first = deployment.pay(short, 1, hold=1.5, hold_at="before", queue="soft")
    second = deployment.pay(long, 2, hold=60, hold_at="before", queue="soft")
    wait_for(lambda: deployment.runs(short) and deployment.runs(long), "both bodies to start", GET)
    os.kill(worker.process.pid, signal.SIGTERM)
    wait_for(lambda: "Warm shutdown" in worker.output(), "the warm shutdown", GET)
    os.kill(worker.process.pid, signal.SIGQUIT)
    worker.process.wait(timeout=GET)
    seen = {"short": short, "long": long, "first": first, "second": second, "log": worker.output()}
    seen.update(short_state=deployment.state(short), long_state=deployment.state(long), long_rows=deployment.rows(long))
    deployment.hand_over("soft")
    return seen


def cold_shutdown(deployment: Deployment) -> dict[str, Any]:
    """The worker ``cold`` runs a long body and is shut down cold (SIGQUIT: the soft shutdown waits),
    then cold again while it waits."""
    worker = deployment.workers["cold"]
    k = key("cold")
    handle = deployment.pay(k, 3, hold=60, hold_at="before", queue="cold")
    wait_for(lambda: deployment.runs(k), "the body to start", GET)
    pid = deployment.pid(k)
    os.kill(worker.process.pid, signal.SIGQUIT)
    wait_for(lambda: "Initiating Soft Shutdown" in worker.output(), "the soft shutdown", GET)
    asked = time.monotonic()
    os.kill(worker.process.pid, signal.SIGQUIT)
    wait_for(lambda: not alive(pid), "the body to be cancelled", GET)
    cancelled_after = time.monotonic() - asked
    worker.process.wait(timeout=GET)
    seen = {"key": k, "handle": handle, "cancelled_after": cancelled_after, "state": deployment.state(k)}
    seen["rows"] = deployment.rows(k)
    deployment.hand_over("cold")
    return seen


def test_soft_shutdown_finishes_a_short_body_and_sends_a_long_one_back(deployment: Deployment) -> None:
    # Given a worker running a short and a long body, shut down warm, then cold (soft_shutdown above)
    seen = deployment.shutdowns["soft"].result(timeout=2 * GET)
    # Then the short body finished within the soft shutdown: stored, once
    assert "Initiating Soft Shutdown" in seen["log"]
    assert seen["short_state"] is State.COMPLETED
    value = seen["first"].get(timeout=GET)
    assert deployment.rows(seen["short"]) == [value["payment_id"]] and deployment.runs(seen["short"]) == 1
    # The long one was cancelled (ended with SIGTERM) before its effect: the attempt gave its record
    # back on its way out (released, as for any SystemExit), its message went back to the broker
    # (acks_late, unacked) and runs once on another worker
    assert seen["long_rows"] == []
    assert seen["long_state"] is None
    value = seen["second"].get(timeout=GET)
    assert deployment.rows(seen["long"]) == [value["payment_id"]] and deployment.runs(seen["long"]) == 2
    assert deployment.state(seen["long"]) is State.COMPLETED


def test_a_cold_shutdown_during_the_soft_one_cancels_at_once_and_the_message_runs_once(
    deployment: Deployment,
) -> None:
    # Given a worker running a long body, shut down cold, then cold again during the soft shutdown
    seen = deployment.shutdowns["cold"].result(timeout=2 * GET)
    # Then the body was cancelled at once, not at the end of the soft shutdown, before its effect
    assert seen["cancelled_after"] < OVERRIDES["worker_soft_shutdown_timeout"]
    assert seen["rows"] == [] and seen["state"] is None  # released by the attempt on its way out
    # And its message runs once on another worker
    value = seen["handle"].get(timeout=GET)
    assert deployment.rows(seen["key"]) == [value["payment_id"]] and deployment.runs(seen["key"]) == 2
    assert deployment.state(seen["key"]) is State.COMPLETED
