"""The ledger on the Django ORM (DjangoLedger): one business row per identity, its ledger row
written first in the transaction of the ORM writes, on SQLite and PostgreSQL (DESIGN §4, §6).

Executions run through real idempotent tasks (eager apps, each its own memory store), so the
handler opens the attempt exactly as a worker does; racers each get their own app and store, as
two workers do after a lost lease: only the database can stop the second payment. Effects are
counted outside the library: rows of ``storefront.Payment``, which has no unique constraint. An error
raised inside fn runs through a real worker process too (``contrib_django.django_worker``'s
``djworker.decline``, one worker per database), the provider's calls counted in Redis.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL, REDIS_COUNTER_URL

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module
import redis  # noqa: E402
from celery import Celery  # noqa: E402
from celery.exceptions import SoftTimeLimitExceeded  # noqa: E402
from conftest import REDIS_URL, require_server, wipe  # noqa: E402
from django.db import OperationalError, connections, transaction  # noqa: E402
from django_project import require_alias, shop_env  # noqa: E402
from storefront.models import Payment  # noqa: E402
from workers import BACKEND, Worker  # noqa: E402

from celery_idem import (  # noqa: E402
    Idempotency,
    IdempotentTask,
    PayloadMismatchError,
    PermanentError,
    RetryableError,
    State,
    store_from_url,
)
from celery_idem.contrib.django.ledger import DjangoLedger  # noqa: E402
from celery_idem.contrib.django.models import LedgerEntry  # noqa: E402
from celery_idem.errors import ConfigurationError, LedgerUnavailableError  # noqa: E402
from celery_idem.records import Identity  # noqa: E402
from celery_idem.stores import MemoryStore  # noqa: E402

TASK = "djledger.pay"


class CardDeclined(Exception):
    """A business failure raised inside the transaction."""


@pytest.fixture(params=django_project.ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    require_alias(request.param)
    return str(request.param)


@pytest.fixture
def ledger(alias: str) -> Iterator[DjangoLedger]:
    ledger = DjangoLedger(alias, namespace=f"t-{uuid.uuid4().hex[:12]}")
    yield ledger
    LedgerEntry.objects.using(alias).filter(namespace=ledger.namespace).delete()
    connections.close_all()


@pytest.fixture
def order() -> int:
    return uuid.uuid4().int % 2_000_000_000


def payments(ledger: DjangoLedger, order: int) -> list[Payment]:
    return list(Payment.objects.using(ledger.using).filter(order_id=order).order_by("id"))


def pay_app(
    ledger: DjangoLedger,
    calls: list[str],
    *,
    fail: bool = False,
    effect_seconds: float = 0.0,
    after: Callable[[], None] | None = None,
    read_by_app: bool = True,
    propagates: bool = True,
) -> Celery:
    """One worker's view: an eager app with its own memory store and the idempotent task ``djledger.pay``."""
    app = Celery("djledger", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = propagates
    Idempotency(app, ledger=ledger if read_by_app else None)

    @app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)
    def pay(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        def effect() -> dict[str, Any]:
            calls.append(self.request.id)
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=amount, task_id=self.request.id)
            if effect_seconds:
                time.sleep(effect_seconds)
            if fail:
                raise CardDeclined(f"card declined for order {order_id}")
            return {"order": order_id, "paid": amount, "task_id": self.request.id}

        value = ledger.run_once(self, effect)
        if after is not None:
            after()
        return value

    return app


def body_app(ledger: DjangoLedger, body: Callable[..., Any]) -> Celery:
    """An eager app (its own memory store) whose idempotent task ``djledger.pay`` runs ``body``."""
    app = Celery("djledger-body", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app, ledger=ledger)
    app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)(body)
    return app


def pay(app: Celery, order: int, amount: int, key: str) -> Any:
    return app.tasks[TASK].apply_async((order, amount), idempotency_key=key).get(disable_sync_subtasks=False)


# ---- once ----------------------------------------------------------------------------------------


def test_the_first_execution_commits_its_row_with_the_effect_and_a_later_one_returns_it_without_running(
    ledger: DjangoLedger, order: int
) -> None:
    calls: list[str] = []
    first = pay(pay_app(ledger, calls), order, 500, "k")
    # A second worker (its own store: the lease was lost) runs the same call
    second = pay(pay_app(ledger, calls), order, 500, "k")
    assert second == first and len(calls) == 1
    assert [p.amount for p in payments(ledger, order)] == [500]
    entry = ledger.lookup(Identity("", TASK, "k"))
    assert entry is not None and entry.outcome == "COMPLETED" and entry.value() == first
    assert entry.task_id == first["task_id"] and entry.committed_at is not None


def test_fn_raising_rolls_back_the_effect_and_the_row_and_a_later_execution_runs(
    ledger: DjangoLedger, order: int
) -> None:
    calls: list[str] = []
    with pytest.raises(CardDeclined):
        pay(pay_app(ledger, calls, fail=True), order, 500, "k")
    assert payments(ledger, order) == [] and ledger.lookup(Identity("", TASK, "k")) is None
    assert pay(pay_app(ledger, calls), order, 500, "k")["paid"] == 500
    assert len(calls) == 2 and len(payments(ledger, order)) == 1


