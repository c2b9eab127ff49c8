"""SQLStore on PostgreSQL (psycopg 3), SQLite and MySQL/MariaDB (PyMySQL), by concern: the store and
its transitions (``store``), the reconciler's and operators' queries and the processes' liveness rows
(``upkeep``), what it stands on (``base``: its private pool, what the database's errors mean,
running one statement, its parameters and clock), every statement it runs (``statements``), MySQL's
transitions as short locked transactions (``locked``), its tables and how they are created and
upgraded (``schema``, shared with the ledger), and its connections and the database's clock
(``engine``)."""

from __future__ import annotations

from ...errors import ConfigurationError

try:  # the extra, checked here once for every module of the package
    import sqlalchemy  # noqa: F401
    import sqlalchemy.dialects.postgresql  # noqa: F401
    import sqlalchemy.dialects.sqlite  # noqa: F401
    import sqlalchemy.exc  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("SQLStore needs SQLAlchemy: pip install 'celery-idem[sql]'") from exc

from .schema import create_all, liveness_table, records_table
from .store import SQLStore

__all__ = ["SQLStore", "create_all", "liveness_table", "records_table"]
