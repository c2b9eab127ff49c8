"""The SQL store's connections: its own pool under its timeouts, and the database's clock.

On MySQL and MariaDB (through PyMySQL) every connection of the store's pool also reads time in UTC
(the clock below converts the server's local time to POSIX seconds: UTC has no hour that a DST
change repeats) and runs its transactions under READ COMMITTED (a locked read of a missing row then
takes no gap lock, so two claims of one new key queue on its insert instead of deadlocking).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import sqlalchemy as sa

from ...errors import ConfigurationError

__all__ = ["MYSQL", "engine_from_url", "private_engine", "server_clock"]

MYSQL = ("mysql", "mariadb")  # SQLAlchemy's dialect names for MySQL and MariaDB (mariadb+pymysql://)


def server_clock(dialect: str) -> sa.ColumnElement[float]:
    """The database's own time as POSIX seconds (fixed for one statement on every dialect)."""
    if dialect == "postgresql":
        return sa.cast(sa.extract("epoch", sa.func.now()), sa.Double)
    if dialect in MYSQL:
        # NOW(6) is the statement's start, to the microsecond; the session's time zone is UTC.
        return sa.cast(sa.func.unix_timestamp(sa.func.now(6)), sa.Double)
    # SQLite: julianday('now') is one value per statement; 2440587.5 is the Julian day of the epoch.
    return sa.cast((sa.func.julianday("now") - 2440587.5) * 86400.0, sa.Double)


READ_COMMITTED = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
_ISOLATION_CHANGED = "celery_idem_isolation_changed"


def _session_settings(dialect: str, timeout: float, mariadb: bool = False) -> list[str]:
    milliseconds = max(1, math.ceil(timeout * 1000))  # 0 would mean "no timeout" to both
    if dialect == "postgresql":
        return [f"SET statement_timeout = {milliseconds}", f"SET lock_timeout = {milliseconds}"]
    if dialect in MYSQL:
        seconds = max(1, math.ceil(timeout))  # InnoDB's lock wait is whole seconds, at least one
        return [
            READ_COMMITTED,
            # Whatever charset the driver was given (a Django alias's OPTIONS may say utf8, MySQL's
            # 3-byte one): the error text a failure stores may hold any character.
            "SET NAMES utf8mb4",
            "SET SESSION time_zone = '+00:00'",
            f"SET SESSION innodb_lock_wait_timeout = {seconds}",  # a row lock
            f"SET SESSION lock_wait_timeout = {seconds}",  # a table's metadata lock (DDL)
            # MariaDB bounds every statement; MySQL's own bound covers SELECTs only.
            f"SET SESSION max_statement_time = {milliseconds / 1000:.3f}"
            if mariadb
            else f"SET SESSION max_execution_time = {milliseconds}",
        ]
    return [f"PRAGMA busy_timeout = {milliseconds}"]


def private_engine(engine: sa.Engine, timeout: float) -> sa.Engine:
    """An engine of the store's own on the same database, in autocommit mode (one statement is one
    transaction), every connection of it under ``timeout``.

    Session settings on the caller's pool would leak into the caller's own sessions, so the store
    opens its own connections: ``Pool.recreate()`` keeps the creator (driver, connect arguments) and
    the pool's listeners, and a ``connect`` listener sets the timeouts once per connection. The
    engine itself is in autocommit mode: switching a pooled connection to it and back on every
    checkout (``execution_options``) cost about 130 µs of client CPU a statement.
    An in-memory SQLite database lives in its one pool, so that engine is shared as it is.
    """
    if engine.dialect.name == "sqlite" and engine.url.database in (None, "", ":memory:"):
        return engine.execution_options(isolation_level="AUTOCOMMIT")
    # A pooled connection is rolled back when it comes back: a round trip on PyMySQL, whose
    # rollback() always asks the server, for nothing in autocommit mode (the store's transactions
    # end themselves), so it is skipped there.
    skip = {"skip_autocommit_rollback": True} if engine.dialect.name in MYSQL else {}
    # hide_parameters: a statement's parameters (keys, stored calls) stay out of its errors' text.
    own = sa.create_engine(
        engine.url, pool=engine.pool.recreate(), isolation_level="AUTOCOMMIT", hide_parameters=True, **skip
    )
    dialect = engine.dialect.name

    @sa.event.listens_for(own.pool, "connect")
    def _timeouts(dbapi_connection: Any, _: Any) -> None:
        if dialect in MYSQL:
            _require_found_rows(dbapi_connection)
        mariadb = dialect in MYSQL and "mariadb" in str(dbapi_connection.get_server_info()).lower()
        cursor = dbapi_connection.cursor()
        for statement in _session_settings(dialect, timeout, mariadb):
            cursor.execute(statement)
        cursor.close()
        if engine.dialect.name == "postgresql":
            dbapi_connection.commit()  # SET in psycopg's implicit transaction lasts once committed

    if dialect in MYSQL:
        _keep_read_committed(own)
    # Disposing the caller's engine closes the store's connections too.
    sa.event.listen(engine, "engine_disposed", lambda _: own.dispose())
    return own


