"""Server-side bounds on the ledger's own statements, that end with them (:func:`bounded`).

The connections the ledger reads on are Django's: Django 5.1+'s PostgreSQL pool hands the one a
reader gave back to the next thread that asks, and PgBouncer in transaction mode hands a server
connection to another client after every transaction. A session setting left behind (a
``statement_timeout`` of 3 s) would cancel that client's business queries. So nothing set here
outlives the block: on PostgreSQL the bounds are ``SET LOCAL`` in a transaction (opened for the
block unless one is), which its COMMIT or ROLLBACK ends whatever happens; on MySQL/MariaDB and SQLite,
which have no transaction-scoped form of them, the session's own values are read first and put back
after the block, however it ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import transaction

__all__ = ["bounded"]


@contextmanager
def bounded(connection: Any, seconds: float) -> Iterator[None]:
    """Bound the statements and lock waits run on ``connection`` inside the block by ``seconds``,
    for the block only."""
    ms = max(1, int(seconds * 1000))
    if connection.vendor == "postgresql":
        with transaction.atomic(using=connection.alias, savepoint=False):
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = {ms}")
                cursor.execute(f"SET LOCAL statement_timeout = {ms}")
            yield
        return
    wanted: dict[str, float]
    if connection.vendor == "sqlite":
        wanted = {"busy_timeout": ms}
    elif connection.vendor == "mysql":  # MariaDB's statement bound is in seconds, MySQL's in milliseconds
        statement: float = round(seconds, 3) if connection.mysql_is_mariadb else ms
        name = "max_statement_time" if connection.mysql_is_mariadb else "max_execution_time"
        wanted = {"innodb_lock_wait_timeout": max(1, math.ceil(seconds)), name: statement}
    else:
        yield  # another backend: bounded by the reader's thread join alone
        return
    found = _session(connection, list(wanted))
    _set(connection, wanted)
    try:
        yield
    finally:
        _set(connection, found)


def _session(connection: Any, names: list[str]) -> dict[str, Any]:
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("PRAGMA busy_timeout")
        else:
            cursor.execute("SELECT " + ", ".join(f"@@SESSION.{name}" for name in names))
        return dict(zip(names, cursor.fetchone(), strict=True))


def _set(connection: Any, values: dict[str, Any]) -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute(f"PRAGMA busy_timeout = {int(values['busy_timeout'])}")
        else:
            cursor.execute("SET " + ", ".join(f"SESSION {name} = %s" for name in values), list(values.values()))