def test_a_committed_row_for_other_arguments_raises_payload_mismatch_without_running(
    ledger: DjangoLedger, order: int
) -> None:
    calls: list[str] = []
    pay(pay_app(ledger, calls), order, 500, "k")
    with pytest.raises(PayloadMismatchError, match="for other arguments"):
        pay(pay_app(ledger, calls), order, 999, "k")
    assert len(calls) == 1 and [p.amount for p in payments(ledger, order)] == [500]


def test_run_once_in_the_callers_atomic_block_commits_and_rolls_back_with_it(ledger: DjangoLedger, order: int) -> None:
    calls: list[str] = []
    app = pay_app(ledger, calls)
    # Rolled back by the caller: neither the payment nor the ledger row stays
    with pytest.raises(RuntimeError), transaction.atomic(using=ledger.using):
        pay(app, order, 500, "k")
        raise RuntimeError("the caller's transaction fails after the task ran")
    assert payments(ledger, order) == [] and ledger.lookup(Identity("", TASK, "k")) is None
    # Committed by the caller: both stay, and the call is done for good
    with transaction.atomic(using=ledger.using):
        first = pay(pay_app(ledger, calls), order, 500, "k")
    assert pay(pay_app(ledger, calls), order, 500, "k") == first
    assert len(calls) == 2 and len(payments(ledger, order)) == 1


def test_a_lost_race_inside_the_callers_atomic_block_leaves_its_transaction_usable(
    ledger: DjangoLedger, order: int
) -> None:
    calls: list[str] = []
    first = pay(pay_app(ledger, calls), order, 500, "k")
    with transaction.atomic(using=ledger.using):
        assert pay(pay_app(ledger, calls), order, 500, "k") == first  # the INSERT refused, in a savepoint
        Payment.objects.using(ledger.using).create(order_id=order, amount=1, task_id="after")
    assert [p.amount for p in payments(ledger, order)] == [500, 1]


def test_a_second_run_once_in_one_attempt_is_refused(ledger: DjangoLedger, order: int) -> None:
    calls: list[str] = []
    app = pay_app(ledger, calls, after=lambda: ledger.run_once(app.tasks[TASK], lambda: "again"))
    with pytest.raises(ConfigurationError, match="already called in this attempt"):
        pay(app, order, 500, "k")
    assert len(calls) == 1


def test_run_once_outside_an_idempotent_task_is_a_configuration_error(ledger: DjangoLedger) -> None:
    app = Celery("plain", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True

    @app.task(bind=True, shared=False)
    def plain(self: Any) -> Any:
        return ledger.run_once(self, lambda: 1)

    with pytest.raises(ConfigurationError, match=r"DjangoLedger.run_once must be called from the body of an idem"):
        plain.delay().get()


def test_a_bypassed_call_runs_fn_in_a_transaction_without_a_ledger_row(ledger: DjangoLedger, order: int) -> None:
    calls: list[str] = []
    app = pay_app(ledger, calls)
    app.tasks[TASK].apply_async((order, 5), idempotency=False).get()
    app.tasks[TASK].apply_async((order, 5), idempotency=False).get()
    assert len(calls) == 2 and len(payments(ledger, order)) == 2
    assert not LedgerEntry.objects.using(ledger.using).filter(namespace=ledger.namespace).exists()


def test_an_unknown_database_alias_is_a_configuration_error(order: int) -> None:
    ledger = DjangoLedger("nowhere")
    with pytest.raises(ConfigurationError, match=r"DjangoLedger\(using='nowhere'\): settings.DATABASES has no"):
        pay(pay_app(ledger, []), order, 1, "k")


def test_bad_ledger_settings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="namespace must be 1-255 printable characters"):
        DjangoLedger(namespace="")
    with pytest.raises(ConfigurationError, match="read_timeout_seconds must be > 0"):
        DjangoLedger(read_timeout_seconds=0)


# ---- the ledger wins -----------------------------------------------------------------------------


def test_a_permanent_failure_after_the_row_committed_completes_the_record_with_the_ledger_value(
    ledger: DjangoLedger, order: int
) -> None:
    calls: list[str] = []

    def receipt_printer_on_fire() -> None:
        raise PermanentError("receipt printer on fire")

    app = pay_app(ledger, calls, after=receipt_printer_on_fire)
    with pytest.raises(PermanentError):
        pay(app, order, 500, "k")
    record = Idempotency.of(app).get(TASK, "k")
    assert record is not None and record.state is State.COMPLETED
    duplicate = app.tasks[TASK].apply_async((order, 500), idempotency_key="k")
    assert duplicate.deduplicated and duplicate.get()["paid"] == 500
    assert len(calls) == 1 and len(payments(ledger, order)) == 1