def _require_found_rows(dbapi_connection: Any) -> None:
    """The store judges a conditional write by the rows it matched; MySQL counts rows changed
    unless the connection asked for CLIENT_FOUND_ROWS (SQLAlchemy asks for it when it builds the
    connection; a ``creator`` or a ``client_flag`` of the caller's does not)."""
    from pymysql.constants import CLIENT  # type: ignore[import-untyped]

    flags = getattr(dbapi_connection, "client_flag", None)
    if flags is not None and not flags & CLIENT.FOUND_ROWS:
        raise ConfigurationError(
            "the SQL store's MySQL connections must count rows matched, not rows changed: open them "
            "with client_flag=pymysql.constants.CLIENT.FOUND_ROWS (in connect_args, or in your creator)"
        )


def _keep_read_committed(engine: sa.Engine) -> None:
    """A caller who opens a transaction of their own on ``store.engine`` at another isolation level
    changes the MySQL session, and returning the connection only turns autocommit back on: the
    store's session goes back to READ COMMITTED when that connection comes back to the pool."""

    @sa.event.listens_for(engine, "set_connection_execution_options")
    def _changed(connection: sa.Connection, options: dict[str, Any]) -> None:
        if "isolation_level" in options:
            connection.info[_ISOLATION_CHANGED] = True

    @sa.event.listens_for(engine, "engine_connect")
    def _connected(connection: sa.Connection) -> None:
        if connection.get_execution_options().get("isolation_level", "AUTOCOMMIT") != "AUTOCOMMIT":
            connection.info[_ISOLATION_CHANGED] = True  # an engine of execution_options(isolation_level=...)

    @sa.event.listens_for(engine.pool, "checkin")
    def _restored(dbapi_connection: Any, record: Any) -> None:
        if dbapi_connection is not None and record.info.pop(_ISOLATION_CHANGED, False):
            cursor = dbapi_connection.cursor()
            cursor.execute(READ_COMMITTED)
            cursor.close()


def engine_from_url(url: str | sa.URL, timeout: float, connect_args: dict[str, Any] | None = None) -> sa.Engine:
    """An engine for ``url`` (a string, or a URL object built part by part) with the store's pool and
    timeouts; ``connect_args`` adds the driver's own (a Django database's OPTIONS)."""
    extra = dict(connect_args or {})
    if isinstance(url, str):
        scheme, _, rest = url.partition("://")
        if scheme in ("postgresql", "postgres"):
            url = f"postgresql+psycopg://{rest}"  # psycopg 3 is the driver the `sql` extra installs
        elif scheme in MYSQL:
            url = f"mysql+pymysql://{rest}"  # PyMySQL, pure Python: the `mysql` extra installs it
    driver = url if isinstance(url, str) else url.drivername
    if driver.startswith(MYSQL):
        if importlib.util.find_spec("pymysql") is None:
            raise ConfigurationError("a mysql:// or mariadb:// store needs PyMySQL: pip install 'celery-idem[mysql]'")
        return sa.create_engine(
            url,
            hide_parameters=True,
            pool_size=10,
            max_overflow=20,
            pool_timeout=timeout,
            pool_recycle=3600,  # under the server's wait_timeout (8 hours), which closes idle connections
            connect_args={
                "connect_timeout": max(1, math.ceil(timeout)),
                # A server that accepts the connection and then says nothing: PyMySQL reads its
                # greeting with no deadline but this (the watchdog guards statements only). A
                # second past the server's own statement timeout, which answers first.
                "read_timeout": timeout + 1.0,
                "write_timeout": timeout + 1.0,
                "charset": "utf8mb4",
                **extra,
            },
        )
    if driver.startswith("postgresql"):
        return sa.create_engine(
            url,
            hide_parameters=True,
            pool_size=10,
            max_overflow=20,
            pool_timeout=timeout,
            connect_args={"connect_timeout": max(2, math.ceil(timeout)), **extra},  # libpq's minimum is 2 seconds
        )
    engine = sa.create_engine(
        url, hide_parameters=True, pool_timeout=timeout, connect_args={"timeout": timeout, **extra}
    )

    @sa.event.listens_for(engine, "connect")
    def _sqlite_wal(dbapi_connection: Any, _: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
        cursor.close()

    return engine
