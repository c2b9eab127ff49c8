"""Moving a records table an older celery-idem made (layout 1: every field as text, the identity as
the primary key) to this release's compact row (layout 2, :mod:`~celery_idem.stores.sql.codec`).

The store calls :func:`upgrade_layout` before it creates its schema, so the first process of the
new release to use the table moves it, once, in one transaction: the old table is renamed, the new
one created under the old name, the live rows copied (each field packed as the store writes it;
expired rows are absent to every operation and are left behind), and the old table dropped. The
transaction holds the table's exclusive lock (PostgreSQL) or the database's write lock (SQLite)
from its first statement, so a process that starts meanwhile fails to take it within its timeout (an
outage to that call, tried again), then finds layout 2 and moves nothing; a crash anywhere rolls the
whole move back. Processes of the old release must be stopped first: their statements name layout
1's ``state`` column and fail on layout 2 (docs/stores.md, "Upgrading").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import sqlalchemy as sa

from ...errors import ConfigurationError
from ...records import State
from . import codec
from .engine import server_clock

__all__ = ["BATCH", "upgrade_layout"]

BATCH = 1000  # rows read and written at a time (keyset pages over the old primary key)
_OLD_KEY = ("namespace", "scope", "task_name", "key")
_SETTLED = {State.COMPLETED.value, State.FAILED.value}


def move_seconds(rows: float) -> float:
    """How long a move of ``rows`` rows may take before it is an outage: a minute, and a second per
    5,000 rows (about seven times the pace measured on the dev machine, 35,000 rows a second)."""
    return 60.0 + max(0.0, rows) / 5000.0


def upgrade_layout(
    engine: sa.Engine, table: sa.Table, timeout: float, guard: Callable[[sa.Connection, float], ContextManager[None]]
) -> int | None:
    """Move ``table`` from layout 1 to ``table``'s layout if the database holds layout 1; the
    number of rows moved, or None when there was nothing to move. ``engine`` runs in autocommit:
    the transaction is opened here, by hand (SQLite's driver would commit DDL on its own).

    Taking the lock waits at most ``timeout`` (the store's; its engine's busy timeout on SQLite):
    a session holding the table (another mover, a long transaction of an operator) makes this
    store call an outage, tried again on the next call, never a wait without end that would also
    queue every other reader of the table behind it. On PostgreSQL the move then has a deadline
    that grows with the table (:func:`move_seconds`), kept by the server (``statement_timeout``)
    and by ``guard`` (the store's watchdog, which cuts off a connection whose server went silent).
    """
    inspector = sa.inspect(engine)
    if not _is_layout_1(inspector, table.name):
        return None
    if inspector.has_table(f"{table.name}_layout1"):
        raise ConfigurationError(
            f"the records table {table.name!r} has celery-idem's old layout and must be moved, but a table "
            f"{table.name}_layout1, the name the move gives the old table, exists already: drop or rename it"
        )
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        connection.exec_driver_sql("BEGIN IMMEDIATE" if sqlite else "BEGIN")
        try:
            deadline = timeout
            if not sqlite:
                with guard(connection, timeout):
                    deadline = _lock(connection, table.name, timeout)
            with guard(connection, deadline):
                moved = _move(connection, table) if _is_layout_1(sa.inspect(connection), table.name) else None
                connection.exec_driver_sql("COMMIT")
        except BaseException:
            connection.exec_driver_sql("ROLLBACK")
            raise
    return moved


def _lock(connection: sa.Connection, name: str, timeout: float) -> float:
    """Take the table's exclusive lock within ``timeout``, and give the move its deadline (the
    server's ``statement_timeout`` for the transaction's statements): the seconds it may take."""
    milliseconds = max(1, math.ceil(timeout * 1000))
    connection.exec_driver_sql(f"SET LOCAL lock_timeout = {milliseconds}")
    connection.exec_driver_sql(f"SET LOCAL statement_timeout = {2 * milliseconds}")  # the lock's own answers first
    quoted = connection.dialect.identifier_preparer.quote(name)
    connection.exec_driver_sql(f"LOCK TABLE {quoted} IN ACCESS EXCLUSIVE MODE")
    # The planner's estimate is enough for a deadline (-1 for a table never analysed: its size then).
    estimate = connection.execute(
        sa.text("SELECT greatest(reltuples, pg_relation_size(oid) / 100.0) FROM pg_class WHERE oid = to_regclass(:t)"),
        {"t": quoted},
    ).scalar_one()
    seconds = move_seconds(float(estimate))
    deadline = math.ceil(seconds * 1000)
    connection.exec_driver_sql("SET LOCAL lock_timeout = 0")  # the lock is ours: the move waits on nothing
    connection.exec_driver_sql(f"SET LOCAL statement_timeout = {deadline}")
    # A client cut off mid-move (the watchdog, a dead link) leaves its transaction open on the
    # server, holding the table's lock until TCP notices, hours later: the server ends it instead.
    connection.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {deadline}")
    return seconds


def _is_layout_1(inspector: Any, name: str) -> bool:
    if not inspector.has_table(name):
        return False
    columns = {column["name"] for column in inspector.get_columns(name)}
    return "id" not in columns and "fingerprint" in columns


def _move(connection: sa.Connection, table: sa.Table) -> int:
    preparer = connection.dialect.identifier_preparer
    old_name = f"{table.name}_layout1"
    connection.exec_driver_sql(f"ALTER TABLE {preparer.quote(table.name)} RENAME TO {preparer.quote(old_name)}")
    old = sa.Table(old_name, sa.MetaData(), autoload_with=connection)
    # The old table's indexes keep their names (SQLite's are database-wide): the new ones differ.
    # They are built once the rows are in: one sort each, not an insert per row.
    connection.execute(sa.schema.CreateTable(table))
    if connection.dialect.name == "postgresql":
        moved = _copy_in_postgresql(connection, old, table)
    else:
        moved = 0
        for batch in _live_rows(connection, old):
            connection.execute(sa.insert(table), [_packed(row) for row in batch])
            moved += len(batch)
    for index in table.indexes:
        index.create(connection)
    old.drop(connection)
    return moved


# PostgreSQL packs the rows itself, in one INSERT ... SELECT (a table of millions of rows moves in
# minutes, not hours of Python round trips). The expressions restate codec.py in SQL:
# tests/stores/test_sql_schema.py holds them against it, value by value.
_TEXT = "'\\xff'::bytea"


def _text_form(value: sa.ColumnElement[Any], *packed_lengths: int) -> sa.ColumnElement[Any]:
    utf8 = sa.func.convert_to(value, "UTF8")
    text = sa.literal_column(_TEXT).op("||")(utf8)
    return sa.case(
        (sa.func.octet_length(text).in_(packed_lengths), text.op("||")(sa.literal_column(_TEXT))), else_=text
    )


def _hex(value: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    return sa.func.decode(value, "hex")


def _matches(value: sa.ColumnElement[Any], pattern: str) -> sa.ColumnElement[bool]:
    return value.op("~")(f"^{pattern}$")


_UUID_PATTERN = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def _task_id(value: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    return sa.case((_matches(value, _UUID_PATTERN), _hex(sa.func.replace(value, "-", ""))), else_=_text_form(value, 16))


def _identity_hash(old: sa.Table) -> sa.ColumnElement[Any]:
    parts: list[sa.ColumnElement[Any]] = []
    for name in _OLD_KEY:
        utf8 = sa.func.convert_to(old.c[name], "UTF8")
        parts += [sa.func.int4send(sa.func.octet_length(utf8)), utf8]
    joined = parts[0]
    for part in parts[1:]:
        joined = joined.op("||")(part)
    return sa.cast(sa.func.encode(sa.func.substring(sa.func.sha256(joined), 1, 16), "hex"), sa.Uuid)


def _copy_in_postgresql(connection: sa.Connection, old: sa.Table, table: sa.Table) -> int:
    c = old.c

    def null(name: str) -> sa.ColumnElement[Any]:
        return sa.cast(sa.null(), table.c[name].type)  # typed: a bare NULL in a CASE is text

    def column(name: str) -> sa.ColumnElement[Any]:
        return c[name] if name in c else null(name)  # a column older tables lack

    settled = c.state.in_(sorted(_SETTLED))
    packed: dict[str, sa.ColumnElement[Any]] = {
        "id": _identity_hash(old),
        "state_code": sa.case(*((c.state == state.value, code) for state, code in codec.STATE_CODES.items())),
        "fingerprint": sa.case(
            (_matches(c.fingerprint, "[0-9a-f]{64}"), _hex(c.fingerprint)), else_=_text_form(c.fingerprint, 32)
        ),
        "task_id": _task_id(c.task_id),
        "owner": sa.case(
            (_matches(c.owner, "[0-9a-f]{32}"), _hex(c.owner)),
            (_matches(c.owner, "#[0-9a-f]{16}"), _hex(sa.func.substr(c.owner, 2))),
            else_=_text_form(c.owner, 8, 16),
        ),
        "previous_task_id": _task_id(c.previous_task_id) if "previous_task_id" in c else null("previous_task_id"),
        "content_type": sa.case((c.content_type == "application/json", null("content_type")), else_=c.content_type),
        "content_encoding": sa.case(
            (c.content_encoding == "utf-8", null("content_encoding")), else_=c.content_encoding
        ),
        "call": sa.case((settled, null("call")), else_=column("call")),
        "linger_until": column("linger_until"),
    }
    names = [column.name for column in table.columns]
    select = sa.select(*(packed[name] if name in packed else c[name] for name in names)).where(
        c.expires_at > server_clock("postgresql")
    )
    return int(connection.execute(sa.insert(table).from_select(names, select)).rowcount)


def _live_rows(connection: sa.Connection, old: sa.Table) -> Iterator[list[dict[str, Any]]]:
    key = [old.c[name] for name in _OLD_KEY]
    now = server_clock(connection.dialect.name)
    query = sa.select(old).where(old.c.expires_at > now).order_by(*key).limit(BATCH)
    page = connection.execute(query).mappings().all()
    while page:
        yield [dict(row) for row in page]
        last = tuple(page[-1][name] for name in _OLD_KEY)
        page = connection.execute(query.where(sa.tuple_(*key) > sa.tuple_(*last))).mappings().all()


def _packed(row: dict[str, Any]) -> dict[str, Any]:
    """A layout 1 row as layout 2 keeps it (SQLite; PostgreSQL moves its rows in SQL). A settled row
    drops its call, as a settlement in this release does, and keeps its whole owner token (which
    ``held_by`` reads as well as a digest); a column older still (added since) may be absent."""
    settled = row["state"] in _SETTLED
    return {
        "id": codec.identity_id(row["namespace"], row["scope"], row["task_name"], row["key"]),
        **{name: row[name] for name in ("namespace", "scope", "task_name", "key", "attempt", "result", "error")},
        **{name: row[name] for name in ("created_at", "updated_at", "expires_at", "ttl_seconds", "lease_expires_at")},
        "linger_until": row.get("linger_until"),
        "state_code": codec.STATE_CODES[State(row["state"])],
        "fingerprint": codec.FINGERPRINT.pack(row["fingerprint"]),
        "task_id": codec.TASK_ID.pack(row["task_id"]),
        "owner": codec.OWNER.pack(row["owner"]),
        "previous_task_id": codec.TASK_ID.pack_optional(row.get("previous_task_id")),
        "content_type": codec.content_type(row["content_type"]),
        "content_encoding": codec.content_encoding(row["content_encoding"]),
        "call": None if settled else row.get("call"),
    }
