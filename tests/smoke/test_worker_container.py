"""celery-idem on a Celery worker in a Docker container, through pytest-celery's setup: the smoke test
for a suite whose CI has Docker (how to run it: tests/smoke/README.md).

pytest-celery starts a Redis broker, a Redis result backend and a worker container built from
tests/smoke/Dockerfile (celery-idem as checked out), whose app imports tests/smoke/idem_smoke_tasks.py.
celery-idem runs on both sides over one store, a database of the backend's Redis: on the test's
``celery_setup.app`` through the ``idem`` fixture, and on the worker's app.

Where no Docker engine answers, the tests are skipped with the reason, with ``CI=true`` too: the one
exception to "a test whose server is down fails in CI". Every other server this suite needs is one CI
starts itself (.ci/run); a Docker engine is the CI machine's own, and this suite is also run where
there is none (a container without the engine's socket, as on the development machine). A CI that has
one runs these tests; it is there to see the setup users are told to use work, not to guard a rule
of the library that another test does not already guard on the machine's own servers.

The fixtures are in this module, not a conftest.py: tests/ is not a package, so a second conftest.py
would take the name ``conftest`` from tests/conftest.py, which other modules import by that name.
"""

from __future__ import annotations

import gc
import shutil
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import pytest
import pytest_celery
import redis
from pytest_celery import (
    RESULT_TIMEOUT,
    CeleryBackendCluster,
    CeleryBrokerCluster,
    CeleryTestSetup,
    CeleryTestWorker,
    CeleryWorkerCluster,
    RedisTestBackend,
    RedisTestBroker,
)

from celery_idem import State
from celery_idem.contrib.pytest import IdempotencyFixture
from celery_idem.stores import Store, store_from_url

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
IMAGE_TAG = "celery-idem/smoke-worker:local"
STORE_DB = 1  # the result backend uses 0


def _docker_down() -> str:
    """Why no Docker engine can be used here ("" when one answers)."""
    import docker

    try:
        client = docker.from_env(timeout=5)  # asks the engine its API version: fails here without one
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - whatever the reason, there is no engine to run containers on
        why = f"{type(exc).__name__}: {exc}"
    else:
        return ""
    # The client that failed in its constructor never closed its socket: collect it now, quietly, rather
    # than let its ResourceWarning fail whichever test the garbage collector happens to run in.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return (
        f"no Docker engine answers ({why}); these tests run pytest-celery's worker container and are "
        "skipped without one, CI=true included (tests/smoke/README.md)"
    )


DOCKER_DOWN = _docker_down()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(DOCKER_DOWN), reason=DOCKER_DOWN),
    pytest.mark.timeout(900),  # the first run builds the worker image
]


# ---- pytest-celery's setup, pinned to Redis and to a worker image with celery-idem -----------------


@pytest.fixture
def celery_broker_cluster(celery_redis_broker: RedisTestBroker) -> Iterator[CeleryBrokerCluster]:
    cluster = CeleryBrokerCluster(celery_redis_broker)
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster(celery_redis_backend: RedisTestBackend) -> Iterator[CeleryBackendCluster]:
    cluster = CeleryBackendCluster(celery_redis_backend)
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_worker_cluster(celery_setup_worker: CeleryTestWorker) -> Iterator[CeleryWorkerCluster]:
    # Built from celery_setup_worker, not from "celery_worker": in this suite that name is
    # celery.contrib.pytest's in-process worker (tests/conftest.py), which wins over pytest-celery's.
    cluster = CeleryWorkerCluster(celery_setup_worker)
    yield cluster
    cluster.teardown()


@pytest.fixture(scope="session")
def celery_base_worker_image(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The image pytest-celery's worker container runs: tests/smoke/Dockerfile over this checkout."""
    context = tmp_path_factory.mktemp("smoke-worker-image")
    shutil.copytree(REPO / "celery_idem", context / "celery_idem", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, context / name)
    shutil.copy(HERE / "Dockerfile", context / "Dockerfile")
    image, _ = docker_client.images.build(
        path=str(context),
        tag=IMAGE_TAG,
        rm=True,
        buildargs={
            "PYTHON_VERSION": f"{sys.version_info.major}.{sys.version_info.minor}",
            "CELERY_VERSION": celery.__version__,
            "PYTEST_CELERY_VERSION": pytest_celery.__version__,
        },
    )
    return image


def _tasks() -> Any:
    # Imported only where a test runs: its shared task joins every app finalized in the process after it.
    import idem_smoke_tasks

    return idem_smoke_tasks


@pytest.fixture
def default_worker_tasks(default_worker_tasks: set[Any]) -> set[Any]:
    return default_worker_tasks | {_tasks()}


def _store_url(backend: RedisTestBackend, *, inside: bool) -> str:
    container = backend.container
    where = f"{container.hostname}:6379" if inside else f"localhost:{container.port}"
    return f"redis://{where}/{STORE_DB}"


@pytest.fixture
def default_worker_env(default_worker_env: dict[str, str], celery_redis_backend: RedisTestBackend) -> dict[str, str]:
    return {**default_worker_env, _tasks().STORE_ENV: _store_url(celery_redis_backend, inside=True)}


@pytest.fixture
def idem_store(celery_redis_backend: RedisTestBackend) -> Iterator[Store]:
    """The worker's store, as the test's process reaches it, for celery-idem on ``celery_setup.app``."""
    store = store_from_url(_store_url(celery_redis_backend, inside=False))
    yield store
    store.close()


@pytest.fixture
def effects(celery_redis_backend: RedisTestBackend) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(_store_url(celery_redis_backend, inside=False))
    yield client
    client.close()


# ---- the test -------------------------------------------------------------------------------------


def test_a_retried_call_charges_once_on_a_worker_container(
    celery_setup: CeleryTestSetup, idem: IdempotencyFixture, effects: redis.Redis
) -> None:
    tasks = _tasks()
    charge = celery_setup.app.tasks[tasks.CHARGE]
    queue = celery_setup.worker.worker_queue
    key = f"order-{uuid.uuid4().hex[:12]}"
    assert idem.app is celery_setup.app  # idem_app follows the test's pytest-celery setup

    # When a checkout's call is retried while the first is queued or running
    first = charge.apply_async((42, 100), idempotency_key=key, queue=queue)
    retry = charge.apply_async((42, 100), idempotency_key=key, queue=queue)

    # Then the retry is handed the first call's task id, nothing is published for it, and both get the charge
    assert retry.deduplicated and retry.id == first.id
    assert first.get(timeout=RESULT_TIMEOUT) == {"order_id": 42, "charged": 100}
    assert retry.get(timeout=RESULT_TIMEOUT) == {"order_id": 42, "charged": 100}
    idem.assert_deduplicated(charge, key)

    # When a copy arrives by name, as from a producer without celery-idem or a broker's redelivery
    copy = celery_setup.app.send_task(tasks.CHARGE, (42, 100), headers={"idempotency_key": key}, queue=queue)

    # Then the worker answers it from the store without running the body: one charge in all
    assert copy.get(timeout=RESULT_TIMEOUT) == {"order_id": 42, "charged": 100}
    assert int(effects.get(tasks.effect_key(42)) or 0) == 1
    idem.assert_ran(charge, key, times=0)  # the body ran in the container, never in this process
    record = idem.record(charge, key)
    assert record is not None and record.state is State.COMPLETED and record.task_id == first.id
