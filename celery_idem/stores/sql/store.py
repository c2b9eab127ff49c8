"""SQLStore: one conditional statement per transition, on PostgreSQL (psycopg 3) and SQLite.

Every statement is built once, with bind parameters, and runs in autocommit mode: one statement is
one transaction and one round trip.

- claim and acquire: ``INSERT ... ON CONFLICT DO UPDATE SET ... WHERE <the caller may take the
  record> RETURNING``. A returned row means the caller took the record (NEW / RUN) in that one
  atomic statement. No row means the record is held: it is then read, and the decision
  (DUPLICATE, REPLAY, MISMATCH, BUSY) is named from it. A duplicate writes nothing.
- complete, fail, release, renew: ``UPDATE``/``DELETE ... WHERE owner = :token AND state IN
  (unsettled)``, judged by the row count.
- acquire's BUSY answer is itself a write: ``UPDATE ... SET linger_until WHERE <held by a live
  attempt of this call> RETURNING``, so the waiter's mark lands on exactly the record judged BUSY.

Time is the database's: every statement reads the server clock itself (``:p_now`` is NULL unless a
test injected a clock; a test that shifts the clock adds ``:p_shift`` to it), so clients whose
clocks disagree still agree on every lease and expiry.
The store runs on a private pool derived from the engine it is given, whose connections carry its
timeouts (statement and lock timeouts on PostgreSQL, the busy timeout on SQLite); the caller's own
sessions on that engine are untouched.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ...errors import ConfigurationError
from ...records import Decision, ErrorInfo, IdempotencyRecord, Identity, State, Transition
from ..base import Store
from ..deadline import Watchdog, socket_of
from ..rules import LOST, OK, UNSETTLED, classify
from ..spi import Clock, Fence, Settlement
from .engine import engine_from_url, private_engine, server_clock
from .schema import DATA, TIMES, add_columns, create_all, liveness_table, records_table

try:
    import sqlalchemy as sa
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.dialects import postgresql, sqlite
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("SQLStore needs SQLAlchemy: pip install 'celery-idem[sql]'") from exc

__all__ = ["SQLStore"]

T = TypeVar("T")

_WATCHDOG = Watchdog()
_DEADLINE_MARGIN_SECONDS = 1.0  # past the server's own statement/lock timeout, which answers first
_UNSETTLED = [s.value for s in UNSETTLED]
# Both dialects' insert() has on_conflict_do_update and .excluded; the generic Insert has neither.
_INSERTS: dict[str, Callable[[sa.Table], Any]] = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
_TAKE_TRIES = 5  # a held record that frees itself between our upsert and our read is taken on a retry


def _one(result: sa.CursorResult[Any]) -> Any:
    return result.one()


def _one_or_none(result: sa.CursorResult[Any]) -> Any:
    return result.one_or_none()


def _all(result: sa.CursorResult[Any]) -> Sequence[Any]:
    return result.all()


def _rowcount(result: sa.CursorResult[Any]) -> int:
    return result.rowcount


def _takeable(record: IdempotencyRecord, now: float | None, claiming: bool) -> bool:
    """Whether the upsert should be tried again on a record read after it declined: the record
    changed in between to one the operation may take (acquire takes any PENDING record, e.g. one a
    Celery retry just released; both take a lease that had run out at ``now``, the database's time
    of the read)."""
    if not claiming and record.state is State.PENDING:
        return True
    if now is None or record.lease_expires_at is None or record.lease_expires_at > now:
        return False
    return record.state is State.IN_PROGRESS or record.state is State.PENDING


class SQLStore(Store):
    """Records as rows of ``celery_idem_records``; the table is created on first use.

    Args:
        engine: A SQLAlchemy engine on PostgreSQL or SQLite (or build one with :meth:`from_url`).
            The store runs its statements in autocommit mode on a private pool derived from it,
            whose connections honour ``timeout_seconds``; ``store.engine`` is that private engine.
        table_name: The records table.
        liveness_table_name: The worker processes' liveness table.
    """

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
        # PostgreSQL refuses the connection (SQLSTATE 3D000, 28000): no waiting creates them.
        text = str(getattr(exc, "orig", None) or exc)
        if not isinstance(exc, sa_exc.DBAPIError):
            return None
        if re.search(r'database "[^"]*" does not exist', text):
            return "create the database (CREATE DATABASE ...) or name an existing one in the URL"
        if re.search(r'role "[^"]*" does not exist', text):
            return "create the role (CREATE ROLE ... LOGIN) or name an existing user in the URL"
        return None

    @classmethod
    def _is_outage(cls, exc: Exception) -> bool:
        if isinstance(exc, sa_exc.InternalError) and getattr(exc.orig, "sqlstate", None) == cls._READ_ONLY_SQLSTATE:
            return True
        if "password authentication failed" in str(exc):
            return False  # an OperationalError by class, a wrong password by nature (as on Redis): a surprise
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
        if engine.dialect.name not in _INSERTS:
            raise ConfigurationError(f"SQLStore runs on PostgreSQL and SQLite; got the {engine.dialect.name!r} dialect")
        if len(key_prefix) > 64:
            raise ConfigurationError(f"key_prefix must be at most 64 characters for SQLStore; got {len(key_prefix)}")
        self.engine = private_engine(engine, self.timeout_seconds)
        self._deadline = self.timeout_seconds + _DEADLINE_MARGIN_SECONDS
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self.metadata = sa.MetaData()
        self.table = records_table(self.metadata, table_name)
        self.liveness = liveness_table(self.metadata, liveness_table_name)
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        # The injected clock when there is one, else the database's clock, in every statement.
        self._now = sa.func.coalesce(sa.bindparam("p_now", type_=sa.Double), server_clock(engine.dialect.name))
        self._shifting = False  # tests only: whether the statements add :p_shift to the server clock
        self._build_statements(_INSERTS[engine.dialect.name])

    def advance_clock_for_tests(self, seconds: float) -> None:
        if not self._shifting and not self._injected_clock:
            # Production statements never carry the shift: it is built in on a test's first call.
            server = server_clock(self.engine.dialect.name) + sa.bindparam("p_shift", type_=sa.Double)
            self._now = sa.func.coalesce(sa.bindparam("p_now", type_=sa.Double), server)
            self._build_statements(_INSERTS[self.engine.dialect.name])
            self._shifting = True
        super().advance_clock_for_tests(seconds)

    def _build_statements(self, insert: Callable[[sa.Table], Any]) -> None:
        t, c, now = self.table, self.table.c, self._now

        def p(name: str) -> sa.BindParameter[Any]:
            # Parameters are prefixed: SQLAlchemy reserves column names for INSERT/UPDATE values.
            return sa.bindparam(f"p_{name}")

        pk = sa.and_(c.namespace == p("ns"), c.scope == p("scope"), c.task_name == p("task_name"), c.key == p("key"))
        unsettled = c.state.in_(_UNSETTLED)
        absent = c.expires_at <= now

        def upsert(take: sa.ColumnElement[bool], special: dict[str, Any]) -> sa.Executable:
            times = {
                "lease_expires_at": now + p("lease"),
                "created_at": now,
                "updated_at": now,
                "expires_at": now + p("lease") + p("ttl_seconds"),
            }
            ins = insert(t).values(
                namespace=p("ns"),
                scope=p("scope"),
                task_name=p("task_name"),
                key=p("key"),
                **{name: p(name) for name in DATA},
                **times,
            )
            # A takeover keeps the task id of the attempt it takes (stores/rules.py: taken_over).
            previous = sa.case(
                (absent, None), (c.state == State.IN_PROGRESS.value, c.task_id), else_=c.previous_task_id
            )
            changes = {name: ins.excluded[name] for name in (*DATA, *TIMES)} | {"previous_task_id": previous}
            # A live record keeps a BUSY waiter's mark whoever takes it over; an absent one has none.
            changes["linger_until"] = sa.case((absent, sa.null()), else_=c.linger_until)
            statement: sa.Executable = ins.on_conflict_do_update(
                index_elements=[c.namespace, c.scope, c.task_name, c.key], set_=changes | special, where=take
            ).returning(c.fingerprint, c.attempt, c.call, c.previous_task_id, *(c[name] for name in TIMES))
            return statement

        # claim takes an absent record, or one whose lease ran out under the same fingerprint.
        self._claim_sql = upsert(
            sa.or_(absent, sa.and_(c.fingerprint == p("fingerprint"), unsettled, c.lease_expires_at <= now)), {}
        )
        # acquire takes an absent record, a PENDING one, or an IN_PROGRESS one whose lease ran out,
        # if it is the same call or the same attempt chain (a Celery retry under the record's task
        # id); the chain keeps the caller's fingerprint and counts its attempts.
        runnable = sa.or_(
            c.state == State.PENDING.value, sa.and_(c.state == State.IN_PROGRESS.value, c.lease_expires_at <= now)
        )
        retry = sa.bindparam("p_retry", type_=sa.Integer)
        chain = sa.and_(retry == 1, c.task_id == p("task_id"), c.attempt > 0)  # no retry before an attempt ran
        same = sa.or_(c.fingerprint == p("fingerprint"), chain)
        self._acquire_sql = upsert(
            sa.or_(absent, sa.and_(same, runnable)),
            {
                "fingerprint": sa.case((absent, p("fingerprint")), else_=c.fingerprint),
                "created_at": sa.case((absent, now), else_=c.created_at),
                "attempt": sa.case((absent, 1), else_=c.attempt + 1),
                # An absent (expired) record's call belongs to another call: never inherited.
                "call": sa.case((absent, p("call")), else_=sa.func.coalesce(p("call"), c.call)),
            },
        )
        # BUSY: a live attempt of this call (or chain) holds the record. Marked in the same statement
        # that judges it so, with when the waiter will have looked again by; the mark only grows.
        look = now + p("next_look")
        self._busy_sql = (
            sa.update(t)
            .where(pk, c.expires_at > now, c.state == State.IN_PROGRESS.value, c.lease_expires_at > now, same)
            .values(linger_until=sa.case((sa.func.coalesce(c.linger_until, 0.0) > look, c.linger_until), else_=look))
            .returning(*t.c)
        )
        # A read carries the database's time, so a held record is judged by the same clock.
        self._get_sql = sa.select(t, now.label("db_now")).where(pk, c.expires_at > now)

        expired_lease = c.lease_expires_at <= now

        def owned(fence: str) -> sa.ColumnElement[bool]:
            held = sa.and_(pk, c[fence] == p("token"), unsettled, c.expires_at > now)
            if fence == "task_id":
                # The task id frees only what that delivery may still hold: a claim, or an attempt
                # past its lease. A live attempt under the same id is a copy running elsewhere.
                return sa.and_(held, sa.or_(c.state == State.PENDING.value, expired_lease))
            return held

        self._settle_sql = (
            sa.update(t)
            .where(owned("owner"))
            .values(
                state=p("state"),
                result=p("result"),
                content_type=p("content_type"),
                content_encoding=p("content_encoding"),
                error=p("error"),
                lease_expires_at=None,
                updated_at=now,
                expires_at=sa.case(
                    (sa.func.coalesce(c.linger_until, 0.0) > now + c.ttl_seconds, c.linger_until),
                    else_=now + c.ttl_seconds,
                ),  # never before a BUSY waiter's next look
            )
        )
        only_expired = sa.or_(sa.not_(p("expired_only")), expired_lease)
        self._delete_sql = {fence: sa.delete(t).where(owned(fence), only_expired) for fence in ("owner", "task_id")}
        self._pending_sql = {
            fence: sa.update(t)
            .where(owned(fence), only_expired)
            .values(
                state=State.PENDING.value,
                owner=p("new_owner"),
                lease_expires_at=now + p("lease"),
                updated_at=now,
                expires_at=now + p("lease") + c.ttl_seconds,
            )
            for fence in ("owner", "task_id")
        }
        # A renewal extends the lease, never shortens it (a late beat must not undo a longer lease).
        renewed = sa.case((c.lease_expires_at > now + p("lease"), c.lease_expires_at), else_=now + p("lease"))
        self._renew_sql = (
            sa.update(t)
            .where(owned("owner"), c.state == State.IN_PROGRESS.value)
            .values(lease_expires_at=renewed, updated_at=now, expires_at=renewed + c.ttl_seconds)
        )
        self._hand_over_sql = (
            sa.update(t)
            .where(owned("owner"), c.state == State.IN_PROGRESS.value)
            .values(
                owner=p("new_owner"),
                lease_expires_at=now + p("lease"),
                updated_at=now,
                expires_at=now + p("lease") + c.ttl_seconds,
            )
        )
        self._forget_sql = sa.delete(t).where(pk).returning((c.expires_at > now).label("live"))
        self._due_sql = (
            sa.select(t)
            .where(c.namespace == p("ns"), expired_lease, unsettled, c.expires_at > now)
            .order_by(c.lease_expires_at)
            .limit(p("limit"))
        )
        # The expiry is checked on the DELETE itself, not only in the subquery: under READ COMMITTED
        # PostgreSQL re-checks the DELETE's own condition on a row it waited for, so a row that a
        # claim or acquire revived meanwhile is kept.
        expired = sa.and_(c.namespace == p("ns"), c.expires_at <= now)
        doomed = sa.select(c.namespace, c.scope, c.task_name, c.key).where(expired).limit(p("limit"))
        self._purge_sql = sa.delete(t).where(expired, sa.tuple_(c.namespace, c.scope, c.task_name, c.key).in_(doomed))
        self._now_sql = sa.select(now)
        self._build_liveness_statements(insert)

    def _build_liveness_statements(self, insert: Callable[[sa.Table], Any]) -> None:
        t, c, now = self.liveness, self.liveness.c, self._now
        mine = sa.and_(c.namespace == sa.bindparam("p_ns"), c.process == sa.bindparam("p_process"))
        live = c.expires_at > now
        until = now + sa.bindparam("p_seconds", type_=sa.Double)
        longer = sa.case((c.expires_at > until, c.expires_at), else_=until)  # never shortened
        self._renew_liveness_sql = (
            sa.update(t).where(mine, c.token == sa.bindparam("p_token"), live).values(expires_at=longer)
        )
        ins = insert(t).values(
            namespace=sa.bindparam("p_ns"),
            process=sa.bindparam("p_process"),
            token=sa.bindparam("p_token"),
            expires_at=until,
        )
        # Created when absent or expired; a live record is taken only under its own token (a retry).
        self._create_liveness_sql = ins.on_conflict_do_update(
            index_elements=[c.namespace, c.process],
            set_={"token": ins.excluded.token, "expires_at": sa.case((live, longer), else_=until)},
            where=sa.or_(sa.not_(live), c.token == ins.excluded.token),
        ).returning(c.process)
        self._alive_sql = sa.select(c.process).where(
            c.namespace == sa.bindparam("p_ns"), c.process.in_(sa.bindparam("p_processes", expanding=True)), live
        )
        dead = sa.and_(c.namespace == sa.bindparam("p_ns"), sa.not_(live))
        self._purge_liveness_sql = sa.delete(t).where(dead)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLStore:
        """``postgresql+psycopg://...`` (``postgresql://`` too) or ``sqlite:///path``."""
        engine = engine_from_url(url, float(options.get("timeout_seconds", 2.0)))
        return cls(engine, **options)

    def create_schema(self) -> None:
        """Create the table and its indexes if they are missing, and add the nullable columns a
        newer celery-idem brought to an older table (safe to call from many processes)."""
        with self._guard("create_schema"):
            create_all(self.metadata, self.engine)
            self._add_missing_columns()
        self._schema_ready = True

    def _add_missing_columns(self) -> None:
        dialect = self.engine.dialect
        nullable = {
            column.name: column.type.compile(dialect=dialect) for column in self.table.columns if column.nullable
        }
        add_columns(self.engine, self.table.name, nullable)

    def _run(self, statement: sa.Executable, params: dict[str, Any], fetch: Callable[[sa.CursorResult[Any]], T]) -> T:
        """Run one prebuilt statement (autocommit: one transaction, one round trip) and read its answer."""
        if not self._schema_ready:
            with self._schema_lock:
                if not self._schema_ready:
                    self.create_schema()
        with self._autocommit.connect() as connection, _WATCHDOG.guard(socket_of(connection), self._deadline):
            return fetch(connection.execute(statement, params))

    def _clock_params(self) -> dict[str, float | None]:
        """``:p_now`` of a statement: the injected clock's time, or NULL for the database's own
        (plus ``:p_shift``, the test-only shift of the database's clock, once a test set one)."""
        if self._injected_clock:
            return {"p_now": self._clock_now()}
        return {"p_now": None, "p_shift": self._time_offset} if self._shifting else {"p_now": None}

    def _params(self, identity: Identity, **more: Any) -> dict[str, Any]:
        scope, task_name, key = identity
        named = {"ns": self.key_prefix, "scope": scope, "task_name": task_name, "key": key, **more}
        return {f"p_{name}": value for name, value in named.items()} | self._clock_params()

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
            call=bytes(row.call) if row.call is not None else None,
            previous_task_id=row.previous_task_id,
        )

    # ---- take-or-read: claim and acquire ------------------------------------------------------

    def _take(
        self,
        statement: sa.Executable,
        claiming: bool,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        next_look: float = 0.0,
        retry: bool = False,
    ) -> Transition:
        values = {
            "fingerprint": fingerprint,
            "state": (State.PENDING if claiming else State.IN_PROGRESS).value,
            "task_id": task_id,
            "owner": owner,
            "attempt": 0 if claiming else 1,
            "ttl_seconds": ttl,
            "result": None,
            "content_type": None,
            "content_encoding": None,
            "error": None,
            "call": call,
            "previous_task_id": None,
        }
        params = self._params(identity, lease=lease, **values) | ({} if claiming else {"p_retry": int(retry)})
        for _ in range(_TAKE_TRIES):
            taken = self._run(statement, params, _one_or_none)
            if taken is not None:
                # The row as written: the database computed its times, kept a chain's fingerprint
                # and (a run without a call) the claim's call.
                written = taken._asdict() | {"call": None if taken.call is None else bytes(taken.call)}
                record = IdempotencyRecord(
                    scope=identity.scope,
                    task_name=identity.task_name,
                    key=identity.key,
                    **(values | {"state": State(values["state"])} | written),
                )
                return Transition(Decision.NEW if claiming else Decision.RUN, record)
            if not claiming:
                busy = self._run(self._busy_sql, params | {"p_next_look": next_look}, _one_or_none)
                if busy is not None:
                    return Transition(Decision.BUSY, self._record(busy))
            held, now = self._read(identity)
            if held is not None:
                decision = classify(held, fingerprint, claiming=claiming, task_id=task_id, retry=retry)
                # An acquire's BUSY comes from the marking statement above only: a record read as
                # BUSY here changed hands since, so the acquire is tried again.
                if decision is not (Decision.DUPLICATE if claiming else Decision.BUSY) or (
                    claiming and not _takeable(held, now, claiming)
                ):
                    return Transition(decision, held)
            # It was freed (deleted, expired, lease ran out) between the upsert and the read: take again.
        raise sa_exc.TimeoutError(f"{identity} changed hands {_TAKE_TRIES} times in a row")

    def _claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
    ) -> Transition:
        return self._take(self._claim_sql, True, identity, fingerprint, task_id, owner, lease, ttl, call)

    def _acquire(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        next_look: float,
        retry: bool,
    ) -> Transition:
        return self._take(
            self._acquire_sql, False, identity, fingerprint, task_id, owner, lease, ttl, call, next_look, retry
        )

    # ---- fenced writes --------------------------------------------------------------------------

    def _settle(self, identity: Identity, token: str, outcome: Settlement) -> Transition:
        state, result, content_type, content_encoding, error = outcome
        params = self._params(
            identity,
            token=token,
            state=state.value,
            result=result,
            content_type=content_type,
            content_encoding=content_encoding,
            error=error.model_dump_json() if error else None,
        )
        return OK if self._run(self._settle_sql, params, _rowcount) == 1 else LOST

    def _release(
        self, identity: Identity, fence: Fence, token: str, lease: float | None, new_owner: str, expired_only: bool
    ) -> Transition:
        params = self._params(identity, token=token, expired_only=expired_only)
        if lease is None:
            return OK if self._run(self._delete_sql[fence], params, _rowcount) == 1 else LOST
        params.update(p_lease=lease, p_new_owner=new_owner)
        return OK if self._run(self._pending_sql[fence], params, _rowcount) == 1 else LOST

    def _renew(self, identity: Identity, token: str, lease: float) -> Transition:
        params = self._params(identity, token=token, lease=lease)
        return OK if self._run(self._renew_sql, params, _rowcount) == 1 else LOST

    def _hand_over(self, identity: Identity, token: str, new_owner: str, lease: float) -> Transition:
        params = self._params(identity, token=token, new_owner=new_owner, lease=lease)
        return OK if self._run(self._hand_over_sql, params, _rowcount) == 1 else LOST

    # ---- reads ------------------------------------------------------------------------------------

    def _read(self, identity: Identity) -> tuple[IdempotencyRecord | None, float | None]:
        """The live record and the database's time of the read (None, None when there is none)."""
        row = self._run(self._get_sql, self._params(identity), _one_or_none)
        return (None, None) if row is None else (self._record(row), row.db_now)

    def _get(self, identity: Identity) -> IdempotencyRecord | None:
        return self._read(identity)[0]

    def _forget(self, identity: Identity) -> bool:
        return any(row.live for row in self._run(self._forget_sql, self._params(identity), _all))

    def _expired_leases(self, limit: int) -> list[IdempotencyRecord]:
        params = {"p_ns": self.key_prefix, "p_limit": limit, **self._clock_params()}
        return [self._record(row) for row in self._run(self._due_sql, params, _all)]

    def _purge_expired(self, limit: int) -> int:
        params = {"p_ns": self.key_prefix, "p_limit": limit, **self._clock_params()}
        self._run(self._purge_liveness_sql, {"p_ns": self.key_prefix, **self._clock_params()}, _rowcount)
        return self._run(self._purge_sql, params, _rowcount)

    def _keep_alive(self, process: str, token: str, seconds: float, create: bool) -> Transition:
        params = {"p_ns": self.key_prefix, "p_process": process, "p_token": token, "p_seconds": seconds}
        params |= self._clock_params()
        if create:
            return OK if self._run(self._create_liveness_sql, params, _one_or_none) is not None else LOST
        return OK if self._run(self._renew_liveness_sql, params, _rowcount) == 1 else LOST

    def _alive(self, processes: list[str]) -> set[str]:
        params = {"p_ns": self.key_prefix, "p_processes": processes, **self._clock_params()}
        return {row.process for row in self._run(self._alive_sql, params, _all)}

    def _live_rows(self) -> sa.ColumnElement[bool]:
        c = self.table.c
        return sa.and_(c.namespace == self.key_prefix, c.expires_at > self._now)

    def _records(self, state: State | None, task_name: str | None, limit: int) -> list[IdempotencyRecord]:
        c = self.table.c
        query = sa.select(self.table).where(self._live_rows())
        if state is not None:
            query = query.where(c.state == state.value)
        if task_name is not None:
            query = query.where(c.task_name == task_name)
        query = query.order_by(c.updated_at.desc()).limit(limit)
        return [self._record(row) for row in self._run(query, self._clock_params(), _all)]

    def _count_by_state(self) -> dict[State, int]:
        c = self.table.c
        query = sa.select(c.state, sa.func.count()).where(self._live_rows()).group_by(c.state)
        return {State(state): int(n) for state, n in self._run(query, self._clock_params(), _all)}

    def _server_now(self) -> float:
        if self._injected_clock:
            return self._clock_now()
        return float(self._run(self._now_sql, self._clock_params(), _one)[0])

    def _ping(self) -> None:
        with self._autocommit.connect() as connection, _WATCHDOG.guard(socket_of(connection), self._deadline):
            connection.execute(sa.select(1)).one()

    def close(self) -> None:
        self.engine.dispose()
