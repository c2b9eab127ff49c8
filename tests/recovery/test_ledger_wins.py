"""The ledger wins, against real PostgreSQL and SQLite: an effect committed through run_once is the
call's outcome whatever the attempt raised afterwards; a stored failure over a committed effect is
answered with the ledger's value, by a worker and by every read of a result; a failure the ledger
cannot be asked about is left to the reconciler, never stored; and attacked: ledger outages, a silent
ledger database, a missing table, retries after the commit, an app that does not read the ledger its
task writes to.

Every execution runs through a real idempotent task (eager app, memory store), so the handler sets the
request's key, scope and fingerprint exactly as a worker does; side effects are counted outside the
library, as rows of a business table with no unique constraint and calls of the effect function. The
apps and the ``db`` fixture (SQLite, then PostgreSQL) are tests/ledger_shop.py's.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import ledger_shop
import pytest
import sqlalchemy as sa
from celery import Celery
from celery.exceptions import Reject, Retry
from ledger_shop import TASK, Db, body_app

from celery_idem import (
    ConfigurationError,
    Idempotency,
    IdempotentTask,
    LedgerUnavailableError,
    MemoryStore,
    PermanentError,
    RetryableError,
    State,
)
from celery_idem.ledger import Ledger
from celery_idem.records import ErrorInfo, Identity

db = ledger_shop.db
key = ledger_shop.key


# ---- the ledger wins ----------------------------------------------------------------------------


def committing_then_declining_app(
    db: Db, calls: list[str], raising: Callable[[int], BaseException] | None = None, **settings: Any
) -> Celery:
    """An eager app whose task commits its effect through run_once, then raises a permanent error
    (or what ``raising`` builds from the order id)."""
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
        if raising is not None:
            raise raising(order_id)
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


@pytest.mark.parametrize(
    "raising",
    [
        lambda order_id: ValueError(f"receipt printer jammed for order {order_id}"),  # retryable: RELEASE
        lambda order_id: Reject(f"order {order_id}: try elsewhere", requeue=True),  # nothing requeues it
        lambda order_id: Retry(f"order {order_id}: later"),  # raised by hand: no retry was sent
    ],
    ids=["retryable", "reject-requeue-dropped", "retry-by-hand"],
)
def test_every_ending_that_frees_the_key_completes_from_the_ledger_once_it_committed(
    db: Db, key: str, raising: Callable[[int], BaseException]
) -> None:
    """The ledger wins over each step that would free the key, whatever ending took it (the endings
    table, celery_idem.endings): an early-acked requeue and a hand-raised Retry freed it before."""
    calls: list[str] = []
    app = committing_then_declining_app(db, calls, raising, ledger=db.ledger, default_failure="retryable")
    with contextlib.suppress(Exception):
        app.tasks[TASK].apply_async((7, 700), idempotency_key=key)
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and record.state is State.COMPLETED
    duplicate = app.tasks[TASK].apply_async((7, 700), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.get() == {"order": 7, "paid": 700}
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
