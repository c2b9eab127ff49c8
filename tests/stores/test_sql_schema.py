"""SQLStore's schema on a real PostgreSQL and SQLite: created on first use, and brought up to date
when an older celery-idem made the table."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import POSTGRES_URL, require_server

from celery_idem.records import Decision, Identity
from celery_idem.stores.sql import SQLStore, records_table


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[sa.Engine]:
    if request.param == "postgresql":
        require_server("postgresql")
        made = sa.create_engine(POSTGRES_URL)
    else:
        made = sa.create_engine(f"sqlite:///{tmp_path}/old.db")
    yield made
    made.dispose()


def test_a_table_made_by_an_older_version_gets_the_new_columns(engine: sa.Engine) -> None:
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


def test_a_schema_another_process_creates_object_by_object_meanwhile_is_created_once(engine: sa.Engine) -> None:
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
