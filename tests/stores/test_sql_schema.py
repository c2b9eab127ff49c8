"""SQLStore's schema on a real PostgreSQL and SQLite (and MariaDB, where a test is not about layout 1,
which no release made there): created on first use, and brought up to date when an older celery-idem
made the table."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MARIADB_URL, POSTGRES_URL, require_server
from sql_layouts import drop, layout_1_rows, layout_1_table, make_layout_1

from celery_idem.errors import ConfigurationError, StoreUnavailableError
from celery_idem.records import Decision, Identity, State
from celery_idem.stores.sql import SQLStore, codec, migrate, records_table
from celery_idem.stores.sql.engine import server_clock


def _engine(kind: str, tmp_path: Any) -> sa.Engine:
    if kind == "postgresql":
        require_server("postgresql")
        return sa.create_engine(POSTGRES_URL)
    if kind == "mariadb":
        require_server("mariadb")
        return sa.create_engine(MARIADB_URL.replace("mysql://", "mysql+pymysql://", 1))
    return sa.create_engine(f"sqlite:///{tmp_path}/old.db")


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[sa.Engine]:
    made = _engine(request.param, tmp_path)
    yield made
    made.dispose()


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def any_engine(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[sa.Engine]:
    """The ``engine`` fixture's databases, and MariaDB."""
    made = _engine(request.param, tmp_path)
    yield made
    made.dispose()


def test_a_table_made_by_an_older_version_gets_the_new_columns(any_engine: sa.Engine) -> None:
    engine = any_engine
    # Given a records table as an older release made it (no `call` column)
    name = f"idem_old_{uuid.uuid4().hex[:8]}"
    old = records_table(sa.MetaData(), name)
    old._columns.remove(old.c.call)  # type: ignore[attr-defined]
    old.metadata.create_all(engine)
    try:
        # When this release's store first uses it
        store = SQLStore(engine, table_name=name)
        identity = Identity("", "shop.charge", "k")
        t = store.claim(identity, "f" * 64, "t1", pending_seconds=60, ttl_seconds=60, call=b"[1,2]")
        # Then the column was added and works
        assert t.decision is Decision.NEW
        assert store.get(identity).call == b"[1,2]"
        assert "call" in {c["name"] for c in sa.inspect(engine).get_columns(name)}
    finally:
        with engine.begin() as connection:
            connection.exec_driver_sql(f"DROP TABLE {name}")


