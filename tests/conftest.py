"""Shared fixtures: one ``store`` fixture over every store, real servers, a fake clock.

Servers come from the environment, all read in tests/addresses.py. The store kind ``mariadb`` uses a
database of each test process's own on the MariaDB server, ``idem_<pid>``, created on first use and
dropped when the process ends.

A test that needs a server which is down is skipped with the reason locally, and fails in CI
(``CI=true``): CI must never go green by skipping the real thing.
"""

from __future__ import annotations

import atexit
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from addresses import (  # noqa: F401 - re-exported: tests import the addresses from here too
    MARIADB_SERVER_URL,
    POSTGRES_URL,
    RABBITMQ_URL,
    REDIS_BACKEND_URL,
    REDIS_BROKER_URL,
    REDIS_COUNTER_URL,
    REDIS_URL,
)

from celery_idem.stores import MemoryStore, Store, store_from_url

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_MARIA = urlsplit(MARIADB_SERVER_URL)
MARIADB_DATABASE = f"idem_{os.getpid()}"
MARIADB_URL = (
    f"mysql://{_MARIA.username or 'root'}{':' + _MARIA.password if _MARIA.password else ''}"
    f"@{_MARIA.hostname}:{_MARIA.port or 3306}/{MARIADB_DATABASE}"
)


STORE_KINDS = ("memory", "sqlite", "redis", "postgresql", "mariadb")
# The django:// store on each database of tests/django_project.py (kind -> its alias).
DJANGO_KINDS = {"django": "postgresql", "django-mariadb": "mariadb", "django-sqlite": "sqlite"}


@pytest.fixture(autouse=True)
def _fresh_memory_result_backend() -> Iterator[None]:
    """Celery's ``cache+memory://`` backend keeps one dict per process, shared by every app: a task id
    one test stored (``t-1``) would answer another test's ``AsyncResult('t-1')`` in the same pytest-xdist
    process. Each test starts with it empty."""
    from celery.backends import cache

    cache._DUMMY_CLIENT_CACHE.clear()
    yield


@pytest.fixture(autouse=True)
def _joins_allowed() -> Iterator[None]:
    """Celery's eager ``apply()`` marks "inside a task" in one process-wide flag, saved and restored
    around each call: threads racing eager calls can restore it set, and every later ``get()`` in
    the process then raises "Never call result.get() within a task!". Each test starts outside a task."""
    from celery._state import _set_task_join_will_block

    _set_task_join_will_block(False)
    yield


class FakeClock:
    """A clock tests move by hand. Starts at the real time so Redis key expiry stays sane."""

    def __init__(self, start: float | None = None) -> None:
        import time

        self.now = time.time() if start is None else start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


_mariadb_ready: str | None = None  # "" once this process's database exists, else why it does not


def _mariadb_connect(**options: Any) -> Any:
    import pymysql

    return pymysql.connect(
        host=_MARIA.hostname,
        port=_MARIA.port or 3306,
        user=_MARIA.username or "root",
        password=_MARIA.password or "",
        connect_timeout=2,
        **options,
    )


def _mariadb_database() -> str:
    """Create this process's database on MariaDB once (dropped at exit); "" or why it could not."""
    global _mariadb_ready
    if _mariadb_ready is None:
        try:
            connection = _mariadb_connect()
            with connection.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE IF NOT EXISTS `{MARIADB_DATABASE}` CHARACTER SET utf8mb4")
            connection.close()
            atexit.register(_drop_mariadb_database)
            _mariadb_ready = ""
        except Exception as exc:  # noqa: BLE001 - any failure means the server is not usable
            _mariadb_ready = f"mariadb is not reachable at {_MARIA.hostname}:{_MARIA.port or 3306}: {exc}"
    return _mariadb_ready


