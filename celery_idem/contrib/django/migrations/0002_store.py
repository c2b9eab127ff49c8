"""The django:// store's tables (records and worker liveness), created by the store's own schema code
(:meth:`~celery_idem.stores.sql.SQLStore.create_schema`, the layout every SQL store has), on
PostgreSQL, SQLite and MySQL/MariaDB. Elsewhere (where the SQL store does not run) it does nothing,
so ``migrate`` still gives such a project the ledger's table."""

from __future__ import annotations

from typing import Any

from django.db import migrations

STORE_VENDORS = ("postgresql", "sqlite", "mysql")  # Django's vendor of MariaDB is "mysql" too


def _store(schema_editor: Any) -> Any:
    """The alias's django:// store; None where there can be none (no SQLAlchemy, another vendor, an
    in-memory SQLite database, which is private to each connection)."""
    if schema_editor.connection.vendor not in STORE_VENDORS:
        return None
    try:
        from celery_idem.contrib.django.store import DjangoStore
        from celery_idem.errors import ConfigurationError
    except Exception:  # noqa: BLE001 - without the sql extra there is no django:// store
        return None
    try:
        return DjangoStore.from_url(f"django://{schema_editor.connection.alias}")
    except (ConfigurationError, ImportError):  # not a database the store runs on; or no psycopg 3 / PyMySQL
        return None


def create_tables(apps: Any, schema_editor: Any) -> None:
    store = _store(schema_editor)
    if store is None:
        return
    try:
        store.create_schema()
    finally:
        store.close()


def drop_tables(apps: Any, schema_editor: Any) -> None:
    store = _store(schema_editor)
    if store is None:
        return
    try:
        store.metadata.drop_all(store.engine, checkfirst=True)
    finally:
        store.close()


class Migration(migrations.Migration):
    # The store's own connections create the tables: a transaction of the migration's, holding
    # SQLite's write lock, would keep them waiting.
    atomic = False

    dependencies = [("celery_idem", "0001_initial")]

    operations = [migrations.RunPython(create_tables, drop_tables, elidable=False)]
