"""The SQL store's reconciler and operator side: records whose lease ran out, purging rows past
their TTL, the worker processes' liveness rows, and listing and counting records."""

from __future__ import annotations

import sqlalchemy as sa

from ...records import IdempotencyRecord, State, Transition
from ..rules import LOST, OK
from . import codec
from .base import SQLBase, one_or_none, rowcount, rows

__all__ = ["SQLUpkeep"]


class SQLUpkeep(SQLBase):
    """The reconciler's and the operators' queries of a :class:`~celery_idem.stores.sql.SQLStore`."""

    def _expired_leases(self, limit: int) -> list[IdempotencyRecord]:
        params = {"p_ns": self.key_prefix, "p_limit": limit, **self._clock_params()}
        return [self._record(row) for row in self._run(self._due_sql, params, rows)]

    def _purge_expired(self, limit: int) -> int:
        params = {"p_ns": self.key_prefix, "p_limit": limit, **self._clock_params()}
        self._run(self._purge_liveness_sql, {"p_ns": self.key_prefix, **self._clock_params()}, rowcount)
        return self._run(self._purge(limit), params, rowcount)

    def _keep_alive(self, process: str, token: str, seconds: float, create: bool) -> Transition:
        params = {"p_ns": self.key_prefix, "p_process": process, "p_token": token, "p_seconds": seconds}
        params |= self._clock_params()
        if create:
            return OK if self._run(self._create_liveness_sql, params, one_or_none) is not None else LOST
        return OK if self._run(self._renew_liveness_sql, params, rowcount) == 1 else LOST

    def _alive(self, processes: list[str]) -> set[str]:
        params = {"p_ns": self.key_prefix, "p_processes": processes, **self._clock_params()}
        return {row.process for row in self._run(self._alive_sql, params, rows)}

    def _live_rows(self) -> sa.ColumnElement[bool]:
        c = self.table.c
        return sa.and_(c.namespace == self.key_prefix, c.expires_at > self._now)

    def _records(self, state: State | None, task_name: str | None, limit: int) -> list[IdempotencyRecord]:
        c = self.table.c
        query = sa.select(self.table).where(self._live_rows())
        if state is not None:
            query = query.where(c.state_code == codec.STATE_CODES[state])
        if task_name is not None:
            query = query.where(c.task_name == task_name)
        query = query.order_by(c.updated_at.desc()).limit(limit)
        return [self._record(row) for row in self._run(query, self._clock_params(), rows)]

    def _count_by_state(self) -> dict[State, int]:
        c = self.table.c
        query = sa.select(c.state_code, sa.func.count()).where(self._live_rows()).group_by(c.state_code)
        return {codec.state_of(state): int(n) for state, n in self._run(query, self._clock_params(), rows)}

    def _count_by_task(self) -> dict[tuple[str, State], int]:
        c = self.table.c
        query = (
            sa.select(c.task_name, c.state_code, sa.func.count())
            .where(self._live_rows())
            .group_by(c.task_name, c.state_code)
        )
        return {
            (task_name, codec.state_of(state)): int(n)
            for task_name, state, n in self._run(query, self._clock_params(), rows)
        }
