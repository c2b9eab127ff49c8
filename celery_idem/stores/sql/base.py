"""What the SQL store stands on: its private pool, what the database's errors mean, running one
prebuilt statement, its parameters and clock, its schema, and reading a row back as a record.

Time is the database's: every statement reads the server clock itself (``:p_now`` is NULL unless a
test injected a clock; a test that shifts the clock adds ``:p_shift`` to it), so clients whose
clocks disagree still agree on every lease and expiry.
The store runs on a private pool derived from the engine it is given, whose connections carry its
timeouts (statement and lock timeouts on PostgreSQL and MySQL/MariaDB, the busy timeout on SQLite);
the caller's own sessions on that engine are untouched.

On MySQL/MariaDB a transition may be a :class:`~celery_idem.stores.sql.locked.Locked`
transaction: it is run whole again when InnoDB picks it as a deadlock's victim (InnoDB rolled all of
it back) or when its insert lost the race for a new key to another one (it then finds that row), a
few times; past that it is an outage, never an answer.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from ...errors import ConfigurationError
from ...records import ErrorInfo, IdempotencyRecord, Identity
from ..base import Store
from ..deadline import Watchdog, socket_of
from ..spi import Clock
from . import codec
from .engine import MYSQL, private_engine, server_clock
from .locked import Answer, Locked, mysql_code, run_locked
from .migrate import upgrade_layout
from .schema import add_columns, create_all, liveness_table, records_table
from .statements import INSERTS, Statements

__all__ = ["JOINED", "SQLBase", "one", "one_or_none", "rowcount", "rows"]

T = TypeVar("T")

_WATCHDOG = Watchdog()
_DEADLINE_MARGIN_SECONDS = 1.0  # past the server's own statement/lock timeout, which answers first
_TRIES = 5  # runs of one statement or Locked transaction that InnoDB may roll back (see the docstring)
# MySQL/MariaDB error codes
_DEADLOCK, _DUPLICATE_KEY, _UNKNOWN_DATABASE, _ACCESS_DENIED = 1213, 1062, 1049, 1045
_MYSQL_READ_ONLY = (1290, 1792)  # --read-only server; a READ ONLY transaction


JOINED: ContextVar[Callable[[sa.Executable, dict[str, Any]], Answer] | None] = ContextVar(
    "celery_idem_sql_joined", default=None
)
"""Set around one store call that runs in a transaction the caller holds, on the caller's own
connection (the ``django://`` store's claim at staging, :mod:`celery_idem.contrib.django.store`):
how that connection runs a statement. Its statements then commit or roll back with the caller's."""


# How a statement's answer is read (the ``fetch`` of :meth:`SQLBase._run`).


def _own_pool_after_fork(ref: weakref.ref[SQLBase]) -> None:
    """In a forked child: forget the parent's pooled connections without closing them (they are the
    parent's; SQLAlchemy's recipe for os.fork), so the child opens its own."""
    store = ref()
    if store is not None:
        store.engine.dispose(close=False)


def one(result: Answer) -> Any:
    return result.one()


def one_or_none(result: Answer) -> Any:
    return result.one_or_none()


def rows(result: Answer) -> Sequence[Any]:
    return result.all()


def rowcount(result: Answer) -> int:
    return result.rowcount


class SQLBase(Statements, Store):
    """What :class:`~celery_idem.stores.sql.SQLStore` (which documents the arguments) runs its
    statements on: its pool, what the database's errors mean, its parameters, clock and schema."""

    _unavailable = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)
    # A hot standby (or default_transaction_read_only) refuses writes with SQLSTATE 25006, which
    # psycopg classes an InternalError: the store is up but cannot take writes, an outage.
    _READ_ONLY_SQLSTATE = "25006"

    @classmethod
    def _is_mistake(cls, exc: Exception) -> bool:
        # create_engine's verdict on a URL it cannot read (sqlite://relative.db, an unknown driver)
        return isinstance(exc, sa_exc.ArgumentError) or super()._is_mistake(exc)

    @classmethod
    def _misconfiguration(cls, exc: Exception) -> str | None:
        # PostgreSQL refuses the connection (SQLSTATE 3D000, 28000), MySQL/MariaDB too (1049: unknown
        # database): no waiting creates them.
        text = str(getattr(exc, "orig", None) or exc)
        if not isinstance(exc, sa_exc.DBAPIError):
            return None
        if re.search(r'database "[^"]*" does not exist', text) or mysql_code(exc) == _UNKNOWN_DATABASE:
            return "create the database (CREATE DATABASE ...) or name an existing one in the URL"
        if re.search(r'role "[^"]*" does not exist', text):
            return "create the role (CREATE ROLE ... LOGIN) or name an existing user in the URL"
        return None

    @classmethod
    def _is_outage(cls, exc: Exception) -> bool:
        if isinstance(exc, sa_exc.InternalError) and getattr(exc.orig, "sqlstate", None) == cls._READ_ONLY_SQLSTATE:
            return True
        if "password authentication failed" in str(exc) or mysql_code(exc) == _ACCESS_DENIED:
            return False  # an OperationalError by class, a wrong password by nature (as on Redis): a surprise
        if mysql_code(exc) in _MYSQL_READ_ONLY:
            return True  # the server or its transaction takes no writes (a replica): an outage, as on PostgreSQL
        return super()._is_outage(exc)

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table_name: str = "celery_idem_records",
        liveness_table_name: str = "celery_idem_liveness",
        key_prefix: str = "idem",
        timeout_seconds: float = 2.0,
        max_result_bytes: int = 1_048_576,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            key_prefix=key_prefix, timeout_seconds=timeout_seconds, max_result_bytes=max_result_bytes, clock=clock
        )
        if engine.dialect.name not in INSERTS:
            raise ConfigurationError(
                f"SQLStore runs on PostgreSQL, SQLite, MySQL and MariaDB; got the {engine.dialect.name!r} dialect"
            )
        if len(key_prefix) > 64:
            raise ConfigurationError(f"key_prefix must be at most 64 characters for SQLStore; got {len(key_prefix)}")
        self.engine = private_engine(engine, self.timeout_seconds)  # in autocommit mode
        # A process forked after this one used the store (a prefork pool's child, started when one is
        # recycled or killed) must not share its pooled connections: two processes on one socket
        # break it for both (the parent's revoke and kill hooks then fail). It starts a pool of its own.
        os.register_at_fork(after_in_child=functools.partial(_own_pool_after_fork, weakref.ref(self)))
        self._deadline = self.timeout_seconds + _DEADLINE_MARGIN_SECONDS
        self.metadata = sa.MetaData()
        self.table = records_table(self.metadata, table_name)
        self.liveness = liveness_table(self.metadata, liveness_table_name)
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        # The injected clock when there is one, else the database's clock, in every statement.
        self._now = sa.func.coalesce(sa.bindparam("p_now", type_=sa.Double), server_clock(engine.dialect.name))
        self._shifting = False  # tests only: whether the statements add :p_shift to the server clock
        self._build_statements(engine.dialect.name)

    def advance_clock_for_tests(self, seconds: float) -> None:
        if not self._shifting and not self._injected_clock:
            # Production statements never carry the shift: it is built in on a test's first call.
            server = server_clock(self.engine.dialect.name) + sa.bindparam("p_shift", type_=sa.Double)
            self._now = sa.func.coalesce(sa.bindparam("p_now", type_=sa.Double), server)
            self._build_statements(self.engine.dialect.name)
            self._shifting = True
        super().advance_clock_for_tests(seconds)

    def create_schema(self) -> None:
        """Create the table and its indexes if they are missing, move a table an older celery-idem
        made to this release's layout (:mod:`~celery_idem.stores.sql.migrate`), and add the nullable
        columns a newer celery-idem brought to an older table (safe to call from many processes)."""
        with self._guard("create_schema"):
            # Created first, then moved: a process of the older release that creates its layout in
            # between (on an empty database) makes ours find layout 1 and move it.
            create_all(self.metadata, self.engine)
            upgrade_layout(self.engine, self.table, self.timeout_seconds, self._watched)
            self._add_missing_columns()
        self._schema_ready = True

    def _watched(self, connection: sa.Connection, seconds: float) -> AbstractContextManager[None]:
        """The watchdog on ``connection`` for ``seconds`` (and its margin past the server's timeout)."""
        return _WATCHDOG.guard(socket_of(connection), seconds + _DEADLINE_MARGIN_SECONDS)

    def _add_missing_columns(self) -> None:
        dialect = self.engine.dialect
        nullable = {
            column.name: column.type.compile(dialect=dialect) for column in self.table.columns if column.nullable
        }
        add_columns(self.engine, self.table.name, nullable)

    def _run(self, statement: sa.Executable | Locked, params: dict[str, Any], fetch: Callable[[Answer], T]) -> T:
        """Run one prebuilt statement (autocommit: one transaction, one round trip), or a Locked
        transaction, and read its answer."""
        if not self._schema_ready:
            # Another thread of this process may be moving a large table: waiting for it is bounded
            # like any store call (an outage, tried again), never the length of the move.
            if not self._schema_lock.acquire(timeout=self.timeout_seconds):
                raise sa_exc.TimeoutError("another thread of this process is still creating or moving the schema")
            try:
                if not self._schema_ready:
                    self.create_schema()
            finally:
                self._schema_lock.release()
        joined = JOINED.get()
        if joined is not None and not isinstance(statement, Locked):
            return fetch(joined(statement, params))
        for tries_left in range(_TRIES - 1, -1, -1):
            try:
                with self.engine.connect() as connection, _WATCHDOG.guard(socket_of(connection), self._deadline):
                    if isinstance(statement, Locked):
                        return fetch(run_locked(connection, statement, params))
                    return fetch(connection.execute(statement, params))
            except sa_exc.DBAPIError as exc:
                if not tries_left or not self._run_again(exc, statement):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover - the last try returns or raises

    def _run_again(self, exc: sa_exc.DBAPIError, statement: sa.Executable | Locked) -> bool:
        """Whether a statement that failed with ``exc`` is run again: on MySQL/MariaDB, one InnoDB
        rolled back whole as a deadlock's victim, or a Locked insert that another insert of the
        same key beat (run again, the transaction finds and locks that row)."""
        if self.engine.dialect.name not in MYSQL:
            return False
        code = mysql_code(exc)
        return code == _DEADLOCK or (code == _DUPLICATE_KEY and isinstance(statement, Locked))

    def _clock_params(self) -> dict[str, float | None]:
        """``:p_now`` of a statement: the injected clock's time, or NULL for the database's own
        (plus ``:p_shift``, the test-only shift of the database's clock, once a test set one)."""
        if self._injected_clock:
            return {"p_now": self._clock_now()}
        return {"p_now": None, "p_shift": self._time_offset} if self._shifting else {"p_now": None}

    def _params(self, identity: Identity, **more: Any) -> dict[str, Any]:
        scope, task_name, key = identity
        row_id = codec.identity_id(self.key_prefix, scope, task_name, key)
        named = {"id": row_id, "ns": self.key_prefix, "scope": scope, "task_name": task_name, "key": key, **more}
        return {f"p_{name}": value for name, value in named.items()} | self._clock_params()

    def _record(self, row: Any) -> IdempotencyRecord:
        return IdempotencyRecord(
            key=row.key,
            scope=row.scope,
            task_name=row.task_name,
            fingerprint=codec.FINGERPRINT.unpack(row.fingerprint),
            state=codec.state_of(row.state_code),
            task_id=codec.TASK_ID.unpack(row.task_id),
            owner=codec.OWNER.unpack(row.owner),
            attempt=row.attempt,
            lease_expires_at=row.lease_expires_at,
            created_at=row.created_at,
            updated_at=row.updated_at,
            expires_at=row.expires_at,
            ttl_seconds=row.ttl_seconds,
            result=bytes(row.result) if row.result is not None else None,
            content_type=codec.read_content_type(row.content_type, row.result),
            content_encoding=codec.read_content_encoding(row.content_encoding, row.result),
            error=ErrorInfo.model_validate_json(row.error) if row.error else None,
            call=bytes(row.call) if row.call is not None else None,
            previous_task_id=codec.TASK_ID.unpack_optional(row.previous_task_id),
        )

    def _server_now(self) -> float:
        if self._injected_clock:
            return self._clock_now()
        return float(self._run(self._now_sql, self._clock_params(), one)[0])

    def _ping(self) -> None:
        with self.engine.connect() as connection, _WATCHDOG.guard(socket_of(connection), self._deadline):
            connection.execute(sa.select(1)).one()

    def close(self) -> None:
        self.engine.dispose()
