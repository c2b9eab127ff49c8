"""SQLStore: one conditional statement per transition, on PostgreSQL (psycopg 3) and SQLite.

claim and acquire are one ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` each: every column
is set to ``CASE WHEN <the caller may take the record> THEN <new value> ELSE <old value> END``, so
the statement always returns the row as it stands after the decision, under the row lock, even
when a concurrent transaction inserted it after this one's snapshot. The caller took the record
exactly when the returned owner is its own fresh token. The fenced writes are ``UPDATE``/``DELETE
... WHERE owner = :token``, judged by their row count.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import ConfigurationError
from ..records import Decision, ErrorInfo, IdempotencyRecord, Identity, State, Transition
from .base import LOST, OK, UNSETTLED, Clock, Fence, Store, classify

try:
    import sqlalchemy as sa
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.dialects import postgresql, sqlite
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("SQLStore needs SQLAlchemy: pip install 'celery-idem[sql]'") from exc

__all__ = ["SQLStore", "records_table"]

T = TypeVar("T")
_UNSETTLED = [s.value for s in UNSETTLED]


def _one(result: sa.CursorResult[Any]) -> Any:
    return result.one()


def _one_or_none(result: sa.CursorResult[Any]) -> Any:
    return result.one_or_none()


def _all(result: sa.CursorResult[Any]) -> Sequence[Any]:
    return result.all()


def _rowcount(result: sa.CursorResult[Any]) -> int:
    return result.rowcount


# Both dialects' insert() has on_conflict_do_update and .excluded; the generic Insert has neither.
_INSERTS: dict[str, Callable[[sa.Table], Any]] = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


def records_table(metadata: sa.MetaData, name: str = "celery_idem_records") -> sa.Table:
    """The records table. ``namespace`` is the store's key_prefix, so apps can share one table."""
    return sa.Table(
        name,
        metadata,
        sa.Column("namespace", sa.String(64), primary_key=True),
        sa.Column("scope", sa.String(255), primary_key=True),
        sa.Column("task_name", sa.String(255), primary_key=True),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("lease_expires_at", sa.Double, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Column("ttl_seconds", sa.Double, nullable=False),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),
        sa.Column("content_encoding", sa.String(64), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        # The reconciler's index: unsettled records by lease expiry (settled rows hold NULL).
        sa.Index(f"ix_{name}_lease", "namespace", "lease_expires_at"),
        sa.Index(f"ix_{name}_expires", "expires_at"),
    )


def _engine_from_url(url: str, timeout: float) -> sa.Engine:
    scheme, _, rest = url.partition("://")
    if scheme in ("postgresql", "postgres"):
        url = f"postgresql+psycopg://{rest}"  # psycopg 3 is the driver the `sql` extra installs
    if url.startswith("postgresql"):
        return sa.create_engine(
            url,
            pool_size=10,
            max_overflow=20,
            pool_timeout=timeout,
            connect_args={
                "connect_timeout": max(2, math.ceil(timeout)),  # libpq's minimum is 2 seconds
                "options": f"-c statement_timeout={int(timeout * 1000)} -c lock_timeout={int(timeout * 1000)}",
            },
        )
    engine = sa.create_engine(url, pool_timeout=timeout, connect_args={"timeout": timeout})

    @sa.event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
        cursor.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
        cursor.close()

    return engine


class SQLStore(Store):
    """Records as rows of ``celery_idem_records``; the table is created on first use.

    Args:
        engine: A SQLAlchemy engine on PostgreSQL or SQLite (or build one with :meth:`from_url`).
        table_name: The records table.
    """

    _unavailable = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table_name: str = "celery_idem_records",
        key_prefix: str = "idem",
        timeout_seconds: float = 2.0,
        max_result_bytes: int = 1_048_576,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            key_prefix=key_prefix, timeout_seconds=timeout_seconds, max_result_bytes=max_result_bytes, clock=clock
        )
        if engine.dialect.name not in _INSERTS:
            raise ConfigurationError(f"SQLStore runs on PostgreSQL and SQLite; got the {engine.dialect.name!r} dialect")
        if len(key_prefix) > 64:
            raise ConfigurationError(f"key_prefix must be at most 64 characters for SQLStore; got {len(key_prefix)}")
        self.engine = engine
        self.metadata = sa.MetaData()
        self.table = records_table(self.metadata, table_name)
        self._insert = _INSERTS[engine.dialect.name]
        self._schema_ready = False
        self._schema_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLStore:
        """``postgresql+psycopg://...`` (``postgresql://`` too) or ``sqlite:///path``."""
        engine = _engine_from_url(url, float(options.get("timeout_seconds", 2.0)))
        return cls(engine, **options)

    def create_schema(self) -> None:
        """Create the table and its indexes if they are missing (safe to call from many processes)."""
        with self._guard("create_schema"):
            try:
                self.metadata.create_all(self.engine, checkfirst=True)
            except sa_exc.DBAPIError:
                # Another process created it between our check and our CREATE ("already exists":
                # IntegrityError on PostgreSQL, OperationalError on SQLite). Check again; a real
                # failure fails the second time too.
                self.metadata.create_all(self.engine, checkfirst=True)
        self._schema_ready = True

    def _ensure_schema(self) -> None:
        if not self._schema_ready:
            with self._schema_lock:
                if not self._schema_ready:
                    self.create_schema()

    def _pk(self, identity: Identity) -> sa.ColumnElement[bool]:
        c = self.table.c
        return sa.and_(
            c.namespace == self.key_prefix,
            c.scope == identity.scope,
            c.task_name == identity.task_name,
            c.key == identity.key,
        )

    def _record(self, row: Any) -> IdempotencyRecord:
        return IdempotencyRecord(
            key=row.key,
            scope=row.scope,
            task_name=row.task_name,
            fingerprint=row.fingerprint,
            state=State(row.state),
            task_id=row.task_id,
            owner=row.owner,
            attempt=row.attempt,
            lease_expires_at=row.lease_expires_at,
            created_at=row.created_at,
            updated_at=row.updated_at,
            expires_at=row.expires_at,
            ttl_seconds=row.ttl_seconds,
            result=bytes(row.result) if row.result is not None else None,
            content_type=row.content_type,
            content_encoding=row.content_encoding,
            error=ErrorInfo.model_validate_json(row.error) if row.error else None,
        )

    def _execute(self, statement: sa.Executable, fetch: Callable[[sa.CursorResult[Any]], T]) -> T:
        """Run one statement in its own transaction and read its answer before the commit."""
        self._ensure_schema()
        with self.engine.begin() as connection:
            return fetch(connection.execute(statement))

    # ---- take-or-read: claim and acquire ------------------------------------------------------

    def _upsert(
        self,
        identity: Identity,
        values: dict[str, Any],
        take: sa.ColumnElement[bool],
        special: dict[str, sa.ColumnElement[Any]],
    ) -> IdempotencyRecord:
        t = self.table
        insert = self._insert(t).values(
            namespace=self.key_prefix,
            scope=identity.scope,
            task_name=identity.task_name,
            key=identity.key,
            result=None,
            content_type=None,
            content_encoding=None,
            error=None,
            **values,
        )
        changes: dict[str, Any] = {
            name: sa.case((take, insert.excluded[name]), else_=t.c[name])
            for name in (*values, "result", "content_type", "content_encoding", "error")
        }
        changes.update(special)
        statement = insert.on_conflict_do_update(
            index_elements=[t.c.namespace, t.c.scope, t.c.task_name, t.c.key], set_=changes
        ).returning(*t.c)
        return self._record(self._execute(statement, _one))

    def _claim(
        self, identity: Identity, fingerprint: str, task_id: str, owner: str, lease: float, ttl: float
    ) -> Transition:
        now, c = self.clock(), self.table.c
        take = sa.or_(
            c.expires_at <= now,
            sa.and_(c.fingerprint == fingerprint, c.state.in_(_UNSETTLED), c.lease_expires_at <= now),
        )
        record = self._upsert(
            identity,
            dict(
                fingerprint=fingerprint,
                state=State.PENDING.value,
                task_id=task_id,
                owner=owner,
                attempt=0,
                lease_expires_at=now + lease,
                created_at=now,
                updated_at=now,
                expires_at=now + lease + ttl,
                ttl_seconds=ttl,
            ),
            take,
            {},
        )
        if record.owner == owner:
            return Transition(Decision.NEW, record)
        return Transition(classify(record, fingerprint, now=now, claiming=True, task_id=task_id), record)

    def _acquire(
        self, identity: Identity, fingerprint: str, task_id: str, owner: str, lease: float, ttl: float
    ) -> Transition:
        now, c = self.clock(), self.table.c
        absent = c.expires_at <= now
        runnable = sa.or_(
            c.state == State.PENDING.value,
            sa.and_(c.state == State.IN_PROGRESS.value, c.lease_expires_at <= now),
        )
        take = sa.or_(absent, sa.and_(sa.or_(c.fingerprint == fingerprint, c.task_id == task_id), runnable))
        record = self._upsert(
            identity,
            dict(
                fingerprint=fingerprint,
                state=State.IN_PROGRESS.value,
                task_id=task_id,
                owner=owner,
                attempt=1,
                lease_expires_at=now + lease,
                created_at=now,
                updated_at=now,
                expires_at=now + lease + ttl,
                ttl_seconds=ttl,
            ),
            take,
            {
                # A retry of the same chain keeps the caller's fingerprint and counts the attempt.
                "fingerprint": sa.case((absent, fingerprint), else_=c.fingerprint),
                "created_at": sa.case((absent, now), else_=c.created_at),
                "attempt": sa.case((absent, 1), (take, c.attempt + 1), else_=c.attempt),
            },
        )
        if record.owner == owner:
            return Transition(Decision.RUN, record)
        return Transition(classify(record, fingerprint, now=now, claiming=False, task_id=task_id), record)

    # ---- fenced writes --------------------------------------------------------------------------

    def _owned(self, identity: Identity, fence: Fence, token: str, now: float) -> sa.ColumnElement[bool]:
        c = self.table.c
        return sa.and_(self._pk(identity), c[fence] == token, c.state.in_(_UNSETTLED), c.expires_at > now)

    def _settle(
        self,
        identity: Identity,
        fence: Fence,
        token: str,
        state: State,
        result: bytes | None,
        content_type: str | None,
        content_encoding: str | None,
        error: ErrorInfo | None,
    ) -> Transition:
        now, c = self.clock(), self.table.c
        statement = (
            sa.update(self.table)
            .where(self._owned(identity, fence, token, now))
            .values(
                state=state.value,
                result=result,
                content_type=content_type,
                content_encoding=content_encoding,
                error=error.model_dump_json() if error else None,
                lease_expires_at=None,
                updated_at=now,
                expires_at=now + c.ttl_seconds,
            )
        )
        return OK if self._execute(statement, _rowcount) == 1 else LOST

    def _release(
        self, identity: Identity, fence: Fence, token: str, lease: float | None, new_owner: str, expired_only: bool
    ) -> Transition:
        now, c = self.clock(), self.table.c
        where = self._owned(identity, fence, token, now)
        if expired_only:
            where = sa.and_(where, c.lease_expires_at <= now)
        statement: sa.Executable
        if lease is None:
            statement = sa.delete(self.table).where(where)
        else:
            statement = (
                sa.update(self.table)
                .where(where)
                .values(
                    state=State.PENDING.value,
                    owner=new_owner,
                    lease_expires_at=now + lease,
                    updated_at=now,
                    expires_at=now + lease + c.ttl_seconds,
                )
            )
        return OK if self._execute(statement, _rowcount) == 1 else LOST

    def _renew(self, identity: Identity, token: str, lease: float) -> Transition:
        now, c = self.clock(), self.table.c
        statement = (
            sa.update(self.table)
            .where(self._owned(identity, "owner", token, now), c.state == State.IN_PROGRESS.value)
            .values(lease_expires_at=now + lease, updated_at=now, expires_at=now + lease + c.ttl_seconds)
        )
        return OK if self._execute(statement, _rowcount) == 1 else LOST

    # ---- reads ------------------------------------------------------------------------------------

    def _get(self, identity: Identity) -> IdempotencyRecord | None:
        statement = sa.select(self.table).where(self._pk(identity), self.table.c.expires_at > self.clock())
        row = self._execute(statement, _one_or_none)
        return None if row is None else self._record(row)

    def _forget(self, identity: Identity) -> bool:
        now = self.clock()
        statement = sa.delete(self.table).where(self._pk(identity)).returning(self.table.c.expires_at)
        rows = self._execute(statement, _all)
        return any(row.expires_at > now for row in rows)

    def _expired_leases(self, limit: int) -> list[IdempotencyRecord]:
        now, c = self.clock(), self.table.c
        statement = (
            sa.select(self.table)
            .where(c.namespace == self.key_prefix, c.lease_expires_at <= now, c.state.in_(_UNSETTLED))
            .where(c.expires_at > now)
            .order_by(c.lease_expires_at)
            .limit(limit)
        )
        return [self._record(row) for row in self._execute(statement, _all)]

    def _ping(self) -> None:
        self._execute(sa.select(1), _one)

    def close(self) -> None:
        self.engine.dispose()
