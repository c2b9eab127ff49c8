"""The ledger (DESIGN §4, §6) against real PostgreSQL and SQLite: exactly one business effect per identity.

Every execution runs through a real idempotent task (eager app, memory store), so the handler sets the
request's key, scope and fingerprint exactly as a worker does. Racers each get their OWN app and store:
each acquires RUN and reaches the ledger, as two workers do after a lost lease. That is the case the
ledger exists for; the store cannot stop it, only the database can.

Side effects are counted outside the library: rows of a business table with no unique constraint (a
second insert WOULD be a second row), and the calls of the effect function.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.result import allow_join_result
from conftest import PICKLE, POSTGRES_URL, Planted, require_server

from celery_idem import (
    ConfigurationError,
    Idempotency,
    IdempotentTask,
    LedgerUnavailableError,
    MemoryStore,
    PayloadMismatchError,
    PermanentError,
    RetryableError,
    SerializationError,
    State,
)
from celery_idem.ledger import Ledger
from celery_idem.records import ErrorInfo, Identity

TASK = "ledger.pay"
EFFECT_SECONDS = 0.2  # how long a racing effect holds its transaction open after its business insert


class CardDeclined(Exception):
    """A business failure raised inside the transaction."""


def payments_table(metadata: sa.MetaData, name: str) -> sa.Table:
    # No unique constraint on order_id: only the ledger stands between a second execution and a second row.
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.Integer, nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
    )


def shop_app(
    ledger: Ledger,
    payments: sa.Table,
    calls: list[str],
    *,
    effect_seconds: float = 0.0,
    fail: bool = False,
    times: dict[str, list[float]] | None = None,
    holding: Callable[[], None] | None = None,
) -> Celery:
    """One worker's view: an eager app with its own memory store and the idempotent task ``ledger.pay``.

    ``times`` collects when bodies reach the ledger ("entered") and when an effect ends ("effect_done");
    ``holding`` is called inside the transaction, right after the business insert.
    """
    times = times if times is not None else {"entered": [], "effect_done": []}
    app = Celery("ledger-shop", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app)  # memory:// store, this app's alone

    @app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)
    def pay(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        def effect(session: Any) -> dict[str, Any]:
            calls.append(self.request.id)
            session.execute(sa.insert(payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            if holding is not None:
                holding()
            if effect_seconds:
                time.sleep(effect_seconds)
            times["effect_done"].append(time.time())
            if fail:
                raise CardDeclined(f"card declined for order {order_id}")
            return {"order": order_id, "paid": amount, "task_id": self.request.id}

        times["entered"].append(time.time())
        return ledger.run_once(self, effect)

    return app


def pay(app: Celery, order_id: int, amount: int, key: str, scope: str | None = None) -> tuple[str, Any]:
    """Run one call through the task; (its task id, what it returned)."""
    result = app.tasks[TASK].apply_async((order_id, amount), idempotency_key=key, idempotency_scope=scope)
    # Celery's eager apply() flags "inside a task" in a process-wide global, which racing threads see:
    # the call has already run, so get() cannot block.
    return result.id, result.get(disable_sync_subtasks=False)


@dataclass
class Db:
    url: str
    engine: sa.Engine
    ledger: Ledger
    payments: sa.Table

    def payment_rows(self) -> list[Any]:
        with self.engine.connect() as connection:
            return list(connection.execute(sa.select(self.payments).order_by(self.payments.c.id)))

    def ledger_rows(self) -> list[Any]:
        with self.engine.connect() as connection:
            return list(connection.execute(sa.select(self.ledger.table)))


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Db]:
    if request.param == "postgresql":
        require_server("postgresql")
        url = POSTGRES_URL
    else:
        url = f"sqlite:///{tmp_path}/ledger.db"
    engine = sa.create_engine(url)
    suffix = uuid.uuid4().hex[:12]
    ledger = Ledger(engine, table_name=f"ledger_{suffix}")
    payments = payments_table(sa.MetaData(), f"payments_{suffix}")
    try:
        ledger.create_schema()
        payments.create(engine)
        yield Db(url, engine, ledger, payments)
    finally:
        payments.drop(engine, checkfirst=True)
        ledger.table.drop(engine, checkfirst=True)
        engine.dispose()


@pytest.fixture
def key() -> str:
    return f"pay-{uuid.uuid4().hex}"


# ---- once ---------------------------------------------------------------------------------------


def test_first_execution_commits_effect_and_ledger_row_and_a_later_one_returns_it_without_running(
    db: Db, key: str
) -> None:
    calls: list[str] = []
    # When the call runs for the first time
    first_id, first = pay(shop_app(db.ledger, db.payments, calls), 1, 100, key)
    # Then the effect and the ledger row are committed, and the task returns fn's value
    assert first == {"order": 1, "paid": 100, "task_id": first_id}
    assert calls == [first_id]
    assert [(r.order_id, r.amount, r.task_id) for r in db.payment_rows()] == [(1, 100, first_id)]
    [row] = db.ledger_rows()
    assert (row.scope, row.task_name, row.key, row.task_id, row.outcome) == ("", TASK, key, first_id, "COMPLETED")

    # When the same call runs again on a worker whose store knows nothing of it (a lost lease, a dead worker)
    second_id, second = pay(shop_app(db.ledger, db.payments, calls), 1, 100, key)
    # Then fn is not called again and the committed outcome comes back, with the first task's id in it
    assert second_id != first_id
    assert second == first
    assert calls == [first_id]
    assert len(db.payment_rows()) == 1
    assert len(db.ledger_rows()) == 1


def test_lookup_is_none_before_and_the_committed_entry_after(db: Db, key: str) -> None:
    identity = Identity("", TASK, key)
    assert db.ledger.lookup(identity) is None
    app = shop_app(db.ledger, db.payments, [])
    task_id, value = pay(app, 2, 250, key)
    entry = db.ledger.lookup(identity)
    assert entry is not None
    assert entry.identity == identity
    assert entry.task_id == task_id
    assert entry.value() == value == {"order": 2, "paid": 250, "task_id": task_id}
    assert entry.content_type == "application/json"
    # The ledger holds the fingerprint of the call, the same one the store recorded.
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and entry.fingerprint == record.fingerprint
    # Another key, another task name or a scope is another identity.
    assert db.ledger.lookup(Identity("", TASK, key + "x")) is None
    assert db.ledger.lookup(Identity("", "ledger.other", key)) is None
    assert db.ledger.lookup(Identity("eu", TASK, key)) is None


def test_same_key_in_two_scopes_is_two_identities_each_run_once(db: Db, key: str) -> None:
    calls: list[str] = []
    eu_id, eu = pay(shop_app(db.ledger, db.payments, calls), 3, 30, key, scope="eu")
    us_id, us = pay(shop_app(db.ledger, db.payments, calls), 3, 30, key, scope="us")
    _, eu_again = pay(shop_app(db.ledger, db.payments, calls), 3, 30, key, scope="eu")
    assert calls == [eu_id, us_id]
    assert eu["task_id"] == eu_id and us["task_id"] == us_id and eu_again == eu
    assert len(db.payment_rows()) == 2
    assert {(r.scope, r.key) for r in db.ledger_rows()} == {("eu", key), ("us", key)}
    assert db.ledger.lookup(Identity("", TASK, key)) is None


# ---- races --------------------------------------------------------------------------------------


def _race_threads(
    ledger: Ledger, payments: sa.Table, key: str, n: int, go: Any = None, times: dict[str, list[float]] | None = None
) -> tuple[list[str], list[Any]]:
    """n threads, each with its own app and store, run the same call together; (fn calls, answers)."""
    calls: list[str] = []
    apps = [shop_app(ledger, payments, calls, effect_seconds=EFFECT_SECONDS, times=times) for _ in range(n)]
    barrier = threading.Barrier(n)
    answers: list[Any] = [None] * n

    def racer(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            if go is not None:
                go.wait(timeout=60)
            answers[i] = pay(apps[i], 7, 700, key)[1]
        except BaseException as exc:  # noqa: BLE001 - reported to the test as an answer
            answers[i] = exc

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(n)]
    # Concurrent eager apply() calls save and restore that global out of order and can leave it set:
    # restore it for the tests that run after this one.
    with allow_join_result():
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    return calls, answers


@pytest.mark.slow
def test_eight_threads_racing_past_the_store_make_one_effect_and_all_get_the_committed_outcome(
    db: Db, key: str
) -> None:
    # Given 8 workers that each believe they own the call (each its own store), released together
    # When each runs the body, whose effect holds its transaction open for a while
    times: dict[str, list[float]] = {"entered": [], "effect_done": []}
    calls, answers = _race_threads(db.ledger, db.payments, key, 8, times=times)
    # (a real race: all 8 reached the ledger while the winner's transaction was still open)
    assert len(times["entered"]) == 8 and max(times["entered"]) < min(times["effect_done"])
    # Then exactly one effect committed, fn ran once, and all 8 answer the winner's outcome
    assert [a for a in answers if isinstance(a, BaseException)] == []
    [winner] = calls
    assert [(r.order_id, r.task_id) for r in db.payment_rows()] == [(7, winner)]
    assert answers == [{"order": 7, "paid": 700, "task_id": winner}] * 8
    entry = db.ledger.lookup(Identity("", TASK, key))
    assert entry is not None and entry.task_id == winner and entry.value() == answers[0]


def _race_process(
    url: str, ledger_name: str, payments_name: str, key: str, threads: int, ready: Any, go: Any, out: Any
) -> None:
    engine = sa.create_engine(url)
    try:
        ledger = Ledger(engine, table_name=ledger_name)
        payments = payments_table(sa.MetaData(), payments_name)
        ready.put(True)
        times: dict[str, list[float]] = {"entered": [], "effect_done": []}
        calls, answers = _race_threads(ledger, payments, key, threads, go, times)
        out.put((calls, [repr(a) if isinstance(a, BaseException) else a for a in answers], times))
    finally:
        engine.dispose()


@pytest.mark.slow
def test_two_processes_of_four_threads_racing_make_one_effect_and_all_get_the_committed_outcome(
    db: Db, key: str
) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    args = (db.url, db.ledger.table.name, db.payments.name, key, 4, ready, go, out)
    processes = [ctx.Process(target=_race_process, args=args) for _ in range(2)]
    for p in processes:
        p.start()
    try:
        # Both processes are up (imports done, engines built) before any racer is let go.
        for _ in processes:
            ready.get(timeout=60)
        go.set()
        reports = [out.get(timeout=60) for _ in processes]
    finally:
        for p in processes:
            p.join(timeout=60)
    assert [p.exitcode for p in processes] == [0, 0]
    calls = [c for process_calls, _, _ in reports for c in process_calls]
    answers = [a for _, process_answers, _ in reports for a in process_answers]
    entered = [t for _, _, times in reports for t in times["entered"]]
    effect_done = [t for _, _, times in reports for t in times["effect_done"]]
    # A real race: all 8 racers of both processes reached the ledger while the winner's transaction was open.
    assert len(entered) == 8 and max(entered) < min(effect_done)
    [winner] = calls
    assert [(r.order_id, r.task_id) for r in db.payment_rows()] == [(7, winner)]
    assert answers == [{"order": 7, "paid": 700, "task_id": winner}] * 8
    assert len(db.ledger_rows()) == 1


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_ledger_schema_another_process_creates_meanwhile_is_created_once(kind: str, tmp_path: Any) -> None:
    # Given a fresh database where another process (its own connection) wins every CREATE race
    if kind == "postgresql":
        require_server("postgresql")
    engine = sa.create_engine(POSTGRES_URL if kind == "postgresql" else f"sqlite:///{tmp_path}/fresh.db")
    other = sa.create_engine(engine.url)
    ledger = Ledger(engine, table_name=f"ledger_race_{uuid.uuid4().hex[:8]}")
    won: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def another_process_first(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("CREATE"):
            with other.begin() as connection:
                connection.exec_driver_sql(statement)
            won.append(statement.split("(")[0].strip())

    try:
        # When this process creates the ledger's schema
        ledger.create_schema()
        # Then every object the other process made is used, however many races it won
        assert won, "the other process won no race"
        assert ledger.table.name in sa.inspect(other).get_table_names()
    finally:
        sa.event.remove(engine, "before_cursor_execute", another_process_first)
        ledger.table.drop(other, checkfirst=True)
        other.dispose()
        engine.dispose()


# ---- failure, mismatch --------------------------------------------------------------------------


def test_fn_raising_rolls_back_effect_and_ledger_row_and_a_later_execution_runs(db: Db, key: str) -> None:
    calls: list[str] = []
    failing = shop_app(db.ledger, db.payments, calls, fail=True)
    # When fn inserts its row and then raises
    with pytest.raises(CardDeclined, match="card declined for order 4"):
        pay(failing, 4, 40, key)
    # Then the exception propagated and nothing was committed: no business row, no ledger row
    assert len(calls) == 1
    assert db.payment_rows() == []
    assert db.ledger_rows() == []
    assert db.ledger.lookup(Identity("", TASK, key)) is None
    # And a later execution of the same call runs fn and commits
    task_id, value = pay(shop_app(db.ledger, db.payments, calls), 4, 40, key)
    assert len(calls) == 2 and calls[1] == task_id
    assert value == {"order": 4, "paid": 40, "task_id": task_id}
    assert [r.task_id for r in db.payment_rows()] == [task_id]
    assert [r.task_id for r in db.ledger_rows()] == [task_id]


@pytest.mark.slow
def test_a_racer_waiting_on_an_attempt_that_rolls_back_runs_and_commits(db: Db, key: str) -> None:
    calls: list[str] = []
    inside = threading.Event()
    # Given attempt A inside its transaction (ledger row and business row written, not committed),
    # holding it a while and then failing
    failing = shop_app(db.ledger, db.payments, calls, effect_seconds=0.3, fail=True, holding=inside.set)
    second = shop_app(db.ledger, db.payments, calls)
    outcomes: dict[str, Any] = {}

    def attempt_a() -> None:
        try:
            pay(failing, 8, 80, key)
        except CardDeclined as exc:
            outcomes["a"] = exc

    with allow_join_result():
        a = threading.Thread(target=attempt_a)
        a.start()
        assert inside.wait(timeout=10)
        # When attempt B reaches the ledger while A holds the identity
        started = time.monotonic()
        b_id, b_value = pay(second, 8, 80, key)
        waited = time.monotonic() - started
        a.join(timeout=10)
    assert waited >= 0.2  # B queued behind A's open transaction (A holds it 0.3 s after its insert)
    # Then A's effect is rolled back and B, which did not give up, ran fn and committed its own outcome
    assert isinstance(outcomes.get("a"), CardDeclined)
    assert len(calls) == 2 and calls[1] == b_id
    assert b_value == {"order": 8, "paid": 80, "task_id": b_id}
    assert [r.task_id for r in db.payment_rows()] == [b_id]
    assert [r.task_id for r in db.ledger_rows()] == [b_id]


def test_keyless_calls_are_keyed_by_their_fingerprint_in_the_ledger(db: Db) -> None:
    calls: list[str] = []
    # Two workers run the same key-less call (a redelivery to a worker whose store lost it)
    first = shop_app(db.ledger, db.payments, calls).tasks[TASK].apply_async((9, 90))
    second = shop_app(db.ledger, db.payments, calls).tasks[TASK].apply_async((9, 90))
    assert second.get() == first.get() == {"order": 9, "paid": 90, "task_id": first.id}
    assert calls == [first.id] and len(db.payment_rows()) == 1
    entry = db.ledger.lookup(Identity("", TASK, first.idempotency_key))
    assert entry is not None and entry.task_id == first.id and entry.fingerprint == first.idempotency_key


def test_committed_row_for_other_arguments_raises_payload_mismatch_without_running(db: Db, key: str) -> None:
    calls: list[str] = []
    first_id, _ = pay(shop_app(db.ledger, db.payments, calls), 5, 500, key)
    # When the same key reaches the ledger with another amount (a store that lost the record)
    with pytest.raises(PayloadMismatchError, match="other arguments") as raised:
        pay(shop_app(db.ledger, db.payments, calls), 5, 999, key)
    # Then it is refused, naming the committed task, and nothing else ran or was written
    assert raised.value.key == key and raised.value.task_name == TASK and raised.value.task_id == first_id
    assert calls == [first_id]
    assert [(r.amount, r.task_id) for r in db.payment_rows()] == [(500, first_id)]
    assert len(db.ledger_rows()) == 1


# ---- misuse --------------------------------------------------------------------------------------


def test_run_once_in_a_plain_task_raises_configuration_error(db: Db) -> None:
    app = Celery("ledger-plain", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    calls: list[str] = []

    @app.task(bind=True, shared=False, name="ledger.plain")
    def plain(self: Any, order_id: int) -> Any:
        return db.ledger.run_once(self, lambda session: calls.append(order_id))

    with pytest.raises(ConfigurationError, match="must be called from the body of an idempotent task") as raised:
        plain.delay(1).get()
    assert "ledger.plain" in str(raised.value) and "IdempotentTask" in str(raised.value)
    assert calls == []
    assert db.ledger_rows() == []


def test_run_once_without_an_identity_on_the_request_raises_configuration_error(db: Db) -> None:
    calls: list[str] = []
    app = shop_app(db.ledger, db.payments, calls)
    # A bare object whose request carries no identity
    bare = SimpleNamespace(name="ledger.bare", request=SimpleNamespace(id="t-1"))
    with pytest.raises(ConfigurationError, match="idempotent task"):
        db.ledger.run_once(bare, lambda session: calls.append("bare"))
    # An idempotent task called as a plain function (no handler ran, so no identity)
    with pytest.raises(ConfigurationError, match="not running under celery-idem"):
        app.tasks[TASK](1, 10)
    # (a call that bypasses celery-idem, idempotency=False, runs: see the bypass test below)
    assert calls == []
    assert db.payment_rows() == [] and db.ledger_rows() == []


def test_unsupported_dialect_is_refused() -> None:
    # SQLAlchemy's mock engine carries a real MySQL dialect without needing a MySQL driver installed.
    engine = sa.create_mock_engine("mysql+pymysql://x/y", lambda *args, **kwargs: None)
    with pytest.raises(ConfigurationError, match="PostgreSQL and SQLite") as raised:
        Ledger(engine)  # type: ignore[arg-type]
    assert "mysql" in str(raised.value)


# ---- the contract of run_once: commit, joined transactions, fn, one call, bypass, namespace -------


def body_app(body: Callable[..., Any]) -> Celery:
    """An eager app (its own memory store) whose idempotent task ``ledger.pay`` runs ``body``."""
    app = Celery("ledger-body", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app)
    app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)(body)
    return app


def lose_commit_answer(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, *, committed: bool) -> list[bool]:
    """The next COMMIT on ``engine`` raises the driver's OperationalError, as when the connection drops
    while the answer is on its way: after the server committed (``committed``) or without committing."""
    real = engine.dialect.do_commit
    lost: list[bool] = []

    def do_commit(dbapi_connection: Any) -> None:
        if lost:
            return real(dbapi_connection)
        lost.append(committed)
        (real if committed else engine.dialect.do_rollback)(dbapi_connection)
        raise engine.dialect.loaded_dbapi.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(engine.dialect, "do_commit", do_commit)
    return lost


def test_a_commit_whose_answer_is_lost_after_the_server_committed_returns_the_committed_outcome(
    db: Db, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    # Given a COMMIT that the server carries out but whose answer never reaches the worker
    lost = lose_commit_answer(db.engine, monkeypatch, committed=True)
    # When the call runs
    task_id, value = pay(shop_app(db.ledger, db.payments, calls), 11, 110, key)
    # Then run_once asked the database, found its own row committed, and answers with fn's value
    assert lost == [True]
    assert value == {"order": 11, "paid": 110, "task_id": task_id}
    assert [r.task_id for r in db.payment_rows()] == [task_id]
    [row] = db.ledger_rows()
    assert row.task_id == task_id and row.result is not None
    # And a later execution agrees with it, without running fn
    _, again = pay(shop_app(db.ledger, db.payments, calls), 11, 110, key)
    assert again == value and calls == [task_id]


def test_a_commit_that_failed_without_committing_raises_and_the_next_run_runs(
    db: Db, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    lost = lose_commit_answer(db.engine, monkeypatch, committed=False)
    with pytest.raises(sa.exc.OperationalError, match="server closed the connection"):
        pay(shop_app(db.ledger, db.payments, calls), 12, 120, key)
    assert lost == [False] and len(calls) == 1
    assert db.payment_rows() == [] and db.ledger_rows() == []
    task_id, value = pay(shop_app(db.ledger, db.payments, calls), 12, 120, key)
    assert value["task_id"] == task_id and [r.task_id for r in db.payment_rows()] == [task_id]


def joined_app(db: Db, calls: list[str], *, via: str, fail_after: bool = False) -> Celery:
    """A task body with its own transaction (an outer write first) that joins run_once to it."""

    def body(self: Any, order_id: int, amount: int) -> Any:
        def effect(session: Any) -> dict[str, Any]:
            calls.append(self.request.id)
            session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            return {"order": order_id, "paid": amount, "task_id": self.request.id}

        outer = sa.insert(db.payments).values(order_id=order_id, amount=0, task_id=f"outer-{self.request.id}")
        if via == "session":
            with sa.orm.Session(db.engine) as session, session.begin():
                session.execute(outer)
                value = db.ledger.run_once(self, effect, session=session)
                if fail_after:
                    raise CardDeclined("the outer transaction fails after run_once")
                return value
        with db.engine.begin() as connection:
            connection.execute(outer)
            value = db.ledger.run_once(self, effect, session=connection)
            if fail_after:
                raise CardDeclined("the outer transaction fails after run_once")
            return value

    return body_app(body)


@pytest.mark.parametrize("via", ["session", "connection"])
def test_run_once_joined_to_the_callers_transaction_commits_and_rolls_back_with_it(db: Db, key: str, via: str) -> None:
    calls: list[str] = []
    # When the task's own transaction, which run_once joined, rolls back after run_once returned
    with pytest.raises(CardDeclined):
        pay(joined_app(db, calls, via=via, fail_after=True), 13, 130, key)
    # Then the ledger row and fn's effect went with it (on SQLite, without the task locking itself out)
    assert len(calls) == 1
    assert db.payment_rows() == [] and db.ledger_rows() == []
    # And the next run really runs; its outer write, fn's effect and the ledger row commit together
    task_id, value = pay(joined_app(db, calls, via=via), 13, 130, key)
    assert value == {"order": 13, "paid": 130, "task_id": task_id} and calls[1:] == [task_id]
    assert sorted(r.task_id for r in db.payment_rows()) == sorted([f"outer-{task_id}", task_id])
    assert [r.task_id for r in db.ledger_rows()] == [task_id]
    # And a later run finds the committed row without running fn; its transaction survives (a SAVEPOINT
    # took the refused insert) and commits its own outer write
    third_id, third = pay(joined_app(db, calls, via=via), 13, 130, key)
    assert third == value and len(calls) == 2
    assert f"outer-{third_id}" in {r.task_id for r in db.payment_rows()}
    assert len(db.ledger_rows()) == 1


def committing_app(db: Db, calls: list[str], *, fail: bool) -> Celery:
    """A task whose fn commits (a service-layer helper does), then goes on, and maybe fails."""

    def body(self: Any, order_id: int, amount: int) -> Any:
        def effect(session: Any) -> dict[str, Any]:
            calls.append(self.request.id)
            session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            session.commit()
            if fail:
                raise CardDeclined("declined after the helper committed")
            return {"order": order_id, "paid": amount, "task_id": self.request.id}

        return db.ledger.run_once(self, effect)

    return body_app(body)


def test_a_commit_inside_fn_commits_neither_the_ledger_row_nor_the_effect_on_its_own(db: Db, key: str) -> None:
    calls: list[str] = []
    # When fn commits and then fails
    with pytest.raises(CardDeclined):
        pay(committing_app(db, calls, fail=True), 14, 140, key)
    # Then its inner commit only released a savepoint: nothing is left, no ledger row with a NULL result
    assert db.payment_rows() == [] and db.ledger_rows() == []
    # When fn commits and returns
    task_id, value = pay(committing_app(db, calls, fail=False), 14, 140, key)
    # Then the ledger row holds the real result, and a later execution gets it, not None
    assert value == {"order": 14, "paid": 140, "task_id": task_id}
    _, again = pay(committing_app(db, calls, fail=False), 14, 140, key)
    assert again == value and len(calls) == 2
    assert [r.task_id for r in db.payment_rows()] == [task_id]


def test_fn_that_commits_the_connection_itself_is_refused_and_its_row_never_answers_none(db: Db, key: str) -> None:
    calls: list[str] = []

    def body(self: Any, order_id: int, amount: int) -> Any:
        def effect(session: Any) -> str:
            calls.append(self.request.id)
            session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            session.connection().commit()  # past the session: this does end the ledger's transaction
            return "paid"

        return db.ledger.run_once(self, effect)

    # When fn commits the connection under its session, which a savepoint cannot contain
    with pytest.raises(ConfigurationError, match="fn ended the ledger's transaction"):
        pay(body_app(body), 21, 210, key)
    # Then the row it committed early is marked as having no outcome, and a later execution says so
    # loudly instead of returning None as the call's result
    [row] = db.ledger_rows()
    assert row.outcome == "IN_PROGRESS" and row.result is None
    with pytest.raises(ConfigurationError, match="committed without an outcome"):
        pay(body_app(body), 21, 210, key)
    assert len(calls) == 1


def test_the_reconciler_never_completes_a_record_from_a_ledger_row_without_an_outcome(db: Db, key: str) -> None:
    now = [1_700_000_000.0]
    app = Celery("ledger-reconcile", broker="memory://", set_as_current=False)
    idem = Idempotency(app, store=MemoryStore(clock=lambda: now[0]), ledger=db.ledger, inspect_timeout_seconds=0.1)
    identity = Identity("", TASK, key)
    # Given a stale attempt, and a ledger row its fn committed early (no outcome stored with it)
    idem.store.acquire(identity, "fp-1", "task-1", lease_seconds=30, ttl_seconds=3600)
    with db.engine.begin() as connection:
        connection.execute(
            db.ledger.table.insert().values(
                namespace=db.ledger.namespace,
                scope="",
                task_name=TASK,
                key=key,
                task_id="task-1",
                fingerprint="fp-1",
                nonce="n-1",
                outcome="IN_PROGRESS",
                committed_at=0.0,
            )
        )
    now[0] += 31
    # When the reconciler runs, Then it does not complete the record with a made-up null result
    report = idem.reconcile()
    assert report.completed == 0
    record = idem.get(TASK, key)
    assert record is not None and record.state is not State.COMPLETED


def test_a_second_run_once_in_one_attempt_is_refused_not_handed_the_first_outcome(db: Db, key: str) -> None:
    calls: list[str] = []

    def body(self: Any, order_id: int, amount: int) -> Any:
        def charge(session: Any) -> str:
            calls.append("charge")
            session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            return "charged"

        def receipt(session: Any) -> str:
            calls.append("receipt")
            return "receipt written"

        return [db.ledger.run_once(self, charge), db.ledger.run_once(self, receipt)]

    # When a body calls run_once twice
    with pytest.raises(ConfigurationError, match="already called in this attempt") as raised:
        pay(body_app(body), 15, 150, key)
    # Then the second call is refused loudly instead of "returning" a receipt it never wrote
    assert "one fn" in str(raised.value)
    assert calls == ["charge"] and len(db.payment_rows()) == 1 and len(db.ledger_rows()) == 1


def test_run_once_again_after_its_joined_transaction_rolled_back_runs(db: Db, key: str) -> None:
    calls: list[str] = []

    def body(self: Any, order_id: int, amount: int) -> Any:
        def effect(session: Any) -> str:
            calls.append(self.request.id)
            session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            return "paid"

        # A transaction-retry loop: the first transaction rolls back, the second commits.
        for attempt in range(2):
            with sa.orm.Session(db.engine) as session, session.begin():
                value = db.ledger.run_once(self, effect, session=session)
                if attempt == 0:
                    session.rollback()
        return value

    task_id, value = pay(body_app(body), 16, 160, key)
    assert value == "paid" and calls == [task_id, task_id]
    assert [r.task_id for r in db.payment_rows()] == [task_id] and len(db.ledger_rows()) == 1


def test_a_bypassed_call_runs_fn_in_its_own_transaction_without_a_ledger_row(db: Db, key: str) -> None:
    calls: list[str] = []
    app = shop_app(db.ledger, db.payments, calls)
    # When a call bypasses celery-idem (idempotency=False): nothing claimed, no identity on the request
    first = app.tasks[TASK].apply_async((17, 170), idempotency_key=key, idempotency=False).get()
    second = app.tasks[TASK].apply_async((17, 170), idempotency_key=key, idempotency=False).get()
    # Then fn runs and commits each time, as the task would without celery-idem, and no ledger row is written
    assert first["paid"] == second["paid"] == 170 and len(calls) == 2
    assert len(db.payment_rows()) == 2 and db.ledger_rows() == []
    # And an idempotent call of the same key after them is not answered by them
    task_id, value = pay(app, 17, 170, key)
    assert value["task_id"] == task_id and len(calls) == 3 and len(db.ledger_rows()) == 1


def test_two_namespaces_on_one_table_do_not_see_each_others_rows(db: Db, key: str) -> None:
    other = Ledger(db.engine, table_name=db.ledger.table.name, namespace="other-app")
    calls: list[str] = []
    # When two apps run the same task name and key, each with its ledger namespace, on one table
    first_id, first = pay(shop_app(db.ledger, db.payments, calls), 18, 180, key)
    other_id, in_other = pay(shop_app(other, db.payments, calls), 18, 180, key)
    # Then each ran once, and each ledger sees its own row only
    assert calls == [first_id, other_id] and first["task_id"] == first_id and in_other["task_id"] == other_id
    identity = Identity("", TASK, key)
    assert db.ledger.lookup(identity).task_id == first_id  # type: ignore[union-attr]
    assert other.lookup(identity).task_id == other_id  # type: ignore[union-attr]
    assert {(r.namespace, r.task_id) for r in db.ledger_rows()} == {("idem", first_id), ("other-app", other_id)}


def legacy_ledger_table(metadata: sa.MetaData, name: str) -> sa.Table:
    """The ledger table as celery-idem made it before namespaces and nonces."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        *(sa.Column(c, sa.String(255), nullable=False) for c in ("scope", "task_name", "key", "task_id")),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),
        sa.Column("content_encoding", sa.String(64), nullable=True),
        sa.Column("committed_at", sa.Double, nullable=False),
        sa.UniqueConstraint("scope", "task_name", "key", name=f"uq_{name}_identity"),
    )


