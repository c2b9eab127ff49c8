"""The django:// store: the SQL store on a database of Django's settings, its tables from the app's
migration. Its transitions are the SQL store's, and tests/stores/test_store_semantics.py and the
model checker (tests/models/test_model_stores.py) run on it as the store kind "django"; this module
checks what is its own: the URL, the DATABASES entry it is built from, and the migration."""

from __future__ import annotations

import sys
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402, F401 - configures Django for this module
from celery import Celery  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from django_project import require_alias  # noqa: E402

from celery_idem import Idempotency, IdempotentTask, State, store_from_url  # noqa: E402
from celery_idem.contrib.django.store import DjangoStore, engine_url  # noqa: E402
from celery_idem.errors import ConfigurationError  # noqa: E402
from celery_idem.records import Identity  # noqa: E402

TABLES = {"celery_idem_records", "celery_idem_liveness"}


@pytest.mark.parametrize("alias", ["sqlite", "postgresql", "mariadb"])
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
    url, options = engine_url(entry)
    assert url.render_as_string(hide_password=False) == "postgresql+psycopg://app:p%40ss@db.internal:6432/shop"
    assert options == {"sslmode": "require"}
    sqlite, _ = engine_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "/var/shop.db"})
    assert sqlite.drivername == "sqlite" and sqlite.database == "/var/shop.db"


def test_a_mysql_database_entry_becomes_a_pymysql_url_with_the_options_pymysql_takes() -> None:
    # Given a MariaDB/MySQL entry whose OPTIONS mix Django's own, mysqlclient's and shared ones
    entry = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": "shop",
        "USER": "app",
        "PASSWORD": "p@ss",
        "HOST": "db.internal",
        "PORT": "3307",
        "OPTIONS": {"charset": "utf8mb4", "init_command": "SET sql_mode='STRICT_TRANS_TABLES'", "isolation_level": "x"},
    }
    url, options = engine_url(entry)
    # Then the store reaches it through PyMySQL with the options PyMySQL shares with mysqlclient
    assert url.render_as_string(hide_password=False) == "mysql+pymysql://app:p%40ss@db.internal:3307/shop"
    assert options == {"charset": "utf8mb4"}
    # and a HOST that is a path is the server's socket (Django's rule for MySQL)
    socket_url, socket_options = engine_url(dict(entry, HOST="/run/mysqld/mysqld.sock", OPTIONS={}))
    assert socket_url.host is None and socket_options == {"unix_socket": "/run/mysqld/mysqld.sock"}
    geo, _ = engine_url(dict(entry, ENGINE="django.contrib.gis.db.backends.mysql"))
    assert geo.drivername == "mysql+pymysql"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("django://nowhere", r"django://nowhere: settings.DATABASES has no such alias \(it has default, "),
        ("django://", r"django:// needs a SQLite database in a file: an in-memory one is private"),
        ("django://oracle", r"django:// runs on PostgreSQL, SQLite, MySQL and MariaDB; this database's ENGINE is "),
    ],
)
def test_a_database_the_store_cannot_run_on_is_refused(url: str, message: str, monkeypatch: Any) -> None:
    monkeypatch.setitem(settings.DATABASES, "oracle", {"ENGINE": "django.db.backends.oracle", "NAME": "shop"})
    with pytest.raises(ConfigurationError, match=message):
        store_from_url(url)


def test_without_the_app_set_up_the_scheme_says_what_it_needs(monkeypatch: Any) -> None:
    from celery_idem import stores

    monkeypatch.setattr(stores, "_REGISTERED", {})
    with pytest.raises(ConfigurationError, match=r"needs 'celery_idem.contrib.django' in INSTALLED_APPS"):
        store_from_url("django://")


# ---- what DATABASES holds, and what a registered scheme gets from store_from_url ---------------------

PG = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app"}


# store_from_url's _opened asks the registered class for _misconfiguration/_is_mistake/_is_outage,
#    which _DjangoStoreURL (and any class following register_scheme's documented contract) lacks:
#    every error from from_url other than a ConfigurationError becomes an AttributeError.
def test_a_bad_port_in_databases_is_a_configuration_error_not_an_attribute_error(monkeypatch: Any) -> None:
    monkeypatch.setitem(settings.DATABASES, "badport", dict(PG, PORT="54x2"))
    with pytest.raises(ConfigurationError):
        store_from_url("django://badport")


