"""The outbox on SQLAlchemy: :class:`SQLOutbox`, one small table beside the business tables.

    outbox = SQLOutbox(engine)          # once; outbox.create_schema() creates its table
    with Session(engine) as session, session.begin():
        session.add(Order(...))
        handle = outbox.apply_async(session, charge, (order_id,), idempotency_key=f"order-{order_id}")
    # committed: published at once (best effort); rolled back: nothing was ever published

A relay (``outbox.relay(app)`` from a beat task or a loop) publishes what the commit-time attempt
did not (the process died, the broker was down), oldest first, taking rows ``FOR UPDATE SKIP
LOCKED`` and leasing them, so relays share the work.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import orm

from ..stores.sql.engine import server_clock
from ..stores.sql.schema import create_all
from .staging import Outbox, RelayReport, Taken, backoff_seconds, given_back, killed, put_off, stage_call

__all__ = ["SQLOutbox", "outbox_table"]


def outbox_table(metadata: sa.MetaData, name: str = "celery_idem_outbox") -> sa.Table:
    """The outbox table: one row per staged call, deleted once published (times are the database's
    clock as POSIX seconds; ``dead`` rows are the dead letter, kept with their last error)."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("body", sa.LargeBinary(length=16 * 1024 * 1024), nullable=False),  # MySQL: MEDIUMBLOB
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("available_at", sa.Double, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, default=0),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("dead", sa.Boolean, nullable=False, default=False),
        # The mark: when a relay took it that may have published it (celery_idem.outbox.staging).
        sa.Column("taken_at", sa.Double, nullable=True),
        sa.Index(f"ix_{name}_due", "dead", "available_at", "id"),
        # Not unique: a call staged twice under one chosen task id is published twice, and the
        # second finds the first's claim (the caller's transaction never fails on it).
        sa.Index(f"ix_{name}_task_id", "task_id"),
    )


class SQLOutbox(Outbox):
    """A transactional outbox on ``engine``'s database (PostgreSQL, SQLite, MySQL/MariaDB).

    Args:
        engine: the business database's engine (the rows are written on the caller's session).
        table_name: the outbox table's name.
        max_attempts: failed publishes of one row before it moves to the dead letter.
        publish_on_commit: publish a staged call as soon as its transaction commits (the relay
            still publishes whatever that attempt did not).
        lease_seconds: how long rows a relay took stay its own; a relay that dies leaves them
            due again after this.
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table_name: str = "celery_idem_outbox",
        max_attempts: int = 20,
        publish_on_commit: bool = True,
        lease_seconds: float = 60.0,
    ) -> None:
        super().__init__(max_attempts=max_attempts, publish_on_commit=publish_on_commit, lease_seconds=lease_seconds)
        self.engine = engine
        self.metadata = sa.MetaData()
        self.table = outbox_table(self.metadata, table_name)
        self._now = server_clock(engine.dialect.name)

    def create_schema(self) -> None:
        """Create the outbox table (safe to call from many processes at once)."""
        create_all(self.metadata, self.engine)

    def apply_async(
        self,
        session: orm.Session | sa.Connection,
        task: Any,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Stage ``task.apply_async(args, kwargs, **options)`` in ``session``'s transaction and
        return the handle of its task id. Nothing is claimed or published before the commit.

        Raises:
            InvalidKeyError: the key or scope breaks the rule, before anything is written.
            SerializationError: the call is not JSON, or is over 64 KiB.
        """
        staged, handle = stage_call(task, args, kwargs, options)
        now = self._now
        row_id = session.execute(
            sa.insert(self.table)
            .values(
                task_id=staged.task_id,
                task_name=staged.task_name,
                body=staged.body,
                created_at=now,
                available_at=now,
                attempts=0,
                dead=False,
            )
            .returning(self.table.c.id)
        ).scalar_one()
        if self.publish_on_commit and isinstance(session, orm.Session):
            app = task.app
            sa.event.listen(session, "after_commit", lambda _: self._publish_now(app, row_id), once=True)
        return handle

    def delay(self, session: orm.Session | sa.Connection, task: Any, *args: Any, **kwargs: Any) -> Any:
        """``apply_async(session, task, args, kwargs)``."""
        return self.apply_async(session, task, args, kwargs)

    def _settle(self, report: RelayReport) -> None:
        t = self.table
        with self.engine.begin() as connection:
            if report.published:
                connection.execute(sa.delete(t).where(t.c.id.in_(report.published)))
            for row_id, attempts, error in report.failed:
                later = self._now + backoff_seconds(attempts)
                connection.execute(sa.update(t).where(t.c.id == row_id).values(put_off(attempts, error, later)))
            for row_id, attempts, error in report.dead:
                connection.execute(sa.update(t).where(t.c.id == row_id).values(killed(attempts, error)))
            if report.unmarked:
                connection.execute(sa.update(t).where(t.c.id.in_(report.unmarked)).values(taken_at=None))

    def _give_back(self, ids: Collection[Any] | None) -> int:
        t = self.table
        dead = t.c.dead.is_(True) if ids is None else sa.and_(t.c.dead.is_(True), t.c.id.in_(list(ids)))
        with self.engine.begin() as connection:
            return int(connection.execute(sa.update(t).where(dead).values(given_back(self._now))).rowcount)

    def _take(self, limit: int, ids: Collection[Any] | None) -> list[Taken]:
        with self.engine.begin() as connection:
            return self._take_on(connection, limit, ids)

    def _take_on(self, connection: sa.Connection, limit: int, ids: Collection[Any] | None) -> list[Taken]:
        """Lock up to ``limit`` due rows, reading the mark each had (its age; none: NULL), then
        lease and mark them. SQLite has no row locks and its driver begins the transaction at the
        first write, not at a SELECT, so there the rows are locked by an UPDATE that changes
        nothing, holding the database's write lock from the read to the commit."""
        t, now = self.table, self._now
        due = sa.and_(t.c.dead.is_(False), t.c.available_at <= now)
        if ids is not None:
            due = sa.and_(due, t.c.id.in_(list(ids)))
        oldest = sa.select(t.c.id).where(due).order_by(t.c.id).limit(limit)
        columns = (t.c.id, t.c.task_id, t.c.task_name, t.c.body, t.c.attempts, (now - t.c.taken_at).label("mark_age"))
        if connection.dialect.name == "sqlite":
            lock = sa.update(t).where(due, t.c.id.in_(oldest.scalar_subquery())).values(taken_at=t.c.taken_at)
            found = list(connection.execute(lock.returning(*columns)).all())
        else:
            found = list(connection.execute(oldest.with_only_columns(*columns).with_for_update(skip_locked=True)).all())
        if found:
            leased = {"available_at": now + self.lease_seconds, "taken_at": sa.func.coalesce(t.c.taken_at, now)}
            connection.execute(sa.update(t).where(t.c.id.in_([row.id for row in found])).values(leased))

        def taken(row: Any) -> Taken:
            mark_age = None if row.mark_age is None else max(0.0, float(row.mark_age))
            return Taken(row.id, row.task_id, row.task_name, row.body, row.attempts, mark_age)

        return sorted((taken(row) for row in found), key=lambda row: row.id)
