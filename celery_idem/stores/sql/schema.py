"""The SQL store's schema: its tables, and creating and upgrading them from many processes at once
(the ledger uses the same helpers)."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql

__all__ = ["DATA", "LAYOUT", "TIMES", "ExactText", "add_columns", "create_all", "liveness_table", "records_table"]

_MYSQL = ("mysql", "mariadb")  # engine.MYSQL (engine imports nothing of ours; nor does this module)
_NAME_LIMIT = 63  # PostgreSQL's identifiers (MySQL's are 64): a longer index name is shortened
# MySQL/MariaDB: InnoDB (row locks, transactions) in utf8mb4, whatever the server's defaults are.
_TABLE_OPTIONS: dict[str, Any] = {
    f"{d}_{k}": v for d in _MYSQL for k, v in (("engine", "InnoDB"), ("charset", "utf8mb4"))
}
# A BLOB holds 64 KiB on MySQL: results (max_result_bytes, 1 MiB by default) and calls need LONGBLOB.
_BYTES = sa.LargeBinary().with_variant(mysql.LONGBLOB(), *_MYSQL)
_LONG_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), *_MYSQL)


class ExactText(sa.TypeDecorator[str]):
    """Text that compares byte for byte on every database: VARCHAR on PostgreSQL and SQLite; on
    MySQL/MariaDB, VARBINARY of its UTF-8 (4 bytes a character), because their VARCHAR compares
    under a collation (the server's default, utf8mb4_general_ci, holds 'A' = 'a' and 'a' = 'a ')
    and no binary collation without padding is named alike on both."""

    impl = sa.String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.chars = length

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in _MYSQL:
            return dialect.type_descriptor(mysql.VARBINARY(4 * self.chars))
        return dialect.type_descriptor(sa.String(self.chars))

    def bind_processor(self, dialect: sa.Dialect) -> Any:
        if dialect.name not in _MYSQL:
            return None  # no per-value cost where the column is text already

        def encode(value: Any) -> Any:
            return value.encode() if isinstance(value, str) else value

        return encode

    def result_processor(self, dialect: sa.Dialect, coltype: object) -> Any:
        if dialect.name not in _MYSQL:
            return None

        def decode(value: Any) -> Any:
            return bytes(value).decode() if isinstance(value, (bytes, bytearray)) else value

        return decode


class _UuidBytes(sa.TypeDecorator[uuid.UUID]):
    """A UUID as its 16 bytes (MySQL/MariaDB): MariaDB's own UUID type refuses the identity hash,
    which is 16 bytes of SHA-256, not a UUID of any version."""

    impl = sa.LargeBinary  # rendered as BINARY(16): load_dialect_impl
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        return dialect.type_descriptor(mysql.BINARY(16))

    def process_bind_param(self, value: uuid.UUID | None, dialect: sa.Dialect) -> bytes | None:
        return None if value is None else value.bytes

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> uuid.UUID | None:
        return None if value is None else uuid.UUID(bytes=bytes(value))


def index_name(name: str) -> str:
    """``name`` when the database takes it whole, else its head and a hash of the whole (an index
    name of a long table name; every default name is far shorter)."""
    if len(name) <= _NAME_LIMIT:
        return name
    return f"{name[: _NAME_LIMIT - 9]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


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
        sa.Column("id", sa.Uuid().with_variant(_UuidBytes(), *_MYSQL), nullable=False),  # codec.identity_id
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("state_code", sa.SmallInteger, nullable=False),  # codec.STATE_CODES
        sa.Column("namespace", ExactText(64), nullable=False),
        sa.Column("scope", ExactText(255), nullable=False),
        sa.Column("task_name", ExactText(255), nullable=False),
        sa.Column("key", ExactText(255), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary, nullable=False),  # codec.FINGERPRINT
        sa.Column("task_id", sa.LargeBinary, nullable=False),  # codec.TASK_ID
        sa.Column("owner", sa.LargeBinary, nullable=False),  # codec.OWNER; its digest once settled
        sa.Column("result", _BYTES, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),  # '' for application/json
        sa.Column("content_encoding", sa.String(64), nullable=True),  # '' for utf-8
        sa.Column("error", _LONG_TEXT, nullable=True),
        sa.Column("call", _BYTES, nullable=True),  # kept only for stale_action="requeue"
        sa.Column("previous_task_id", sa.LargeBinary, nullable=True),  # an attempt taken over past its lease
        sa.PrimaryKeyConstraint("id", name=f"pk_{name}"),
        # The reconciler's index: unsettled records by lease expiry. Settled rows hold NULL and
        # have no entry; a query on ``lease_expires_at <= :now`` implies the predicate.
        sa.Index(
            index_name(f"ix_{name}_due"),
            "namespace",
            "lease_expires_at",
            postgresql_where=sa.text("lease_expires_at IS NOT NULL"),
            sqlite_where=sa.text("lease_expires_at IS NOT NULL"),
        ),
        sa.Index(index_name(f"ix_{name}_expiry"), "expires_at"),  # the purge's
        **_TABLE_OPTIONS,
    )


def liveness_table(metadata: sa.MetaData, name: str = "celery_idem_liveness") -> sa.Table:
    """Worker processes' liveness records (DESIGN "Death is a fact"): one row per process id."""
    return sa.Table(
        name,
        metadata,
        sa.Column("namespace", ExactText(64), primary_key=True),
        sa.Column("process", ExactText(64), primary_key=True),
        sa.Column("token", ExactText(64), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        **_TABLE_OPTIONS,
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
    # MySQL/MariaDB: "Table ... already exists" (1050), "Duplicate key name" (1061, an index)
    text = str(exc.orig)
    return isinstance(exc, sa_exc.IntegrityError) or "already exists" in text or "Duplicate key name" in text


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
