"""The ledger against real PostgreSQL and SQLite: attempts racing past the store (each its own app and
store, as workers after a lost lease) make one effect, and every racer answers with the committed
outcome, from threads and from processes; a racer queued behind an attempt that rolls back runs and
commits; a ledger schema another process creates meanwhile is created once.

Every execution runs through a real idempotent task (eager app, memory store), so the handler sets the
request's key, scope and fingerprint exactly as a worker does; side effects are counted outside the
library, as rows of a business table with no unique constraint and calls of the effect function. The
apps and the ``db`` fixture (SQLite, then PostgreSQL) are tests/ledger_shop.py's.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ledger_shop
import pytest
import sqlalchemy as sa
from celery.result import allow_join_result
from conftest import POSTGRES_URL, require_server
from ledger_shop import TASK, CardDeclined, Db, pay, payments_table, shop_app

from celery_idem.ledger import Ledger
from celery_idem.records import Identity

db = ledger_shop.db
key = ledger_shop.key

EFFECT_SECONDS = 0.2  # how long a racing effect holds its transaction open after its business insert


# ---- races --------------------------------------------------------------------------------------


def _race_threads(
    ledger: Ledger,
    payments: sa.Table,
    key: str,
    n: int,
    go: Any = None,
    times: dict[str, list[float]] | None = None,
    everyone_entered: Callable[[], bool] | None = None,
) -> tuple[list[str], list[Any]]:
    """n threads, each with its own app and store, run the same call together; (fn calls, answers).

    ``everyone_entered``: the winner's effect holds its transaction open until every racer has
    reached the ledger (at most 30 s), so the race is real however slow the machine is, instead of
    for a fixed time a loaded machine can outlast."""
    calls: list[str] = []

    def hold() -> None:
        deadline = time.monotonic() + 30
        while everyone_entered is not None and not everyone_entered() and time.monotonic() < deadline:
            time.sleep(0.01)

    apps = [
        shop_app(ledger, payments, calls, effect_seconds=EFFECT_SECONDS, times=times, holding=hold) for _ in range(n)
    ]
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
    calls, answers = _race_threads(
        db.ledger, db.payments, key, 8, times=times, everyone_entered=lambda: len(times["entered"]) == 8
    )
    # (a real race: all 8 reached the ledger while the winner's transaction was still open)
    assert len(times["entered"]) == 8 and max(times["entered"]) < min(times["effect_done"])
    # Then exactly one effect committed, fn ran once, and all 8 answer the winner's outcome
    assert [a for a in answers if isinstance(a, BaseException)] == []
    [winner] = calls
    assert [(r.order_id, r.task_id) for r in db.payment_rows()] == [(7, winner)]
    assert answers == [{"order": 7, "paid": 700, "task_id": winner}] * 8
    entry = db.ledger.lookup(Identity("", TASK, key))
    assert entry is not None and entry.task_id == winner and entry.value() == answers[0]


class _Counted(list):  # type: ignore[type-arg]
    """The racers' entry times, counted across processes in ``entered`` as they are appended."""

    def __init__(self, entered: Any) -> None:
        super().__init__()
        self.entered = entered

    def append(self, value: Any) -> None:
        super().append(value)
        with self.entered.get_lock():
            self.entered.value += 1


def _race_process(
    url: str,
    ledger_name: str,
    payments_name: str,
    key: str,
    threads: int,
    ready: Any,
    go: Any,
    out: Any,
    entered: Any,
    racers: int,
) -> None:
    engine = sa.create_engine(url)
    try:
        ledger = Ledger(engine, table_name=ledger_name)
        payments = payments_table(sa.MetaData(), payments_name)
        ready.put(True)
        times: dict[str, list[float]] = {"entered": _Counted(entered), "effect_done": []}
        calls, answers = _race_threads(
            ledger, payments, key, threads, go, times, everyone_entered=lambda: entered.value >= racers
        )
        times = {name: list(values) for name, values in times.items()}
        out.put((calls, [repr(a) if isinstance(a, BaseException) else a for a in answers], times))
    finally:
        engine.dispose()


@pytest.mark.slow
def test_two_processes_of_four_threads_racing_make_one_effect_and_all_get_the_committed_outcome(
    db: Db, key: str
) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, go, out, entered = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Value("i", 0)
    args = (db.url, db.ledger.table.name, db.payments.name, key, 4, ready, go, out, entered, 8)
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
