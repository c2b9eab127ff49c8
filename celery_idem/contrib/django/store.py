"""A store on Django's database: ``CELERY_IDEMPOTENCY_STORE = "django://"`` (the ``default``
database) or ``"django://<alias>"``, so a project with only PostgreSQL (or SQLite, MySQL, MariaDB)
and Django needs no Redis for idempotency.

It is the SQL store (:class:`~celery_idem.stores.sql.SQLStore`: every transition one conditional
statement, the same statements the store semantics suite and the model checker hold every SQL
store to) on the database ``settings.DATABASES[alias]`` names, through its own connections in
autocommit mode: a record's transitions never join a business transaction (the ledger is what
does), but for one: the outbox's claim at staging (:meth:`DjangoStore.claim_in_transaction`), on
PostgreSQL and SQLite, is written on the caller's connection in the caller's transaction, so it
commits or rolls back with the staged call, and a second request with the key waits for the first
one's transaction, then finds its claim. Its tables come from the app's migration (``manage.py
migrate celery_idem``), which creates them through the store's own schema code; the store creates
them too if they are missing.

Needs the ``sql`` and ``django`` extras (SQLAlchemy beside Django, psycopg for PostgreSQL), and the
``mysql`` extra on MySQL/MariaDB: the store talks to the database through PyMySQL, whichever driver
Django itself uses (mysqlclient, or PyMySQL as MySQLdb).
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from ...errors import ConfigurationError
from ...records import Identity, Transition
from ...stores.sql import SQLStore
from ...stores.sql.base import JOINED
from ...stores.sql.engine import engine_from_url

__all__ = ["DjangoStore", "engine_url"]

_ALIAS = re.compile(r"[A-Za-z0-9_.-]{1,100}")
# Django's OPTIONS that are Django's own, not the driver's.
_DJANGO_ONLY = {"isolation_level", "server_side_binding", "pool", "assume_role", "init_command", "transaction_mode"}
# Of a MySQL database's OPTIONS (mysqlclient's connect arguments), those PyMySQL takes alike.
_PYMYSQL = {"charset", "ssl", "read_default_file", "read_default_group", "unix_socket", "connect_timeout"}


def engine_url(database: dict[str, Any]) -> tuple[sa.URL, dict[str, Any]]:
    """The SQLAlchemy URL and driver arguments of a Django ``DATABASES`` entry (GeoDjango's PostGIS,
    SpatiaLite and MySQL backends are PostgreSQL, SQLite and MySQL to the store).

    Raises:
        ConfigurationError: a database engine the SQL store does not run on, or an in-memory SQLite one.
    """
    engine = str(database.get("ENGINE", ""))
    options = {k: v for k, v in (database.get("OPTIONS") or {}).items() if k not in _DJANGO_ONLY}
    if engine.endswith((".sqlite3", ".spatialite")):
        name = str(database.get("NAME", ""))
        if name in ("", ":memory:") or name.startswith("file:"):
            raise ConfigurationError(
                "django:// needs a SQLite database in a file: an in-memory one is private to each connection"
            )
        return sa.engine.URL.create("sqlite", database=name), {}
    try:
        port = int(database["PORT"]) if database.get("PORT") else None
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"django://: the database's PORT is not a number: {database['PORT']!r}") from exc
    if engine.endswith(".mysql"):  # django.db.backends.mysql, and GeoDjango's
        host = str(database.get("HOST") or "") or None
        args = {k: v for k, v in options.items() if k in _PYMYSQL}
        if host is not None and host.startswith("/"):  # Django: a HOST starting with "/" is a socket
            args["unix_socket"], host = host, None
        url = sa.engine.URL.create(
            "mysql+pymysql",
            username=database.get("USER") or None,
            password=database.get("PASSWORD") or None,
            host=host,
            port=port,
            database=database.get("NAME") or None,
        )
        return url, args
    if engine.endswith((".postgresql", ".postgresql_psycopg2", ".postgis")):
        host = str(database.get("HOST") or "") or None
        query: dict[str, str] = {}
        if host is not None and host.startswith("/"):  # a unix socket's directory (libpq's host=)
            query["host"], host = host, None
        url = sa.engine.URL.create(
            "postgresql+psycopg",
            username=database.get("USER") or None,
            password=database.get("PASSWORD") or None,
            host=host,
            port=port,
            database=database.get("NAME") or None,
            query=query,
        )
        return url, options
    raise ConfigurationError(
        f"django:// runs on PostgreSQL, SQLite, MySQL and MariaDB; this database's ENGINE is {engine!r} "
        "(use a redis:// store, or one of those databases)"
    )


class DjangoStore(SQLStore):
    """The SQL store on a database of Django's settings (``django://<alias>``)."""

    alias: str = "default"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> DjangoStore:
        """``django://`` (the ``default`` database) or ``django://<alias>``."""
        from django.conf import settings

        alias = url.partition("://")[2].strip("/") or "default"
        if not _ALIAS.fullmatch(alias):  # never echoed: it may be a URL with a password in it
            raise ConfigurationError("django:// takes the alias of a database in DATABASES: django://<alias>")
        databases = settings.DATABASES
        if alias not in databases:
            raise ConfigurationError(
                f"django://{alias}: settings.DATABASES has no such alias (it has {', '.join(sorted(databases))})"
            )
        address, connect_args = engine_url(databases[alias])
        engine = engine_from_url(address, float(options.get("timeout_seconds", 2.0)), connect_args)
        store = cls(engine, **options)
        store.alias = alias
        return store

    def __repr__(self) -> str:
        return f"DjangoStore(django://{self.alias}, key_prefix={self.key_prefix!r})"

    def claim_in_transaction(
        self, using: str, identity: Identity, fingerprint: str, task_id: str, **options: Any
    ) -> Transition | None:
        """:meth:`claim`, written in the transaction open on the database ``using`` on the caller's
        own connection: it commits or rolls back with that transaction, and a concurrent claim of
        the identity waits for it (its row lock) until then. None, claiming nothing, when it cannot:
        ``using`` is not this store's database, no transaction is open there (Django's autocommit
        would commit the claim alone), or the database is MySQL/MariaDB (whose claim is a
        transaction of its own).
        """
        from django.db import connections

        connection = connections[using]
        if using != self.alias or not connection.in_atomic_block or self.engine.dialect.name not in _JOINABLE:
            return None
        connection.ensure_connection()
        dialect = self.engine.dialect

        def execute(statement: sa.Executable, params: dict[str, Any]) -> _Answer:
            # The driver's own cursor on Django's connection (its transaction), in the dialect's
            # own parameter style: Django's cursor would rewrite the statement for its own style.
            cursor = connection.connection.cursor()
            try:
                if dialect.name == "postgresql" and params.get("p_now") is None:
                    # now() is the caller's transaction's start, which may be long past: the
                    # claim reads the server's clock as it is (a lease that ran out meanwhile has).
                    cursor.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
                    params = {**params, "p_now": float(cursor.fetchone()[0]) + float(params.get("p_shift") or 0.0)}
                compiled = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
                values = compiled.construct_params(params)
                processors = compiled._bind_processors
                values = {name: processors[name](v) if name in processors else v for name, v in values.items()}
                bound: Any = [values[name] for name in compiled.positiontup or ()] if compiled.positional else values
                with _bounded(cursor, dialect.name, self.timeout_seconds):
                    cursor.execute(compiled.string, bound)
                    names = [column[0] for column in cursor.description or ()]
                    found, rowcount = (cursor.fetchall() if names else []), cursor.rowcount
                row = _row(names)
                # psycopg2 (a Django project's older driver) reads bytea as a memoryview
                return _Answer([row(*(_bytes(v) for v in values)) for values in found], rowcount)
            finally:
                cursor.close()

        token = JOINED.set(execute)
        try:
            return self.claim(identity, fingerprint, task_id, **options)
        finally:
            JOINED.reset(token)