def test_a_schema_another_process_creates_object_by_object_meanwhile_is_created_once(any_engine: sa.Engine) -> None:
    engine = any_engine
    # Given a fresh database where another process (its own connection) wins every CREATE race: it
    # creates each table and index just before this store's CREATE of it runs
    name = f"idem_race_{uuid.uuid4().hex[:8]}"
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    other = sa.create_engine(engine.url)
    won: list[str] = []

    @sa.event.listens_for(store.engine, "before_cursor_execute")
    def another_process_first(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("CREATE"):
            with other.begin() as connection:
                connection.exec_driver_sql(statement)
            won.append(statement.split("(")[0].strip())

    try:
        # When the store is first used
        t = store.claim(Identity("", "shop.charge", "k"), "f" * 64, "t1", pending_seconds=60, ttl_seconds=60)
        # Then it created nothing twice and works: every object the other process made is used (each
        # lost race is one object more in place; before, a second lost race failed the first use)
        assert t.decision is Decision.NEW
        assert len(won) >= 2, won
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", another_process_first)
        with engine.begin() as connection:
            for table in (name, f"{name}_live"):
                connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        other.dispose()


# ---- layout 1 (every field as text, the identity as the key) moves to layout 2 on first use -----------


def test_a_layout_1_table_moves_to_layout_2_on_first_use_with_every_live_record_as_it_was(engine: sa.Engine) -> None:
    # Given a records table an older release made, holding live records in every state, one expired
    # record, and one of another namespace
    name = f"idem_l1_{uuid.uuid4().hex[:8]}"
    rows = make_layout_1(engine, name)
    by_key = {(row["namespace"], row["key"]): row for row in rows}
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    others = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live", key_prefix="other")
    try:
        # When this release's store first uses it
        got = {key: store.get(Identity("", "shop.charge", key)) for key in ("claimed", "running", "paid", "refused")}
        # Then the table is in layout 2 and the old one is gone
        columns = {c["name"] for c in sa.inspect(engine).get_columns(name)}
        assert "id" in columns and not sa.inspect(engine).has_table(f"{name}_layout1")
        # And every live record reads back as it was (a settled one keeps its owner's digest and
        # no call, as this release's settlement writes it)
        for key, record in got.items():
            old = by_key[("idem", key)]
            assert record is not None, key
            for field in ("fingerprint", "task_id", "attempt", "lease_expires_at", "created_at", "updated_at"):
                assert getattr(record, field) == old[field], (key, field)
            assert (record.state.value, record.expires_at, record.ttl_seconds) == (
                old["state"],
                old["expires_at"],
                old["ttl_seconds"],
            )
            assert (record.result, record.content_type, record.content_encoding) == (
                old["result"],
                old["content_type"],
                old["content_encoding"],
            )
            assert record.previous_task_id == old["previous_task_id"]
            assert record.held_by(old["owner"]), key
        assert got["claimed"].call == b"[[1], {}]" and got["refused"].error is not None
        assert got["refused"].error.type == "ValueError"
        # ... the expired one is absent, the other namespace's record is its own
        assert store.get(Identity("", "shop.charge", "gone")) is None
        assert others.get(Identity("", "shop.charge", "paid")).task_id == by_key[("other", "paid")]["task_id"]
        assert store.count_by_state() == {State.PENDING: 1, State.IN_PROGRESS: 1, State.COMPLETED: 1, State.FAILED: 1}
        # And the moved records still answer to their fences: the running attempt's owner settles it,
        # the claim's task id frees it, and a duplicate of the paid call is a replay
        running = Identity("", "shop.charge", "running")
        assert store.complete(running, "a" * 32, result=b"1", content_type="application/json").decision is Decision.OK
        assert store.get(running).state is State.COMPLETED
        claimed = Identity("", "shop.charge", "claimed")
        assert store.release(claimed, by_key[("idem", "claimed")]["task_id"], fence="task_id").decision is Decision.OK
        assert store.get(claimed) is None
        replay = store.claim(Identity("", "shop.charge", "paid"), "ab" * 32, "t2", pending_seconds=60, ttl_seconds=60)
        assert replay.decision is Decision.REPLAY
    finally:
        store.close()
        others.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")


def test_stores_that_first_use_a_layout_1_table_at_once_move_it_once(engine: sa.Engine) -> None:
    # Given a layout 1 table, and four stores (each its own pool) that start at once
    name = f"idem_l1r_{uuid.uuid4().hex[:8]}"
    make_layout_1(engine, name)
    stores = [
        SQLStore(sa.create_engine(engine.url), table_name=name, liveness_table_name=f"{name}_live") for _ in range(4)
    ]
    barrier = threading.Barrier(len(stores))
    answers: list[Any] = []

    def first_use(store: SQLStore) -> None:
        barrier.wait()
        try:
            answers.append(store.get(Identity("", "shop.charge", "paid")))
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            answers.append(exc)

    try:
        threads = [threading.Thread(target=first_use, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        # Then every store answered with the moved record, and the table holds each live row once
        assert [type(answer).__name__ for answer in answers] == ["IdempotencyRecord"] * 4, answers
        assert stores[0].count_by_state() == {
            State.PENDING: 1,
            State.IN_PROGRESS: 1,
            State.COMPLETED: 1,
            State.FAILED: 1,
        }
    finally:
        for store in stores:
            store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")


@pytest.mark.parametrize("dies_at", ["INSERT", "CREATE INDEX", "DROP TABLE"])
def test_a_move_that_fails_midway_leaves_layout_1_whole_and_the_next_use_moves_it(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, dies_at: str
) -> None:
    # Given a layout 1 table, moved one row at a time on SQLite, and a process that dies at a step
    # of the move: copying rows (SQLite: the third), building the new indexes, dropping the old table
    name = f"idem_l1f_{uuid.uuid4().hex[:8]}"
    make_layout_1(engine, name)
    monkeypatch.setattr(migrate, "BATCH", 1)
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    seen: list[str] = []
    nth = 3 if dies_at == "INSERT" and engine.dialect.name == "sqlite" else 1

    @sa.event.listens_for(store.engine, "before_cursor_execute")
    def dies(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith(dies_at):
            seen.append(statement)
            if len(seen) == nth:
                raise RuntimeError("the process died here")

    try:
        # When the first use fails there
        with pytest.raises(Exception, match="the process died here"):
            store.get(Identity("", "shop.charge", "paid"))
        # Then nothing of the move is left: the table is layout 1 with every row
        inspector = sa.inspect(engine)
        assert "id" not in {c["name"] for c in inspector.get_columns(name)}
        assert not inspector.has_table(f"{name}_layout1")
        with engine.connect() as connection:
            assert connection.execute(sa.text(f"SELECT count(*) FROM {name}")).scalar_one() == 6
        # And the next use moves it
        sa.event.remove(store.engine, "before_cursor_execute", dies)
        assert store.get(Identity("", "shop.charge", "paid")).state is State.COMPLETED
        assert store.count_by_state()[State.COMPLETED] == 1
    finally:
        store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")


TRICKY = [
    "ab" * 32,  # a SHA-256 hex digest: packed
    "AB" * 32,  # upper case: text
    "a" * 63,
    "x" * 31,  # 0xFF + 31 bytes is a packed length (32): one more 0xFF
    "y" * 32,
    "t" * 15,
    "t" * 16,
    "o" * 7,
    "o" * 8,
    "",
    "é" * 16,
    "#0123456789abcdef",  # an owner digest: packed
    "#0123456789ABCDEF",
    "0123456789abcdef" * 2,  # an owner token: packed
    "6f1c0b52-5a7e-4b9e-9c55-0e0f3d0b7a11",  # a task id: packed
    "6F1C0B52-5A7E-4B9E-9C55-0E0F3D0B7A11",
    "6f1c0b52-5a7e-4b9e-9c55-0e0f3d0b7a11\n",
    "ab" * 31 + "\n",
    "zero\x00byte",
]


def test_postgresql_packs_moved_rows_exactly_as_the_codec_does() -> None:
    # Given a layout 1 PostgreSQL table whose rows carry every awkward value in every packed field
    # (PostgreSQL moves rows in SQL: these expressions restate codec.py, and must agree with it)
    require_server("postgresql")
    engine = sa.create_engine(POSTGRES_URL)
    name = f"idem_l1c_{uuid.uuid4().hex[:8]}"
    old = layout_1_table(name)
    old.metadata.create_all(engine)
    values = [value for value in TRICKY if "\x00" not in value]  # PostgreSQL text holds no NUL
    states = ["PENDING", "IN_PROGRESS", "COMPLETED", "FAILED"]
    with engine.begin() as connection:
        now = float(connection.execute(sa.select(server_clock("postgresql"))).scalar_one())
        rows = [
            {"namespace": "idem", "scope": value[:8], "task_name": "shop.é", "key": f"k{i}", "fingerprint": value[:64]}
            | {"state": states[i % 4], "task_id": value, "owner": value, "attempt": 1, "lease_expires_at": None}
            | {"created_at": now, "updated_at": now, "expires_at": now + 60, "ttl_seconds": 60.0}
            | {"result": None, "content_type": ["application/json", "", None][i % 3], "content_encoding": "utf-8"}
            | {"error": None, "call": b"c", "linger_until": None, "previous_task_id": value if i % 2 else None}
            for i, value in enumerate(values)
        ]
        connection.execute(sa.insert(old), rows)
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    try:
        # When the store moves them
        store.create_schema()
        # Then every packed column holds exactly the codec's bytes, and every row reads back as written
        new = store.table
        with engine.connect() as connection:
            moved = {row.key: row for row in connection.execute(sa.select(new))}
        assert len(moved) == len(rows)
        for row in rows:
            got = moved[row["key"]]
            assert got.id == codec.identity_id("idem", row["scope"], row["task_name"], row["key"]), row
            assert bytes(got.fingerprint) == codec.FINGERPRINT.pack(row["fingerprint"]), row
            assert bytes(got.task_id) == codec.TASK_ID.pack(row["task_id"]), row
            assert bytes(got.owner) == codec.OWNER.pack(row["owner"]), row
            assert got.previous_task_id == codec.TASK_ID.pack_optional(row["previous_task_id"]), row
            assert got.state_code == codec.STATE_CODES[State(row["state"])]
            assert got.content_type == codec.content_type(row["content_type"]), row
            assert (got.call is None) == (row["state"] in ("COMPLETED", "FAILED"))
            record = store.get(Identity(row["scope"], row["task_name"], row["key"]))
            assert record is not None and record.fingerprint == row["fingerprint"]
            assert (record.task_id, record.owner, record.previous_task_id) == (
                row["task_id"],
                row["owner"],
                row["previous_task_id"],
            )
    finally:
        store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")
        engine.dispose()


@pytest.mark.parametrize("packing", ["FINGERPRINT", "TASK_ID", "OWNER"])
def test_the_codec_reads_back_every_string_and_no_two_strings_share_an_encoding(packing: str) -> None:
    # Given every awkward string, in each packed field
    field = getattr(codec, packing)
    encoded = {value: field.pack(value) for value in TRICKY}
    # Then each reads back as itself, and no two encode alike (SQL equality is string equality)
    assert all(field.unpack(raw) == value for value, raw in encoded.items())
    assert len(set(encoded.values())) == len(TRICKY)


@pytest.mark.parametrize("lacks", ["call", "linger_until", "previous_task_id"])
def test_a_layout_1_table_older_still_without_a_later_column_moves_too(engine: sa.Engine, lacks: str) -> None:
    # Given a layout 1 table made before one of its nullable columns existed (PostgreSQL moves rows
    # in SQL: the missing column's NULL must have the new column's type)
    name = f"idem_l1o_{uuid.uuid4().hex[:8]}"
    old = layout_1_table(name)
    old._columns.remove(old.c[lacks])  # type: ignore[attr-defined]
    old.metadata.create_all(engine)
    with engine.begin() as connection:
        now = float(connection.execute(sa.select(server_clock(engine.dialect.name))).scalar_one())
        rows = [{k: v for k, v in row.items() if k != lacks} for row in layout_1_rows(now)]
        connection.execute(sa.insert(old), rows)
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    try:
        # When this release first uses it, then it moved, with every live record
        assert store.count_by_state() == {State.PENDING: 1, State.IN_PROGRESS: 1, State.COMPLETED: 1, State.FAILED: 1}
        record = store.get(Identity("", "shop.charge", "claimed"))
        assert record is not None and record.call == (None if lacks == "call" else b"[[1], {}]")
    finally:
        store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")


def test_a_table_left_in_the_way_of_the_move_is_named_as_a_configuration_error(engine: sa.Engine) -> None:
    # Given a layout 1 table, and a table already holding the name the move gives the old one
    name = f"idem_l1w_{uuid.uuid4().hex[:8]}"
    make_layout_1(engine, name)
    with engine.begin() as connection:
        connection.exec_driver_sql(f"CREATE TABLE {name}_layout1 (x integer)")
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    try:
        # Then the first use says what to do (no waiting would fix it: not an outage)
        with pytest.raises(ConfigurationError, match=f"{name}_layout1, the name the move gives the old table"):
            store.get(Identity("", "shop.charge", "paid"))
    finally:
        store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")


def test_a_move_waits_for_the_table_lock_no_longer_than_the_store_timeout() -> None:
    # Given a layout 1 PostgreSQL table that another session holds (an operator's transaction left
    # open after a SELECT)
    require_server("postgresql")
    engine = sa.create_engine(POSTGRES_URL)
    name = f"idem_l1l_{uuid.uuid4().hex[:8]}"
    make_layout_1(engine, name)
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live", timeout_seconds=1)
    holder = engine.connect()
    try:
        holder.execute(sa.text(f"SELECT count(*) FROM {name}"))
        # When this release first uses the table, the call is an outage within about its timeout
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="canceling statement due to lock timeout"):
            store.get(Identity("", "shop.charge", "paid"))
        assert time.monotonic() - started < 10
        # ... and once the other session is done, the next call moves the table
        holder.rollback()
        assert store.get(Identity("", "shop.charge", "paid")).state is State.COMPLETED
    finally:
        holder.close()
        store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")
        engine.dispose()


def test_a_statement_of_the_older_release_fails_on_layout_2_instead_of_matching_nothing(engine: sa.Engine) -> None:
    # Given a layout 2 table with a running attempt
    name = f"idem_l2_{uuid.uuid4().hex[:8]}"
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    identity = Identity("", "shop.charge", "k")
    owner = store.acquire(identity, "f" * 64, "t1", lease_seconds=60, ttl_seconds=60).record.owner
    try:
        # When a process of the older release still running settles it as layout 1 did (its owner
        # and task id as text, judged by `state`), then the statement fails: an outage to that
        # process, not a LOST that drops an outcome whose effect happened
        old_settle = (
            f"UPDATE {name} SET result = :r WHERE namespace = 'idem' AND key = 'k' AND owner = :o "
            "AND state IN ('PENDING', 'IN_PROGRESS')"
        )
        missing = 'no such column: state|column "state" does not exist'
        with pytest.raises(sa.exc.DBAPIError, match=missing), engine.begin() as connection:
            connection.execute(sa.text(old_settle), {"r": b"1", "o": owner})
    finally:
        store.close()
        drop(engine, name, f"{name}_live")


def test_two_identities_whose_hashes_collide_never_read_or_take_each_others_row(
    any_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = any_engine
    # Given a store where every identity hashes alike (a collision, which 128 bits make unreachable
    # by chance or by search), and a record of one identity
    name = f"idem_col_{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(codec, "identity_id", lambda *_: uuid.UUID(int=7))
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    paid, other = Identity("", "shop.charge", "paid"), Identity("", "shop.charge", "other")
    try:
        owner = store.acquire(paid, "f" * 64, "t1", lease_seconds=60, ttl_seconds=60).record.owner
        # Then the other identity reads nothing, cannot take the row (fail closed: an outage), and
        # cannot write or free it; the record stays its own identity's
        assert store.get(other) is None
        with pytest.raises(StoreUnavailableError, match="changed hands"):
            store.claim(other, "f" * 64, "t2", pending_seconds=60, ttl_seconds=60)
        assert store.complete(other, owner, b"1").decision is Decision.LOST
        assert store.release(other, "t1", fence="task_id").decision is Decision.LOST
        assert store.forget(other) is False
        record = store.get(paid)
        assert record is not None and record.key == "paid" and record.state is State.IN_PROGRESS
        assert store.complete(paid, owner, b"1").decision is Decision.OK
    finally:
        store.close()
        drop(engine, name, f"{name}_live")


def test_a_thread_that_calls_while_another_thread_moves_the_table_waits_no_longer_than_the_timeout(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a layout 1 table whose move takes 3 s, started by one thread of a process
    name = f"idem_l1t_{uuid.uuid4().hex[:8]}"
    make_layout_1(engine, name)
    move = migrate._move
    moving = threading.Event()

    def slow(connection: sa.Connection, table: sa.Table) -> int:
        moving.set()
        time.sleep(3)
        return move(connection, table)

    monkeypatch.setattr(migrate, "_move", slow)
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live", timeout_seconds=0.5)
    paid = Identity("", "shop.charge", "paid")
    mover: list[Any] = []
    first = threading.Thread(target=lambda: mover.append(store.get(paid)), daemon=True)
    try:
        first.start()
        assert moving.wait(10)
        # When another thread of the same process calls the store meanwhile, then it is an outage
        # within about its timeout (before, it waited on the schema lock for the whole move)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="still creating or moving the schema"):
            store.get(paid)
        assert time.monotonic() - started < 2.5
        # ... and the move itself completes
        first.join(timeout=30)
        assert mover and mover[0].state is State.COMPLETED
        assert store.get(paid).state is State.COMPLETED
    finally:
        first.join(timeout=30)
        store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")


def test_an_older_release_that_creates_its_table_as_this_one_starts_has_it_moved(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an empty database, where a process of the older release creates its layout 1 table
    # just before this release's CREATE (both starting at once)
    from celery_idem.stores.sql import base

    name = f"idem_l1s_{uuid.uuid4().hex[:8]}"
    create_all = base.create_all

    def older_release_first(metadata: sa.MetaData, target: sa.Engine) -> None:
        make_layout_1(engine, name)
        create_all(metadata, target)

    monkeypatch.setattr(base, "create_all", older_release_first)
    store = SQLStore(engine, table_name=name, liveness_table_name=f"{name}_live")
    try:
        # When this release's store is first used, then it moved that table and works
        assert store.get(Identity("", "shop.charge", "paid")).state is State.COMPLETED
        assert "id" in {c["name"] for c in sa.inspect(engine).get_columns(name)}
    finally:
        store.close()
        drop(engine, name, f"{name}_layout1", f"{name}_live")
