"""The call a task body makes: :meth:`Ledger.run_once` runs its ``fn`` once per identity, with the
ledger row written first in the same transaction (see :mod:`celery_idem.ledger`); a call made with
``idempotency=False`` runs ``fn`` without a row."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import Session

from ..errors import LedgerUnavailableError
from ..records import Identity
from .calls import COMMITTED, UNSETTLED, LedgerCall, second_call
from .transaction import LedgerTransactions, call_fn, connection_of, open_transaction

__all__ = ["Ledger"]

T = TypeVar("T")
logger = logging.getLogger("celery_idem.ledger")

# committed_at, in epoch seconds, from the database's clock (never the worker's).
_DB_NOW: dict[str, sa.ColumnElement[float]] = {
    "postgresql": sa.literal_column("EXTRACT(EPOCH FROM clock_timestamp())"),
    "sqlite": sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)"),
}


class Ledger(LedgerTransactions):
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
        call = LedgerCall.of(task, "Ledger")
        if call is None:
            return self._bypass(fn, session)
        self._check_columns()
        identity = call.identity
        self._refuse_second_call(call.attempt.ledger_nonce, identity, session)
        row = {
            "namespace": self.namespace,
            "scope": identity.scope,
            "task_name": identity.task_name,
            "key": identity.key,
            "task_id": call.task_id,
            "fingerprint": call.fingerprint,
            "nonce": call.nonce,
            "outcome": UNSETTLED,
            "committed_at": _DB_NOW[self.engine.dialect.name],
        }
        call.touch(self)
        if session is None:
            committed, value = self._record_and_commit(call, row, fn)
            call.ended(committed=True)
        else:
            committed, value = self._record(connection_of(session), call, row, fn)
            call.ended(committed=False, answered_by=committed)
        return value if committed is None else call.answer(committed)

    def _refuse_second_call(
        self, used: str | None, identity: Identity, session: Session | sa.Connection | None
    ) -> None:
        """One ledger row per identity: a second call in an attempt whose first row stands is a bug."""
        if used is None:
            return
        if used != COMMITTED:  # the first call joined a transaction: does its row still stand?
            c = self.table.c
            query = sa.select(c.id).where(self._where(identity), c.nonce == used)
            if session is None:
                with self.engine.connect() as connection:
                    stands = connection.execute(query).first() is not None
            else:
                stands = connection_of(session).execute(query).first() is not None
            if not stands:
                return  # its transaction rolled back: this call starts over
        raise second_call(identity)

    def stands(self, attempt: Any) -> bool:
        """Whether the attempt's row is committed (asked on a connection of its own, within
        ``read_timeout_seconds``)."""
        query = sa.select(self.table.c.id).where(
            self._where(attempt.identity), self.table.c.nonce == attempt.ledger_nonce
        )
        answer: list[bool] = []
        failure: list[BaseException] = []

        def read() -> None:  # on a thread of its own: a pool that hands a thread its one connection
            try:  # (SQLite in memory) would otherwise read the caller's uncommitted row
                with self.engine.connect() as connection:
                    answer.append(connection.execute(query).first() is not None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                failure.append(exc)

        reader = threading.Thread(target=read, name="celery-idem-ledger-stands", daemon=True)
        reader.start()
        reader.join(self.read_timeout_seconds)
        if failure:
            raise failure[0]
        if not answer:
            raise LedgerUnavailableError(f"the ledger did not answer about {attempt.identity} in time")
        return answer[0]

    def _bypass(self, fn: Callable[[Session], T], session: Session | sa.Connection | None) -> T:
        """``fn`` in the caller's transaction or one of its own, with no ledger row."""
        if session is not None:
            connection = connection_of(session)
            open_transaction(connection)
            return call_fn(connection, fn)
        with self.engine.connect() as connection:
            connection.begin()
            open_transaction(connection)
            value = call_fn(connection, fn)
            connection.commit()
        return value
