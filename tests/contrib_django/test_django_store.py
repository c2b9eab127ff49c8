"""The django:// store: the SQL store on a database of Django's settings, its tables from the app's
migration. Its transitions are the SQL store's, and tests/stores/test_store_semantics.py and the
model checker (tests/models/test_model_stores.py) run on it as the store kind "django"; this module
checks what is its own: the URL, the DATABASES entry it is built from, and the migration."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402, F401 - configures Django for this module
from celery import Celery  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from django_project import require_alias  # noqa: E402

from celery_idem import Idempotency, IdempotentTask, State, store_from_url  # noqa: E402
from celery_idem.contrib.django.store import DjangoStore, engine_url  # noqa: E402
from celery_idem.errors import ConfigurationError  # noqa: E402
from celery_idem.records import Identity  # noqa: E402

TABLES = {"celery_idem_records", "celery_idem_liveness"}


@pytest.mark.parametrize("alias", ["sqlite", "postgresql"])
def test_migrate_creates_the_store_tables_and_a_task_runs_once_on_them(alias: str) -> None:
    require_alias(alias)
    assert TABLES <= set(connections[alias].introspection.table_names())  # made by `migrate`
    prefix = f"dj{uuid.uuid4().hex[:8]}"
    app = Celery("djstore", set_as_current=False)
    app.conf.task_always_eager = True
    Idempotency(app, store=f"django://{alias}", key_prefix=prefix)
    ran: list[int] = []

    @app.task(base=IdempotentTask, shared=False, name="djstore.charge")
    def charge(order: int) -> int:
        ran.append(order)
        return order * 10

    assert charge.apply_async((4,), idempotency_key="order-4").get() == 40
    again = charge.apply_async((4,), idempotency_key="order-4")
    assert again.deduplicated and again.get() == 40 and ran == [4]
    store = Idempotency.of(app).store
    assert isinstance(store, DjangoStore) and repr(store) == f"DjangoStore(django://{alias}, key_prefix={prefix!r})"
    record = store.get(Identity("", "djstore.charge", "order-4"))
    assert record is not None and record.state is State.COMPLETED
    store.forget(Identity("", "djstore.charge", "order-4"))


def test_the_migration_is_reversible() -> None:
    call_command("migrate", "celery_idem", "0001", database="sqlite", verbosity=0)
    assert not TABLES & set(connections["sqlite"].introspection.table_names())
    call_command("migrate", "celery_idem", database="sqlite", verbosity=0)
    assert TABLES <= set(connections["sqlite"].introspection.table_names())


def test_a_database_entry_becomes_the_engine_url_and_the_drivers_options() -> None:
    entry = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "shop",
        "USER": "app",
        "PASSWORD": "p@ss",
        "HOST": "db.internal",
        "PORT": "6432",
        "OPTIONS": {"sslmode": "require", "isolation_level": 1, "pool": True},
    }
    assert engine_url(entry) == ("postgresql+psycopg://app:p%40ss@db.internal:6432/shop", {"sslmode": "require"})
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/var/shop.db"}
    assert engine_url(sqlite) == ("sqlite:////var/shop.db", {})


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("django://nowhere", r"django://nowhere: settings.DATABASES has no such alias \(it has default, "),
        ("django://", r"django:// needs a SQLite database in a file: an in-memory one is private"),
        ("django://mariadb", r"django:// runs on PostgreSQL and SQLite; this database's ENGINE is "),
    ],
)
def test_a_database_the_store_cannot_run_on_is_refused(url: str, message: str) -> None:
    if url.endswith("mariadb"):
        require_alias("mariadb")
    with pytest.raises(ConfigurationError, match=message):
        store_from_url(url)


def test_without_the_app_set_up_the_scheme_says_what_it_needs(monkeypatch: Any) -> None:
    from celery_idem import stores

    monkeypatch.setattr(stores, "_REGISTERED", {})
    with pytest.raises(ConfigurationError, match=r"needs 'celery_idem.contrib.django' in INSTALLED_APPS"):
        store_from_url("django://")