_JOINABLE = ("postgresql", "sqlite")


@contextlib.contextmanager
def _bounded(cursor: Any, dialect: str, seconds: float) -> Iterator[None]:
    """The store's deadline on one statement in the caller's transaction, and nothing of it after:
    on PostgreSQL its lock and statement timeouts, set for the transaction (``set_config(...,
    true)``) and put back as they were (the caller's later statements keep theirs). A claim that
    waits past it on another request's row lock raises, and the caller's transaction with it: never a
    hang. SQLite's wait for the write lock is the connection's own ``timeout`` (5 s by default)."""
    if dialect != "postgresql":
        yield
        return
    cursor.execute("SELECT current_setting('lock_timeout'), current_setting('statement_timeout')")
    saved = cursor.fetchone()
    limit = f"{max(1, round(seconds * 1000))}ms"
    set_both = "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)"
    cursor.execute(set_both, (limit, limit))
    yield
    cursor.execute(set_both, tuple(saved))  # not in a finally: after an error the transaction is over


def _row(names: Sequence[str]) -> Any:
    """A row class with the statement's column names as attributes (what the store reads)."""
    return collections.namedtuple("Row", names)


def _bytes(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value


class _Answer:
    """A statement's answer on the caller's connection, read as the store reads a cursor's."""

    def __init__(self, found: list[Any], rowcount: int) -> None:
        self._rows = found
        self.rowcount = rowcount
        self.step = "joined"

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise sa.exc.NoResultFound(f"expected one row, got {len(self._rows)}")
        return self._rows[0]

    def one_or_none(self) -> Any:
        return self._rows[0] if self._rows else None

    def all(self) -> list[Any]:
        return self._rows