def test_the_reconciler_completes_a_stale_record_from_the_committed_row(ledger: DjangoLedger, order: int) -> None:
    now = [1_700_000_000.0]
    app = Celery("djledger-reconcile", broker="memory://", set_as_current=False)
    idem = Idempotency(app, store=MemoryStore(clock=lambda: now[0]), ledger=ledger, inspect_timeout_seconds=0.1)
    identity = Identity("", TASK, "k")
    # Given a worker that committed its effect and ledger row, then died before completing the record
    fingerprint = "fp-1"
    idem.store.acquire(identity, fingerprint, "task-1", lease_seconds=30, ttl_seconds=3600)
    LedgerEntry.objects.using(ledger.using).create(
        id=ledger._id(identity),
        namespace=ledger.namespace,
        scope="",
        task_name=TASK,
        key="k",
        task_id="task-1",
        fingerprint=fingerprint,
        nonce="n-1",
        outcome="COMPLETED",
        payload=b'{"paid": 500}',
        content_type="application/json",
        content_encoding="utf-8",
        committed_at="2026-01-01T00:00:00Z",
    )
    now[0] += 31
    report = idem.reconcile()
    assert report.completed == 1
    record = idem.get(TASK, "k")
    assert record is not None and record.state is State.COMPLETED and record.result == b'{"paid": 500}'


def test_a_ledger_table_that_was_never_migrated_is_a_configuration_error_not_an_outage() -> None:
    ledger = DjangoLedger("default")  # the in-memory database: its reader's connection has no tables
    with pytest.raises(ConfigurationError, match=r"run manage.py migrate celery_idem --database=default"):
        ledger.completed(Identity("", TASK, "k"), "fp")


