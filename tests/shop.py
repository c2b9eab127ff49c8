"""The app the worker tests run: a shop whose tasks count their side effects in Redis.

``make_app(...)`` builds one app per test module (in-process workers); a ``celery worker``
subprocess imports this module and gets ``app`` built from the SHOP_* environment variables.
Every side effect is an INCR on the counter Redis, keyed by task and idempotency key: the tests
count executions there, outside the library, never in its records.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import redis
import sqlalchemy as sa
from addresses import REDIS_COUNTER_URL
from celery import Celery, chain, group
from celery.exceptions import Ignore, Reject
from pydantic import BaseModel
from sqlalchemy.orm import Session

from celery_idem import (
    Idempotency,
    IdempotentTask,
    PermanentError,
    RetryableError,
    StoreUnavailableError,
    idempotent_task,
)
from celery_idem.ledger import Ledger

COUNTER_URL = os.environ.get("SHOP_COUNTER", REDIS_COUNTER_URL)


class Order(BaseModel):
    """The argument of shop.place (module level: Celery's pydantic support resolves it by name)."""

    order_id: int
    amount: int


def effects_key(prefix: str, task: str, key: str) -> str:
    return f"effects:{prefix}:{task}:{key}"


def make_app(
    *,
    broker: str,
    backend: str | None,
    store: str,
    prefix: str,
    queue: str,
    ledger_url: str | None = None,
    **settings: Any,
) -> Celery:
    app = Celery("shop", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        task_store_errors_even_if_ignored=False,
    )
    ledger = payments = None
    if ledger_url:
        engine = sa.create_engine(ledger_url, poolclass=sa.pool.NullPool)
        ledger = settings["ledger"] = Ledger(engine, table_name=f"ledger_{prefix}")
        payments = payments_table(prefix)
    Idempotency(app, store=store, key_prefix=prefix, **settings)
    counter = redis.Redis.from_url(COUNTER_URL)

    def effect(task: Any) -> int:
        """The side effect: one INCR per execution of the body, keyed by the call's identity, and
        the time it started (so a test can tell when each execution ran)."""
        key = effects_key(prefix, task.name, task.request.idempotency_key)
        pipe = counter.pipeline()
        pipe.incr(key)
        pipe.rpush(f"{key}:at", repr(time.time()))
        pipe.set(f"{key}:pid", os.getpid())
        return int(pipe.execute()[0])

    task = functools.partial(app.task, shared=False, base=IdempotentTask, bind=True)

    @task(name="shop.charge", idempotency={"key_args": ["order_id", "amount"]})
    def charge(self: Any, order_id: Any, amount: int, currency: str = "EUR", note: str = "") -> dict[str, Any]:
        effect(self)
        return {"order": str(order_id), "charged": amount, "currency": currency, "task_id": self.request.id}

    @task(name="shop.slow", acks_late=True, idempotency={"lease_seconds": 3})
    def slow(self: Any, seconds: float, tag: str = "") -> str:
        effect(self)
        time.sleep(seconds)
        return f"slept {seconds}"

    @task(name="shop.held", acks_late=True, idempotency={"lease_seconds": 10})
    def held(self: Any, seconds: float) -> str:
        """A slow task whose lease outlasts a loaded machine's delay between a kill and its report."""
        effect(self)
        time.sleep(seconds)
        return f"slept {seconds}"

    @task(name="shop.slow_retry", idempotency={"lease_seconds": 2, "on_busy": "retry"}, max_retries=5)
    def slow_retry(self: Any, seconds: float) -> str:
        effect(self)
        time.sleep(seconds)
        return f"slept {seconds}"

    @task(name="shop.nap", idempotency={"lease_seconds": 1}, max_retries=1)
    def nap(self: Any, seconds: float) -> str:
        """A short lease (its BUSY duplicates go back to the broker every second) and one retry; its
        TTL, on_busy and busy_wait_seconds come from the worker's settings."""
        effect(self)
        time.sleep(seconds)
        return f"napped {seconds}"

    @task(name="shop.patient", autoretry_for=(StoreUnavailableError,), max_retries=2, default_retry_delay=0.1)
    def patient(self: Any, order_id: int) -> int:
        effect(self)
        return order_id

    @task(name="shop.declined")
    def declined(self: Any, order_id: int) -> None:
        effect(self)
        raise PermanentError(f"card declined for order {order_id}")

    @task(
        name="shop.flaky",
        autoretry_for=(ConnectionError,),
        max_retries=2,
        default_retry_delay=0,
    )
    def flaky(self: Any, fail_times: int, tag: str = "") -> dict[str, Any]:
        n = effect(self)
        if n <= fail_times:
            raise ConnectionError(f"payment provider unreachable (attempt {n})")
        return {"attempts": n, "task_id": self.request.id, "retries": self.request.retries}

    @task(name="shop.rebill", max_retries=3)
    def rebill(self: Any, amount: int, tag: str = "") -> dict[str, Any]:
        effect(self)
        if self.request.retries == 0:
            raise self.retry(args=(amount + 1,), kwargs={"tag": tag}, countdown=0)
        return {"amount": amount, "retries": self.request.retries, "task_id": self.request.id}

    @task(name="shop.later", max_retries=1)
    def later(self: Any, order_id: int) -> None:
        effect(self)
        raise self.retry(countdown=3600)

    @idempotent_task(app=app, shared=False, bind=True, name="shop.quiet", ignore_result=True)
    def quiet(self: Any, order_id: int) -> dict[str, Any]:
        effect(self)
        return {"quiet": order_id}

    @idempotent_task(
        app=app,
        shared=False,
        bind=True,
        name="shop.quiet_flaky",
        ignore_result=True,
        autoretry_for=(ConnectionError,),
        max_retries=1,
        default_retry_delay=0,
    )
    def quiet_flaky(self: Any, order_id: int) -> dict[str, Any]:
        effect(self)
        raise ConnectionError(f"payment provider unreachable for order {order_id}")

    @task(name="shop.again")
    def again(self: Any, order_id: int) -> dict[str, Any]:
        effect(self)
        # A task that calls itself with its own arguments is its own duplicate.
        return {"own": self.request.id, "again": again.delay(order_id).id}

    @app.task(shared=False, name="shop.add")
    def add(value: dict[str, Any], extra: int) -> int:
        counter.incr(effects_key(prefix, "shop.add", str(value.get("order"))))
        return int(value["charged"]) + extra

    @task(name="shop.result_of_size")
    def result_of_size(self: Any, size: int) -> str:
        effect(self)
        return "x" * size

    @task(name="shop.unencodable")
    def unencodable(self: Any, tag: str) -> Any:
        effect(self)
        return object()

    @app.task(shared=False, name="shop.replacement")
    def replacement(order_id: int) -> dict[str, Any]:
        counter.incr(effects_key(prefix, "shop.replacement", str(order_id)))
        return {"replaced": order_id}

    @task(name="shop.delegating")
    def delegating(self: Any, order_id: int) -> Any:
        """Hands its work on by returning the child's result object, as plain Celery allows."""
        effect(self)
        return replacement.delay(order_id)

    @task(name="shop.retry_returned", max_retries=2)
    def retry_returned(self: Any, amount: int) -> dict[str, Any]:
        """Retries by returning the Retry (``throw=False``) instead of raising it."""
        effect(self)
        if self.request.retries == 0:
            return self.retry(countdown=0, throw=False)  # type: ignore[no-any-return]
        return {"amount": amount, "retries": self.request.retries, "task_id": self.request.id}

    @task(name="shop.countdown", idempotency={"busy_wait_seconds": 2})
    def countdown(self: Any, n: int) -> str:
        """Calls itself as a plain function, as recursive code does: that call is no copy of the message."""
        counter.incr(effects_key(prefix, "shop.countdown", f"{self.request.idempotency_key}:{n}"))
        return countdown(n - 1) if n > 0 else "done"  # type: ignore[no-any-return]

    @task(name="shop.untyped", typing=False)
    def untyped(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        """Celery's argument check is off: calls are published as given, checked by the body's call."""
        effect(self)
        return {"order": order_id, "amount": amount}

    @task(name="shop.replaced")
    def replaced(self: Any, order_id: int) -> Any:
        effect(self)
        raise self.replace(replacement.si(order_id))

    def moving(self: Any, order_id: int, how: str) -> dict[str, Any]:
        """Replaces itself once with its own call: on the heavy queue (``how="queue"``), on a queue no
        worker consumes until a test says so (``"parked"``), or a little later as polling does
        (``"countdown"``: 1 s, ``"later"``: 4 s); the second run answers."""
        runs = effect(self)
        if runs == 1:
            again = self.s(order_id, how)
            delay = {"countdown": 1, "later": 4}.get(how)
            moved = again.set(queue=f"{queue}.parked" if how == "parked" else f"{queue}.heavy")
            raise self.replace(moved if delay is None else again.set(countdown=delay))
        return {"order": order_id, "runs": runs, "queue": (self.request.delivery_info or {}).get("routing_key")}

    @task(name="shop.moving_slowly")
    def moving_slowly(self: Any, order_id: int) -> dict[str, Any]:
        """Works 1.5 s, then replaces itself once with its own call (a duplicate meets it running)."""
        runs = effect(self)
        if runs == 1:
            time.sleep(1.5)
            raise self.replace(self.s(order_id))
        return {"order": order_id, "runs": runs}

    @task(name="shop.moving_held", idempotency={"lease_seconds": 2})
    def moving_held(self: Any, order_id: int, seconds: float) -> dict[str, Any]:
        """Replaces itself once with its own call on the heavy queue, which works ``seconds`` (later
        calls of the key answer at once)."""
        runs = effect(self)
        if runs == 1:
            raise self.replace(self.s(order_id, seconds).set(queue=f"{queue}.heavy"))
        if runs == 2:
            time.sleep(seconds)
        return {"order": order_id, "runs": runs}

    task(name="shop.moving")(moving)
    task(name="shop.moving_strict", idempotency={"on_duplicate": "raise"})(moving)
    task(name="shop.moving_brief", idempotency={"lease_seconds": 1})(moving)

    @task(name="shop.replaced_later", idempotency={"pending_timeout_seconds": 1, "lease_seconds": 1})
    def replaced_later(self: Any, order_id: int) -> Any:
        """Replaced by another call that waits 3 s, longer than the task's queue wait (1 s)."""
        effect(self)
        raise self.replace(replacement.si(order_id).set(countdown=3))

    @task(name="shop.chained")
    def chained(self: Any, order_id: int, keyed: bool = False) -> Any:
        """Replaces itself once with "prepare, then me again": a chain that ends in its own call."""
        runs = effect(self)
        if runs == 1:
            again = self.si(order_id, keyed)
            if keyed:
                again = again.set(idempotency_key=self.request.idempotency_key)
            raise self.replace(chain(replacement.si(order_id), again))
        return {"order": order_id, "runs": runs}

    @task(name="shop.poll")
    def poll(self: Any, order_id: int, tries: int = 0) -> Any:
        """A keyed poll that replaces itself with its own call (same key) one try later: other arguments."""
        runs = effect(self)
        if runs == 1:
            raise self.replace(
                self.s(order_id, tries + 1).set(idempotency_key=self.request.idempotency_key, countdown=1)
            )
        return {"order": order_id, "runs": runs, "tries": tries}

    @task(name="shop.chain_poll")
    def chain_poll(self: Any, order_id: int, tries: int = 0) -> Any:
        """Replaces itself once with "prepare, then me one try later": a chain ending in its own call
        with other arguments."""
        runs = effect(self)
        if runs == 1:
            again = self.si(order_id, tries + 1).set(idempotency_key=self.request.idempotency_key)
            raise self.replace(chain(replacement.si(order_id), again))
        return {"order": order_id, "runs": runs, "tries": tries}

    @task(name="shop.poll_requeued", acks_late=True)
    def poll_requeued(self: Any, order_id: int, tries: int = 0) -> Any:
        """Replaces itself one try later; the replacement is requeued once (Reject) before it answers."""
        runs = effect(self)
        if tries == 0:
            raise self.replace(self.s(order_id, 1).set(idempotency_key=self.request.idempotency_key))
        if runs == 2:
            raise Reject("not now", requeue=True)
        return {"order": order_id, "runs": runs, "tries": tries}

    @task(name="shop.swap")
    def swap(self: Any, order_id: int) -> Any:
        """Replaced by another call; run as a chain's first step (Celery appends the chain's rest)."""
        effect(self)
        raise self.replace(replacement.si(order_id))

    @app.task(shared=False, name="shop.tail")
    def tail() -> str:
        return "tail-value"

    @task(name="shop.replaced_by_a_slow_chain", idempotency={"pending_timeout_seconds": 1, "lease_seconds": 1})
    def replaced_by_a_slow_chain(self: Any, order_id: int) -> Any:
        """Replaced by two steps of 2 s countdown each: their waits add up (1 + 2, then 1 + 2)."""
        effect(self)
        raise self.replace(chain(replacement.si(order_id).set(countdown=2), replacement.si(order_id).set(countdown=2)))

    @task(name="shop.replaced_by_charge")
    def replaced_by_charge(self: Any, order_id: int) -> Any:
        """Replaced by another idempotent call (whose publish claims its own key)."""
        effect(self)
        raise self.replace(charge.si(order_id, 5).set(idempotency_key=f"{self.request.idempotency_key}-charge"))

    @task(name="shop.replaced_declined")
    def replaced_declined(self: Any, order_id: int) -> Any:
        """Replaced by a call that fails for good (shop.declined)."""
        effect(self)
        raise self.replace(declined.si(order_id))

    @task(name="shop.to_all")
    def to_all(self: Any, numbers: list[int], value: int) -> Any:
        """Replaces itself with a group (Celery's add_to_all in its integration tests)."""
        raise self.replace(group(*(plus.s(number, value) for number in numbers)))

    @task(name="shop.plus")
    def plus(self: Any, number: int, value: int) -> int:
        return number + value

    @app.task(shared=False, name="shop.noted_error")
    def noted_error(request: Any, exc: Any, traceback: Any, tag: str) -> None:
        """A new-style error callback (request, exception, traceback), counted."""
        counter.incr(effects_key(prefix, "shop.noted_error", tag))

    @task(name="shop.rejecting", acks_late=True)
    def rejecting(self: Any, requeue: bool) -> dict[str, Any]:
        n = effect(self)
        if n == 1:
            raise Reject("not now", requeue=requeue)
        return {"attempts": n}

    @task(name="shop.ignoring")
    def ignoring(self: Any, order_id: int) -> None:
        effect(self)
        raise Ignore()

    @task(name="shop.slow_busy_retry", idempotency={"lease_seconds": 1, "on_busy": "retry"}, max_retries=1)
    def slow_busy_retry(self: Any, seconds: float) -> str:
        effect(self)
        time.sleep(seconds)
        return f"slept {seconds}"

    @app.task(shared=False, name="shop.noted")
    def noted(task_id: str, tag: str) -> None:
        counter.incr(effects_key(prefix, "shop.noted", tag))

    @task(
        name="shop.requeued", acks_late=True, max_retries=3, idempotency={"lease_seconds": 3, "stale_action": "requeue"}
    )
    def requeued(self: Any, amount: int, hold: float = 60, retry_first: bool = False) -> dict[str, Any]:
        """Stuck (to be killed) the first time it gets past its optional first retry; then an effect.
        Answers what the attempt ran with: its arguments, retries, time limits, queue and priority."""
        if retry_first and self.request.retries == 0:
            raise self.retry(args=(amount + 1,), kwargs={"hold": hold, "retry_first": True}, countdown=0)
        if counter.incr(effects_key(prefix, f"{self.name}.started", self.request.idempotency_key)) == 1:
            time.sleep(hold)  # only the first attempt gets stuck
        effect(self)
        delivery = self.request.delivery_info or {}
        return {
            "amount": amount,
            "retries": self.request.retries,
            "time_limits": list(self.request.timelimit or ()),
            "queue": delivery.get("routing_key"),
            "priority": delivery.get("priority"),
        }

    def pay(self: Any, order_id: int, amount: int, hold_before_commit: float = 0, hold_after_commit: float = 0) -> Any:
        """A payment recorded in the business database with the ledger, in one transaction."""
        assert ledger is not None and payments is not None

        def charge_card(session: Any) -> dict[str, int]:
            session.execute(payments.insert().values(order_id=order_id, amount=amount))
            if counter.incr(effects_key(prefix, f"{self.name}.fn", self.request.idempotency_key)) == 1:
                time.sleep(hold_before_commit)  # only the first attempt gets stuck
            return {"paid": amount, "order": order_id}

        outcome = ledger.run_once(self, charge_card)
        effect(self)
        time.sleep(hold_after_commit)
        return outcome

    @task(name="shop.place", pydantic=True)
    def place(self: Any, order: Order) -> dict[str, Any]:
        """A pydantic=True task: callers may pass an Order, Celery sends its dump."""
        effect(self)
        return {"order": order.order_id, "amount": order.amount}

    def decline(self: Any, order_id: int, amount: int, error: str = "permanent", caller: str = "") -> Any:
        """The provider declines inside fn (the ledger's transaction): its call is an INCR here,
        outside the library, then ``error`` ("permanent" or "retryable") is raised. With ``caller``,
        run_once joins the body's own Session, which wrote a row of its own first and then
        "commits" or "rolls back" whatever run_once raised."""
        assert ledger is not None and payments is not None
        failure = {"permanent": PermanentError, "retryable": RetryableError}[error]

        def charge_card(session: Any) -> dict[str, int]:
            session.execute(payments.insert().values(order_id=order_id, amount=amount))
            effect(self)  # the provider's charge: it answers with a decline
            raise failure(f"card declined for order {order_id}")

        if not caller:
            return ledger.run_once(self, charge_card)
        with Session(ledger.engine) as session:
            session.execute(payments.insert().values(order_id=-order_id, amount=0))  # the caller's own write
            try:
                return ledger.run_once(self, charge_card, session=session)
            finally:
                session.commit() if caller == "commits" else session.rollback()

    if ledger is not None:
        paying = {"key_args": ["order_id", "amount"], "lease_seconds": 3}
        task(name="shop.pay", acks_late=True, idempotency=paying)(pay)
        task(name="shop.pay_requeue", acks_late=True, idempotency={**paying, "stale_action": "requeue"})(pay)
        task(name="shop.decline", idempotency={"key_args": ["order_id", "amount"]})(decline)

    return app


def payments_table(prefix: str) -> sa.Table:
    """The business table of the ledger tasks: no unique key, so a second charge would show."""
    return sa.Table(
        f"payments_{prefix}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.Integer, nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
    )


if os.environ.get("SHOP_BROKER"):
    _store: Any = os.environ["SHOP_STORE"]
    if os.environ.get("CELERY_IDEM_FAULTS"):  # a worker subprocess under fault injection (tests/faults.py)
        from faults import install_from_env

        from celery_idem.stores import store_from_url

        _store = store_from_url(_store, key_prefix=os.environ["SHOP_PREFIX"])
        install_from_env(_store)
    app = make_app(
        broker=os.environ["SHOP_BROKER"],
        backend=os.environ.get("SHOP_BACKEND") or None,
        store=_store,
        prefix=os.environ["SHOP_PREFIX"],
        queue=os.environ["SHOP_QUEUE"],
        ledger_url=os.environ.get("SHOP_LEDGER") or None,
        **json.loads(os.environ.get("SHOP_SETTINGS") or "{}"),
    )
