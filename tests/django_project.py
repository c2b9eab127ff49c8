"""Django, configured once per test process for celery_idem.contrib.django's tests (imported by
each of them; not a conftest.py, whose module name would shadow tests/conftest.py).

The installed apps are the example project's (``examples/django_shop``: celery-idem's app and the
shop's ``Order`` and ``Payment``), on three databases, each migrated with ``migrate``:

- ``default``: in-memory SQLite (transactions and on_commit; one connection per thread);
- ``sqlite``: a SQLite file of this process, which threads and processes share;
- ``postgresql``: a schema of this process in the ``test`` database, when PostgreSQL answers;
- ``postgresql_pool``: the same schema through Django's connection pool (Django 5.1+ with
  psycopg_pool; ``OPTIONS={"pool": ...}``), one connection at most, so every thread that asks for a
  connection gets the one the last gave back;
- ``mariadb``: a database of this process on MariaDB (127.0.0.1:3306, root), when it answers
  (through PyMySQL, the pure-Python driver Django runs as MySQLdb).

:func:`shop_env` gives a child process (a racer, a worker) the same database through the example
project's own settings module.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

django = pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

from conftest import IN_CI, POSTGRES_URL  # noqa: E402
from django.conf import settings  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_shop"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

_HOME = tempfile.mkdtemp(prefix="celery-idem-django-")
SQLITE_PATH = os.path.join(_HOME, "shop.sqlite3")
SCHEMA = f"djt_{os.getpid()}_{uuid.uuid4().hex[:8]}"
_pg = urlsplit(POSTGRES_URL.replace("+psycopg", ""))
PG_URL = f"postgresql://{_pg.username or 'postgres'}@{_pg.hostname}:{_pg.port or 5432}{_pg.path}"


def _postgres_schema() -> str | None:
    """This process's schema, created now; None (with the reason) when PostgreSQL does not answer."""
    try:
        import psycopg

        with psycopg.connect(PG_URL, autocommit=True, connect_timeout=2) as connection:
            connection.execute(f'CREATE SCHEMA "{SCHEMA}"')
    except Exception as exc:  # noqa: BLE001 - any failure means the server is not usable
        return f"postgresql is not reachable at {PG_URL}: {exc}"
    atexit.register(_drop_schema)
    return None


def _drop_schema() -> None:
    import psycopg
    from django.db import connections

    connections.close_all()
    if "postgresql_pool" in connections.settings:
        connections["postgresql_pool"].close_pool()
    with psycopg.connect(PG_URL, autocommit=True, connect_timeout=2) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')


