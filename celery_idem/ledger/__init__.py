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

One class, :class:`Ledger`, built up by concern, each on the one below it:

- ``calls``: what every ledger's ``run_once`` does around its transaction, whatever the database
  library (the Django ORM's :class:`~celery_idem.contrib.django.ledger.DjangoLedger` too);

- ``table``: the table, a ledger's settings, creating the table and adding the columns an older one
  lacks (:class:`~celery_idem.ledger.table.LedgerTable`);
- ``reads``: :class:`LedgerEntry`, and the reads of the duplicates, the handler and the reconciler,
  bounded by ``read_timeout_seconds`` (:class:`~celery_idem.ledger.reads.LedgerReads`);
- ``transaction``: the row and ``fn`` in a SAVEPOINT of the business transaction, the commit, and
  what an ambiguous COMMIT did (:class:`~celery_idem.ledger.transaction.LedgerTransactions`);
- ``run_once``: :class:`Ledger` and :meth:`Ledger.run_once`, the call a task body makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError

__all__ = ["Ledger", "LedgerEntry", "ledger_table"]

if TYPE_CHECKING:
    from .reads import LedgerEntry
    from .run_once import Ledger
    from .table import ledger_table


def __getattr__(name: str) -> Any:
    """The SQLAlchemy ledger, imported on first use: :mod:`.calls`, which every ledger shares
    (the Django ORM's too), imports no database library."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import sqlalchemy  # noqa: F401 - checked here, before any module of the package imports it
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigurationError("the ledger needs SQLAlchemy: pip install 'celery-idem[sql]'") from exc
    from . import reads, run_once, table

    return {"Ledger": run_once.Ledger, "LedgerEntry": reads.LedgerEntry, "ledger_table": table.ledger_table}[name]
