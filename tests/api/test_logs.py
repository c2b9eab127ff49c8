"""What celery-idem's log lines say: every decision once, with its fields in ``extra`` (outcome, task id,
the key's hash, scope, store latency) for JSON formatters; the end of every attempt that ran, once; and
never a key (keys can be personal data), unless ``telemetry.configure(plain_keys=True)`` allows it.

The rule is checked on whatever the library logs at DEBUG while calls take every path, outages
included: a key is looked for in each line as a formatter would print it, traceback and extras too.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import eager_apps
import pytest
from celery import Celery, Task
from faults import Fault, Injector, Plan

from celery_idem import (
    Idempotency,
    IdempotentTask,
    PayloadMismatchError,
    PermanentError,
    StoreUnavailableError,
    telemetry,
)
from celery_idem.records import Identity
from celery_idem.stores import store_from_url

app = eager_apps.app
calls = eager_apps.calls

# What a key of a user's may look like: an e-mail address is personal data.
KEY = f"alice@example.com/signup-{uuid.uuid4().hex[:8]}"


class Logged:
    """What the library logged during the test (caplog's records are per phase: read them late)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    @property
    def records(self) -> list[logging.LogRecord]:
        return [r for r in self.caplog.records if r.name.startswith("celery_idem")]


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[Logged]:
    with caplog.at_level(logging.DEBUG, logger="celery_idem"):
        yield Logged(caplog)


@pytest.fixture(autouse=True)
def hashed_keys() -> Iterator[None]:
    telemetry.configure(plain_keys=False)
    yield
    telemetry.configure(plain_keys=False)


def printed(record: logging.LogRecord) -> str:
    """Everything a formatter could print of ``record``: its text, its traceback, and every extra."""
    text = logging.Formatter().format(record)
    return text + " " + " ".join(f"{name}={value!r}" for name, value in vars(record).items())


def assert_no_key(logged: Logged, key: str = KEY) -> None:
    leaked = [printed(r) for r in logged.records if key in printed(r)]
    assert not leaked, f"a log line carries the key: {leaked[0]}"


def decisions(logged: Logged) -> list[dict[str, Any]]:
    return [
        {name[len("idempotency_") :]: value for name, value in vars(r).items() if name.startswith("idempotency_")}
        for r in logged.records
        if hasattr(r, "idempotency_outcome")
    ]


def signup_task(app: Celery, calls: list[Any], **options: Any) -> Task:
    @app.task(base=IdempotentTask, name="shop.signup", shared=False, **options)
    def signup(user: str, plan: str) -> str:
        calls.append((user, plan))
        if plan == "broken":
            raise PermanentError("no such plan")
        if plan == "later":
            raise ValueError("try later")  # retryable by default (default_failure)
        return f"{user}:{plan}"

    return signup


def test_every_decision_is_logged_once_with_its_fields_and_only_the_key_hash(
    app: Celery, calls: list[Any], logged: Logged
) -> None:
    Idempotency(app)
    signup = signup_task(app, calls)
    first = signup.apply_async(("alice", "gold"), idempotency_key=KEY)
    again = signup.apply_async(("alice", "gold"), idempotency_key=KEY)
    with pytest.raises(PayloadMismatchError):
        signup.apply_async(("alice", "silver"), idempotency_key=KEY)

    assert again.id == first.id and len(calls) == 1
    assert_no_key(logged)
    hashed = telemetry.key_hash(Identity("", "shop.signup", KEY))
    seen = decisions(logged)
    # The call's claim (NEW), its eager run (RUN), how it ended, then one REPLAY and one MISMATCH.
    assert [(d["side"], d["outcome"]) for d in seen] == [
        ("publish", "NEW"),
        ("worker", "RUN"),
        ("worker", "ENDED"),
        ("publish", "REPLAY"),
        ("publish", "MISMATCH"),
    ]
    for d in seen:
        assert d["key_hash"] == hashed and d["task"] == "shop.signup" and d["scope"] == ""
        assert "key" not in d
    new, run, ended, replay, _ = seen
    assert new["task_id"] == run["task_id"] == ended["task_id"] == first.id
    assert replay["record_task_id"] == first.id and replay["state"] == "COMPLETED"
    assert (ended["ending"], ended["step"]) == ("returned", "complete")
    for d in (new, run, replay):
        assert isinstance(d["store_seconds"], float) and 0 <= d["store_seconds"] < 5  # the claim/acquire's


def test_every_ending_of_an_attempt_is_logged_once(app: Celery, calls: list[Any], logged: Logged) -> None:
    Idempotency(app)
    signup = signup_task(app, calls)
    with pytest.raises(PermanentError, match="no such plan"):
        signup.apply_async(("bob", "broken"), idempotency_key=KEY, idempotency_scope="tenant-7")
    with pytest.raises(ValueError, match="try later"):
        signup.apply_async(("bob", "later"), idempotency_key=KEY + "-2")

    endings = [d for d in decisions(logged) if d["outcome"] == "ENDED"]
    assert [(d["ending"], d["step"], d["scope"]) for d in endings] == [
        ("permanent", "fail", "tenant-7"),
        ("retryable", "release", ""),
    ]
    assert_no_key(logged)


def test_the_ended_line_says_what_the_record_was_given(app: Celery, logged: Logged, tmp_path: Any) -> None:
    # The step is the one taken, not the one the mode names for the ending: a body that returned with
    # its ledger row on a transaction it joined is completed only once that row committed, and its
    # key is freed while the transaction is still open.
    import sqlalchemy as sa

    from celery_idem import IdempotentTask
    from celery_idem.ledger import Ledger

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'shop.db'}")
    ledger = Ledger(engine)
    ledger.create_schema()
    Idempotency(app)
    callers: list[sa.Connection] = []

    @app.task(base=IdempotentTask, bind=True, shared=False, name="shop.pay")
    def pay(self: Any, order_id: int, outlived: bool) -> Any:
        def effect(session: Any) -> dict[str, int]:
            return {"order": order_id}

        if outlived:  # the caller's transaction outlives the attempt
            return ledger.run_once(self, effect, session=callers[-1])
        with engine.begin() as connection:  # committed before the body returns
            return ledger.run_once(self, effect, session=connection)

    pay.apply_async((1, False), idempotency_key=KEY)
    with engine.connect() as caller:
        callers.append(caller)
        caller.begin()
        pay.apply_async((2, True), idempotency_key=KEY + "-2")
        caller.rollback()
    engine.dispose()

    endings = [(d["ending"], d["step"]) for d in decisions(logged) if d["outcome"] == "ENDED"]
    assert endings == [("returned", "complete"), ("returned", "release")]
    assert_no_key(logged)


