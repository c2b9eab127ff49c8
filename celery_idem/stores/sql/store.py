"""SQLStore: one conditional statement per transition, on PostgreSQL (psycopg 3) and SQLite; on
MySQL/MariaDB (PyMySQL) one short transaction with the record's row locked where the database has
no such statement (:class:`~celery_idem.stores.sql.locked.Locked`, docs/stores.md).

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

On MySQL/MariaDB a claim or an acquire locks the row, inserts it or runs the same conditional
UPDATE, and, when that declined, marks BUSY and reads the record in the same transaction: the
decision is named from the row as it declined, still locked.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from ...records import Decision, IdempotencyRecord, Identity, State, Transition, owner_digest
from ..rules import LOST, OK, classify
from ..spi import Fence, Settlement
from . import codec
from .base import one_or_none, rowcount, rows
from .engine import engine_from_url
from .locked import Answer, Locked
from .upkeep import SQLUpkeep

__all__ = ["SQLStore"]

_TAKE_TRIES = 5  # a held record that frees itself between our upsert and our read is taken on a retry


def _answer(result: Answer) -> Any:
    return result


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


class SQLStore(SQLUpkeep):
    """Records as rows of ``celery_idem_records``; the table is created on first use.

    Args:
        engine: A SQLAlchemy engine on PostgreSQL, SQLite, or MySQL/MariaDB through PyMySQL (or
            build one with :meth:`from_url`).
            The store runs its statements in autocommit mode on a private pool derived from it,
            whose connections honour ``timeout_seconds``; ``store.engine`` is that private engine
            (in autocommit mode: open a transaction of your own with
            ``execution_options(isolation_level=...)`` on a connection of it).
        table_name: The records table.
        liveness_table_name: The worker processes' liveness table.
    """

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLStore:
        """``postgresql+psycopg://...`` (``postgresql://`` too), ``sqlite:///path``, or
        ``mysql://...`` / ``mariadb://...`` (``mysql+pymysql://``: PyMySQL)."""
        engine = engine_from_url(url, float(options.get("timeout_seconds", 2.0)))
        return cls(engine, **options)

    # ---- take-or-read: claim and acquire ------------------------------------------------------

    def _take(
        self,
        statement: sa.Executable | Locked,
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
        state = State.PENDING if claiming else State.IN_PROGRESS
        values = {
            "fingerprint": codec.FINGERPRINT.pack(fingerprint),
            "state_code": codec.STATE_CODES[state],
            "task_id": codec.TASK_ID.pack(task_id),
            "owner": codec.OWNER.pack(owner),
            "attempt": 0 if claiming else 1,
            "ttl_seconds": ttl,
            "result": None,
            "content_type": None,
            "content_encoding": None,
            "error": None,
            "call": call,
            "previous_task_id": None,
        }
        params = self._params(identity, lease=lease, **values)
        params |= {} if claiming else {"p_retry": int(retry), "p_next_look": next_look}
        for _ in range(_TAKE_TRIES):
            if isinstance(statement, Locked):  # MySQL: take, or mark BUSY and read, under one lock
                answer = self._run(statement, params, _answer)
                taken = answer.one_or_none() if answer.step == "wrote" else None
            else:
                answer, taken = None, self._run(statement, params, one_or_none)
            if taken is not None:
                # The row as written: the database computed its times, kept a chain's fingerprint
                # and (a run without a call) the claim's call.
                record = IdempotencyRecord(
                    scope=identity.scope,
                    task_name=identity.task_name,
                    key=identity.key,
                    state=state,
                    task_id=task_id,
                    owner=owner,
                    ttl_seconds=ttl,
                    **taken._asdict()
                    | {
                        "fingerprint": codec.FINGERPRINT.unpack(taken.fingerprint),
                        "call": None if taken.call is None else bytes(taken.call),
                        "previous_task_id": codec.TASK_ID.unpack_optional(taken.previous_task_id),
                    },
                )
                return Transition(Decision.NEW if claiming else Decision.RUN, record)
            if answer is not None:
                row = answer.one_or_none()
                if answer.step == "busy":
                    return Transition(Decision.BUSY, self._record(row))
                held, now = (None, None) if row is None else (self._record(row), row.db_now)
            else:
                if not claiming:
                    busy = self._run(self._busy_sql, params, one_or_none)
                    if busy is not None:
                        return Transition(Decision.BUSY, self._record(busy))
                held, now = self._read(identity)
            if held is not None and not (
                statement is self._claim_free_sql and held.state.settled and held.task_id != task_id
            ):
                # (A claim to which a settled record is free that reads one settled since: take again.)
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
        settled_is_free: bool,
    ) -> Transition:
        statement = self._claim_free_sql if settled_is_free else self._claim_sql
        return self._take(statement, True, identity, fingerprint, task_id, owner, lease, ttl, call)

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
            token=codec.OWNER.pack(token),
            digest=codec.OWNER.pack(owner_digest(token)),
            state=codec.STATE_CODES[state],
            result=result,
            content_type=codec.content_type(content_type),
            content_encoding=codec.content_encoding(content_encoding),
            error=error.model_dump_json() if error else None,
        )
        return OK if self._run(self._settle_sql, params, rowcount) == 1 else LOST

    def _release(
        self, identity: Identity, fence: Fence, token: str, lease: float | None, new_owner: str, expired_only: bool
    ) -> Transition:
        packed = (codec.OWNER if fence == "owner" else codec.TASK_ID).pack(token)
        params = self._params(identity, token=packed, expired_only=expired_only)
        if lease is None:
            return OK if self._run(self._delete_sql[fence], params, rowcount) == 1 else LOST
        params.update(p_lease=lease, p_new_owner=codec.OWNER.pack(new_owner))
        return OK if self._run(self._pending_sql[fence], params, rowcount) == 1 else LOST

    def _renew(self, identity: Identity, token: str, lease: float) -> Transition:
        params = self._params(identity, token=codec.OWNER.pack(token), lease=lease)
        return OK if self._run(self._renew_sql, params, rowcount) == 1 else LOST

    def _hand_over(self, identity: Identity, token: str, new_owner: str, lease: float) -> Transition:
        params = self._params(
            identity, token=codec.OWNER.pack(token), new_owner=codec.OWNER.pack(new_owner), lease=lease
        )
        return OK if self._run(self._hand_over_sql, params, rowcount) == 1 else LOST

    # ---- reads ------------------------------------------------------------------------------------

    def _read(self, identity: Identity) -> tuple[IdempotencyRecord | None, float | None]:
        """The live record and the database's time of the read (None, None when there is none)."""
        row = self._run(self._get_sql, self._params(identity), one_or_none)
        return (None, None) if row is None else (self._record(row), row.db_now)

    def _get(self, identity: Identity) -> IdempotencyRecord | None:
        return self._read(identity)[0]

    def _forget(self, identity: Identity) -> bool:
        return any(row.live for row in self._run(self._forget_sql, self._params(identity), rows))
