"""The SQL store's schema: its tables, and creating and upgrading them from many processes at once
(the ledger uses the same helpers)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

__all__ = ["DATA", "LAYOUT", "TIMES", "add_columns", "create_all", "liveness_table", "records_table"]

LAYOUT = 2  # the records table's layout: 2 is the compact row (codec.py); 1 kept every field as text
DATA = (
    "fingerprint",
    "state_code",
    "task_id",
    "owner",
    "attempt",
    "ttl_seconds",
    "result",
    "content_type",
    "content_encoding",
    "error",
    "call",
    "previous_task_id",
)
TIMES = ("lease_expires_at", "created_at", "updated_at", "expires_at")


def records_table(metadata: sa.MetaData, name: str = "celery_idem_records") -> sa.Table:
    """The records table (layout 2, see :mod:`~celery_idem.stores.sql.codec`). ``namespace`` is
    the store's key_prefix, so apps can share one table.

    The columns are in the order that packs a PostgreSQL row tightest: the 8-byte numbers first (a
    settled row's lease and waiter mark are NULL, which takes no space), then the 4- and 2-byte
    ones, then the variable-length ones. The state is ``state_code``, not layout 1's ``state``: every
    statement of an older release that judges a record names ``state``, so a process of that release
    left running fails loudly on this table (an outage) rather than match nothing and lose its writes.
    """
    return sa.Table(
        name,
        metadata,
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Column("ttl_seconds", sa.Double, nullable=False),
        sa.Column("lease_expires_at", sa.Double, nullable=True),
        # Hidden (never read into a record): when a BUSY waiter will have looked again by; an
        # outcome is kept at least until then (stores/rules.py, "A waiting duplicate gets its answer").
        sa.Column("linger_until", sa.Double, nullable=True),
        sa.Column("id", sa.Uuid, nullable=False),  # codec.identity_id
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("state_code", sa.SmallInteger, nullable=False),  # codec.STATE_CODES
        sa.Column("namespace", sa.String(64), nullable=False),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary, nullable=False),  # codec.FINGERPRINT
        sa.Column("task_id", sa.LargeBinary, nullable=False),  # codec.TASK_ID
        sa.Column("owner", sa.LargeBinary, nullable=False),  # codec.OWNER; its digest once settled
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),  # '' for application/json
        sa.Column("content_encoding", sa.String(64), nullable=True),  # '' for utf-8
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("call", sa.LargeBinary, nullable=True),  # kept only for stale_action="requeue"
        sa.Column("previous_task_id", sa.LargeBinary, nullable=True),  # an attempt taken over past its lease
        sa.PrimaryKeyConstraint("id", name=f"pk_{name}"),
        # The reconciler's index: unsettled records by lease expiry. Settled rows hold NULL and
        # have no entry; a query on ``lease_expires_at <= :now`` implies the predicate.
        sa.Index(
            f"ix_{name}_due",
            "namespace",
            "lease_expires_at",
            postgresql_where=sa.text("lease_expires_at IS NOT NULL"),
            sqlite_where=sa.text("lease_expires_at IS NOT NULL"),
        ),
        sa.Index(f"ix_{name}_expiry", "expires_at"),  # the purge's
    )


def liveness_table(metadata: sa.MetaData, name: str = "celery_idem_liveness") -> sa.Table:
    """Worker processes' liveness records (DESIGN "Death is a fact"): one row per process id."""
    return sa.Table(
        name,
        metadata,
        sa.Column("namespace", sa.String(64), primary_key=True),
        sa.Column("process", sa.String(64), primary_key=True),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )


def create_all(metadata: sa.MetaData, engine: sa.Engine) -> None:
    """Create what ``metadata`` holds that the database lacks, safely from many processes at once.

    Another process may create a table or an index between our check and our CREATE: "already
    exists" (OperationalError on SQLite, DuplicateTable or a unique violation in the catalog on
    PostgreSQL). Each such failure means one more object exists, so checking again makes progress.
    Any other error (a server that does not answer, a refused connection) is raised at once.
    """
    objects = len(metadata.tables) + sum(len(table.indexes) for table in metadata.tables.values())
    for tries_left in range(objects, -1, -1):
        try:
            metadata.create_all(engine, checkfirst=True)
            return
        except sa_exc.DBAPIError as exc:
            if not tries_left or not _lost_a_creation_race(exc):
                raise


def _lost_a_creation_race(exc: sa_exc.DBAPIError) -> bool:
    return isinstance(exc, sa_exc.IntegrityError) or "already exists" in str(exc.orig)


def add_columns(engine: sa.Engine, table: str, kinds: dict[str, str]) -> None:
    """Add the columns of ``kinds`` (name: SQL type) that ``table`` lacks: a table made by an older
    release gets what a newer one reads. A column a concurrent upgrader added first is fine."""
    present = {column["name"] for column in sa.inspect(engine).get_columns(table)}
    quote = engine.dialect.identifier_preparer.quote
    for name, kind in kinds.items():
        if name in present:
            continue
        try:
            with engine.begin() as connection:
                connection.exec_driver_sql(f"ALTER TABLE {quote(table)} ADD COLUMN {quote(name)} {kind}")
        except sa_exc.DBAPIError:
            pass
