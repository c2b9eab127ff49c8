"""MySQL's and MariaDB's transitions as short transactions (:class:`Locked`), where PostgreSQL and
SQLite run one conditional statement: what such a transaction does, running it
(:func:`run_locked`), ordering an UPDATE's assignments for MySQL (:func:`in_order`), and reading
PyMySQL's error codes (:func:`mysql_code`). The statements themselves are built in
:mod:`~celery_idem.stores.sql.statements`; :mod:`~celery_idem.stores.sql.base` runs them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

__all__ = ["Answer", "Locked", "Rows", "in_order", "mysql_code", "run_locked"]


@dataclass(frozen=True)
class Locked:
    """One transition as one short transaction (MySQL/MariaDB), run by :func:`run_locked`:

    1. ``lock`` (``SELECT ... FOR UPDATE``) reads and locks the row, if there is one;
    2. no row: ``insert`` writes it (a concurrent insert of the same key makes ours fail on the
       primary key: the transaction is run again, and then finds and locks that row); without an
       ``insert``, nothing is written;
    3. a row (or no ``lock``): ``write``, a conditional UPDATE or DELETE, changes it if its WHERE
       holds, judged by its row count;
    4. when something was written, ``read`` reads the row back (what ``RETURNING`` would return);
    5. when nothing was written to a row it found, ``busy`` (acquire's BUSY mark, a conditional
       UPDATE) may mark it, and ``held`` reads it: a take that declined is judged on the row as it
       was when it declined, still locked, never on one that changed hands since.

    The answer is ``read``'s rows when it wrote, ``held``'s when it did not (none without a
    ``held``), or, without a ``read``, ``lock``'s rows when it wrote (none when it did not); its
    ``step`` says which: ``"wrote"``, ``"busy"`` (the mark landed) or ``"declined"``.
    """

    write: sa.Executable
    lock: sa.Select[Any] | None = None
    insert: sa.Executable | None = None
    read: sa.Select[Any] | None = None
    busy: sa.Executable | None = None
    held: sa.Select[Any] | None = None


def in_order(table: sa.Table, values: dict[str, Any]) -> list[tuple[str, Any]]:
    """``values`` in an order that gives MySQL's UPDATE PostgreSQL's meaning: MySQL assigns left to
    right, each expression seeing the columns assigned before it, where PostgreSQL evaluates every
    expression on the row as it was. So a column is assigned only after every expression that reads
    it (its own reads its old value either way).

    Raises:
        ValueError: two expressions each read the other's column (no order keeps both).
    """
    reads = {name: {c.name for c in _columns_of(table, value)} - {name} for name, value in values.items()}
    ordered: list[tuple[str, Any]] = []
    left = dict(values)
    while left:
        # Free to assign: no expression still to come reads this column.
        free = [name for name in left if not any(name in reads[other] for other in left if other != name)]
        if not free:
            raise ValueError(f"no order of the assignments to {sorted(left)} keeps their old values")
        for name in free:
            ordered.append((name, left.pop(name)))
    return ordered


def _columns_of(table: sa.Table, value: Any) -> Iterable[sa.Column[Any]]:
    if not isinstance(value, sa.ClauseElement):
        return ()
    return [e for e in sa.sql.visitors.iterate(value) if isinstance(e, sa.Column) and e.table is table]


class Answer(Protocol):
    """What a statement answers: a cursor's result, or the rows of a Locked transaction."""

    @property
    def rowcount(self) -> int: ...

    def one(self) -> Any: ...  # (and ``step``, on a Locked transaction's answer: see Locked)

    def one_or_none(self) -> Any: ...

    def all(self) -> Sequence[Any]: ...


class Rows:
    """The answer of a :class:`Locked` transaction: the rows it read, and its ``step``."""

    def __init__(self, found: Sequence[Any], step: str) -> None:
        self._rows = found
        self.step = step

    @property
    def rowcount(self) -> int:
        return len(self._rows)

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise sa_exc.NoResultFound(f"expected one row, got {len(self._rows)}")
        return self._rows[0]

    def one_or_none(self) -> Any:
        return self._rows[0] if self._rows else None

    def all(self) -> Sequence[Any]:
        return self._rows


def mysql_code(exc: BaseException) -> int | None:
    """The MySQL/MariaDB error code of a SQLAlchemy error of PyMySQL's (its ``args[0]``), else None."""
    args = getattr(getattr(exc, "orig", None), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def run_locked(connection: sa.Connection, locked: Locked, params: dict[str, Any]) -> Answer:
    """Run ``locked`` (see :class:`Locked`) in one transaction on ``connection`` (in autocommit mode)."""
    try:
        connection.exec_driver_sql("START TRANSACTION")
        found = None if locked.lock is None else connection.execute(locked.lock, params).all()
        if found is not None and not found:
            wrote = locked.insert is not None
            if locked.insert is not None:
                connection.execute(locked.insert, params)
        else:
            wrote = connection.execute(locked.write, params).rowcount > 0
        step = "wrote" if wrote else "declined"
        answer: Sequence[Any] = (found or []) if wrote else []
        if wrote and locked.read is not None:
            answer = connection.execute(locked.read, params).all()
        elif not wrote:
            if locked.busy is not None and found and connection.execute(locked.busy, params).rowcount > 0:
                step = "busy"
            if locked.held is not None:
                answer = connection.execute(locked.held, params).all()
            elif locked.read is not None:
                answer = []
        connection.exec_driver_sql("COMMIT")
    except BaseException:
        try:
            connection.exec_driver_sql("ROLLBACK")
        except Exception:  # noqa: BLE001 - a connection cut off: the server rolls back when it notices
            connection.invalidate()
        raise
    return Rows(answer, step)