def test_a_ledger_table_made_before_namespaces_keeps_working(db: Db, key: str) -> None:
    name = f"legacy_{uuid.uuid4().hex[:12]}"
    legacy = legacy_ledger_table(sa.MetaData(), name)
    legacy.create(db.engine)
    try:
        calls: list[str] = []
        # Given a row committed by an older version (found through a first call)
        app = shop_app(Ledger(db.engine, table_name=name), db.payments, calls)
        fingerprint = app.tasks[TASK].idempotency_handler.fingerprint((19, 190), {})
        with db.engine.begin() as connection:
            connection.execute(
                legacy.insert().values(
                    scope="",
                    task_name=TASK,
                    key=key,
                    task_id="old-task",
                    fingerprint=fingerprint,
                    outcome="COMPLETED",
                    result=b'"paid long ago"',
                    content_type="application/json",
                    content_encoding="utf-8",
                    committed_at=0.0,
                )
            )
        # When this version's ledger runs on the table, without create_schema (first use adds the columns)
        _, value = pay(app, 19, 190, key)
        # Then the old row is this ledger's: its outcome comes back, fn does not run
        assert value == "paid long ago" and calls == []
        # And new rows work
        new_id, new = pay(app, 20, 200, key + "-new")
        assert new["task_id"] == new_id and calls == [new_id]
        # And another namespace on the unmigrated table is refused loudly, never handed this one's row
        elsewhere = shop_app(Ledger(db.engine, table_name=name, namespace="other-app"), db.payments, calls)
        with pytest.raises(ConfigurationError, match="unique key made before namespaces; migrate"):
            pay(elsewhere, 19, 190, key)
    finally:
        legacy.drop(db.engine, checkfirst=True)


