"""The ledger's table: its columns, a ledger's settings, and creating and upgrading the table
(with the helpers the SQL store's schema uses too)."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from ..errors import ConfigurationError
from ..records import Identity
from ..stores.sql.schema import add_columns, create_all

__all__ = ["LedgerTable", "ledger_table"]


def ledger_table(metadata: sa.MetaData, name: str = "celery_idem_ledger") -> sa.Table:
    """The ledger table: one row per identity (in a namespace) whose effect committed."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("namespace", sa.String(255), nullable=False),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(64), nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),
        sa.Column("content_encoding", sa.String(64), nullable=True),
        sa.Column("committed_at", sa.Double, nullable=False),
        sa.UniqueConstraint("namespace", "scope", "task_name", "key", name=f"uq_{name}_identity"),
    )


class LedgerTable:
    """A ledger's table in its namespace, and its settings (the arguments of :class:`~celery_idem.ledger.Ledger`)."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table_name: str = "celery_idem_ledger",
        namespace: str = "idem",
        commit_check_seconds: float = 10.0,
        read_timeout_seconds: float = 3.0,
    ) -> None:
        if engine.dialect.name not in ("postgresql", "sqlite"):
            raise ConfigurationError(f"the ledger runs on PostgreSQL and SQLite; got {engine.dialect.name!r}")
        if not 1 <= len(namespace) <= 255 or not namespace.isprintable():
            raise ConfigurationError(f"the ledger's namespace must be 1-255 printable characters; got {namespace!r}")
        self.engine = engine
        self.namespace = namespace
        self.commit_check_seconds = commit_check_seconds
        if not read_timeout_seconds > 0:
            raise ConfigurationError(f"the ledger's read_timeout_seconds must be > 0; got {read_timeout_seconds!r}")
        self.read_timeout_seconds = read_timeout_seconds
        self.metadata = sa.MetaData()
        self.table = ledger_table(self.metadata, table_name)
        self._columns_checked = False
        self._columns_lock = threading.Lock()
        self._warned = False  # run_once: told once that the app reads another ledger

    # ---- schema ------------------------------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the ledger table if it is missing; add the columns a table from an older version lacks."""
        create_all(self.metadata, self.engine)  # many processes may create it at once
        self._add_missing_columns()

    def _check_columns(self) -> None:
        if not self._columns_checked:
            with self._columns_lock:
                if not self._columns_checked:
                    self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """A table made before namespaces and nonces gets them; its rows join this ledger's namespace.

        Its unique key stays (scope, task_name, key) until migrated (docs/ledger-and-reconciler.md).
        """
        try:
            present = {column["name"] for column in sa.inspect(self.engine).get_columns(self.table.name)}
        except sa_exc.NoSuchTableError:
            return  # not created yet: statements fail on it as they would without this check
        if not {"namespace", "nonce"} <= present:
            literal = sa.literal(self.namespace).compile(
                dialect=self.engine.dialect, compile_kwargs={"literal_binds": True}
            )
            kinds = {"namespace": f"VARCHAR(255) NOT NULL DEFAULT {literal}", "nonce": "VARCHAR(64)"}
            add_columns(self.engine, self.table.name, kinds)
        self._columns_checked = True

    def _where(self, identity: Identity) -> sa.ColumnElement[bool]:
        """The row of ``identity`` in this ledger's namespace."""
        c = self.table.c
        return sa.and_(
            c.namespace == self.namespace,
            c.scope == identity.scope,
            c.task_name == identity.task_name,
            c.key == identity.key,
        )
