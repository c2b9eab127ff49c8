"""The ledger: a task's outcome recorded in the same transaction as its business effect.

The store is a fast lock and outcome cache; the business database is the truth. A task body that
changes the database calls :meth:`Ledger.run_once`: the ledger row is written *first* in the
business transaction, so its unique constraint decides the race before any effect is made:

- PostgreSQL (READ COMMITTED, the default, or stronger): a second attempt's INSERT waits for the
  first attempt's transaction; if that commits, the INSERT fails on the unique key, the second
  attempt rolls back without calling ``fn`` and returns the committed outcome; if it rolls back,
  the second attempt goes on.
- SQLite: the INSERT takes the database's write lock as the transaction's first statement, so
  racers queue on the busy timeout instead of failing "database is locked" on a late upgrade.

Exactly-once effect even when a lease was lost or a worker died after its commit: the reconciler
finds the committed outcome here and completes the record with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from .errors import ConfigurationError, PayloadMismatchError
from .extension import Idempotency
from .outcome import JSON_ONLY, decode_result, encode_result
from .records import IdempotencyRecord, Identity, State

try:
    import sqlalchemy as sa
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.orm import Session
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("the ledger needs SQLAlchemy: pip install 'celery-idem[sql]'") from exc

__all__ = ["Ledger", "LedgerEntry", "ledger_table"]

T = TypeVar("T")


def ledger_table(metadata: sa.MetaData, name: str = "celery_idem_ledger") -> sa.Table:
    """The ledger table: one row per identity whose effect committed."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),
        sa.Column("content_encoding", sa.String(64), nullable=True),
        sa.Column("committed_at", sa.Double, nullable=False),
        sa.UniqueConstraint("scope", "task_name", "key", name=f"uq_{name}_identity"),
    )


class LedgerEntry:
    """A committed outcome as the ledger holds it."""

    __slots__ = ("content_encoding", "content_type", "fingerprint", "identity", "result", "task_id")

    def __init__(self, row: Any) -> None:
        self.identity = Identity(row.scope, row.task_name, row.key)
        self.task_id: str = row.task_id
        self.fingerprint: str = row.fingerprint
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

    Use it inside an idempotent task::

        @app.task(base=IdempotentTask, bind=True)
        def charge(self, order_id, amount):
            def effect(session):
                session.add(Payment(order_id=order_id, amount=amount))
                return {"charged": amount}
            return ledger.run_once(self, effect)
    """

    def __init__(self, engine: sa.Engine, *, table_name: str = "celery_idem_ledger") -> None:
        if engine.dialect.name not in ("postgresql", "sqlite"):
            raise ConfigurationError(f"the ledger runs on PostgreSQL and SQLite; got {engine.dialect.name!r}")
        self.engine = engine
        self.metadata = sa.MetaData()
        self.table = ledger_table(self.metadata, table_name)

    def create_schema(self) -> None:
        """Create the ledger table if it is missing."""
        try:
            self.metadata.create_all(self.engine, checkfirst=True)
        except sa_exc.DBAPIError:
            self.metadata.create_all(self.engine, checkfirst=True)  # a concurrent creator won

    def _where(self, identity: Identity) -> sa.ColumnElement[bool]:
        c = self.table.c
        return sa.and_(c.scope == identity.scope, c.task_name == identity.task_name, c.key == identity.key)

    def lookup(self, identity: Identity) -> LedgerEntry | None:
        """The committed outcome of ``identity``, or None."""
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(self.table).where(self._where(identity))).one_or_none()
        return None if row is None else LedgerEntry(row)

    def run_once(self, task: Any, fn: Callable[[Session], T]) -> T:
        """Run ``fn(session)`` in a transaction that also records the outcome, once per identity.

        Args:
            task: The running idempotent task (``self`` of a bound task): its request holds the
                identity and the fingerprint of the call.
            fn: Does the business writes on ``session`` and returns the outcome (serializable
                with the task's serializer). It must not commit.

        Returns:
            ``fn``'s result on the first execution; the committed outcome on any later execution
            or lost race, without calling ``fn``.

        Raises:
            PayloadMismatchError: the identity's committed row belongs to other arguments.
            ConfigurationError: called outside an idempotent task's run.
        """
        request = task.request
        key = getattr(request, "idempotency_key", None)
        fingerprint = getattr(request, "idempotency_fingerprint", None)
        if key is None or fingerprint is None:
            raise ConfigurationError(
                f"Ledger.run_once must be called from the body of an idempotent task; {task.name!r} "
                "is not running under celery-idem (is its base IdempotentTask?)"
            )
        identity = Identity(request.idempotency_scope or "", task.name, key)
        serializer = task.serializer or task.app.conf.task_serializer or "json"
        row = {"scope": identity.scope, "task_name": identity.task_name, "key": identity.key,
               "task_id": request.id or "", "fingerprint": fingerprint, "outcome": State.COMPLETED.value,
               "committed_at": time.time()}  # fmt: skip
        try:
            with Session(self.engine) as session, session.begin():
                # The ledger row goes first: the unique key decides the race before any effect.
                session.execute(sa.insert(self.table).values(**row))
                value = fn(session)
                payload, content_type, encoding = encode_result(value, serializer)
                session.execute(
                    sa.update(self.table)
                    .where(self._where(identity))
                    .values(result=payload, content_type=content_type, content_encoding=encoding)
                )
            return value
        except sa_exc.IntegrityError:
            committed = self.lookup(identity)
            if committed is None:  # pragma: no cover - the winner's row vanished (forgotten by hand)
                raise
        if committed.fingerprint != fingerprint:
            raise PayloadMismatchError(
                f"the ledger holds a committed outcome of {identity} for other arguments",
                key=identity.key,
                task_name=identity.task_name,
                task_id=committed.task_id,
            )
        return committed.value(Idempotency.of(task.app).accepted_content_types)  # type: ignore[no-any-return]