def test_plain_keys_are_logged_only_when_configured(app: Celery, calls: list[Any], logged: Logged) -> None:
    telemetry.configure(plain_keys=True)
    Idempotency(app)
    signup = signup_task(app, calls)
    signup.apply_async(("carol", "gold"), idempotency_key=KEY)

    seen = decisions(logged)
    assert seen and all(d["key"] == KEY for d in seen)
    assert all(KEY in r.getMessage() for r in logged.records if hasattr(r, "idempotency_outcome"))


def test_a_store_outage_logs_no_key_and_no_advice_to_run_unprotected(
    app: Celery, calls: list[Any], logged: Logged, tmp_path: Any
) -> None:
    store = store_from_url(f"sqlite:///{tmp_path / 'store.db'}")
    store.create_schema()
    injector = Injector(store)
    Idempotency(app, store=store)
    signup = signup_task(app, calls)
    # The acquire fails once (the claim landed): the eager call is told, and gives its claim back.
    injector.arm(Plan("acquire", Fault.REFUSED))
    with pytest.raises(StoreUnavailableError) as caught:
        signup.apply_async(("dave", "gold"), idempotency_key=KEY)
    # The caller's own exception names the key on its attribute, never in its text.
    assert caught.value.key == KEY and KEY not in str(caught.value)
    # A settled record whose write fails: the retries and the heartbeat hand-off are logged.
    injector.arm(Plan("complete", Fault.REFUSED, times=3))
    signup.apply_async(("dave", "gold"), idempotency_key=KEY + "-2")

    assert len(calls) == 1
    warned = [r.getMessage() for r in logged.records if r.levelno >= logging.WARNING]
    assert any("settling" in text for text in warned), warned
    assert_no_key(logged)
    assert not [text for text in warned if "proceed" in text or "unprotected" in text]


def test_proceeding_unprotected_is_one_line_per_store_call_and_one_traceback_a_minute(
    app: Celery, calls: list[Any], logged: Logged
) -> None:
    # Nothing listens on port 1: every store call is refused at once.
    Idempotency(app, store="redis://127.0.0.1:1/0", on_store_error="proceed")
    signup = signup_task(app, calls)
    for n in range(3):
        signup.apply_async(("erin", "gold"), idempotency_key=f"{KEY}-{n}")

    assert len(calls) == 3  # unprotected, as the setting says
    warned = [r for r in logged.records if r.levelno == logging.WARNING and "unprotected" in r.getMessage()]
    # The claim and the acquire of each call, one line each, saying what the store answered.
    assert len(warned) == 6 and all(r.exc_info is None for r in warned)
    assert all("Connection refused" in r.getMessage() or "Error 111" in r.getMessage() for r in warned), warned[0]
    tracebacks = [r for r in logged.records if r.exc_info]
    assert len(tracebacks) == 1 and tracebacks[0].levelno == logging.DEBUG
    assert_no_key(logged, KEY)


