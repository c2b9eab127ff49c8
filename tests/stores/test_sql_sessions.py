"""The SQL store's own sessions on MySQL/MariaDB, whatever the engine it was given: they count rows
matched (the store judges its conditional writes by them), take any character (utf8mb4), and stay
READ COMMITTED after a caller's transaction of their own on ``store.engine``. On PostgreSQL: a
process forked after the store was used (a prefork pool's child, started when one is recycled or
killed) opens connections of its own, never the parent's pooled ones."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest
import sqlalchemy as sa
from conftest import MARIADB_DATABASE, MARIADB_URL, POSTGRES_URL, require_server

from celery_idem import ConfigurationError
from celery_idem.records import Decision, ErrorInfo, Identity
from celery_idem.stores import store_from_url
from celery_idem.stores.sql import SQLStore

FP = "f" * 64
_URL = urlsplit(MARIADB_URL)


@pytest.fixture
def prefix() -> Iterator[str]:
    require_server("mariadb")
    yield f"s{uuid.uuid4().hex[:10]}"


def engine(**connect: Any) -> sa.Engine:
    """An engine of the caller's own: a ``creator``, as the Cloud SQL connector's guide builds one."""
    options = {"host": _URL.hostname, "port": _URL.port or 3306, "user": _URL.username or "root"}
    return sa.create_engine(
        "mysql+pymysql://", creator=lambda: pymysql.connect(database=MARIADB_DATABASE, **options, **connect)
    )


def test_connections_that_count_rows_changed_are_a_configuration_error_naming_the_fix(prefix: str) -> None:
    store = SQLStore(engine(charset="utf8mb4"), key_prefix=prefix)
    try:
        with pytest.raises(ConfigurationError, match="CLIENT.FOUND_ROWS"):
            store.get(Identity("", "t.sessions", "k"))
    finally:
        store.close()


def test_an_engine_of_the_callers_own_with_found_rows_answers_busy_and_liveness_right(prefix: str) -> None:
    found_rows = pymysql.constants.CLIENT.FOUND_ROWS
    store = SQLStore(engine(charset="utf8mb4", client_flag=found_rows), key_prefix=prefix)
    try:
        identity = Identity("", "t.sessions", "busy")
        task_id = str(uuid.uuid4())
        assert store.acquire(identity, FP, task_id, lease_seconds=60, ttl_seconds=60).decision is Decision.RUN
        later = store.acquire(identity, FP, task_id, lease_seconds=60, ttl_seconds=60, next_look_seconds=30)
        sooner = store.acquire(identity, FP, task_id, lease_seconds=60, ttl_seconds=60, next_look_seconds=1)
        assert (later.decision, sooner.decision) == (Decision.BUSY, Decision.BUSY)  # the mark does not move
        assert store.keep_alive("p-1", "tok", seconds=60, create=True).decision is Decision.OK
        assert store.keep_alive("p-1", "tok", seconds=5).decision is Decision.OK  # the expiry does not move
    finally:
        store.close()


def test_a_failure_with_any_character_is_stored_whatever_charset_the_driver_was_given(prefix: str) -> None:
    store = SQLStore(engine(charset="utf8", client_flag=pymysql.constants.CLIENT.FOUND_ROWS), key_prefix=prefix)
    try:
        identity = Identity("", "t.sessions", "emoji")
        taken = store.acquire(identity, FP, str(uuid.uuid4()), lease_seconds=60, ttl_seconds=60)
        assert taken.record is not None
        error = ErrorInfo(type="CardDeclined", module="shop", message="declined 💳", args=["💳"])
        assert store.fail(identity, taken.record.owner, error).decision is Decision.OK
        record = store.get(identity)
        assert record is not None and record.error is not None and record.error.message == "declined 💳"
    finally:
        store.close()


def test_a_callers_transaction_at_another_isolation_level_leaves_the_stores_sessions_read_committed(
    prefix: str,
) -> None:
    store = SQLStore.from_url(MARIADB_URL, key_prefix=prefix)
    try:
        store.get(Identity("", "t.sessions", "warm"))
        connections = [store.engine.connect() for _ in range(5)]
        for connection in connections:
            connection.execution_options(isolation_level="REPEATABLE READ").exec_driver_sql("SELECT 1")
            connection.commit()
        for connection in connections:
            connection.close()
        levels = set()
        held = [store.engine.connect() for _ in range(5)]
        for connection in held:
            levels.add(connection.exec_driver_sql("SELECT @@tx_isolation").scalar())
            connection.close()
        assert levels == {"READ-COMMITTED"}
    finally:
        store.close()


def test_children_forked_after_the_store_was_used_open_their_own_connections() -> None:
    """Found by the task-level model (a prefork worker on PostgreSQL whose children are recycled): two
    children forked after the parent's first store call shared its pooled connection, breaking it
    for all three; the parent's revoke hook then could not release a revoked call's claim."""
    require_server("postgresql")
    store = store_from_url(POSTGRES_URL, key_prefix=f"f{uuid.uuid4().hex[:10]}")
    try:
        store.ping()  # the parent's pool now holds a connection (a worker pings its store when ready)
        children = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                failed = 0
                for _ in range(100):
                    try:
                        store.ping()
                    except Exception:  # noqa: BLE001 - counted
                        failed += 1
                os._exit(min(failed, 100))
            children.append(pid)
        failures = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        assert failures == [0, 0], f"store calls failed in the children: {failures}"
        store.ping()  # and the parent's connection still works
    finally:
        store.close()