def _drop_mariadb_database() -> None:
    try:
        connection = _mariadb_connect()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{MARIADB_DATABASE}`")
        connection.close()
    except Exception:  # noqa: BLE001, S110 - the server went away: nothing is left to drop
        pass


def require_server(kind: str) -> None:
    """Skip (locally) or fail (CI) when the server behind ``kind`` does not answer."""
    if kind == "mariadb":
        down = _mariadb_database()
        if down:
            if IN_CI:
                pytest.fail(f"{down} (CI=true: servers are required)")
            pytest.skip(down)
        return
    url = {"redis": REDIS_URL, "postgresql": POSTGRES_URL}.get(kind)
    if url is None:
        return
    probe = store_from_url(url, timeout_seconds=1.0)
    try:
        probe.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means the server is not usable
        message = f"{kind} is not reachable at {url}: {exc}"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: servers are required)")
        pytest.skip(message)
    finally:
        probe.close()


def require_rabbitmq() -> None:
    """Skip (locally) or fail (CI) when RabbitMQ does not answer."""
    from kombu import Connection

    try:
        with Connection(RABBITMQ_URL, connect_timeout=3) as connection:
            connection.connect()
    except Exception as exc:  # noqa: BLE001
        message = f"RabbitMQ is not reachable at {RABBITMQ_URL}: {exc}"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: servers are required)")
        pytest.skip(message)


def store_url(kind: str, tmp_path: Any) -> str:
    """A URL other processes can open to reach the same store as the fixture."""
    return {
        "memory": "memory://",
        "sqlite": f"sqlite:///{tmp_path}/idem.db",
        "redis": REDIS_URL,
        "postgresql": POSTGRES_URL,
        "mariadb": MARIADB_URL,
    }[kind]


def make_store(kind: str, tmp_path: Any, prefix: str, **options: Any) -> Store:
    if kind in DJANGO_KINDS:
        # The django:// store on one of Django's databases (tests/django_project.py: a schema or a
        # database of this process, migrated): the SQL store built from DATABASES, tables from the migration.
        import django_project

        alias = DJANGO_KINDS[kind]
        django_project.require_alias(alias)
        return store_from_url(f"django://{alias}", key_prefix=prefix, **options)
    require_server(kind)
    return store_from_url(store_url(kind, tmp_path), key_prefix=prefix, **options)


def wipe(store: Store, backend: Any = None) -> None:
    """Remove everything the test wrote under its prefix; with a result ``backend``, the results of
    the calls its records name too."""
    if backend is not None:
        for record in store.records(limit=100_000):
            backend.forget(record.task_id)
    if type(store).__name__ == "RedisStore":
        client = store.client  # type: ignore[attr-defined]
        keys = list(client.scan_iter(match=f"{{{store.key_prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    elif type(store).__name__ in ("SQLStore", "DjangoStore"):
        import sqlalchemy as sa

        table = store.table  # type: ignore[attr-defined]
        store.create_schema()  # type: ignore[attr-defined]
        with store.engine.begin() as connection:  # type: ignore[attr-defined]
            connection.execute(sa.delete(table).where(table.c.namespace == store.key_prefix))
            liveness = store.liveness  # type: ignore[attr-defined]
            connection.execute(sa.delete(liveness).where(liveness.c.namespace == store.key_prefix))
    store.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(store_kind: str, tmp_path: Any, prefix: str, clock: FakeClock) -> Iterator[Store]:
    """Every store, each on its real backend, driven by the injected fake clock."""
    if store_kind == "memory":
        instance: Store = MemoryStore(key_prefix=prefix, clock=clock)
    else:
        instance = make_store(store_kind, tmp_path, prefix, clock=clock)
    yield instance
    wipe(instance)


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private 3-master Redis Cluster for the whole session (tests/redis_servers.py)."""
    from redis_servers import redis_cluster

    with redis_cluster(tmp_path_factory.mktemp("cluster")) as url:
        yield url


# The celery_app / celery_worker fixtures users test their own tasks with (tests/worker/test_contrib_pytest.py),
# and ours beside them, as docs/guides/testing.md tells users with pytest-celery installed (it is, in dev) to
# enable them: celery.contrib.pytest's in-process celery_worker, registered here after pytest-celery's plugin,
# is the one tests get; tests/smoke builds pytest-celery's worker cluster without that name.
pytest_plugins = ("celery.contrib.pytest", "celery_idem.contrib.pytest")


# ---- a hostile record: a pickle whose loading runs code ------------------------------------------

PICKLE = "application/x-python-serialize"


class Planted:
    """Unpickling this creates the directory ``path``: proof that something decoded it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.path,))


def plant_pickle(store: Store, identity: Any, fingerprint: str, path: str, ttl_seconds: float = 600) -> str:
    """A COMPLETED record of ``identity`` whose result claims the pickle content type and would
    create ``path`` when unpickled, written straight through the store; its task id."""
    import pickle

    task_id = str(uuid.uuid4())
    taken = store.acquire(identity, fingerprint, task_id, lease_seconds=ttl_seconds, ttl_seconds=ttl_seconds)
    assert taken.record is not None and taken.decision.value == "RUN"
    payload = pickle.dumps(Planted(path))
    assert store.complete(identity, taken.record.owner, payload, content_type=PICKLE, content_encoding="binary").ok
    return task_id


# The suite runs in four processes, a file each (README: -n 4 --dist loadfile), each taking the next
# file in collection order as it finishes one. The longest files go first (measured with --durations
# at issue 27's end: a minute or more each), so none of them starts last and keeps one process busy
# alone at the end.
LONGEST_FIRST = (
    "outages/test_chaos.py",
    "worker/test_busy_duplicates.py",
    "models/test_task_model.py",
    "worker/test_prefork.py",
    "outages/test_faults_sql.py",
    "worker/test_modes.py",
    "docs/test_demo.py",
    "worker/test_handles.py",
    "docs/test_readme.py",
    "recovery/test_reconciler.py",
    "worker/test_worker_control_flow.py",
    "compat/test_once.py",
    "compat/test_singleton.py",
    "contrib_django/test_django_outbox.py",
    "recovery/test_outbox.py",
    "worker/test_results_store.py",
    "api/test_cli.py",
    "outages/test_send_back.py",
    "docs/test_site_browser.py",
    "contrib_django/test_django_celery_outbox.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the rest, the order stays
