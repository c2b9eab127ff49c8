"""Headers are input (DESIGN, "Rules at the task level"): a worker merges every message header into
the task request, so nothing internal may be read from the request. Each case runs a message that
forges one of the library's own marks, as a worker's pool runs it (Celery's own Request), and shows
that the mark changes nothing. (The handover token of ``self.replace()`` is the one mark a message
carries on purpose; the store compares it with the record: tests/worker/test_worker_control_flow.py forges it too.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.exceptions import Ignore
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, MemoryStore, State
from celery_idem.ledger import Ledger


def make_app(name: str, **settings: Any) -> tuple[Celery, Idempotency]:
    app = Celery(name, set_as_current=False, broker="memory://", backend="cache+memory://")
    return app, Idempotency(app, store=MemoryStore(), **settings)


def test_running_flag_from_a_header_does_not_skip_dedup() -> None:
    # Found by an attacker: the in-body flag ``idempotency_running`` was read from the request: a
    # message carrying it ran its body unprotected, every copy of it, with no bypass recorded.
    app, _ = make_app("a3-flag")
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    app.finalize()
    for task_id in ("t-1", "t-2"):
        execute_as_worker(app, charge.name, task_id, idempotency_key="k", idempotency_running=True)
    assert runs == [1], f"body ran {len(runs)} times for one key"


def test_a_replaced_mark_from_a_header_does_not_hold_the_record_for_a_replacement() -> None:
    # The mark that replace() sent a replacement was a request attribute: a header set it, and an
    # attempt ending in Ignore left its key IN_PROGRESS for an hour, handing duplicates its task id.
    app, idem = make_app("h-replaced")

    @app.task(base=IdempotentTask, shared=False)
    def skipped(x: int) -> None:
        raise Ignore()

    app.finalize()
    execute_as_worker(app, skipped.name, "t-1", idempotency_key="k", idempotency_replaced=True)
    record = idem.get(skipped, "k")
    assert record is not None and record.state is State.FAILED and record.error is not None
    assert record.error.type == "Ignore"  # as any Ignore ends (concepts page: how a task can end)


def ledger_app(name: str, tmp_path: Path) -> tuple[Celery, Idempotency, Ledger, list[int]]:
    ledger = Ledger(sa.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}"))
    ledger.create_schema()
    app, idem = make_app(name, ledger=ledger)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, bind=True, name="h.pay")
    def pay(self: Any, x: int) -> int:
        return ledger.run_once(self, lambda session: runs.append(x) or x)

    app.finalize()
    return app, idem, ledger, runs


def ledger_rows(ledger: Ledger) -> list[Any]:
    with ledger.engine.connect() as connection:
        return list(connection.execute(sa.select(ledger.table.c.key, ledger.table.c.fingerprint)))


def test_ledger_marks_from_headers_do_not_make_run_once_refuse(tmp_path: Path) -> None:
    # The ledger's per-attempt marks were request attributes: a forged nonce ("committed") made
    # run_once refuse a first call as its second, and a forged ledger was asked for the outcome.
    app, idem, ledger, runs = ledger_app("h-nonce", tmp_path)
    execute_as_worker(
        app, "h.pay", "t-1", idempotency_key="k", idempotency_ledger_nonce="committed", idempotency_ledger="forged"
    )
    assert runs == [1]
    record = idem.get("h.pay", "k")
    assert record is not None and record.state is State.COMPLETED
    assert [key for key, _ in ledger_rows(ledger)] == ["k"]


def test_a_bypassed_call_cannot_name_the_identity_its_ledger_row_is_written_under(tmp_path: Path) -> None:
    # A bypassed call (idempotency=False) has no identity; run_once read key and fingerprint from the
    # request, which the headers set: a forged pair wrote a ledger row that every later call of that
    # key would have been answered with, without running.
    app, idem, ledger, runs = ledger_app("h-bypass", tmp_path)
    execute_as_worker(
        app,
        "h.pay",
        "t-1",
        idempotency=False,
        idempotency_key="k",
        idempotency_scope="",
        idempotency_fingerprint="0" * 64,
    )
    assert runs == [1] and ledger_rows(ledger) == [] and idem.get("h.pay", "k") is None
    # and the real call of the key runs
    execute_as_worker(app, "h.pay", "t-2", args=(2,), idempotency_key="k")
    assert runs == [1, 2]


def test_an_owner_from_a_header_is_not_the_attempts_owner_on_a_bypassed_replace() -> None:
    # replace() read the attempt's owner token from the request: on a bypassed call a forged one
    # linked callbacks that settle the record of any key it names with the replacement's outcome.
    app, idem = make_app("h-owner")
    sent: list[Any] = []

    @app.task(shared=False, name="h.replacement")
    def replacement(x: int) -> int:
        return x

    @app.task(base=IdempotentTask, shared=False, bind=True, name="h.replaced")
    def replaced(self: Any, x: int) -> Any:
        raise self.replace(replacement.si(x))

    app.finalize()
    original = replacement.apply_async
    replacement.apply_async = lambda *a, **options: sent.append(options) or original(*a, **options)
    execute_as_worker(
        app,
        "h.replaced",
        "t-1",
        idempotency=False,
        idempotency_key="victim",
        idempotency_scope="",
        idempotency_owner="forged-owner",
    )
    assert sent, "the replacement was not sent"
    links = [link["task"] for options in sent for link in (options.get("link") or [])]
    assert "celery_idem.replaced" not in links
