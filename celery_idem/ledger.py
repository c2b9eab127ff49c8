"""The ledger: a task's outcome recorded in the same transaction as its business effect.

The store is a fast lock and outcome cache; the business database is the truth. A task body that
changes the database calls :meth:`Ledger.run_once`: the ledger row is written *first* in the
business transaction, so its unique constraint decides the race before any effect is made:

- PostgreSQL (READ COMMITTED, the default, or stronger): a second attempt's INSERT waits for the
  first attempt's transaction; if that commits, the INSERT fails on the unique key, the second
  attempt rolls back without calling ``fn`` and returns the committed outcome; if it rolls back,
  the second attempt goes on.
- SQLite: the INSERT takes the database's write lock early in the transaction, so racers queue on
  the busy timeout instead of failing "database is locked" on a late upgrade.

The row and ``fn`` run inside a SAVEPOINT, and ``fn`` gets a Session joined to it with
``join_transaction_mode="create_savepoint"``: a commit inside ``fn`` cannot commit the row on its
own, and a caller's transaction (``session=``) survives a lost race. Every row carries the nonce of
the call that wrote it, so an error at COMMIT is settled by asking the database what it holds.

Exactly-once effect even when a lease was lost or a worker died after its commit: the reconciler
finds the committed outcome here and completes the record with it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from . import attempts
from .errors import ConfigurationError, LedgerUnavailableError, PayloadMismatchError
from .outcome import JSON_ONLY, decode_result, encode_result, serializer_of
from .protocol import BYPASS_HEADER, request_header
from .records import IdempotencyRecord, Identity, State
from .stores.deadline import Watchdog, socket_of
from .stores.sql.schema import add_columns, create_all

try:
    import sqlalchemy as sa
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.orm import Session
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("the ledger needs SQLAlchemy: pip install 'celery-idem[sql]'") from exc

__all__ = ["Ledger", "LedgerEntry", "ledger_table"]

T = TypeVar("T")
logger = logging.getLogger("celery_idem.ledger")
# Errors that say the database is down or unreachable, not that a statement is wrong.
_DOWN = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError, OSError)
_WATCHDOG = Watchdog()

# What an attempt remembers of its run_once call (Attempt.ledger_nonce): the nonce of the row it
# stands on, or this when that row is known to be committed.
_COMMITTED = "committed"
# A row's outcome until run_once stores fn's result with it; committed so only if fn ended the transaction.
_UNSETTLED = State.IN_PROGRESS.value
# committed_at, in epoch seconds, from the database's clock (never the worker's).
_DB_NOW: dict[str, sa.ColumnElement[float]] = {
    "postgresql": sa.literal_column("EXTRACT(EPOCH FROM clock_timestamp())"),
    "sqlite": sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)"),
}


def ledger_table(metadata: sa.MetaData, name: str = "celery_idem_ledger") -> sa.Table:
    """The ledger table: one row per identity (in a namespace) whose effect committed."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("namespace", sa.String(255), nullable=False),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(64), nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),
        sa.Column("content_encoding", sa.String(64), nullable=True),
        sa.Column("committed_at", sa.Double, nullable=False),
        sa.UniqueConstraint("namespace", "scope", "task_name", "key", name=f"uq_{name}_identity"),
    )


class LedgerEntry:
    """A committed outcome as the ledger holds it."""

    __slots__ = ("content_encoding", "content_type", "fingerprint", "identity", "nonce", "outcome", "result", "task_id")

    def __init__(self, row: Any) -> None:
        self.identity = Identity(row.scope, row.task_name, row.key)
        self.nonce: str | None = row.nonce  # the run_once call that wrote it (None: written before nonces)
        self.task_id: str = row.task_id
        self.fingerprint: str = row.fingerprint
        self.outcome: str = row.outcome  # COMPLETED, or IN_PROGRESS: committed before run_once stored the result
        self.result: bytes | None = bytes(row.result) if row.result is not None else None
        self.content_type: str | None = row.content_type
        self.content_encoding: str | None = row.content_encoding

    def value(self, accept: Collection[str] = JSON_ONLY) -> Any:
        """The committed result, decoded only from a content type in ``accept`` (the app's
        :attr:`~celery_idem.Idempotency.accepted_content_types`).

        Raises:
            SerializationError: the entry's content type is not accepted, or it does not decode.
        """
        return decode_result(
            IdempotencyRecord.model_construct(
                key=self.identity.key,
                task_name=self.identity.task_name,
                task_id=self.task_id,
                result=self.result,
                content_type=self.content_type,
                content_encoding=self.content_encoding,
            ),
            accept,
        )


