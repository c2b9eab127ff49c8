"""The ledger on the Django ORM (DjangoLedger): one business row per identity, its ledger row
written first in the transaction of the ORM writes, on SQLite and PostgreSQL (DESIGN §4, §6).

Executions run through real idempotent tasks (eager apps, each its own memory store), so the
handler opens the attempt exactly as a worker does; racers each get their own app and store, as
two workers do after a lost lease: only the database can stop the second payment. Effects are
counted outside the library: rows of ``storefront.Payment``, which has no unique constraint.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module
from celery import Celery  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from django_project import require_alias, shop_env  # noqa: E402
from storefront.models import Payment  # noqa: E402

from celery_idem import Idempotency, IdempotentTask, PayloadMismatchError, PermanentError, State  # noqa: E402
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
) -> Celery:
    """One worker's view: an eager app with its own memory store and the idempotent task ``djledger.pay``."""
    app = Celery("djledger", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
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
