"""The app of the task-level model (tests/models/test_task_model.py): worker subprocesses, the producer
subprocess and the test process all build it from the same settings.

Every execution of a body is logged outside the library, on the counter Redis, before and after the
effect: ``tm:<prefix>:exec`` gets one JSON line at the start (``key``, ``task_id``, ``pid``, ``start``)
and one at the end (``end``), and the body returns ``{"key", "amount", "task_id", "run"}`` where
``run`` is the INCR of its key: the invariants read these, never the library's records.

Two releases of the app (``RELEASES``) run side by side across a deploy: ``release="v2"`` is the
next release of ``tm.pay``, a backward-compatible change (DESIGN §2, "Across releases"): a parameter
with a default added (and named in ``key_args``), other policy fields and time limits. A worker
subprocess builds the release its ``TM_RELEASE`` names, on the broker its ``TM_BROKER`` names (a
Redis one, or RabbitMQ with quorum queues behind topic exchanges: :func:`broker_conf`).

Bodies that fail: ``tm.flaky`` (by key: permanent, retryable, ``self.retry``), ``tm.backoff``
(``autoretry_for`` with ``retry_backoff``), ``tm.ledger_fails`` (its ledger ``fn`` raises);
``tm.limited`` runs past the time limits its calls carry.

``python task_model_app.py produce`` is the second producer: it reads one JSON command a line on
stdin and answers one JSON line (run under another ``PYTHONHASHSEED``: a fingerprint is a function of
the call, never of the process that made it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import redis
import sqlalchemy as sa
from addresses import RABBITMQ_URL, REDIS_BACKEND_URL, REDIS_BROKER_URL, REDIS_COUNTER_URL
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from kombu import Exchange, Queue
from pydantic import BaseModel
from sqlalchemy import orm

from celery_idem import Idempotency, IdempotentTask, PermanentError, RetryableError
from celery_idem.ledger import Ledger
from celery_idem.outbox import SQLOutbox, staging

COUNTER_URL = REDIS_COUNTER_URL
BROKER = REDIS_BROKER_URL
BROKERS = {"redis": REDIS_BROKER_URL, "rabbitmq": RABBITMQ_URL}
BACKEND = REDIS_BACKEND_URL
LEDGER_URL = os.environ.get("CELERY_IDEM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

# Seconds. Short, so that leases, liveness and TTLs pass within a history.
LEASE = 2.0
TTL = 5.0
PENDING = 12.0
BUSY_WAIT = 3.0
LIVENESS = 2.0
STORE_TIMEOUT = 1.0
VISIBILITY = 8.0  # a message unacked this long goes back to the queue (a redelivered copy)
# On RabbitMQ an unacked message goes back when its channel closes (its worker died): at once, give
# or take the broker noticing the closed connection.
RABBITMQ_RETURN = 2.0
DELIVERY_LIMIT = 20  # x-delivery-limit of the quorum queues (RabbitMQ 4's default; set here on 3.x)
RELEASES = ("v1", "v2")


# How tm.flaky's body fails, by the call's order number (so a key always fails the same way)
FAIL_MODES = ("permanent", "retryable", "retry")


# tm.backoff fails this many first attempts (autoretry_for, retry_backoff, max_retries=2), by key
BACKOFF_FAILS = (1, 2, 3)
# tm.ledger_fails raises inside the ledger's fn, by key: for good, or retryably on the key's first try
LEDGER_FAIL_MODES = ("permanent", "retryable", "permanent")
# tm.limited's (soft, hard) time limits per call, by key: under the lease (2 s), the hard one alone,
# and both over it, the body ignoring its soft limit (the heartbeat renews the lease meanwhile)
LIMITS: tuple[tuple[float | None, float], ...] = ((1.0, 1.5), (None, 1.0), (2.5, 3.5))


def quorum_queue(name: str) -> Queue:
    """A queue as docs/guides/production.md lays it out on RabbitMQ: a quorum queue with a delivery
    limit behind a topic exchange (so that Celery's native delayed delivery carries countdowns)."""
    arguments = {"x-queue-type": "quorum", "x-delivery-limit": DELIVERY_LIMIT}
    return Queue(name, Exchange(name, type="topic"), routing_key=name, queue_arguments=arguments)


def broker_conf(broker: str, queues: list[str]) -> dict[str, Any]:
    """The broker settings of an app whose broker URL is ``broker`` and whose queues are ``queues``."""
    if broker.startswith("amqp"):
        return {
            "task_queues": [quorum_queue(name) for name in queues],
            "broker_transport_options": {"confirm_publish": True},
        }
    return {
        "broker_transport_options": {
            "visibility_timeout": VISIBILITY,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    }


class Declined(PermanentError):
    """A permanent failure of tm.flaky: stored, and every duplicate within the TTL gets it."""


class Flaky(RetryableError):
    """A retryable failure of tm.flaky, never retried: the key is freed, its caller gets it."""


class Basket(BaseModel):
    """A model with a set: Celery dumps it as a list in the producer's hash order."""

    order_id: int
    tags: set[str]


def exec_log(prefix: str) -> str:
    return f"tm:{prefix}:exec"


def continuation_key(prefix: str, tag: str) -> str:
    return f"tm:{prefix}:cont:{tag}"


def payments(prefix: str) -> sa.Table:
    """The business table of the ledger task: no unique key, so a second charge would show."""
    return sa.Table(
        f"tm_payments_{prefix}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(300), nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
    )


def make_app(*, store: Any, prefix: str, queue: str, release: str = "v1", broker: str = BROKER) -> Celery:
    app = Celery("tm", broker=broker, backend=BACKEND, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        **broker_conf(broker, [queue, f"{queue}-heavy"]),
    )
    engine = sa.create_engine(LEDGER_URL, poolclass=sa.pool.NullPool)
    ledger = Ledger(engine, table_name=f"tm_ledger_{prefix}")
    Idempotency(
        app,
        store=store,
        key_prefix=prefix,
        ledger=ledger,
        lease_seconds=LEASE,
        ttl_seconds=TTL,
        pending_timeout_seconds=PENDING,
        busy_wait_seconds=BUSY_WAIT,
        liveness_seconds=LIVENESS,
        store_timeout_seconds=STORE_TIMEOUT,
        inspect_timeout_seconds=0.5,
    )
    counter = redis.Redis.from_url(COUNTER_URL)
    table = payments(prefix)

    def started(task: Any) -> tuple[str, float]:
        key = str(task.request.idempotency_key)
        at = time.time()
        line = {"key": key, "task_id": task.request.id, "pid": os.getpid(), "start": at, "task": task.name}
        line["release"] = release
        hard = (task.request.timelimit or (None, None))[0]
        if hard:
            line["hard"] = hard  # the call's hard time limit: the pool kills the body past it
        counter.rpush(exec_log(prefix), json.dumps(line))
        return key, at

    def ended(task: Any, key: str, amount: int) -> dict[str, Any]:
        run = int(counter.incr(f"tm:{prefix}:runs:{task.name}:{key}"))
        at = time.time()
        line = {"key": key, "task_id": task.request.id, "pid": os.getpid(), "end": at, "run": run, "task": task.name}
        counter.rpush(exec_log(prefix), json.dumps(line))
        return {"key": key, "amount": amount, "task_id": task.request.id, "run": run}

    def failed(task: Any, key: str, error: BaseException, *, final: bool) -> BaseException:
        """The attempt's end, failed with ``error`` (``final``: the outcome stored for the key)."""
        line = {"key": key, "task_id": task.request.id, "pid": os.getpid(), "failed": time.time(), "task": task.name}
        counter.rpush(exec_log(prefix), json.dumps({**line, "error": type(error).__name__, "final": final}))
        return error

    task = app.task
    options: dict[str, Any] = {"shared": False, "base": IdempotentTask, "bind": True}

    if release == "v1":

        @task(name="tm.pay", idempotency={"key_args": ["order", "amount"]}, **options)
        def pay(self: Any, order: int, amount: int, hold: float = 0.0) -> dict[str, Any]:
            key, _ = started(self)
            time.sleep(hold)
            return ended(self, key, amount)

    else:
        # The next release: `currency` added with a default (in the fingerprint's key_args too),
        # a longer busy wait, time limits (longer than any body).
        policy = {"key_args": ["order", "amount", "currency"], "busy_wait_seconds": BUSY_WAIT + 1}

        @task(name="tm.pay", idempotency=policy, soft_time_limit=20, time_limit=30, **options)
        def pay(self: Any, order: int, amount: int, hold: float = 0.0, currency: str = "EUR") -> dict[str, Any]:
            key, _ = started(self)
            time.sleep(hold)
            return ended(self, key, amount)

    @task(name="tm.moving", idempotency={"key_args": ["order", "amount"]}, **options)
    def moving(self: Any, order: int, amount: int, heavy: str = "", hold: float = 0.0) -> Any:
        """Moves itself to the big-memory queue first (replace with the same call), then pays."""
        if heavy and (self.request.delivery_info or {}).get("routing_key") != heavy:
            raise self.replace(self.s(order, amount, heavy, hold).set(queue=heavy))
        key, _ = started(self)
        time.sleep(0.2 + hold)
        return ended(self, key, amount)

    @task(name="tm.ledger_pay", idempotency={"key_args": ["order", "amount"]}, **options)
    def ledger_pay(self: Any, order: int, amount: int, hold: float = 0.0) -> dict[str, Any]:
        key, _ = started(self)
        time.sleep(hold)

        def charge(session: Any) -> dict[str, Any]:
            session.execute(table.insert().values(key=key, amount=amount))
            return ended(self, key, amount)

        return dict(ledger.run_once(self, charge))

    @task(name="tm.ledger_fails", idempotency={"key_args": ["order", "amount", "mode"]}, **options)
    def ledger_fails(self: Any, order: int, amount: int, mode: str, hold: float = 0.0) -> dict[str, Any]:
        """A ledger payment whose ``fn`` raises after its business write (rolled back with it): by
        ``mode``, ``permanent`` (Declined, every time) or ``retryable`` (Flaky on the key's first
        try, then it pays)."""
        key, _ = started(self)
        time.sleep(hold)

        def charge(session: Any) -> dict[str, Any]:
            session.execute(table.insert().values(key=key, amount=amount))
            if mode == "permanent":
                raise failed(self, key, Declined(f"order {order} declined"), final=True)
            if mode == "retryable" and counter.incr(f"tm:{prefix}:tries:{key}") == 1:
                raise failed(self, key, Flaky(f"order {order}: try again"), final=False)
            return ended(self, key, amount)

        return dict(ledger.run_once(self, charge))

    retried: dict[str, Any] = {"retry_backoff": 1, "retry_backoff_max": 4, "retry_jitter": False, "max_retries": 2}
    retried.update(autoretry_for=(Flaky,), idempotency={"key_args": ["order", "amount"]})

    @task(name="tm.backoff", **retried, **options)
    def backoff(self: Any, order: int, amount: int, fails: int = 1, hold: float = 0.0) -> dict[str, Any]:
        """Fails its first ``fails`` attempts retryably; ``autoretry_for`` retries it after 1 s, then
        2 s (``retry_backoff``, no jitter), at most twice: with ``fails=3`` the last attempt's Flaky
        is its caller's answer."""
        key, _ = started(self)
        time.sleep(hold)
        if self.request.retries < fails:
            raise failed(self, key, Flaky(f"order {order}: attempt {self.request.retries} failed"), final=False)
        return ended(self, key, amount)

    @task(name="tm.limited", idempotency={"key_args": ["order", "amount"]}, **options)
    def limited(self: Any, order: int, amount: int, hold: float = 0.0, stubborn: bool = False) -> dict[str, Any]:
        """Called with time limits (``LIMITS``); sleeps ``hold``. Its soft limit is its error
        (SoftTimeLimitExceeded, retryable), unless ``stubborn``: it sleeps on until the hard one
        kills its process."""
        key, _ = started(self)
        try:
            time.sleep(hold)
        except SoftTimeLimitExceeded as exc:
            if not stubborn:
                raise failed(self, key, exc, final=False) from None
            time.sleep(hold)
        return ended(self, key, amount)

    @task(name="tm.flaky", idempotency={"key_args": ["order", "amount", "mode"]}, **options)
    def flaky(self: Any, order: int, amount: int, mode: str, hold: float = 0.0) -> dict[str, Any]:
        """Fails by ``mode``: ``permanent`` (Declined), ``retryable`` (Flaky, no retry), ``retry``
        (``self.retry`` with other arguments, a key argument among them, and a countdown; the retry
        returns)."""
        key, _ = started(self)
        time.sleep(hold)
        if mode == "permanent":
            raise failed(self, key, Declined(f"order {order} declined"), final=True)
        if mode == "retryable":
            raise failed(self, key, Flaky(f"order {order}: try again"), final=False)
        if mode == "retry":
            retry = self.retry(
                args=(order, amount), kwargs={"mode": "retried", "hold": 0.0}, countdown=0.5, throw=False
            )
            raise failed(self, key, retry, final=False)
        return ended(self, key, amount)

    @task(name="tm.tagged", pydantic=True, **options)
    def tagged(self: Any, basket: Basket) -> dict[str, Any]:
        key, _ = started(self)
        time.sleep(0.1)
        return ended(self, key, basket.order_id)

    @app.task(name="tm.then", shared=False)
    def then(value: Any, tag: str) -> Any:
        """A continuation (link or chain): counts its runs per call."""
        counter.incr(continuation_key(prefix, tag))
        return value

    transactional_tasks(app, prefix, ledger, started, failed)
    return app


def create_tables(prefix: str) -> None:
    engine = sa.create_engine(LEDGER_URL, poolclass=sa.pool.NullPool)
    payments(prefix).create(engine, checkfirst=True)
    Ledger(engine, table_name=f"tm_ledger_{prefix}").create_schema()
    outbox_of(prefix).create_schema()
    engine.dispose()


def drop_tables(prefix: str) -> None:
    engine = sa.create_engine(LEDGER_URL, poolclass=sa.pool.NullPool)
    with engine.begin() as connection:
        connection.exec_driver_sql(f'DROP TABLE IF EXISTS "tm_payments_{prefix}"')
        connection.exec_driver_sql(f'DROP TABLE IF EXISTS "tm_ledger_{prefix}"')
        connection.exec_driver_sql(f'DROP TABLE IF EXISTS "tm_outbox_{prefix}"')
    engine.dispose()


def _produce(app: Celery) -> None:
    """The second producer: ``{"task", "args", "kwargs", "options"}`` in, ``{"id", "deduplicated",
    "key"}`` or ``{"error": class name}`` out, one JSON line each."""
    for line in sys.stdin:
        command = json.loads(line)
        if command["task"] == "ping":  # after a cut: a pooled connection the cut broke fails once
            try:
                Idempotency.of(app).store.ping()
            except Exception:  # noqa: BLE001 - the first use of a broken connection
                pass
            print(json.dumps({"pong": True}), flush=True)
            continue
        args = command.get("args", [])
        if command["task"] == "tm.tagged":
            args = [Basket(**args[0])]
        try:
            result = app.tasks[command["task"]].apply_async(args, command.get("kwargs", {}), **command["options"])
            answer = {"id": result.id, "deduplicated": result.deduplicated, "key": result.idempotency_key}
        except Exception as exc:  # noqa: BLE001 - the test judges every error by its class
            answer = {"error": type(exc).__name__, "message": str(exc)[:300]}
        print(json.dumps(answer), flush=True)


# ---- transactions (issue 27): the transactional outbox, and the ledger joined to the body's own
# transaction. Kept in a block of their own: the model draws them as call forms (tests/models/test_task_model.py).

RELAY_LEASE = 1.0  # seconds a relay's rows stay its own: a dead relay's are due again this soon
# Where `python task_model_app.py relay` SIGKILLs itself in its pass (TM_RELAY_DIES), as
# tests/outbox_shop.py's relay does: after taking the rows and before the first claim, after the claim
# and before the message reaches the broker, after the publish and before the pass settles its rows.
RELAY_DIES = ("before_claim", "before_publish", "after_publish")
# How tm.ledger_tx's body ends the transaction it opened and joined run_once to (not in the fingerprint:
# a call that rolled back and one that commits are the same call, and the first leaves the key free).
TX_MODES = ("commit", "rollback")


class RolledBack(RetryableError):
    """tm.ledger_tx's body rolled back the transaction its payment was in: the key is freed."""


def outbox_of(prefix: str) -> SQLOutbox:
    """The model's outbox: a table beside the ledger's, on the business database (PostgreSQL)."""
    engine = sa.create_engine(LEDGER_URL, poolclass=sa.pool.NullPool)
    return SQLOutbox(engine, table_name=f"tm_outbox_{prefix}", lease_seconds=RELAY_LEASE)


def transactional_tasks(app: Celery, prefix: str, ledger: Ledger, started: Any, failed: Any) -> None:
    """``tm.ledger_tx``: a payment through ``run_once`` joined to a transaction the body opened; the
    body holds (a kill lands between run_once and the commit), then commits or rolls back by
    ``mode``. Its business row's key is ``tx:<key>``, beside tm.ledger_pay's in the payments table.
    Its end is logged after the commit, and an execution the ledger answered with a committed
    outcome (``fn`` not run) is logged as ``answered``: it made no payment and returned another's."""
    counter, table = redis.Redis.from_url(COUNTER_URL), payments(prefix)

    def log_end(task: Any, key: str, value: dict[str, Any], paid: bool) -> dict[str, Any]:
        line = {"key": key, "task_id": task.request.id, "pid": os.getpid(), "task": task.name}
        line.update({"end": time.time(), "run": value["run"]} if paid else {"answered": time.time()})
        counter.rpush(exec_log(prefix), json.dumps(line))
        return value

    @app.task(
        name="tm.ledger_tx", idempotency={"key_args": ["order", "amount"]}, shared=False, base=IdempotentTask, bind=True
    )
    def ledger_tx(self: Any, order: int, amount: int, mode: str, hold: float = 0.0) -> dict[str, Any]:
        key, _ = started(self)
        paid: list[bool] = []

        def charge(session: Any) -> dict[str, Any]:
            session.execute(table.insert().values(key=f"tx:{key}", amount=amount))
            paid.append(True)
            run = int(counter.incr(f"tm:{prefix}:runs:{self.name}:{key}"))
            return {"key": key, "amount": amount, "task_id": self.request.id, "run": run}

        with orm.Session(ledger.engine) as session:
            value = dict(ledger.run_once(self, charge, session=session))
            time.sleep(hold)  # between run_once and the end of the transaction: a kill lands here
            if mode == "rollback":
                session.rollback()
                raise failed(self, key, RolledBack(f"order {order}: its transaction rolled back"), final=False)
            session.commit()
        return log_end(self, key, value, bool(paid))


def _relay_dying(app: Celery, when: str) -> None:
    """Make this relay process SIGKILL itself at ``when`` in its first row (tests/outbox_shop.py's way)."""
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if when == "before_claim":
        staging.relay_call = lambda *args, **kwargs: die()  # type: ignore[assignment]
    elif when == "after_publish":
        relay_call = staging.relay_call

        def published_then_die(*args: Any, **kwargs: Any) -> Any:
            relay_call(*args, **kwargs)
            die()

        staging.relay_call = published_then_die  # type: ignore[assignment]
    elif when == "before_publish":
        for task in app.tasks.values():
            if isinstance(task, IdempotentTask):
                task._send = lambda *args, **kwargs: die()  # type: ignore[method-assign]
    else:
        raise SystemExit(f"TM_RELAY_DIES={when!r}: one of {RELAY_DIES}")


def _relay(app: Celery, prefix: str) -> None:
    """One relay pass (``python task_model_app.py relay``), dying where TM_RELAY_DIES says."""
    if os.environ.get("TM_RELAY_DIES"):
        _relay_dying(app, os.environ["TM_RELAY_DIES"])
    report = outbox_of(prefix).relay(app)
    print(json.dumps({"published": len(report.published), "failed": report.failed, "dead": report.dead}))


if os.environ.get("TM_PREFIX"):
    app = make_app(
        store=os.environ["TM_STORE"],
        prefix=os.environ["TM_PREFIX"],
        queue=os.environ["TM_QUEUE"],
        release=os.environ.get("TM_RELEASE", "v1"),
        broker=os.environ.get("TM_BROKER", BROKER),
    )

if __name__ == "__main__" and sys.argv[1:] == ["produce"]:
    _produce(app)
if __name__ == "__main__" and sys.argv[1:] == ["relay"]:
    _relay(app, os.environ["TM_PREFIX"])