MARIADB = os.environ.get("CELERY_IDEM_TEST_MARIADB_URL", "mysql://root@127.0.0.1:3306/test")
_maria = urlsplit(MARIADB)
MARIA_DB = f"djt_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def _mariadb_database() -> str | None:
    """This process's database on MariaDB, created now; None (with the reason) when it does not answer."""
    try:
        import pymysql

        pymysql.install_as_MySQLdb()
        connection = pymysql.connect(
            host=_maria.hostname, port=_maria.port or 3306, user=_maria.username or "root", connect_timeout=2
        )
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{MARIA_DB}` CHARACTER SET utf8mb4")
        connection.close()
    except Exception as exc:  # noqa: BLE001 - any failure means the server is not usable
        return f"mariadb is not reachable at {MARIADB}: {exc}"
    atexit.register(_drop_mariadb)
    return None


def _drop_mariadb() -> None:
    import pymysql
    from django.db import connections

    connections.close_all()
    connection = pymysql.connect(host=_maria.hostname, port=_maria.port or 3306, user=_maria.username or "root")
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS `{MARIA_DB}`")
    connection.close()


def _no_pool() -> str | None:
    """Why Django cannot pool PostgreSQL connections here, or None."""
    if django.VERSION < (5, 1):
        return f"Django {django.get_version()} has no connection pool (5.1+)"
    if importlib.util.find_spec("psycopg_pool") is None:
        return "psycopg_pool is not installed (the dev extra's psycopg[pool])"
    return None


PG_DOWN: str | None = None
POOL_DOWN: str | None = _no_pool()
MARIA_DOWN: str | None = None
ALIASES = ("sqlite", "postgresql", "mariadb")

if not settings.configured:
    PG_DOWN = _postgres_schema()
    MARIA_DOWN = _mariadb_database()
    databases = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
        "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": SQLITE_PATH, "OPTIONS": {"timeout": 20}},
    }
    if PG_DOWN is None:
        databases["postgresql"] = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _pg.path.lstrip("/"),
            "USER": _pg.username or "postgres",
            "HOST": _pg.hostname,
            "PORT": str(_pg.port or 5432),
            "OPTIONS": {"options": f"-c search_path={SCHEMA}"},
        }
        if POOL_DOWN is None:
            pooled = dict(databases["postgresql"], OPTIONS=dict(databases["postgresql"]["OPTIONS"]))
            pooled["OPTIONS"]["pool"] = {"min_size": 1, "max_size": 1, "timeout": 10}
            databases["postgresql_pool"] = pooled
    if MARIA_DOWN is None:
        databases["mariadb"] = {
            "ENGINE": "django.db.backends.mysql",
            "NAME": MARIA_DB,
            "USER": _maria.username or "root",
            "HOST": _maria.hostname,
            "PORT": str(_maria.port or 3306),
            "OPTIONS": {"charset": "utf8mb4"},
        }
    # The example's settings file alone (its package's __init__ loads the project's Celery app)
    spec = importlib.util.spec_from_file_location("django_shop_settings", EXAMPLE / "django_shop" / "settings.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    settings.configure(
        INSTALLED_APPS=[app for app in example.INSTALLED_APPS if app != "django.contrib.staticfiles"],
        MIDDLEWARE=example.MIDDLEWARE,
        TEMPLATES=example.TEMPLATES,
        # The admin alone: the example's URLconf imports its Celery app, which sets DJANGO_SETTINGS_MODULE
        # in this process's environment (for every worker a later test starts), as a project's should
        ROOT_URLCONF="contrib_django.admin_urls",
        ALLOWED_HOSTS=example.ALLOWED_HOSTS,
        DATABASES=databases,
        USE_TZ=True,
        SECRET_KEY="celery-idem-tests",
    )
    django.setup()
    from django.core.management import call_command

    for alias in databases:
        call_command("migrate", database=alias, verbosity=0)
    atexit.register(shutil.rmtree, _HOME, True)


def require_alias(alias: str) -> None:
    """Skip (locally) or fail (CI) when the database behind ``alias`` is not there."""
    if alias == "postgresql_pool" and POOL_DOWN is not None:
        pytest.skip(POOL_DOWN)  # not a server that is down: what this Django can do
    down = {"postgresql": PG_DOWN, "postgresql_pool": PG_DOWN, "mariadb": MARIA_DOWN}.get(alias)
    if down is not None:
        if IN_CI:
            pytest.fail(f"{down} (CI=true: servers are required)")
        pytest.skip(down)


def shop_env(alias: str) -> dict[str, str]:
    """The environment of a child process running the example project on ``alias``'s database."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="django_shop.settings")
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), str(Path(__file__).resolve().parent.parent)])
    if alias == "postgresql":
        env.update(DJANGO_SHOP_DB=PG_URL, DJANGO_SHOP_DB_SCHEMA=SCHEMA)
    elif alias == "mariadb":
        user, port = _maria.username or "root", _maria.port or 3306
        env["DJANGO_SHOP_DB"] = f"mysql://{user}@{_maria.hostname}:{port}/{MARIA_DB}"
    else:
        env["DJANGO_SHOP_DB"] = f"sqlite:///{SQLITE_PATH}"
    return env