def test_a_ledger_whose_database_is_down_is_unavailable(monkeypatch: pytest.MonkeyPatch, alias: str) -> None:
    require_alias(alias)
    ledger = DjangoLedger(alias)
    from django.db import OperationalError

    def down(*_: Any, **__: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(DjangoLedger, "_read", down)
    with pytest.raises(LedgerUnavailableError, match="the ledger could not be asked about"):
        ledger.completed(Identity("", TASK, "k"), "fp")


# ---- races ---------------------------------------------------------------------------------------


def test_eight_threads_racing_past_the_store_make_one_payment_and_all_get_the_committed_outcome(
    ledger: DjangoLedger, order: int
) -> None:
    calls: list[str] = []
    start = threading.Barrier(8)
    answers: list[Any] = []
    errors: list[BaseException] = []

    def racer() -> None:
        app = pay_app(ledger, calls, effect_seconds=0.05)
        start.wait()
        try:
            answers.append(pay(app, order, 500, "k"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(calls) == 1 and len(payments(ledger, order)) == 1
    assert len(answers) == 8 and all(answer == answers[0] for answer in answers)


RACER = """
import json, sys, threading, django
django.setup()
from django.db import connections
sys.path.insert(0, {tests!r})
from contrib_django.test_django_ledger import pay, pay_app
from celery_idem.contrib.django.ledger import DjangoLedger
ledger = DjangoLedger("default", namespace={namespace!r})
calls, answers, start = [], [], threading.Barrier(4)
def racer():
    app = pay_app(ledger, calls, effect_seconds=0.05)
    start.wait()
    try:
        answers.append(pay(app, {order}, 500, "k"))
    finally:
        connections.close_all()
threads = [threading.Thread(target=racer) for _ in range(4)]
[t.start() for t in threads]; [t.join(60) for t in threads]
print(json.dumps({{"calls": len(calls), "answers": answers}}))
"""


def test_two_processes_of_four_threads_racing_make_one_payment(ledger: DjangoLedger, order: int) -> None:
    tests = str(django_project.EXAMPLE.parent.parent / "tests")
    script = RACER.format(tests=tests, namespace=ledger.namespace, order=order)
    env = shop_env(ledger.using)
    children = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    import json

    outputs = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()
        outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
    answers = [answer for output in outputs for answer in output["answers"]]
    assert sum(output["calls"] for output in outputs) == 1
    assert len(payments(ledger, order)) == 1
    assert len(answers) == 8 and all(answer == answers[0] for answer in answers)


@pytest.fixture
def pg_ledger() -> Iterator[DjangoLedger]:
    require_alias("postgresql")
    ledger = DjangoLedger("postgresql", namespace=f"a-{uuid.uuid4().hex[:12]}", read_timeout_seconds=0.5)
    yield ledger
    connections.close_all()
    LedgerEntry.objects.using("postgresql").filter(namespace=ledger.namespace).delete()
    connections.close_all()


# ---- the COMMIT: an ambiguous one, and what runs after it --------------------------------------


def test_on_commit_callbacks_of_fn_run_when_an_ambiguous_commit_is_settled_as_committed(
    ledger: DjangoLedger, order: int
) -> None:
    # The COMMIT succeeds on the server but its answer is lost (the connection drops after it):
    # run_once finds its own row committed and returns fn's value, so the on_commit work fn
    # registered with it runs too (Django's rollback after the failed commit() had dropped it)
    sent: list[int] = []

    def charge(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        def effect() -> dict[str, Any]:
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=amount, task_id=self.request.id)
            transaction.on_commit(lambda: sent.append(order_id), using=ledger.using)
            return {"paid": amount}

        return ledger.run_once(self, effect)

    charge = body_app(ledger, charge).tasks[TASK]
    connection = connections[ledger.using]
    connection.ensure_connection()
    real_commit = connection._commit

    def commit_then_lose_the_answer() -> None:
        real_commit()
        raise OperationalError("server closed the connection unexpectedly (after COMMIT)")

    connection._commit = commit_then_lose_the_answer  # type: ignore[method-assign]
    try:
        result = charge.apply_async((order, 500), idempotency_key="k").get(disable_sync_subtasks=False)
    finally:
        del connection._commit
    assert result == {"paid": 500}  # settled: run_once says the effect committed
    assert len(payments(ledger, order)) == 1  # and it did
    assert sent == [order], "the receipt of a committed payment was never sent (on_commit callback dropped)"


# ---- a transaction that outlives the attempt: the outcome is stored only once its row is committed


def test_a_call_whose_callers_transaction_rolled_back_is_not_answered_as_done(ledger: DjangoLedger, order: int) -> None:
    # An eager call inside the caller's atomic block runs in a savepoint of it: the caller's
    # rollback takes the payment and the row, and the same store must not answer the key as done
    calls: list[str] = []
    app = pay_app(ledger, calls)
    with pytest.raises(RuntimeError), transaction.atomic(using=ledger.using):
        pay(app, order, 500, "k")
        raise RuntimeError("the caller's transaction fails after the task ran")
    assert payments(ledger, order) == [] and ledger.lookup(Identity("", TASK, "k")) is None
    # The same app (the same store) is asked again with the same key
    again = pay(app, order, 500, "k")
    assert len(payments(ledger, order)) == 1, (
        f"the retried call answered {again!r} from the store, but no payment exists (calls={len(calls)})"
    )


# ---- races under stronger isolation, and racers that roll back ---------------------------------


@pytest.fixture
def pg_isolation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every new connection of alias postgresql opens at ``request.param`` (Django OPTIONS)."""
    require_alias("postgresql")
    import psycopg

    connections.close_all()
    options = connections.settings["postgresql"]["OPTIONS"]
    monkeypatch.setitem(options, "isolation_level", getattr(psycopg.IsolationLevel, request.param))
    yield
    connections.close_all()


@pytest.mark.parametrize("pg_isolation", ["SERIALIZABLE", "REPEATABLE_READ"], indirect=True)
def test_the_loser_of_a_race_under_serializable_returns_the_committed_outcome(
    pg_isolation: None, pg_ledger: DjangoLedger, order: int
) -> None:
    calls: list[str] = []
    answers: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def racer(delay: float) -> None:
        app = pay_app(pg_ledger, calls, effect_seconds=0.5)
        start.wait()
        time.sleep(delay)  # the second racer's INSERT arrives while the first holds its row
        try:
            answers.append(pay(app, order, 500, "k"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=racer, args=(d,)) for d in (0.0, 0.2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(calls) == 1 and len(payments(pg_ledger, order)) == 1
    assert errors == [], f"the loser raised {errors!r} instead of returning the committed outcome"
    assert len(answers) == 2 and answers[0] == answers[1]


# ---- readers: bounded, one at a time, and an outage told from a mistake --------------------------


def test_readers_asking_at_once_are_not_taken_for_an_outage(ledger: DjangoLedger, monkeypatch: Any) -> None:
    # Two tasks failing at once on a threads pool both ask the ledger: a read still under way in
    # another thread is no outage; only a read stuck past its timeout makes the next one fail fast
    def slow_read(self: DjangoLedger, identity: Identity) -> None:
        time.sleep(0.3)

    monkeypatch.setattr(DjangoLedger, "_checked_read", slow_read)
    answers: list[Any] = []

    def ask() -> None:
        try:
            answers.append(ledger.completed(Identity("", TASK, "k"), "fp"))
        except Exception as exc:  # noqa: BLE001 - reported below
            answers.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert answers == [None, None]


def test_completed_does_not_pile_up_reader_threads_while_the_ledger_hangs(pg_ledger: DjangoLedger) -> None:
    # A lock on the ledger table (a migration's ACCESS EXCLUSIVE): each completed() times out after
    # read_timeout_seconds, and its reader gives up too (statement and lock timeouts), so a handler
    # or a reconciler asking in a loop never piles up threads and server connections
    import psycopg

    identity = Identity("", TASK, "k")
    pg_ledger.completed(identity, "fp")  # the table check is done: later reads go straight to the SELECT
    before = {t.ident for t in threading.enumerate() if t.name == "celery-idem-ledger-read"}
    with psycopg.connect(django_project.PG_URL, options=f"-c search_path={django_project.SCHEMA}") as locker:
        locker.execute("LOCK TABLE celery_idem_ledgerentry IN ACCESS EXCLUSIVE MODE")
        for _ in range(5):
            with pytest.raises(LedgerUnavailableError):
                pg_ledger.completed(identity, "fp")
        stuck = [
            t
            for t in threading.enumerate()
            if t.name == "celery-idem-ledger-read" and t.ident not in before and t.is_alive()
        ]
        locker.rollback()
    time.sleep(0.5)
    assert len(stuck) <= 1, (
        f"{len(stuck)} reader threads (each with a server connection) still blocked after timing out"
    )


# ---- readers leave nothing of theirs on a connection others get next -----------------------------

TIMEOUTS = {
    "postgresql": "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')",
    "mysql": "SELECT @@SESSION.max_statement_time, @@SESSION.innodb_lock_wait_timeout",
    "sqlite": "PRAGMA busy_timeout",
}


def session_timeouts(connection: Any) -> tuple[Any, ...]:
    """The connection's statement and lock-wait bounds, read on its DB-API connection."""
    cursor = connection.connection.cursor()
    try:
        cursor.execute(TIMEOUTS[connection.vendor])
        return tuple(cursor.fetchone())
    finally:
        cursor.close()


@pytest.mark.parametrize("alias", [*django_project.ALIASES, "postgresql_pool"])
def test_a_ledger_read_gives_its_connection_back_as_it_found_it(alias: str) -> None:
    # Django 5.1's pool hands the connection a reader gave back to the next thread that asks, and
    # PgBouncer (transaction mode) its server connection to another client: whatever bounds the
    # reader set must be gone by then. Seen at the reader's connection: its bounds when it was
    # opened, and when the reader gave it back (its close())
    require_alias(alias)
    from django.db.backends.signals import connection_created

    # A bound none of the databases has by default, wide enough for a loaded CI machine to open the
    # reader's connection within it (0.5 s did not, once, on MariaDB)
    ledger = DjangoLedger(alias, namespace=f"r-{uuid.uuid4().hex[:12]}", read_timeout_seconds=5.0)
    seen: dict[str, tuple[Any, ...]] = {}

    def opened(sender: Any, connection: Any, **_: Any) -> None:
        if connection.alias != alias or threading.current_thread().name != "celery-idem-ledger-read":
            return
        seen["opened"] = session_timeouts(connection)
        close = connection.close

        def given_back() -> None:
            seen["given back"] = session_timeouts(connection)
            close()

        connection.close = given_back

    connection_created.connect(opened, weak=False)
    try:
        assert ledger.completed(Identity("", TASK, "k"), "fp") is None
    finally:
        connection_created.disconnect(opened)
        connections.close_all()
    assert seen["given back"] == seen["opened"]


def test_a_business_query_on_a_pooled_connection_a_ledger_read_used_is_not_cancelled() -> None:
    # The pool holds one connection: the reader's is the one this thread gets back after it
    require_alias("postgresql_pool")
    ledger = DjangoLedger("postgresql_pool", namespace=f"r-{uuid.uuid4().hex[:12]}", read_timeout_seconds=2.0)
    business = connections["postgresql_pool"]
    show = "SELECT pg_backend_pid(), current_setting('statement_timeout'), current_setting('lock_timeout')"
    try:
        with business.cursor() as cursor:
            cursor.execute(show)
            before = cursor.fetchone()
        business.close()  # back to the pool
        assert ledger.completed(Identity("", TASK, "k"), "fp") is None
        with business.cursor() as cursor:
            cursor.execute(show)
            after = cursor.fetchone()
            assert after == before  # the same connection, with the bounds it had
            cursor.execute("SELECT pg_sleep(3.0)")  # past the reader's bound: not cancelled
    finally:
        connections.close_all()


@pytest.mark.parametrize("alias", ["postgresql", "postgresql_pool"])
def test_a_ledger_read_stuck_on_a_lock_is_ended_by_the_server(alias: str) -> None:
    # The bounds hold for the reader's own statements: a read stuck behind a migration's lock is
    # cancelled by the server (its thread ends, its connection is free) while the lock is still held
    require_alias(alias)
    import psycopg

    ledger = DjangoLedger(alias, namespace=f"r-{uuid.uuid4().hex[:12]}", read_timeout_seconds=0.5)
    identity = Identity("", TASK, "k")
    ledger.completed(identity, "fp")  # the table check is done: the next read goes straight to the SELECT
    try:
        with psycopg.connect(django_project.PG_URL, options=f"-c search_path={django_project.SCHEMA}") as locker:
            locker.execute("LOCK TABLE celery_idem_ledgerentry IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(LedgerUnavailableError):
                ledger.completed(identity, "fp")
            reader = ledger._stuck
            assert reader is not None
            reader.join(3)
            assert not reader.is_alive(), "the reader is still waiting on the lock: the server did not end its read"
            locker.rollback()
    finally:
        connections.close_all()


# ---- all or nothing ----------------------------------------------------------------------------


def test_a_second_run_once_after_the_first_ones_atomic_block_rolled_back_runs(ledger: DjangoLedger, order: int) -> None:

    class Oops(Exception):
        pass

    def charge(self: Any, order_id: int, amount: int) -> Any:
        def effect(n: int) -> Any:
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=n, task_id=self.request.id)
            return n

        try:
            with transaction.atomic(using=ledger.using):
                ledger.run_once(self, lambda: effect(1))
                raise Oops
        except Oops:
            pass
        return ledger.run_once(self, lambda: effect(2))

    charge = body_app(ledger, charge).tasks[TASK]
    assert charge.apply_async((order, 5), idempotency_key="k").get(disable_sync_subtasks=False) == 2
    assert [p.amount for p in payments(ledger, order)] == [2]


def test_a_winner_that_rolls_back_after_the_loser_waited_lets_the_loser_run(ledger: DjangoLedger, order: int) -> None:
    calls: list[str] = []
    answers: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def racer(delay: float, fail: bool) -> None:
        app = pay_app(ledger, calls, effect_seconds=0.5, fail=fail)
        start.wait()
        time.sleep(delay)
        try:
            answers.append(pay(app, order, 500, "k"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=racer, args=a) for a in ((0.0, True), (0.2, False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(errors) == 1 and type(errors[0]).__name__ == "CardDeclined"
    assert len(calls) == 2 and len(payments(ledger, order)) == 1 and len(answers) == 1


def test_fn_that_swallows_a_database_error_does_not_commit_half_an_effect(ledger: DjangoLedger, order: int) -> None:
    from django.db import IntegrityError

    def charge(self: Any, order_id: int, amount: int) -> Any:
        def effect() -> Any:
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=amount, task_id=self.request.id)
            try:
                Payment.objects.using(ledger.using).create(order_id=None, amount=1, task_id="x")  # NOT NULL
            except IntegrityError:
                pass
            return amount

        return ledger.run_once(self, effect)

    charge = body_app(ledger, charge).tasks[TASK]
    try:
        charge.apply_async((order, 5), idempotency_key="k").get(disable_sync_subtasks=False)
    except Exception:  # noqa: BLE001, S110 - either outcome is fine as long as it is all or nothing
        pass
    entry = ledger.lookup(Identity("", TASK, "k"))
    assert (entry is None and payments(ledger, order) == []) or (
        entry is not None and entry.outcome == "COMPLETED" and len(payments(ledger, order)) == 1
    )


# ---- an error after the COMMIT is not the COMMIT's ---------------------------------------------


def test_a_database_error_from_an_on_commit_callback_is_not_swallowed(ledger: DjangoLedger, order: int) -> None:
    # Django runs on_commit callbacks after the COMMIT succeeded: an error one raises is the
    # callback's, raised to the task as plain Django raises it, never taken for an ambiguous COMMIT
    from django.db import IntegrityError

    def charge(self: Any, order_id: int, amount: int) -> Any:
        def effect() -> Any:
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=amount, task_id=self.request.id)

            def mark_shipped() -> None:  # follow-up work after the commit, which fails
                Payment.objects.using(ledger.using).create(order_id=None, amount=0, task_id="hook")

            transaction.on_commit(mark_shipped, using=ledger.using)
            return "paid"

        return ledger.run_once(self, effect)

    charge = body_app(ledger, charge).tasks[TASK]
    with pytest.raises(IntegrityError):
        charge.apply_async((order, 5), idempotency_key="k").get(disable_sync_subtasks=False)


# ---- an outage told from a mistake --------------------------------------------------------------


def test_a_schema_mistake_is_not_counted_as_the_ledger_being_down(pg_ledger: DjangoLedger) -> None:
    # A schema mistake (a column a migration has not added, a revoked privilege) is raised as it is:
    # only an outage is LedgerUnavailableError (which leaves records to the reconciler for ever)
    identity = Identity("", TASK, "k")
    pg_ledger.completed(identity, "fp")  # the table exists
    with connections["postgresql"].cursor() as cursor:
        cursor.execute("ALTER TABLE celery_idem_ledgerentry RENAME COLUMN result TO result_renamed")
    try:
        from django.db import ProgrammingError

        with pytest.raises(ProgrammingError, match="result"):  # raised as it is, not LedgerUnavailableError
            pg_ledger.completed(identity, "fp")
    finally:
        with connections["postgresql"].cursor() as cursor:
            cursor.execute("ALTER TABLE celery_idem_ledgerentry RENAME COLUMN result_renamed TO result")


def test_a_task_body_running_an_idempotent_task_inline_in_its_atomic_block_then_failing(
    ledger: DjangoLedger, order: int
) -> None:
    # Without task_always_eager: a worker's task body runs the idempotent charge inline (apply())
    # inside its own atomic block, then fails and is retried: the retry pays
    from celery_idem.stores import MemoryStore

    calls: list[str] = []
    app = Celery("attack-worker", set_as_current=False)  # not eager: a worker runs checkout
    app.conf.task_eager_propagates = True
    Idempotency(app, store=MemoryStore(), ledger=ledger)

    @app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)
    def charge(self: Any, order_id: int, amount: int) -> Any:
        def effect() -> Any:
            calls.append(self.request.id)
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=amount, task_id=self.request.id)
            return {"paid": amount}

        return ledger.run_once(self, effect)

    tries = [0]

    @app.task(bind=True, shared=False, name="attack.checkout")
    def checkout(self: Any, order_id: int) -> Any:
        tries[0] += 1
        with transaction.atomic(using=ledger.using):
            paid = charge.apply((order_id, 500), headers={"idempotency_key": f"pay-{order_id}"}).get(
                disable_sync_subtasks=False
            )
            if tries[0] == 1:
                raise RuntimeError("the stock reservation failed: the whole checkout rolls back")
        return paid

    with pytest.raises(RuntimeError):
        checkout.apply((order,), throw=True).get(disable_sync_subtasks=False)
    checkout.apply((order,), throw=True).get(disable_sync_subtasks=False)  # the retry
    assert len(payments(ledger, order)) == 1, f"the checkout succeeded with no payment (fn ran {len(calls)} time)"


def test_a_permanent_error_inside_fn_of_an_inline_call_in_the_callers_atomic_block_is_stored_failed(
    ledger: DjangoLedger, order: int
) -> None:
    # A worker's task body runs the idempotent charge inline (apply()) inside its own atomic block; the
    # provider declines inside fn and the whole checkout rolls back; then the checkout is retried
    calls: list[str] = []
    app = Celery("inline-decline", set_as_current=False)  # not eager: a worker runs checkout
    app.conf.task_eager_propagates = True
    Idempotency(app, store=MemoryStore(), ledger=ledger)

    @app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)
    def charge(self: Any, order_id: int, amount: int) -> Any:
        def effect() -> Any:
            calls.append(self.request.id)  # the provider's charge: it declines
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=amount, task_id=self.request.id)
            raise PermanentError(f"card declined for order {order_id}")

        return ledger.run_once(self, effect)

    @app.task(bind=True, shared=False, name="inline.checkout")
    def checkout(self: Any, order_id: int) -> Any:
        with transaction.atomic(using=ledger.using):
            Payment.objects.using(ledger.using).create(order_id=-order_id, amount=0, task_id=self.request.id)
            return charge.apply((order_id, 500), headers={"idempotency_key": f"pay-{order_id}"}).get(
                disable_sync_subtasks=False
            )

    for _ in range(2):  # the checkout, then its retry: the decline is replayed, the provider not asked again
        with pytest.raises(PermanentError, match=f"card declined for order {order}"):
            checkout.apply((order,), throw=True).get(disable_sync_subtasks=False)
    record = Idempotency.of(app).get(TASK, f"pay-{order}")
    assert record is not None and record.state is State.FAILED
    assert len(calls) == 1 and payments(ledger, order) == [] and payments(ledger, -order) == []


