"""The call a task body makes: :meth:`Ledger.run_once` runs its ``fn`` once per identity, with the
ledger row written first in the same transaction (see :mod:`celery_idem.ledger`); a call made with
``idempotency=False`` runs ``fn`` without a row."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import Session

from .. import attempts
from ..errors import ConfigurationError, PayloadMismatchError
from ..outcome import serializer_of
from ..protocol import BYPASS_HEADER, request_header
from ..records import Identity, State
from .transaction import LedgerTransactions, call_fn, connection_of, open_transaction

__all__ = ["Ledger"]

T = TypeVar("T")
logger = logging.getLogger("celery_idem.ledger")

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
            committed, value = self._record(connection_of(session), identity, row, fn, serializer)
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
                stands = connection_of(session).execute(query).first() is not None
            if not stands:
                return  # its transaction rolled back: this call starts over
        raise ConfigurationError(
            f"Ledger.run_once was already called in this attempt of {identity}: the ledger keeps one "
            "outcome per identity, so a second call would be handed the first one's; do all of the "
            "attempt's writes in one fn"
        )

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


def _bypassed(request: Any) -> bool:
    """Whether this run is a call made with ``idempotency=False`` (a plain function call is not)."""
    return (
        hasattr(request, "headers") and not request.called_directly and request_header(request, BYPASS_HEADER) is False
    )
