"""The transactional outbox on SQLAlchemy (SQLite, PostgreSQL and MariaDB), with a real broker, store and
``celery worker``: a rolled-back transaction publishes nothing and claims nothing; a committed one
is published even when the process dies before publishing; a relay killed after it published (or
after its claim, before the message reached the broker) is followed by one that publishes again,
and the effect still happens once. Effects and publishes are counted in Redis by the task body and
``before_task_publish`` (tests/outbox_shop.py), never read from our records.

Every test runs on the three databases but the relay-kill scenarios: each of those (a relay process
SIGKILLed, then a worker) runs on one database, the five spread over all three, as what they check
is the relay's protocol; how each database takes and settles rows is in every other test, and
tests/contrib_django/test_django_outbox.py kills its relay on all three."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import outbox_shop
import pytest
import sqlalchemy as sa
from addresses import REDIS_BROKER_URL
from conftest import MARIADB_URL, POSTGRES_URL, REDIS_URL, require_server
from faults import Fault, Injector, Plan
from sqlalchemy import orm
from workers import BACKEND, TESTS, Worker, wait_for

from celery_idem import Idempotency, InvalidKeyError, PayloadMismatchError, SerializationError
from celery_idem.outbox import SQLOutbox

BROKER = REDIS_BROKER_URL


class Boom(Exception):
    pass


DATABASES = ["sqlite", "postgresql", "mariadb"]


def on(database: str) -> pytest.MarkDecorator:
    """Run a test on ``database`` only (see the module docstring)."""
    return pytest.mark.parametrize("db", [database], indirect=True)


@pytest.fixture(params=DATABASES)
def db(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/orders.db"
        return
    require_server(request.param)
    url = POSTGRES_URL if request.param == "postgresql" else MARIADB_URL.replace("mysql://", "mysql+pymysql://", 1)
    yield url
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as connection:
        connection.exec_driver_sql(
            f"DROP TABLE IF EXISTS {engine.dialect.identifier_preparer.quote(f'outbox_{prefix}')}"
        )
    engine.dispose()


@pytest.fixture
def shop(db: str, prefix: str) -> Iterator[tuple[Any, SQLOutbox]]:
    require_server("redis")
    app, outbox = outbox_shop.make(
        broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix, db=db, table=f"outbox_{prefix}"
    )
    outbox.create_schema()
    yield app, outbox
    Idempotency.of(app).store.close()


def env(db: str, prefix: str, **more: str) -> dict[str, str]:
    return {"SHOP_OUTBOX_DB": db, "SHOP_OUTBOX_TABLE": f"outbox_{prefix}", **more}


def worker(tmp_path: Path, db: str, prefix: str) -> Worker:
    return Worker(tmp_path, BROKER, REDIS_URL, prefix, app="outbox_shop", pool="threads", env=env(db, prefix))


def relay_process(db: str, prefix: str, dies: str = "") -> subprocess.CompletedProcess[str]:
    """One relay pass in a process of its own (SHOP_RELAY_DIES: where it SIGKILLs itself)."""
    environment = {
        **os.environ,
        "SHOP_BROKER": BROKER,
        "SHOP_BACKEND": BACKEND,
        "SHOP_STORE": REDIS_URL,
        "SHOP_PREFIX": prefix,
        "SHOP_QUEUE": prefix,
        "SHOP_RELAY_DIES": dies,
        "SHOP_RELAY_LEASE": "300",
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
        **env(db, prefix),
    }
    return subprocess.run(
        [sys.executable, str(TESTS / "outbox_shop.py"), "relay"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


def relay_after_the_lease(outbox: SQLOutbox, app: Any) -> Any:
    """The next relay's pass, before (nothing: the rows are the dead relay's) and after the lease
    of the rows the dead relay took ran out (moved back in the table, as time would)."""
    assert outbox.relay(app).published == []
    with outbox.engine.begin() as connection:
        connection.execute(sa.update(outbox.table).where(outbox.table.c.dead.is_(False)).values(available_at=0.0))
    return outbox.relay(app).published


def rows(outbox: SQLOutbox) -> list[Any]:
    with outbox.engine.connect() as connection:
        return list(connection.execute(sa.select(outbox.table)).all())


def stage(outbox: SQLOutbox, app: Any, *args: Any, key: str, **options: Any) -> Any:
    with orm.Session(outbox.engine) as session, session.begin():
        return outbox.apply_async(session, app.tasks["outbox.charge"], args, idempotency_key=key, **options)


def test_a_rolled_back_transaction_publishes_nothing_and_leaves_no_claim(shop: Any, prefix: str) -> None:
    app, outbox = shop
    handle = None
    with pytest.raises(Boom), orm.Session(outbox.engine) as session, session.begin():
        handle = outbox.apply_async(session, app.tasks["outbox.charge"], (1, 100), idempotency_key="order-1")
        raise Boom
    assert handle is not None
    assert rows(outbox) == []
    assert outbox_shop.publishes(prefix, handle.id) == 0
    assert Idempotency.of(app).store.get(handle.identity) is None  # the key is free for any call
    assert outbox.relay(app).published == []


def test_a_committed_call_is_published_at_commit_and_runs_once(shop: Any, db: str, prefix: str, tmp_path: Path) -> None:
    app, outbox = shop
    running = worker(tmp_path, db, prefix)
    try:
        handle = stage(outbox, app, 7, 700, key="order-7")
        assert handle.get(timeout=30) == {"order_id": 7, "charged": 700}
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 7) == 1
    assert outbox_shop.publishes(prefix, handle.id) == 1
    assert rows(outbox) == []


def test_a_call_whose_process_died_before_publishing_is_published_by_the_relay(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False  # as if the process died right after its commit
    handle = stage(outbox, app, 8, 800, key="order-8")
    assert len(rows(outbox)) == 1 and outbox_shop.publishes(prefix, handle.id) == 0
    report = outbox.relay(app)
    assert len(report.published) == 1
    running = worker(tmp_path, db, prefix)
    try:
        assert handle.get(timeout=30) == {"order_id": 8, "charged": 800}
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 8) == 1
    assert rows(outbox) == []


@pytest.mark.parametrize(
    ("db", "worker_first"),
    [("mariadb", False), ("postgresql", True)],
    ids=["mariadb-resent-before-the-worker-ran", "postgresql-worker-ran-first"],
    indirect=["db"],
)
def test_a_relay_killed_after_publishing_is_followed_by_one_more_publish_at_most_and_one_effect(
    shop: Any, db: str, prefix: str, tmp_path: Path, worker_first: bool
) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    handle = stage(outbox, app, 9, 900, key="order-9")
    died = relay_process(db, prefix, dies="after_publish")
    assert died.returncode == -9, died.stderr
    assert outbox_shop.publishes(prefix, handle.id) == 1
    assert len(rows(outbox)) == 1  # its DELETE never committed
    running = worker(tmp_path, db, prefix) if worker_first else None
    try:
        if running is not None:
            wait_for(lambda: outbox_shop.effects(prefix, 9) == 1, "the first message ran")
        assert len(relay_after_the_lease(outbox, app)) == 1
        # Resent while the claim was still PENDING (the first message may never have arrived); once
        # a worker took it, the second relay has nothing to send.
        assert outbox_shop.publishes(prefix, handle.id) == (1 if worker_first else 2)
        running = running or worker(tmp_path, db, prefix)
        assert handle.get(timeout=30) == {"order_id": 9, "charged": 900}
        wait_for(lambda: "succeeded" in running.output(), "the worker ran it")
    finally:
        if running is not None:
            running.stop()
    assert outbox_shop.effects(prefix, 9) == 1
    assert rows(outbox) == []


@on("postgresql")
def test_a_relay_killed_between_its_claim_and_its_publish_is_followed_by_a_copy_that_runs_once(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    handle = stage(outbox, app, 10, 1000, key="order-10")
    died = relay_process(db, prefix, dies="before_publish")
    assert died.returncode == -9, died.stderr
    record = Idempotency.of(app).store.get(handle.identity)
    assert record is not None and record.task_id == handle.id  # claimed, and no message carries it
    assert outbox_shop.publishes(prefix, handle.id) == 0
    assert len(relay_after_the_lease(outbox, app)) == 1
    assert outbox_shop.publishes(prefix, handle.id) == 1
    running = worker(tmp_path, db, prefix)
    try:
        assert handle.get(timeout=30) == {"order_id": 10, "charged": 1000}
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 10) == 1


def test_two_calls_under_one_key_run_once_and_both_handles_answer(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    first = stage(outbox, app, 11, 1100, key="order-11")
    second = stage(outbox, app, 11, 1100, key="order-11")
    assert first.id != second.id
    running = worker(tmp_path, db, prefix)
    try:
        assert first.get(timeout=30) == second.get(timeout=30) == {"order_id": 11, "charged": 1100}
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 11) == 1


def test_relays_racing_publish_each_row_once(shop: Any, db: str, prefix: str) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    handles = [stage(outbox, app, n, n, key=f"race-{n}") for n in range(30)]
    published: list[Any] = []
    barrier = threading.Barrier(3)

    def relay() -> None:
        barrier.wait()
        while True:
            try:
                report = outbox.relay(app, limit=4)
            except sa.exc.OperationalError:  # SQLite: another relay took rows first ("database is locked")
                continue
            if not report.published:
                return
            published.extend(report.published)

    threads = [threading.Thread(target=relay) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(published) == sorted(set(published)) and len(published) == 30
    assert [outbox_shop.publishes(prefix, handle.id) for handle in handles] == [1] * 30
    assert rows(outbox) == []


def test_a_broker_that_is_down_puts_the_row_off_then_into_the_dead_letter(shop: Any, prefix: str) -> None:
    app, outbox = shop
    app.conf.broker_url = "redis://127.0.0.1:1/0"  # nothing listens there
    app.conf.task_publish_retry = False
    # kombu's own connection retries (12 s by default) are not what this test is about.
    app.conf.broker_transport_options = {"max_retries": 1, "interval_start": 0, "interval_step": 0.05}
    outbox.publish_on_commit = False
    outbox.max_attempts = 2
    handle = stage(outbox, app, 12, 1200, key="order-12")
    first = outbox.relay(app)
    assert [row_id for row_id, _, _ in first.failed] and first.published == []
    (row,) = rows(outbox)
    assert row.attempts == 1 and not row.dead and "OperationalError" in row.last_error
    assert outbox.relay(app).failed == []  # put off: not due yet
    assert Idempotency.of(app).store.get(handle.identity) is None  # the failed publish gave its claim back
    with outbox.engine.begin() as connection:
        connection.execute(sa.update(outbox.table).values(available_at=0.0))
    assert len(outbox.relay(app).dead) == 1
    (row,) = rows(outbox)
    assert row.dead and row.attempts == 2
    assert outbox.relay(app).dead == []  # the dead letter is never tried again


def test_a_call_that_can_never_be_published_goes_to_the_dead_letter_at_once(shop: Any, prefix: str) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    charge = app.tasks["outbox.charge"]
    charge.apply_async((13, 1), idempotency_key="order-13")  # another call takes the key first
    refused = stage(outbox, app, 13, 1300, key="order-13")
    report = outbox.relay(app)
    assert len(report.dead) == 1
    (row,) = rows(outbox)
    assert row.dead and row.last_error.startswith("PayloadMismatchError")
    with pytest.raises(PayloadMismatchError):  # the staged handle is answered with the refusal
        refused.get(timeout=10)
    stage(outbox, app, 14, 1400, key="order-14")
    del app.tasks["outbox.charge"]  # a relay whose app lacks the task
    assert len(outbox.relay(app).dead) == 1
    assert sorted(row.last_error.split(":")[0] for row in rows(outbox)) == ["NotRegistered", "PayloadMismatchError"]


def test_staging_refuses_what_apply_async_refuses_before_writing_anything(shop: Any) -> None:
    app, outbox = shop
    charge = app.tasks["outbox.charge"]
    with orm.Session(outbox.engine) as session, session.begin():
        with pytest.raises(InvalidKeyError, match="whitespace"):
            outbox.apply_async(session, charge, (1, 1), idempotency_key="has space")
        with pytest.raises(SerializationError, match="not JSON"):
            outbox.apply_async(session, charge, (object(), 1), idempotency_key="order-x")
        with pytest.raises(TypeError, match="producer= cannot be staged"):
            outbox.apply_async(session, charge, (1, 1), idempotency_key="order-y", producer=object())
    assert rows(outbox) == []


def test_a_plain_task_is_relayed_too(shop: Any, db: str, prefix: str, tmp_path: Path) -> None:
    app, outbox = shop
    with orm.Session(outbox.engine) as session, session.begin():
        handle = outbox.apply_async(session, app.tasks["outbox.plain"], (15,))
    running = worker(tmp_path, db, prefix)
    try:
        assert handle.get(timeout=30) == 15
    finally:
        running.stop()
    assert rows(outbox) == []


@on("sqlite")
def test_a_relay_killed_before_its_claim_is_followed_by_a_publish_that_runs_once(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    handle = stage(outbox, app, 16, 1600, key="order-16")
    died = relay_process(db, prefix, dies="before_claim")
    assert died.returncode == -9, died.stderr
    assert Idempotency.of(app).store.get(handle.identity) is None  # within the TTL: never claimed
    assert len(relay_after_the_lease(outbox, app)) == 1
    running = worker(tmp_path, db, prefix)
    try:
        assert handle.get(timeout=30) == {"order_id": 16, "charged": 1600}
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 16) == outbox_shop.publishes(prefix, handle.id) == 1


@on("mariadb")
def test_a_row_a_dead_relay_left_for_longer_than_its_keys_ttl_is_refused_not_run_again(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    handle = stage(outbox, app, 17, 1700, key="order-17")
    died = relay_process(db, prefix, dies="after_publish")
    assert died.returncode == -9, died.stderr
    running = worker(tmp_path, db, prefix)
    try:
        assert handle.get(timeout=30) == {"order_id": 17, "charged": 1700}
    finally:
        running.stop()
    # As a day later: the record expired (forgotten here) and the dead relay took the row a TTL ago
    idem = Idempotency.of(app)
    assert idem.store.forget(handle.identity)
    ttl = app.tasks["outbox.charge"].idempotency_handler.policy.ttl_seconds
    t = outbox.table
    with outbox.engine.begin() as connection:
        connection.execute(sa.update(t).values(available_at=0.0, taken_at=t.c.taken_at - ttl - 1))
    report = outbox.relay(app)
    assert report.published == [] and len(report.dead) == 1
    (row,) = rows(outbox)
    assert row.dead and row.last_error.startswith("AmbiguousRelay")
    assert outbox_shop.effects(prefix, 17) == 1
    assert handle.get(timeout=5) == {"order_id": 17, "charged": 1700}  # its outcome stands


def test_one_task_id_staged_twice_never_fails_the_transaction_and_runs_once(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    chosen = str(uuid.uuid4())
    first = stage(outbox, app, 18, 1800, key="order-18", task_id=chosen)
    second = stage(outbox, app, 18, 1800, key="order-18", task_id=chosen)
    assert first.id == second.id == chosen
    outbox.relay(app)
    running = worker(tmp_path, db, prefix)
    try:
        assert first.get(timeout=30) == {"order_id": 18, "charged": 1800}
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 18) == 1 and rows(outbox) == []


def a_ttl_later(outbox: SQLOutbox, app: Any, handle: Any) -> None:
    """As a TTL later: the call's record expired (forgotten here), and the relay that died took the
    row more than a TTL ago (its mark moved back); the row is due."""
    Idempotency.of(app).store.forget(handle.identity)
    ttl = app.tasks["outbox.charge"].idempotency_handler.policy.ttl_seconds
    t = outbox.table
    with outbox.engine.begin() as connection:
        connection.execute(sa.update(t).values(available_at=0.0, taken_at=t.c.taken_at - ttl - 1))


def due_now(outbox: SQLOutbox) -> None:
    with outbox.engine.begin() as connection:
        connection.execute(sa.update(outbox.table).values(available_at=0.0))


@pytest.mark.parametrize("db", ["sqlite", "postgresql"], indirect=True)
def test_a_pass_that_failed_at_the_orphan_check_keeps_the_dead_relays_mark_and_the_call_never_runs_twice(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    handle = stage(outbox, app, 19, 1900, key="order-19")
    died = relay_process(db, prefix, dies="after_publish")
    assert died.returncode == -9, died.stderr
    running = worker(tmp_path, db, prefix)
    try:
        assert handle.get(timeout=30) == {"order_id": 19, "charged": 1900}
        a_ttl_later(outbox, app, handle)
        # The next pass asks the store whether the key has a record, and the store times out.
        injector = Injector(Idempotency.of(app).store)
        plan = injector.arm(Plan("get", Fault.TIMEOUT, key="order-19"))
        report = outbox.relay(app)
        injector.clear()
        assert plan.fired == 1 and report.published == [] and len(report.failed) == 1
        due_now(outbox)  # its backoff ran out
        report = outbox.relay(app)
        # The dead relay's mark survived the failed pass: the row is refused, not published blind.
        assert outbox_shop.publishes(prefix, handle.id) == 1
        assert report.published == [] and len(report.dead) == 1
        (row,) = rows(outbox)
        assert row.dead and row.last_error.startswith("AmbiguousRelay") and row.taken_at is not None
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 19) == 1


@pytest.mark.parametrize("db", ["sqlite", "postgresql"], indirect=True)
def test_a_row_refused_as_ambiguous_then_given_back_is_sent_on_the_next_pass_and_runs_once(
    shop: Any, db: str, prefix: str, tmp_path: Path
) -> None:
    app, outbox = shop
    outbox.publish_on_commit = False
    handle = stage(outbox, app, 20, 2000, key="order-20")
    died = relay_process(db, prefix, dies="before_claim")  # it never ran: the operator will find that out
    assert died.returncode == -9, died.stderr
    a_ttl_later(outbox, app, handle)
    report = outbox.relay(app)
    assert len(report.dead) == 1 and rows(outbox)[0].last_error.startswith("AmbiguousRelay")
    assert outbox.relay(app).dead == []  # never tried again by itself
    assert outbox.retry_dead() == 1  # the operator checked: it never ran
    (row,) = rows(outbox)
    assert not row.dead and row.attempts == 0 and row.taken_at is None
    assert len(outbox.relay(app).published) == 1
    running = worker(tmp_path, db, prefix)
    try:
        assert handle.get(timeout=30) == {"order_id": 20, "charged": 2000}
    finally:
        running.stop()
    assert outbox_shop.effects(prefix, 20) == outbox_shop.publishes(prefix, handle.id) == 1
    assert rows(outbox) == []


# Found by the attack on issue 28 (modes): fails on the current code.
@on("sqlite")
def test_an_until_done_call_whose_relay_died_before_its_claim_is_published_and_runs_once(
    db: str, prefix: str, tmp_path: Path
) -> None:
    require_server("redis")
    app, outbox = outbox_shop.make(
        broker=BROKER,
        backend=BACKEND,
        store=REDIS_URL,
        prefix=prefix,
        queue=prefix,
        db=db,
        table=f"outbox_{prefix}",
        mode="until_done",
    )
    outbox.create_schema()
    try:
        outbox.publish_on_commit = False
        # Given a call of an until_done task staged, whose relay died before it claimed or published it
        handle = stage(outbox, app, 18, 1800, key="order-18")
        died = relay_process(db, prefix, dies="before_claim")
        assert died.returncode == -9, died.stderr
        assert Idempotency.of(app).store.get(handle.identity) is None  # never claimed
        # When the next relay takes the row (the dead relay took it a moment ago, not a TTL ago)
        published = relay_after_the_lease(outbox, app)
        # Then it publishes the call, which runs once (an until_done key's TTL is no horizon of a
        # call: its record is gone a millisecond after every run, so "no record past the TTL" says
        # nothing of whether this call ran)
        assert len(published) == 1, rows(outbox)
        running = Worker(
            tmp_path,
            BROKER,
            REDIS_URL,
            prefix,
            app="outbox_shop",
            pool="threads",
            env=env(db, prefix),
            mode="until_done",
        )
        try:
            assert handle.get(timeout=30) == {"order_id": 18, "charged": 1800}
        finally:
            running.stop()
        assert outbox_shop.effects(prefix, 18) == 1
    finally:
        Idempotency.of(app).store.close()


@on("sqlite")
def test_an_until_done_call_whose_relay_died_after_publishing_runs_once_when_the_next_relay_sends_it_again(
    db: str, prefix: str, tmp_path: Path
) -> None:
    require_server("redis")
    app, outbox = outbox_shop.make(
        broker=BROKER,
        backend=BACKEND,
        store=REDIS_URL,
        prefix=prefix,
        queue=prefix,
        db=db,
        table=f"outbox_{prefix}",
        mode="until_done",
    )
    outbox.create_schema()
    running = Worker(
        tmp_path, BROKER, REDIS_URL, prefix, app="outbox_shop", pool="threads", env=env(db, prefix), mode="until_done"
    )
    try:
        outbox.publish_on_commit = False
        # Given a call of an until_done task staged, whose relay died after publishing it (its DELETE
        # never committed), and whose message ran: its run ended
        handle = stage(outbox, app, 19, 1900, key="order-19")
        died = relay_process(db, prefix, dies="after_publish")
        assert died.returncode == -9, died.stderr
        assert handle.get(timeout=30) == {"order_id": 19, "charged": 1900}
        wait_for(lambda: outbox_shop.effects(prefix, 19) == 1, "the first message ran")
        # When the next relay takes the row again and relays it (the same task id: the same call)
        relay_after_the_lease(outbox, app)
        time.sleep(1.5)
        # Then the call's effect happens once, and nothing is published again: the call ran (its
        # record of that task id, kept for its own messages, says so)
        assert outbox_shop.effects(prefix, 19) == 1
        assert outbox_shop.publishes(prefix, handle.id) == 1
    finally:
        running.stop()
        Idempotency.of(app).store.close()