class Ledger:
    """Record task outcomes in the business database, in the business transaction.

    Args:
        engine: The application's SQLAlchemy engine (PostgreSQL or SQLite).
        table_name: The ledger table.
        namespace: Separates apps that share the table, as ``key_prefix`` separates them in a
            store: give each app its own (use its ``key_prefix``).
        commit_check_seconds: How long to keep asking the database what an ambiguous COMMIT did.
        read_timeout_seconds: How long a reader (a duplicate's replay, ``get()``, the handler
            settling a failure, the reconciler) waits for the ledger before it counts as down.

    Use it inside an idempotent task::

        @app.task(base=IdempotentTask, bind=True)
        def charge(self, order_id, amount):
            def effect(session):
                session.add(Payment(order_id=order_id, amount=amount))
                return {"charged": amount}
            return ledger.run_once(self, effect)
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table_name: str = "celery_idem_ledger",
        namespace: str = "idem",
        commit_check_seconds: float = 10.0,
        read_timeout_seconds: float = 3.0,
    ) -> None:
        if engine.dialect.name not in ("postgresql", "sqlite"):
            raise ConfigurationError(f"the ledger runs on PostgreSQL and SQLite; got {engine.dialect.name!r}")
        if not 1 <= len(namespace) <= 255 or not namespace.isprintable():
            raise ConfigurationError(f"the ledger's namespace must be 1-255 printable characters; got {namespace!r}")
        self.engine = engine
        self.namespace = namespace
        self.commit_check_seconds = commit_check_seconds
        if not read_timeout_seconds > 0:
            raise ConfigurationError(f"the ledger's read_timeout_seconds must be > 0; got {read_timeout_seconds!r}")
        self.read_timeout_seconds = read_timeout_seconds
        self.metadata = sa.MetaData()
        self.table = ledger_table(self.metadata, table_name)
        self._columns_checked = False
        self._columns_lock = threading.Lock()
        self._warned = False

    # ---- schema ------------------------------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the ledger table if it is missing; add the columns a table from an older version lacks."""
        create_all(self.metadata, self.engine)  # many processes may create it at once
        self._add_missing_columns()

    def _check_columns(self) -> None:
        if not self._columns_checked:
            with self._columns_lock:
                if not self._columns_checked:
                    self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """A table made before namespaces and nonces gets them; its rows join this ledger's namespace.

        Its unique key stays (scope, task_name, key) until migrated (docs/ledger-and-reconciler.md).
        """
        try:
            present = {column["name"] for column in sa.inspect(self.engine).get_columns(self.table.name)}
        except sa_exc.NoSuchTableError:
            return  # not created yet: statements fail on it as they would without this check
        if not {"namespace", "nonce"} <= present:
            literal = sa.literal(self.namespace).compile(
                dialect=self.engine.dialect, compile_kwargs={"literal_binds": True}
            )
            kinds = {"namespace": f"VARCHAR(255) NOT NULL DEFAULT {literal}", "nonce": "VARCHAR(64)"}
            add_columns(self.engine, self.table.name, kinds)
        self._columns_checked = True

    # ---- reading -----------------------------------------------------------------------------------

    def _where(self, identity: Identity) -> sa.ColumnElement[bool]:
        c = self.table.c
        return sa.and_(
            c.namespace == self.namespace,
            c.scope == identity.scope,
            c.task_name == identity.task_name,
            c.key == identity.key,
        )

    def _read(self, connection: sa.Connection, identity: Identity) -> LedgerEntry | None:
        row = connection.execute(sa.select(self.table).where(self._where(identity))).one_or_none()
        return None if row is None else LedgerEntry(row)

    def lookup(self, identity: Identity) -> LedgerEntry | None:
        """The committed outcome of ``identity`` in this ledger's namespace, or None."""
        self._check_columns()
        with self.engine.connect() as connection:
            return self._read(connection, identity)

    def completed(self, identity: Identity, fingerprint: str | None) -> LedgerEntry | None:
        """The entry of this very call (``fingerprint``) if its outcome is committed, else None.

        The one rule every reader applies where the store and the ledger disagree: the ledger wins.
        Bounded by ``read_timeout_seconds``, however the database fails to answer.

        Raises:
            LedgerUnavailableError: the database could not be reached, or did not answer in time.
            sqlalchemy.exc.SQLAlchemyError: any other database error (a missing table, a privilege).
        """
        if fingerprint is None:
            return None
        entry = self._bounded_lookup(identity)
        if entry is None or entry.outcome != State.COMPLETED.value or entry.fingerprint != fingerprint:
            return None
        return entry

    def _bounded_lookup(self, identity: Identity) -> LedgerEntry | None:
        """:meth:`lookup` within ``read_timeout_seconds``: on a thread of its own, so neither a
        connect nor a server gone silent holds the caller (a silent PostgreSQL socket is also cut
        off by the watchdog, which ends the thread)."""
        answer: list[LedgerEntry | None] = []
        failure: list[BaseException] = []

        def read() -> None:
            try:
                self._check_columns()
                if not self._columns_checked:  # a mistake, not an outage: never counted as "down"
                    raise ConfigurationError(
                        f"the ledger table {self.table.name!r} does not exist: run Ledger.create_schema() "
                        "(or the migration that creates it)"
                    )
                with (
                    self.engine.connect() as connection,
                    _WATCHDOG.guard(socket_of(connection), self.read_timeout_seconds),
                ):
                    answer.append(self._read(connection, identity))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                failure.append(exc)

        reader = threading.Thread(target=read, name="celery-idem-ledger-read", daemon=True)
        reader.start()
        reader.join(self.read_timeout_seconds)
        if reader.is_alive():
            raise LedgerUnavailableError(
                f"the ledger did not answer about {identity} within {self.read_timeout_seconds:g}s "
                "(read_timeout_seconds)"
            )
        if failure:
            if isinstance(failure[0], _DOWN):
                raise LedgerUnavailableError(
                    f"the ledger could not be asked about {identity}: {failure[0]}"
                ) from failure[0]
            raise failure[0]
        return answer[0]

    # ---- run_once ----------------------------------------------------------------------------------

    def run_once(self, task: Any, fn: Callable[[Session], T], *, session: Session | sa.Connection | None = None) -> T:
        """Run ``fn(session)`` in a transaction that also records the outcome, once per identity.

        Args:
            task: The running idempotent task (``self`` of a bound task): its running attempt holds the
                identity and the fingerprint of the call.
            fn: Does the business writes on the session it is given and returns the outcome
                (serializable with the task's serializer). The session is joined to the ledger's
                transaction through a SAVEPOINT: its ``commit()`` only releases that savepoint.
            session: The caller's Session or Connection, to join its transaction instead of
                opening one: the ledger row is written in it and ``run_once`` does not commit
                (the caller does; a rollback takes the row and ``fn``'s writes with it).

        Returns:
            ``fn``'s result on the first execution; the committed outcome on any later execution
            or lost race, without calling ``fn``. A call that bypasses celery-idem
            (``idempotency=False``) runs ``fn`` in the transaction without a ledger row.

        Raises:
            PayloadMismatchError: the identity's committed row belongs to other arguments.
            ConfigurationError: called outside an idempotent task's run, or a second time in one
                attempt whose first row stands.
        """
        request = task.request
        # The identity and the call from the handler's attempt, never from the request: a message
        # header becomes a request attribute, so a forged one could name another identity.
        attempt = attempts.current(task)
        if attempt is None:
            if _bypassed(request):
                logger.debug("bypassed call of %s (task_id=%s): fn runs without a ledger row", task.name, request.id)
                return self._bypass(fn, session)
            raise ConfigurationError(
                f"Ledger.run_once must be called from the body of an idempotent task; {task.name!r} "
                "is not running under celery-idem (is its base IdempotentTask?)"
            )
        self._check_columns()
        identity, fingerprint = attempt.identity, attempt.fingerprint
        self._refuse_second_call(attempt.ledger_nonce, identity, session)
        serializer = serializer_of(task, task.app.conf)
        row = {
            "namespace": self.namespace,
            "scope": identity.scope,
            "task_name": identity.task_name,
            "key": identity.key,
            "task_id": request.id or "",
            "fingerprint": fingerprint,
            "nonce": uuid.uuid4().hex,
            "outcome": _UNSETTLED,
            "committed_at": _DB_NOW[self.engine.dialect.name],
        }
        # Marked before the row can commit: an attempt whose COMMIT's fate is unknown has touched the
        # ledger, and the handler leaves such an attempt's failure to the reconciler.
        nonce = str(row["nonce"])
        attempt.ledger_nonce, attempt.ledger = nonce, self
        self._warn_if_unread(task)
        if session is None:
            committed, value = self._record_and_commit(identity, row, fn, serializer)
            attempt.ledger_nonce = _COMMITTED
        else:
            committed, value = self._record(_connection_of(session), identity, row, fn, serializer)
            attempt.ledger_nonce = _COMMITTED if committed is not None else nonce
        if committed is None:
            return value
        if committed.fingerprint != fingerprint:
            raise PayloadMismatchError(
                f"the ledger holds a committed outcome of {identity} for other arguments",
                key=identity.key,
                task_name=identity.task_name,
                task_id=committed.task_id,
            )
        if committed.outcome != State.COMPLETED.value:
            raise ConfigurationError(
                f"the ledger row of {identity} (task {committed.task_id}) was committed without an outcome: "
                "that attempt's fn ended the ledger's transaction (a commit on its connection) before run_once "
                "stored the outcome, so its effect may be partial; check it, then delete the row to run the call again"
            )
        # The settings' accepted content types, through the task's handler (the ledger sits below
        # the extension and never imports it).
        accept = task.idempotency_handler.idem.accepted_content_types
        return committed.value(accept)  # type: ignore[no-any-return]

    def _warn_if_unread(self, task: Any) -> None:
        """Once per ledger: the app's readers (duplicates' get(), the reconciler) ask only the
        ledger given to ``Idempotency(app, ledger=...)``; the worker asks the one run_once used."""
        if self._warned:
            return
        configured = task.idempotency_handler.idem.settings.ledger
        if configured is not self:
            self._warned = True
            logger.warning(
                "Ledger.run_once of %s writes to a ledger that app %r does not read (%s): pass it as "
                "Idempotency(app, ledger=...) so duplicates' results and the reconciler answer from it",
                task.name,
                task.app.main,
                "it has none" if configured is None else "it has another",
            )

    def _refuse_second_call(
        self, used: str | None, identity: Identity, session: Session | sa.Connection | None
    ) -> None:
        """One ledger row per identity: a second call in an attempt whose first row stands is a bug."""
        if used is None:
            return
        if used != _COMMITTED:  # the first call joined a transaction: does its row still stand?
            c = self.table.c
            query = sa.select(c.id).where(self._where(identity), c.nonce == used)
            if session is None:
                with self.engine.connect() as connection:
                    stands = connection.execute(query).first() is not None
            else:
                stands = _connection_of(session).execute(query).first() is not None
            if not stands:
                return  # its transaction rolled back: this call starts over
        raise ConfigurationError(
            f"Ledger.run_once was already called in this attempt of {identity}: the ledger keeps one "
            "outcome per identity, so a second call would be handed the first one's; do all of the "
            "attempt's writes in one fn"
        )

    def _record_and_commit(
        self, identity: Identity, row: dict[str, Any], fn: Callable[[Session], T], serializer: str
    ) -> tuple[LedgerEntry | None, T]:
        """:meth:`_record` in a transaction of its own, committed; an error at COMMIT is settled."""
        with self.engine.connect() as connection:
            connection.begin()
            committed, value = self._record(connection, identity, row, fn, serializer)
            if committed is not None:
                connection.rollback()
                return committed, value
            try:
                connection.commit()
                return None, value
            except sa_exc.DBAPIError as exc:
                failed = exc
        # The COMMIT's answer was lost or wrong about what happened: ask the database, on a new connection.
        known, entry = self._settle(identity, row)
        if not known or entry is None:
            logger.warning(
                "COMMIT of %s failed (%s); %s",
                identity,
                failed,
                "the ledger holds no row of it" if known else "the ledger could not be asked",
            )
            raise failed
        ours = entry.nonce == row["nonce"]
        logger.warning(
            "COMMIT of %s raised %s but %s row is committed: %s",
            identity,
            failed,
            "its" if ours else "another attempt's",
            "its outcome stands",
        )
        return (None, value) if ours else (entry, value)

    def _record(
        self,
        connection: sa.Connection,
        identity: Identity,
        row: dict[str, Any],
        fn: Callable[[Session], T],
        serializer: str,
    ) -> tuple[LedgerEntry | None, T]:
        """Write the row, run ``fn`` and store its outcome, in a SAVEPOINT of ``connection``'s transaction.

        Returns (None, fn's value) when fn ran, or (the committed entry, None) when the unique key
        refused the row: another attempt committed it first. Nothing is committed here.
        """
        savepoint = _savepoint(connection)
        try:
            # The ledger row goes first: the unique key decides the race before any effect.
            connection.execute(sa.insert(self.table).values(**row))
        except sa_exc.IntegrityError:
            savepoint.rollback()
            return self._committed(connection, identity), None  # type: ignore[return-value]
        try:
            value = _call(connection, fn)
        except BaseException as exc:
            if not savepoint.is_active:
                raise _ended(identity) from exc
            savepoint.rollback()
            raise
        if not savepoint.is_active:
            raise _ended(identity)
        try:
            payload, content_type, encoding = encode_result(value, serializer)
            connection.execute(
                sa.update(self.table)
                .where(self._where(identity), self.table.c.nonce == row["nonce"])
                .values(
                    outcome=State.COMPLETED.value, result=payload, content_type=content_type, content_encoding=encoding
                )
            )
        except BaseException:
            savepoint.rollback()
            raise
        savepoint.commit()
        return None, value

    def _committed(self, connection: sa.Connection, identity: Identity) -> LedgerEntry:
        """The row that made the unique key refuse ours: this transaction's view, else a fresh one."""
        entry = self._read(connection, identity) or self.lookup(identity)
        if entry is None:
            raise ConfigurationError(
                f"the ledger's unique key refused {identity} but namespace {self.namespace!r} holds no row of "
                f"it: table {self.table.name!r} still has the unique key made before namespaces; migrate it "
                "(see 'The table' in docs/ledger-and-reconciler.md)"
            )
        return entry

    def _settle(self, identity: Identity, row: dict[str, Any]) -> tuple[bool, LedgerEntry | None]:
        """What the database holds for ``identity`` after an ambiguous COMMIT: (known, entry).

        A probe INSERT of the identity waits for any transaction still holding it, then either fails
        on the unique key (a row is committed: read it) or succeeds (none is: roll the probe back).
        """
        deadline = time.monotonic() + self.commit_check_seconds
        pause = 0.05
        while True:
            try:
                with self.engine.connect() as connection:
                    connection.begin()
                    if connection.dialect.name == "postgresql":
                        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
                        connection.exec_driver_sql(f"SET LOCAL lock_timeout = {wait_ms}")
                    try:
                        connection.execute(sa.insert(self.table).values(**{**row, "nonce": None}))
                    except sa_exc.IntegrityError:
                        connection.rollback()
                        return True, self._committed(connection, identity)
                    connection.rollback()
                    return True, None
            except sa_exc.DBAPIError as exc:
                if time.monotonic() + pause >= deadline:
                    logger.warning("could not ask the ledger about %s: %s", identity, exc)
                    return False, None
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _bypass(self, fn: Callable[[Session], T], session: Session | sa.Connection | None) -> T:
        """``fn`` in the caller's transaction or one of its own, with no ledger row."""
        if session is not None:
            connection = _connection_of(session)
            _open(connection)
            return _call(connection, fn)
        with self.engine.connect() as connection:
            connection.begin()
            _open(connection)
            value = _call(connection, fn)
            connection.commit()
        return value


