"""The ledger's writes inside the business transaction: the row first, then ``fn`` and its outcome,
in a SAVEPOINT; the commit of a transaction of its own, and what the database holds after an
ambiguous COMMIT. Nothing here decides whose call it is: :meth:`~celery_idem.ledger.Ledger.run_once`
does, and hands the row in."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .. import telemetry
from ..errors import ConfigurationError
from ..outcome import encode_result
from ..records import Identity, State
from .calls import LedgerCall, after_ambiguous_commit
from .reads import LedgerEntry, LedgerReads

__all__ = ["LedgerTransactions", "call_fn", "connection_of", "open_transaction"]

T = TypeVar("T")
logger = logging.getLogger("celery_idem.ledger")


class LedgerTransactions(LedgerReads):
    """Writing a ledger row with ``fn``'s effect in one transaction, and settling its COMMIT."""

    def _record_and_commit(
        self, call: LedgerCall, row: dict[str, Any], fn: Callable[[Session], T]
    ) -> tuple[LedgerEntry | None, T]:
        """:meth:`_record` in a transaction of its own, committed; an error at COMMIT is settled."""
        identity = call.identity
        with self.engine.connect() as connection:
            connection.begin()
            committed, value = self._record(connection, call, row, fn)
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
        return after_ambiguous_commit(identity, str(row["nonce"]), failed, known, entry), value

    def _record(
        self, connection: sa.Connection, call: LedgerCall, row: dict[str, Any], fn: Callable[[Session], T]
    ) -> tuple[LedgerEntry | None, T]:
        """Write the row, run ``fn`` and store its outcome, in a SAVEPOINT of ``connection``'s transaction.

        Returns (None, fn's value) when fn ran, or (the committed entry, None) when the unique key
        refused the row: another attempt committed it first. Nothing is committed here. An error
        from ``fn`` or its outcome rolls the SAVEPOINT back and is raised, the call told
        (:meth:`LedgerCall.rolled_back`): no transaction holds its row any more.
        """
        identity = call.identity
        savepoint = _savepoint(connection)
        try:
            # The ledger row goes first: the unique key decides the race before any effect.
            connection.execute(sa.insert(self.table).values(**row))
        except sa_exc.IntegrityError:
            savepoint.rollback()
            return self._committed(connection, identity), None  # type: ignore[return-value]
        try:
            value = call_fn(connection, fn)
        except BaseException as exc:
            if not savepoint.is_active:
                raise _ended(identity) from exc
            savepoint.rollback()
            call.rolled_back()
            raise
        if not savepoint.is_active:
            raise _ended(identity)
        try:
            payload, content_type, encoding = encode_result(value, call.serializer)
            connection.execute(
                sa.update(self.table)
                .where(self._where(identity), self.table.c.nonce == row["nonce"])
                .values(
                    outcome=State.COMPLETED.value, result=payload, content_type=content_type, content_encoding=encoding
                )
            )
        except BaseException:
            savepoint.rollback()
            call.rolled_back()
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
                    logger.warning(
                        "could not ask the ledger about %s: %s", telemetry.shown(identity), telemetry.described(exc)
                    )
                    return False, None
                time.sleep(pause)
                pause = min(pause * 2, 1.0)


def _ended(identity: Identity) -> ConfigurationError:
    return ConfigurationError(
        f"fn ended the ledger's transaction of {identity} (a commit or rollback on its connection, not its "
        "session): the row may be committed without an outcome; fn must leave the transaction to run_once"
    )


def connection_of(session: Session | sa.Connection) -> sa.Connection:
    """The connection of the caller's transaction (a Session's is begun if it is not yet)."""
    if isinstance(session, sa.Connection):
        if not session.in_transaction():
            session.begin()  # commit-as-you-go: the caller commits it
        return session
    return session.connection()


def open_transaction(connection: sa.Connection) -> None:
    """Make the transaction real before a SAVEPOINT.

    pysqlite begins a transaction lazily, at the first INSERT/UPDATE/DELETE; a SAVEPOINT sent
    before that would start one of its own, and releasing it would COMMIT.
    """
    if connection.dialect.name == "sqlite":
        dbapi = connection.connection.dbapi_connection
        if dbapi is not None and not dbapi.in_transaction:
            connection.exec_driver_sql("BEGIN")


def _savepoint(connection: sa.Connection) -> sa.NestedTransaction:
    open_transaction(connection)
    return connection.begin_nested()


def call_fn(connection: sa.Connection, fn: Callable[[Session], T]) -> T:
    """``fn`` on a Session joined to ``connection`` through a SAVEPOINT, its pending writes flushed.

    The Session's commit() releases that savepoint and its rollback() rolls back to it: neither
    can end the transaction that holds the ledger row (SQLAlchemy's "Joining a Session into an
    External Transaction").
    """
    with Session(bind=connection, join_transaction_mode="create_savepoint") as work:
        value = fn(work)
        work.commit()
    return value
