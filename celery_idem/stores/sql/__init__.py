"""SQLStore on PostgreSQL (psycopg 3) and SQLite, by concern: the store and its statements
(``store``), its tables and how they are created and upgraded (``schema``, shared with the ledger),
and its connections and the database's clock (``engine``)."""

from __future__ import annotations

from .schema import create_all, liveness_table, records_table
from .store import SQLStore

__all__ = ["SQLStore", "create_all", "liveness_table", "records_table"]