# ---- safe decode ---------------------------------------------------------------------------------


def test_a_ledger_row_claiming_pickle_is_never_unpickled_without_accept_pickle(db: Db, key: str, tmp_path: Any) -> None:
    calls: list[str] = []
    first_id, _ = pay(shop_app(db.ledger, db.payments, calls), 4, 40, key)
    # Given the committed row's outcome replaced by a pickle that would create a directory when loaded
    flag = tmp_path / "unpickled"
    with db.engine.begin() as connection:
        connection.execute(
            sa.update(db.ledger.table)
            .where(db.ledger.table.c.key == key)
            .values(result=pickle.dumps(Planted(str(flag))), content_type=PICKLE, content_encoding="binary")
        )
    # When another execution of the call reaches the ledger, and when the entry is read directly
    with pytest.raises(SerializationError, match="application/x-python-serialize") as raised:
        pay(shop_app(db.ledger, db.payments, calls), 4, 40, key)
    entry = db.ledger.lookup(Identity("", TASK, key))
    assert entry is not None
    with pytest.raises(SerializationError, match="does not accept"):
        entry.value()
    # Then it is refused clearly and nothing was unpickled; fn did not run again
    assert raised.value.key == key and raised.value.task_id == first_id
    assert not flag.exists()
    assert calls == [first_id] and len(db.payment_rows()) == 1

    # An app that opted in with accept_pickle=True decodes it
    trusting = shop_app(db.ledger, db.payments, calls)
    Idempotency(trusting, accept_pickle=True)
    assert pay(trusting, 4, 40, key)[1] is None  # what os.makedirs returned
    assert flag.exists()
    assert calls == [first_id]