# ---- which attempts count as joined, and what a joined one may store -------------------------------


def test_a_call_under_manual_transactions_is_not_stored_done_before_its_commit(ledger: DjangoLedger) -> None:
    # Under manual transactions (AUTOCOMMIT=False, set_autocommit(False)) atomic() opens and commits
    # nothing: the caller's rollback decides. (On SQLite, Django's RELEASE of the savepoint outside a
    # transaction commits the row with the payment: then both stand.)
    order = uuid.uuid4().int % 2_000_000_000
    calls: list[str] = []
    app = pay_app(ledger, calls)
    transaction.set_autocommit(False, using=ledger.using)
    try:
        app.tasks[TASK].apply_async((order, 500), idempotency_key="k").get()
        transaction.rollback(using=ledger.using)
    finally:
        transaction.set_autocommit(True, using=ledger.using)
    record = Idempotency.of(app).get(TASK, "k")
    paid = len(payments(ledger, order))
    # The store says done only for a payment that stands; and the next call leaves exactly one
    assert paid == (1 if connections[ledger.using].vendor == "sqlite" else 0)
    assert (record is not None and record.state is State.COMPLETED) == (paid == 1)
    again = app.tasks[TASK].apply_async((order, 500), idempotency_key="k").get()
    assert len(payments(ledger, order)) == 1, f"answered {again!r} from the store, but nothing was paid"


