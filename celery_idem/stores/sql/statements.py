"""Every statement of the SQL store, built once with bind parameters from its tables and the clock
it reads (``:p_now``, the database's clock by default): what each transition, read and liveness
beat runs, in one place (how the store runs them: :mod:`~celery_idem.stores.sql.store`).

MySQL and MariaDB have no conditional upsert that returns the row (``ON DUPLICATE KEY UPDATE``
has no ``WHERE`` and no ``RETURNING``; MariaDB has no ``UPDATE ... RETURNING``): there, a transition
that PostgreSQL and SQLite run as one such statement is a :class:`Locked` transaction instead (its
row locked, then the same conditional write, then the row read back), built from the same
conditions, so the rules are written once (:mod:`~celery_idem.stores.sql.locked`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from ...records import State
from ..rules import UNSETTLED
from .codec import STATE_CODES
from .engine import MYSQL
from .locked import Locked, in_order
from .schema import DATA, TIMES

__all__ = ["INSERTS", "Statements"]

_UNSETTLED = [STATE_CODES[s] for s in UNSETTLED]
_PENDING, _IN_PROGRESS = STATE_CODES[State.PENDING], STATE_CODES[State.IN_PROGRESS]
# PostgreSQL's and SQLite's insert() have on_conflict_do_update and .excluded; MySQL's upserts are
# Locked transactions of plain statements.
INSERTS: dict[str, Callable[[sa.Table], Any]] = {
    "postgresql": postgresql.insert,
    "sqlite": sqlite.insert,
    **dict.fromkeys(MYSQL, sa.insert),
}


class Statements:
    """The statements of a :class:`~celery_idem.stores.sql.SQLStore`, built from its tables and its
    clock expression (set by the store, which builds them again when a test shifts its clock)."""

    table: sa.Table
    liveness: sa.Table
    _now: sa.ColumnElement[Any]
    _purge_sql: sa.Executable | None
    _purge_limited: tuple[sa.Delete, str]

    def _build_statements(self, dialect: str) -> None:
        insert, locked = INSERTS[dialect], dialect in MYSQL
        t, c, now = self.table, self.table.c, self._now

        def p(name: str) -> sa.BindParameter[Any]:
            # Parameters are prefixed: SQLAlchemy reserves column names for INSERT/UPDATE values.
            return sa.bindparam(f"p_{name}")

        def update() -> sa.Update:
            """An UPDATE of one record, found by its primary key. MySQL's optimizer of a one-table
            UPDATE may reach the row through an index on ``expires_at`` or ``lease_expires_at``
            instead (it does on a small table), locking that index's entry before the row while a
            Locked transaction holds the row and then needs the entry: a deadlock on every such
            pair. Forced to the primary key, every transition locks the row first."""
            if not locked:
                return sa.update(t)
            return sa.update(t).with_hint("FORCE INDEX (PRIMARY)", t, dialect)

        # The row's key is the identity's hash; the identity itself is checked too, so a colliding
        # one is never read or taken (an upsert on it finds a row it may not take: held, fail closed).
        ours = sa.and_(c.namespace == p("ns"), c.scope == p("scope"), c.task_name == p("task_name"), c.key == p("key"))
        pk = sa.and_(c.id == p("id"), ours)
        # Written out, not IN (a list): a list is an expanding parameter, rendered again on every run.
        unsettled = sa.or_(*(c.state_code == code for code in _UNSETTLED))
        absent = c.expires_at <= now

        def upsert(take: sa.ColumnElement[bool], special: dict[str, Any]) -> sa.Executable | Locked:
            times = {
                "lease_expires_at": now + p("lease"),
                "created_at": now,
                "updated_at": now,
                "expires_at": now + p("lease") + p("ttl_seconds"),
            }
            ins = insert(t).values(
                id=p("id"),
                namespace=p("ns"),
                scope=p("scope"),
                task_name=p("task_name"),
                key=p("key"),
                **{name: p(name) for name in DATA},
                **times,
            )
            # A takeover keeps the task id of the attempt it takes (stores/rules.py: taken_over).
            # A settled record taken (by a free claim: a new call of a mode that keeps no outcome)
            # leaves nothing behind: no earlier attempt to read evidence of, no waiter's mark.
            settled = sa.not_(unsettled)
            previous = sa.case(
                (absent, None), (settled, None), (c.state_code == _IN_PROGRESS, c.task_id), else_=c.previous_task_id
            )
            written = {name: p(name) for name in DATA} | times
            changes = written | {"previous_task_id": previous}
            # A live record keeps a BUSY waiter's mark whoever takes it over; an absent one has none.
            changes["linger_until"] = sa.case((absent, sa.null()), (settled, sa.null()), else_=c.linger_until)
            returned = (c.fingerprint, c.attempt, c.call, c.previous_task_id, *(c[name] for name in TIMES))
            if locked:
                return Locked(
                    lock=sa.select(c.id).where(c.id == p("id")).with_for_update(),
                    insert=ins,
                    write=update().where(ours, c.id == p("id"), take).ordered_values(*in_order(t, changes | special)),
                    read=sa.select(*returned).where(c.id == p("id")),
                )
            statement: sa.Executable = ins.on_conflict_do_update(
                index_elements=[c.id], set_=changes | special, where=sa.and_(ours, take)
            ).returning(*returned)
            return statement

        # claim takes an absent record, or one whose lease ran out under the same fingerprint; the
        # claim of a mode that keeps no outcome for new calls takes a settled one too.
        claimable = sa.or_(absent, sa.and_(c.fingerprint == p("fingerprint"), unsettled, c.lease_expires_at <= now))
        self._claim_sql = upsert(claimable, {})
        # (Under the settled record's own task id it is that call again: answered as usual.)
        self._claim_free_sql = upsert(sa.or_(claimable, sa.and_(sa.not_(unsettled), c.task_id != p("task_id"))), {})
        # acquire takes an absent record, a PENDING one, or an IN_PROGRESS one whose lease ran out,
        # if it is the same call or the same attempt chain (a Celery retry under the record's task
        # id); the chain keeps the caller's fingerprint and counts its attempts.
        runnable = sa.or_(c.state_code == _PENDING, sa.and_(c.state_code == _IN_PROGRESS, c.lease_expires_at <= now))
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
        mark = (
            update()
            .where(pk, c.expires_at > now, c.state_code == _IN_PROGRESS, c.lease_expires_at > now, same)
            .values(linger_until=sa.case((sa.func.coalesce(c.linger_until, 0.0) > look, c.linger_until), else_=look))
        )
        self._busy_sql: sa.Executable | Locked = (
            Locked(write=mark, read=sa.select(t).where(c.id == p("id"))) if locked else mark.returning(*t.c)
        )
        # A read carries the database's time, so a held record is judged by the same clock.
        self._get_sql = sa.select(t, now.label("db_now")).where(pk, c.expires_at > now)
        if isinstance(self._claim_sql, Locked) and isinstance(self._acquire_sql, Locked):
            # MySQL: a declined take marks BUSY and reads the record in its own transaction.
            self._claim_sql = replace(self._claim_sql, held=self._get_sql)
            assert isinstance(self._claim_free_sql, Locked)
            self._claim_free_sql = replace(self._claim_free_sql, held=self._get_sql)
            self._acquire_sql = replace(self._acquire_sql, busy=mark, held=self._get_sql)

        expired_lease = c.lease_expires_at <= now

        def owned(fence: str) -> sa.ColumnElement[bool]:
            held = sa.and_(pk, c[fence] == p("token"), unsettled, c.expires_at > now)
            if fence == "task_id":
                # The task id frees only what that delivery may still hold: a claim, or an attempt
                # past its lease. A live attempt under the same id is a copy running elsewhere.
                return sa.and_(held, sa.or_(c.state_code == _PENDING, expired_lease))
            return held

        self._settle_sql = (
            update()
            .where(owned("owner"))
            .values(
                state_code=p("state"),
                result=p("result"),
                content_type=p("content_type"),
                content_encoding=p("content_encoding"),
                error=p("error"),
                lease_expires_at=None,
                call=None,  # the reconciler requeues unsettled records only: a settled one needs no call
                owner=p("digest"),  # all a settled record needs of its owner: who settled it (held_by)
                updated_at=now,
                expires_at=sa.case(
                    (sa.func.coalesce(c.linger_until, 0.0) > now + c.ttl_seconds, c.linger_until),
                    else_=now + c.ttl_seconds,
                ),  # never before a BUSY waiter's next look
            )
        )
        only_expired = sa.or_(sa.not_(p("expired_only")), expired_lease)
        # MySQL's one-table DELETE takes no index hint (see update()): the row is locked by its
        # primary key first, then deleted by it alone.
        self._delete_sql: dict[str, sa.Executable | Locked] = {
            fence: Locked(
                lock=sa.select(c.id).where(owned(fence), only_expired).with_for_update(),
                write=sa.delete(t).where(c.id == p("id")),
            )
            if locked
            else sa.delete(t).where(owned(fence), only_expired)
            for fence in ("owner", "task_id")
        }
        self._pending_sql = {
            fence: update()
            .where(owned(fence), only_expired)
            .values(
                state_code=_PENDING,
                owner=p("new_owner"),
                lease_expires_at=now + p("lease"),
                updated_at=now,
                expires_at=now + p("lease") + c.ttl_seconds,
            )
            for fence in ("owner", "task_id")
        }
        # A renewal extends the lease, never shortens it (a late beat must not undo a longer lease).
        renewed = sa.case((c.lease_expires_at > now + p("lease"), c.lease_expires_at), else_=now + p("lease"))
        renewal = {"lease_expires_at": renewed, "updated_at": now, "expires_at": renewed + c.ttl_seconds}
        self._renew_sql = (
            update().where(owned("owner"), c.state_code == _IN_PROGRESS).ordered_values(*in_order(t, renewal))
        )
        self._hand_over_sql = (
            update()
            .where(owned("owner"), c.state_code == _IN_PROGRESS)
            .values(
                owner=p("new_owner"),
                lease_expires_at=now + p("lease"),
                updated_at=now,
                expires_at=now + p("lease") + c.ttl_seconds,
            )
        )
        live = (c.expires_at > now).label("live")
        self._forget_sql: sa.Executable | Locked = (
            Locked(lock=sa.select(live).where(pk).with_for_update(), write=sa.delete(t).where(c.id == p("id")))
            if locked
            else sa.delete(t).where(pk).returning(live)
        )
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
        if locked:
            # MySQL takes no LIMIT in an IN subquery, nor a subquery on the table it deletes from;
            # its DELETE has a LIMIT of its own (a number, not a parameter: built per call).
            self._purge_sql = None
            self._purge_limited = (sa.delete(t).where(expired), f"{dialect}_limit")
        else:
            doomed = sa.select(c.id).where(expired).limit(p("limit"))
            self._purge_sql = sa.delete(t).where(expired, c.id.in_(doomed))
        self._now_sql = sa.select(now)
        self._build_liveness_statements(insert, locked)

    def _purge(self, limit: int) -> sa.Executable:
        """The purge of at most ``limit`` rows past their TTL (``:p_limit`` where it is a parameter)."""
        if self._purge_sql is not None:
            return self._purge_sql
        statement, option = self._purge_limited
        return statement.with_dialect_options(**{option: limit})

    def _build_liveness_statements(self, insert: Callable[[sa.Table], Any], locked: bool = False) -> None:
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
        token: sa.BindParameter[Any] = sa.bindparam("p_token")
        takes = {"token": token, "expires_at": sa.case((live, longer), else_=until)}
        self._create_liveness_sql: sa.Executable | Locked = (
            Locked(
                lock=sa.select(c.process).where(mine).with_for_update(),
                insert=ins,
                write=sa.update(t)
                .where(mine, sa.or_(sa.not_(live), c.token == token))
                .ordered_values(*in_order(t, takes)),
                read=sa.select(c.process).where(mine),
            )
            if locked
            else ins.on_conflict_do_update(
                index_elements=[c.namespace, c.process], set_=takes, where=sa.or_(sa.not_(live), c.token == token)
            ).returning(c.process)
        )
        self._alive_sql = sa.select(c.process).where(
            c.namespace == sa.bindparam("p_ns"), c.process.in_(sa.bindparam("p_processes", expanding=True)), live
        )
        dead = sa.and_(c.namespace == sa.bindparam("p_ns"), sa.not_(live))
        self._purge_liveness_sql = sa.delete(t).where(dead)