def test_without_sqlalchemy_django_url_says_to_install_the_sql_extra(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # `import sqlalchemy` fails
    monkeypatch.delitem(sys.modules, "celery_idem.contrib.django.store")
    with pytest.raises(ConfigurationError):
        store_from_url("django://sqlite")


def test_a_third_party_scheme_with_only_from_url_gets_its_errors_classified(monkeypatch: Any) -> None:
    from celery_idem import stores

    class Mine:  # what register_scheme's docstring asks for: "a class with from_url(url, **options)"
        @staticmethod
        def from_url(url: str, **options: Any) -> Any:
            raise OSError("connection refused")

    monkeypatch.setitem(stores._REGISTERED, "mine", Mine)
    from celery_idem.errors import StoreUnavailableError

    with pytest.raises(StoreUnavailableError):
        store_from_url("mine://x")


# HOST as a unix-socket directory (libpq's usual local setup; Cloud SQL's /cloudsql/<instance>):
#    the rendered URL puts the path into the database name and loses the host.
@pytest.mark.parametrize("port", [None, "5432"])
def test_a_unix_socket_host_reaches_the_socket_and_the_named_database(port: str | None) -> None:
    entry = dict(PG, HOST="/var/run/postgresql", PORT=port)
    url, _ = engine_url(entry)
    # the socket directory is libpq's host=, and the database is "shop"
    assert url.database == "shop" and url.host is None and url.query["host"] == "/var/run/postgresql", url


def test_a_unix_socket_host_store_engine_targets_database_shop(monkeypatch: Any) -> None:
    monkeypatch.setitem(settings.DATABASES, "socket", dict(PG, HOST="/cloudsql/proj:region:inst"))
    store = DjangoStore.from_url("django://socket")
    try:
        assert store.engine.url.database == "shop", store.engine.url
    finally:
        store.close()


# The migration on PostgreSQL crashes `migrate` when SQLAlchemy is installed but psycopg (3) is
#    not, e.g. a Django project on psycopg2 that never asked for the sql extra: _store() only
#    swallows import errors of the module, not the driver's, raised by create_engine.
def test_the_migration_does_not_crash_migrate_without_psycopg3(monkeypatch: Any) -> None:
    require_alias("postgresql")
    migration = __import__("celery_idem.contrib.django.migrations.0002_store", fromlist=["create_tables"])
    monkeypatch.setitem(sys.modules, "psycopg", None)
    for name in [m for m in sys.modules if m.startswith("psycopg.")]:
        monkeypatch.setitem(sys.modules, name, None)
    editor = SimpleNamespace(connection=connections["postgresql"])
    migration.create_tables(None, editor)  # a no-op: no django:// store without psycopg 3


# PostGIS / SpatiaLite are PostgreSQL / SQLite (connection.vendor says so), but ENGINE's suffix
#    is checked: the store is refused, with a message saying it runs on PostgreSQL, and the
#    migration silently creates no tables on them.
@pytest.mark.parametrize(
    "entry",
    [
        dict(PG, ENGINE="django.contrib.gis.db.backends.postgis"),
        {"ENGINE": "django.contrib.gis.db.backends.spatialite", "NAME": "/tmp/geo.db"},
    ],
)
def test_geodjango_backends_are_postgresql_and_sqlite(entry: dict[str, Any]) -> None:
    url, _ = engine_url(entry)
    assert url.drivername.startswith(("postgresql", "sqlite"))


# A SQLite NAME with '?' or '#' (legal in a file name) is rendered unescaped into the URL:
#    the store opens another file than Django's database.
def test_a_sqlite_name_with_a_question_mark_is_the_same_file(tmp_path: Any) -> None:
    name = str(tmp_path / "shop?v2.sqlite3")
    url, _ = engine_url({"ENGINE": "django.db.backends.sqlite3", "NAME": name})
    assert url.database == name, url


# A password typed into django:// (someone mistaking it for a database URL) is echoed back in
#    the ConfigurationError: _opened redacts the URL it prints but not DjangoStore's own message.
def test_a_password_in_a_django_url_is_not_echoed() -> None:
    with pytest.raises(ConfigurationError) as caught:
        store_from_url("django://app:s3cret@db.internal/shop")
    assert "s3cret" not in str(caught.value), str(caught.value)


def test_a_scheme_of_celery_idems_own_cannot_be_registered() -> None:
    from celery_idem.stores import register_scheme

    with pytest.raises(ConfigurationError, match=r"redis:// is one of celery-idem's own store URL schemes"):
        register_scheme("REDIS", DjangoStore)