def _ended(identity: Identity) -> ConfigurationError:
    return ConfigurationError(
        f"fn ended the ledger's transaction of {identity} (a commit or rollback on its connection, not its "
        "session): the row may be committed without an outcome; fn must leave the transaction to run_once"
    )


def _bypassed(request: Any) -> bool:
    """Whether this run is a call made with ``idempotency=False`` (a plain function call is not)."""
    return (
        hasattr(request, "headers") and not request.called_directly and request_header(request, BYPASS_HEADER) is False
    )


def _connection_of(session: Session | sa.Connection) -> sa.Connection:
    """The connection of the caller's transaction (a Session's is begun if it is not yet)."""
    if isinstance(session, sa.Connection):
        if not session.in_transaction():
            session.begin()  # commit-as-you-go: the caller commits it
        return session
    return session.connection()


def _open(connection: sa.Connection) -> None:
    """Make the transaction real before a SAVEPOINT.

    pysqlite begins a transaction lazily, at the first INSERT/UPDATE/DELETE; a SAVEPOINT sent
    before that would start one of its own, and releasing it would COMMIT.
    """
    if connection.dialect.name == "sqlite":
        dbapi = connection.connection.dbapi_connection
        if dbapi is not None and not dbapi.in_transaction:
            connection.exec_driver_sql("BEGIN")


def _savepoint(connection: sa.Connection) -> sa.NestedTransaction:
    _open(connection)
    return connection.begin_nested()


def _call(connection: sa.Connection, fn: Callable[[Session], T]) -> T:
    """``fn`` on a Session joined to ``connection`` through a SAVEPOINT, its pending writes flushed.

    The Session's commit() releases that savepoint and its rollback() rolls back to it: neither
    can end the transaction that holds the ledger row (SQLAlchemy's "Joining a Session into an
    External Transaction").
    """
    with Session(bind=connection, join_transaction_mode="create_savepoint") as work:
        value = fn(work)
        work.commit()
    return value