# ---- the ledger wins ----------------------------------------------------------------------------


def committing_then_declining_app(db: Db, calls: list[str], **settings: Any) -> Celery:
    """An eager app whose task commits its effect through run_once, then raises a permanent error."""
    app = Celery("ledger-wins", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app, **settings)

    @app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)
    def pay(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        def effect(session: Any) -> dict[str, Any]:
            calls.append(self.request.id)
            session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            return {"order": order_id, "paid": amount}

        db.ledger.run_once(self, effect)
        raise PermanentError(f"receipt printer on fire for order {order_id}")

    return app


def test_a_permanent_failure_after_the_ledger_committed_completes_the_record_with_the_ledger_value(
    db: Db, key: str
) -> None:
    calls: list[str] = []
    app = committing_then_declining_app(db, calls, ledger=db.ledger)
    # When: the body commits its effect through the ledger, then raises a permanent error
    with pytest.raises(PermanentError):
        app.tasks[TASK].apply_async((5, 500), idempotency_key=key)
    # Then: the record is COMPLETED with what the ledger committed, and duplicates get it
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and record.state is State.COMPLETED
    duplicate = app.tasks[TASK].apply_async((5, 500), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.get() == {"order": 5, "paid": 500}
    assert len(calls) == 1 and len(db.payment_rows()) == 1


def fail_over_a_committed_effect(db: Db, calls: list[str], store: MemoryStore, key: str, order_id: int) -> Celery:
    """A FAILED record whose effect the ledger holds committed, as an older version (or an app whose
    worker could not reach the ledger) left it: the call runs and commits, then its record is
    rewritten as a stored failure. Returns an app with the store and without the ledger."""
    app = committing_then_declining_app(db, calls, store=store)
    with pytest.raises(PermanentError):
        app.tasks[TASK].apply_async((order_id, order_id * 100), idempotency_key=key)
    identity = Identity("", TASK, key)
    done = store.get(identity)
    assert done is not None and done.state is State.COMPLETED  # the worker asked the ledger run_once used
    store.forget(identity)
    owner = store.acquire(identity, done.fingerprint, done.task_id, lease_seconds=30, ttl_seconds=3600).record.owner
    store.fail(identity, owner, ErrorInfo.from_exception(PermanentError("receipt printer on fire")))
    record = store.get(identity)
    assert record is not None and record.state is State.FAILED
    return app


def test_a_worker_replaying_a_stored_failure_answers_with_the_ledgers_committed_value(db: Db, key: str) -> None:
    calls: list[str] = []
    store = MemoryStore()
    # Given: a FAILED record whose effect the ledger holds committed
    app = fail_over_a_committed_effect(db, calls, store, key, 6)
    # When: a worker that has the ledger gets a message of the call
    Idempotency(app, store=store, ledger=db.ledger)
    replayed = app.tasks[TASK].apply((6, 600), headers={"idempotency_key": key})
    # Then: it answers with the ledger's value, without running the body
    assert replayed.get() == {"order": 6, "paid": 600}
    assert len(calls) == 1 and len(db.payment_rows()) == 1


def unreachable(*args: Any) -> None:
    """A ledger read on a database that is down (patched over Ledger._read)."""
    raise sa.exc.OperationalError("SELECT", {}, Exception("could not connect to server"))


def test_get_of_a_stored_failure_answers_with_the_ledgers_committed_value(db: Db, key: str) -> None:
    calls: list[str] = []
    store = MemoryStore()
    # Given: a FAILED record whose effect the ledger holds committed
    fail_over_a_committed_effect(db, calls, store, key, 7)
    # When: a producer that has the ledger calls again and reads the replayed outcome
    app = committing_then_declining_app(db, calls, store=store, ledger=db.ledger)
    duplicate = app.tasks[TASK].apply_async((7, 700), idempotency_key=key)
    # Then: its result is the ledger's committed value, in every way a result is read
    assert duplicate.deduplicated
    assert duplicate.state == "SUCCESS" and duplicate.successful()
    assert duplicate.get() == {"order": 7, "paid": 700}
    assert duplicate.get(propagate=False) == {"order": 7, "paid": 700}
    assert len(calls) == 1 and len(db.payment_rows()) == 1


def test_a_failure_after_run_once_while_the_ledger_is_down_is_left_to_the_reconciler(
    db: Db, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    now = [1_700_000_000.0]
    store = MemoryStore(clock=lambda: now[0])
    app = committing_then_declining_app(db, calls, store=store, ledger=db.ledger, inspect_timeout_seconds=0.1)
    app.conf.broker_url = "memory://"
    idem = Idempotency.of(app)
    # Given: the body commits its effect through run_once, raises a permanent error, and the ledger's
    # database stops answering before the handler can ask whether the effect committed
    monkeypatch.setattr(db.ledger, "_read", unreachable)
    with pytest.raises(PermanentError):
        app.tasks[TASK].apply_async((8, 800), idempotency_key=key)
    # Then: no outcome is stored (FAILED would answer every duplicate with a failure for the whole TTL)
    record = idem.get(TASK, key)
    assert record is not None and record.state is State.IN_PROGRESS
    now[0] += 3600  # past the lease (and the grace period)
    # And: while the ledger is still down the reconciler leaves the record, whatever else it knows
    assert idem.reconcile().left == 1
    record = idem.get(TASK, key)
    assert record is not None and record.state is State.IN_PROGRESS
    # And: once the ledger answers, the reconciler completes the record with the committed value
    monkeypatch.undo()
    assert idem.reconcile().completed == 1
    duplicate = app.tasks[TASK].apply_async((8, 800), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.get() == {"order": 8, "paid": 800}
    assert len(calls) == 1 and len(db.payment_rows()) == 1


def test_a_failure_before_run_once_while_the_ledger_is_down_is_stored(
    db: Db, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A body that never reached the ledger made no effect through it: its failure is the outcome.
    def body(self: Any, order_id: int, amount: int) -> Any:
        raise PermanentError(f"order {order_id} declined")

    app = body_app(body)
    Idempotency(app, ledger=db.ledger)
    monkeypatch.setattr(db.ledger, "_read", unreachable)
    with pytest.raises(PermanentError):
        app.tasks[TASK].apply_async((9, 900), idempotency_key=key)
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and record.state is State.FAILED


# ---- the ledger wins, attacked: outages, silence, retries, other ledgers ---------------------------


def test_a_result_whose_task_raised_after_the_ledger_committed_reports_success_in_every_read(db: Db, key: str) -> None:
    calls: list[str] = []
    app = committing_then_declining_app(db, calls, store=MemoryStore(), ledger=db.ledger)
    app.conf.update(
        task_always_eager=False,
        task_eager_propagates=False,
        task_store_eager_result=True,
        broker_url="memory://",
        result_backend="cache+memory://",
    )
    task = app.tasks[TASK]
    original = task.apply_async((3, 300), idempotency_key=key)
    duplicate = task.apply_async((3, 300), idempotency_key=key)  # taken while the call is PENDING
    # When: the worker runs it: the effect commits through run_once, then the body raises
    task.apply((3, 300), task_id=original.id, headers={"idempotency_key": key})
    assert original.backend.get_task_meta(original.id)["status"] == "FAILURE"  # the task did raise
    # Then: state and successful() agree with get(), asked first (before get() cached anything)
    assert (original.state, duplicate.state) == ("SUCCESS", "SUCCESS")
    assert original.successful() and duplicate.successful()
    assert original.get(timeout=2) == duplicate.get(timeout=2) == {"order": 3, "paid": 300}
    assert len(calls) == 1


def test_a_reader_during_a_ledger_outage_keeps_asking_and_answers_from_the_ledger_once_it_is_back(
    db: Db, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    store = MemoryStore()
    fail_over_a_committed_effect(db, calls, store, key, 4)
    app = committing_then_declining_app(db, calls, store=store, ledger=db.ledger)
    duplicate = app.tasks[TASK].apply_async((4, 400), idempotency_key=key)
    # While the ledger is down the stored failure stands (and says so in the log)...
    monkeypatch.setattr(db.ledger, "_read", unreachable)
    assert duplicate.state == "FAILURE"
    with pytest.raises(PermanentError):
        duplicate.get()
    # ...but the outage is not remembered as an answer: once the ledger is back, the same result
    # object answers with the committed value
    monkeypatch.undo()
    assert duplicate.state == "SUCCESS"
    assert duplicate.get(propagate=False) == duplicate.get() == {"order": 4, "paid": 400}


def test_a_silent_ledger_database_holds_no_reader_past_read_timeout_seconds() -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes the handshake; nobody ever answers
    try:
        port = listener.getsockname()[1]
        engine = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test")
        ledger = Ledger(engine, read_timeout_seconds=0.5)
        started = time.monotonic()
        with pytest.raises(
            LedgerUnavailableError, match=r"did not answer about .* within 0.5s \(read_timeout_seconds\)"
        ):
            ledger.completed(Identity("", TASK, "k"), "f" * 64)
        assert time.monotonic() - started < 30  # not the kernel's timeout: a hang would never return
    finally:
        listener.close()


def test_a_ledger_that_is_down_is_reported_as_unavailable_not_as_a_database_error(db: Db, monkeypatch: Any) -> None:
    monkeypatch.setattr(db.ledger, "_read", unreachable)
    with pytest.raises(LedgerUnavailableError, match="the ledger could not be asked about .*could not connect"):
        db.ledger.completed(Identity("", TASK, "k"), "f" * 64)


def test_a_ledger_table_that_does_not_exist_is_a_configuration_error_the_reconciler_raises(db: Db, key: str) -> None:
    now = [1_700_000_000.0]
    missing = Ledger(db.engine, table_name=f"never_created_{uuid.uuid4().hex[:8]}")
    app = Celery("ledger-missing", broker="memory://", set_as_current=False)
    idem = Idempotency(app, store=MemoryStore(clock=lambda: now[0]), ledger=missing, inspect_timeout_seconds=0.1)
    idem.store.acquire(Identity("", TASK, key), "f" * 64, "task-1", lease_seconds=30, ttl_seconds=3600)
    now[0] += 31
    # A mistake is not an outage: the reconciler does not leave every record forever, it says what is wrong
    with pytest.raises(
        ConfigurationError, match="the ledger table 'never_created_.*' does not exist: run Ledger.create_schema"
    ):
        idem.reconcile()


def test_the_reconciler_asks_a_silent_ledger_once_per_run_not_once_per_record(
    db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1_700_000_000.0]
    app = Celery("ledger-silent", broker="memory://", set_as_current=False)
    idem = Idempotency(app, store=MemoryStore(clock=lambda: now[0]), ledger=db.ledger, inspect_timeout_seconds=0.1)
    for n in range(5):
        idem.store.acquire(Identity("", TASK, f"k{n}"), "f" * 64, f"task-{n}", lease_seconds=30, ttl_seconds=3600)
    now[0] += 31
    reads: list[int] = []

    def silent(*args: Any) -> None:
        reads.append(1)
        raise sa.exc.OperationalError("SELECT", {}, Exception("timeout expired"))

    monkeypatch.setattr(db.ledger, "_read", silent)
    report = idem.reconcile()
    assert (report.scanned, report.left) == (5, 5) and len(reads) == 1


def test_a_retryable_error_after_the_ledger_committed_completes_the_record_instead_of_freeing_the_key(
    db: Db, key: str
) -> None:
    calls: list[str] = []

    def body(self: Any, order_id: int, amount: int) -> Any:
        def effect(session: Any) -> dict[str, int]:
            calls.append(self.request.id)
            session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            return {"order": order_id, "paid": amount}

        db.ledger.run_once(self, effect)
        raise RetryableError("the receipt service timed out")

    app = body_app(body)
    Idempotency(app, ledger=db.ledger)
    with pytest.raises(RetryableError):
        app.tasks[TASK].apply_async((5, 500), idempotency_key=key)
    # The effect committed: the key is not freed (a new call would be told nothing happened)
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and record.state is State.COMPLETED
    duplicate = app.tasks[TASK].apply_async((5, 500), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.get() == {"order": 5, "paid": 500}
    assert len(calls) == 1


def test_a_failure_in_a_later_attempt_while_the_ledger_is_down_is_left_to_the_reconciler(
    db: Db, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    app = Celery("ledger-retried", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = False  # eager retries run inline only without propagation
    Idempotency(app, store=MemoryStore(), ledger=db.ledger)

    @app.task(base=IdempotentTask, bind=True, shared=False, name=TASK, max_retries=3)
    def pay(self: Any, order_id: int, amount: int) -> Any:
        if self.request.retries == 0:

            def effect(session: Any) -> dict[str, int]:
                calls.append(self.request.id)
                session.execute(sa.insert(db.payments).values(order_id=order_id, amount=amount, task_id="-"))
                return {"order": order_id, "paid": amount}

            db.ledger.run_once(self, effect)
            raise self.retry(countdown=0)  # a step after the commit failed: the chain retries
        # The retry raises before it reaches run_once, while the ledger's database is down
        monkeypatch.setattr(db.ledger, "_read", unreachable)
        raise PermanentError("provider: duplicate charge")

    result = pay.apply_async((9, 900), idempotency_key=key)
    assert isinstance(result.result, PermanentError) and len(calls) == 1
    # An earlier attempt of the identity ran and may have committed: unknown is not failed
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and record.state is State.IN_PROGRESS and record.attempt == 2


def test_the_worker_asks_the_ledger_run_once_wrote_to_and_warns_that_the_app_does_not_read_it(
    db: Db, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    app = committing_then_declining_app(db, calls)  # Idempotency(app) without ledger=
    with caplog.at_level("WARNING", logger="celery_idem.ledger"), pytest.raises(PermanentError):
        app.tasks[TASK].apply_async((6, 600), idempotency_key=key)
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and record.state is State.COMPLETED
    assert "writes to a ledger that app 'ledger-wins' does not read (it has none): pass it as " in caplog.text