def test_a_store_outage_is_told_to_the_caller_and_logs_no_warning_of_its_own(
    app: Celery, calls: list[Any], logged: Logged
) -> None:
    Idempotency(app, store="redis://127.0.0.1:1/0", store_timeout_seconds=0.5)  # nothing listens: refused
    signup = signup_task(app, calls)
    with pytest.raises(StoreUnavailableError, match=r"ConnectionError: .*\(after \d+\.\d\ds, timeout 0\.5s\)"):
        signup.apply_async(("frank", "gold"), idempotency_key=KEY)
    # The claim may have landed with its reply lost: giving it back fails too, which is no news.
    assert [r.getMessage() for r in logged.records if r.levelno >= logging.WARNING] == []
    assert calls == []


def test_a_task_called_with_and_without_a_key_is_warned_of_once(app: Celery, calls: list[Any], logged: Logged) -> None:
    Idempotency(app)
    signup = signup_task(app, calls)
    signup.apply_async(("gina", "gold"))  # keyed by its fingerprint
    signup.apply_async(("gina", "gold"))  # the same call: replayed
    assert [r for r in logged.records if r.levelno >= logging.WARNING] == []
    signup.apply_async(("gina", "gold"), idempotency_key=KEY)  # the same arguments, another identity
    signup.apply_async(("gina", "gold"), idempotency_key=KEY + "-2")
    signup.apply_async(("gina", "silver"))

    assert len(calls) == 4  # as documented: keyed and key-less are two calls (two keys, two more)
    warned = [r.getMessage() for r in logged.records if r.levelno >= logging.WARNING]
    assert warned == [
        "task shop.signup is called both with an idempotency key and without one: a keyed call and a "
        "key-less call of the same arguments are two calls, and both run; give every call a key "
        "(require_key=True makes a call without one an error)"
    ]


# ---- found by review (h-attack): paths that still wrote a key ----------------------------------------


def test_the_outbox_relay_logs_no_key_of_a_call_the_claim_refuses(
    app: Celery, calls: list[Any], logged: Logged, tmp_path: Any
) -> None:
    # Shows: a staged call whose key was taken by other arguments is refused with PayloadMismatchError
    # (whose own text names the key); the relay logged that error's repr at ERROR, and the failed
    # attempt to store it in a result backend logged a traceback chaining it: the key, twice.
    import sqlalchemy as sa
    from sqlalchemy import orm

    from celery_idem.outbox import SQLOutbox

    Idempotency(app)
    signup = signup_task(app, calls)
    signup.apply_async(("alice", "gold"), idempotency_key=KEY)  # another call takes the key first
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    outbox = SQLOutbox(engine, publish_on_commit=False)
    outbox.create_schema()
    with orm.Session(engine) as session, session.begin():
        outbox.apply_async(session, signup, ("alice", "silver"), idempotency_key=KEY)
    report = outbox.relay(app)

    assert len(report.dead) == 1 and report.dead[0][2].startswith("PayloadMismatchError")  # the row says why
    assert any("can never be published" in r.getMessage() for r in logged.records)
    assert_no_key(logged)
    engine.dispose()


def test_a_ledger_that_cannot_be_read_logs_no_key_and_its_error_names_none(
    app: Celery, calls: list[Any], logged: Logged, tmp_path: Any
) -> None:
    # Shows: a ledger read that fails (here SQLite's "database is locked") is a LedgerUnavailableError
    # whose text held SQLAlchemy's whole message, "[parameters: ('idem', '', 'shop.signup', KEY)]":
    # the key in the error the caller gets and in the "could not read the ledger" warning. The
    # engine is the user's own (Ledger(engine)), so hide_parameters on the store's engines does not
    # cover it.
    import sqlite3

    import sqlalchemy as sa

    from celery_idem import LedgerUnavailableError
    from celery_idem.ledger import Ledger

    path = tmp_path / "ledger.db"
    engine = sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.05})
    ledger = Ledger(engine)
    ledger.create_schema()
    idem = Idempotency(app, ledger=ledger)
    signup = signup_task(app, calls)
    with pytest.raises(PermanentError):
        signup.apply_async(("alice", "broken"), idempotency_key=KEY)  # FAILED in the store
    record = idem.get("shop.signup", KEY)
    assert record is not None

    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # no one else reads the file now
    try:
        with pytest.raises(LedgerUnavailableError) as caught:
            ledger.completed(record.identity, record.fingerprint)
        with pytest.raises(PermanentError):  # the stored failure stands, and the ledger's silence is logged
            signup.apply_async(("alice", "broken"), idempotency_key=KEY).get()
    finally:
        lock.close()
        engine.dispose()
    assert "database is locked" in str(caught.value)
    assert KEY not in str(caught.value)
    assert any("could not read the ledger" in r.getMessage() for r in logged.records)
    assert_no_key(logged)