def test_a_permanent_failure_after_run_once_in_a_callers_transaction_that_commits_is_not_stored_failed(
    ledger: DjangoLedger,
) -> None:
    # An eager call (task_eager_propagates=False, Celery's default) inside the caller's atomic
    # block raises a permanent error after run_once: the caller gets no exception and commits, so
    # the store must not hold a FAILED the committed payment would contradict
    order = uuid.uuid4().int % 2_000_000_000
    calls: list[str] = []

    def receipt_failed() -> None:
        raise PermanentError("the receipt could not be sent")

    app = pay_app(ledger, calls, propagates=False, after=receipt_failed)
    with transaction.atomic(using=ledger.using):
        app.tasks[TASK].apply_async((order, 500), idempotency_key="k")
    entry = ledger.lookup(Identity("", TASK, "k"))
    assert len(payments(ledger, order)) == 1 and entry is not None and entry.outcome == "COMPLETED"
    record = Idempotency.of(app).get(TASK, "k")
    assert record is None or record.state is not State.FAILED, (
        f"the store says FAILED ({record.error}) for a payment whose ledger row committed"
    )


def test_a_soft_time_limit_in_the_release_of_an_uncommitted_row_does_not_store_it_done(
    ledger: DjangoLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A soft time limit striking in the release of a row that is not committed: the heartbeat
    # frees the key then, never completes it; the caller rolls back, and the next call pays
    order = uuid.uuid4().int % 2_000_000_000
    calls: list[str] = []
    app = pay_app(ledger, calls)
    idem = Idempotency.of(app)
    store = idem.store
    real_release = store.release
    struck = []

    def release(*args: Any, **kwargs: Any) -> Any:
        if not struck:
            struck.append(1)
            raise SoftTimeLimitExceeded()
        return real_release(*args, **kwargs)

    monkeypatch.setattr(store, "release", release)
    with pytest.raises(RuntimeError), transaction.atomic(using=ledger.using):
        app.tasks[TASK].apply_async((order, 500), idempotency_key="k").get()
        raise RuntimeError("the caller rolls back")
    assert struck and len(payments(ledger, order)) == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        record = store.get(Identity("", TASK, "k"))
        if record is not None and record.state is State.COMPLETED:
            break
        time.sleep(0.1)
    again = app.tasks[TASK].apply_async((order, 500), idempotency_key="k").get()
    assert len(payments(ledger, order)) == 1, f"answered {again!r} from the store, but nothing was paid"


def test_a_second_call_in_the_same_callers_transaction_is_not_stored_done_from_its_uncommitted_row(
    ledger: DjangoLedger, order: int
) -> None:
    # Two calls with one key inside one atomic block (a view that retries): the second's row is
    # refused by the first's, which the same transaction holds uncommitted; then the caller rolls back
    calls: list[str] = []
    app = pay_app(ledger, calls)
    with pytest.raises(RuntimeError), transaction.atomic(using=ledger.using):
        pay(app, order, 500, "k")
        pay(app, order, 500, "k")
        raise RuntimeError("the caller rolls back")
    assert payments(ledger, order) == [] and ledger.lookup(Identity("", TASK, "k")) is None
    record = Idempotency.of(app).get(TASK, "k")
    assert record is None or record.state is not State.COMPLETED
    pay(app, order, 500, "k")
    assert len(payments(ledger, order)) == 1


# ---- an error inside fn, through a real worker -------------------------------------------------------


@dataclass
class Bank:
    """``contrib_django.django_worker``'s app in a worker process on one alias's database, and as a
    producer here (its ledger reads that alias)."""

    app: Celery
    alias: str
    prefix: str

    def provider_calls(self, key: str) -> int:
        return int(redis.Redis.from_url(REDIS_COUNTER_URL).get(f"djworker:{self.prefix}:provider:{key}") or 0)


@pytest.fixture(scope="module", params=django_project.ALIASES)
def bank(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bank]:
    alias = str(request.param)
    require_alias(alias)
    require_server("redis")
    from contrib_django.django_worker import make_app

    prefix = f"dj{uuid.uuid4().hex[:10]}"
    env = shop_env(alias)
    env["PYTHONPATH"] = os.pathsep.join([str(django_project.EXAMPLE), env["PYTHONPATH"]])
    worker = Worker(
        tmp_path_factory.mktemp("djworker"),
        REDIS_BROKER_URL,
        REDIS_URL,
        prefix,
        app="contrib_django.django_worker",
        env=env,
    )
    try:
        yield Bank(
            make_app(prefix, REDIS_BROKER_URL, BACKEND, REDIS_URL, DjangoLedger(alias, namespace=prefix)), alias, prefix
        )
    finally:
        worker.stop()
        wipe(store_from_url(REDIS_URL, key_prefix=prefix))
        LedgerEntry.objects.using(alias).filter(namespace=prefix).delete()
        connections.close_all()


def decline(bank: Bank, order: int, key: str, **kwargs: Any) -> Any:
    return bank.app.tasks["djworker.decline"].apply_async((order,), kwargs, idempotency_key=key)


@pytest.mark.parametrize("caller", ["", "atomic commits", "atomic rolls back", "manual commits", "manual rolls back"])
def test_a_permanent_error_inside_fn_is_stored_failed_and_the_provider_is_called_once(bank: Bank, caller: str) -> None:
    key, order = f"k-{uuid.uuid4().hex}", uuid.uuid4().int % 1_000_000_000
    # When the provider declines inside fn (the row and the payment roll back with run_once's savepoint
    # or transaction), in run_once's own transaction or in the body's, which then commits its own
    # payment or rolls back
    first = decline(bank, order, key, caller=caller)
    with pytest.raises(PermanentError, match=f"card declined for order {order}"):
        first.get(timeout=30)
    # Then the record is FAILED, as for a permanent error raised anywhere else in the body
    record = Idempotency.of(bank.app).get("djworker.decline", key)
    assert record is not None and record.state is State.FAILED and record.error.type == "PermanentError"
    # And the client's retry is handed the same exception class without calling the provider again
    again = decline(bank, order, key, caller=caller)
    assert again.deduplicated and again.id == first.id
    with pytest.raises(PermanentError, match=f"card declined for order {order}"):
        again.get(timeout=30)
    assert bank.provider_calls(key) == 1
    assert Payment.objects.using(bank.alias).filter(order_id=order).count() == 0
    callers = Payment.objects.using(bank.alias).filter(order_id=-order).count()
    assert callers == (1 if caller.endswith("commits") else 0)


@pytest.mark.parametrize("caller", ["", "atomic commits", "manual commits"])
def test_a_retryable_error_inside_fn_frees_the_key_and_the_retry_calls_the_provider_again(
    bank: Bank, caller: str
) -> None:
    key, order = f"k-{uuid.uuid4().hex}", uuid.uuid4().int % 1_000_000_000
    first = decline(bank, order, key, error="retryable", caller=caller)
    with pytest.raises(RetryableError):
        first.get(timeout=30)
    assert Idempotency.of(bank.app).get("djworker.decline", key) is None
    # The client's retry runs: the provider is asked again
    again = decline(bank, order, key, error="retryable", caller=caller)
    assert not again.deduplicated and again.id != first.id
    with pytest.raises(RetryableError):
        again.get(timeout=30)
    assert bank.provider_calls(key) == 2
    assert Payment.objects.using(bank.alias).filter(order_id=order).count() == 0
