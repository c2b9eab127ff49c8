"""Settings given in code reach pool children however they are started (Celery 5.7's
``worker_pool_start_method="spawn"``): a real ``celery worker`` subprocess, prefork pool, spawn."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from addresses import REDIS_BROKER_URL
from celery import Celery
from conftest import REDIS_URL, require_server
from shop import make_app
from workers import BACKEND, wait_for

from celery_idem import ConfigurationError, Idempotency, MemoryStore

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]  # tests/: the spawn_shop app
GET = 60
BROKER = REDIS_BROKER_URL


@pytest.fixture
def prefix() -> str:
    return f"s{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store_instance() -> bool:
    return False


@pytest.fixture
def spawn_worker(tmp_path: Path, prefix: str, store_instance: bool) -> Iterator[Path]:
    """``celery -A spawn_shop worker -P prefork`` whose children are spawned; its log file."""
    require_server("redis")
    log = tmp_path / "worker.log"
    env = {
        **os.environ,
        "SHOP_BROKER": BROKER,
        "SHOP_BACKEND": BACKEND,
        "SHOP_STORE": REDIS_URL,
        "SHOP_PREFIX": prefix,
        "SHOP_QUEUE": prefix,
        "SHOP_SETTINGS": json.dumps({"ttl_seconds": 1234}),
        "SPAWN_STORE_INSTANCE": "1" if store_instance else "",
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "spawn_shop",
        "worker",
        "-P",
        "prefork",
        "-c",
        "1",
        "-Q",
        prefix,
        "-n",
        f"{prefix}@%h",
        "-l",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=TESTS, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(lambda: "ready." in log.read_text(errors="replace") or process.poll() is not None, "worker start", 90)
        assert process.poll() is None, f"worker exited:\n{log.read_text(errors='replace')}"
        yield log
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def test_settings_given_in_code_reach_spawned_pool_children(spawn_worker: Path, prefix: str) -> None:
    # Given a worker whose only store setting is Idempotency(app, store=...) and whose children are spawned
    producer = make_app(broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    idem = Idempotency.of(producer)
    key = f"k-{uuid.uuid4().hex}"
    try:
        # When a task runs there, twice
        charge = producer.tasks["shop.charge"]
        first = charge.apply_async((5, 50), idempotency_key=key)
        answer = first.get(timeout=GET)
        # Then the child ran it under the settings given in code: the store, its prefix, the TTL
        assert answer["task_id"] == first.id, spawn_worker.read_text(errors="replace")
        again = producer.send_task("shop.charge", (5, 50), headers={"idempotency_key": key})
        assert again.get(timeout=GET) == answer
        record = idem.get("shop.charge", key)
        assert record is not None and record.state.value == "COMPLETED"
        assert abs(record.expires_at - record.updated_at - 1234) < 1  # the child's TTL, not the producer's
    finally:
        idem.forget("shop.charge", key)
        producer.close()


@pytest.mark.parametrize("store_instance", [True])
def test_a_store_instance_given_in_code_fails_clearly_in_a_spawned_child(spawn_worker: Path, prefix: str) -> None:
    # Given a worker given a Store instance in code (it cannot be pickled), children spawned
    producer = make_app(broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    key = f"k-{uuid.uuid4().hex}"
    try:
        # When a task runs in a child, then it fails naming the setting and the fix
        result = producer.tasks["shop.charge"].apply_async((6, 60), idempotency_key=key)
        with pytest.raises(ConfigurationError, match="setting store was given in code as RedisStore") as raised:
            result.get(timeout=GET)
        assert "worker_pool_start_method='spawn'" in str(raised.value) and "its URL" in str(raised.value)
    finally:
        Idempotency.of(producer).forget("shop.charge", key)
        producer.close()


def test_settings_given_in_code_travel_with_the_pickled_app() -> None:
    # What billiard does for a spawned child: pickle the app, rebuild it from its conf
    app = Celery("travel", set_as_current=False)
    Idempotency(app, store=REDIS_URL, key_prefix="far", ttl_seconds=77, retryable=(KeyError,))
    rebuilt = pickle.loads(pickle.dumps(app))
    settings = Idempotency.of(rebuilt).settings
    assert (settings.store, settings.key_prefix, settings.ttl_seconds) == (REDIS_URL, "far", 77)
    assert settings.retryable == (KeyError,)

    # A Store instance stays behind: using it there is a clear error, and here the instance is used
    instance = MemoryStore()
    Idempotency(app, store=instance)
    assert Idempotency.of(app).store is instance
    with pytest.raises(ConfigurationError, match="cannot travel to this process"):
        Idempotency.of(pickle.loads(pickle.dumps(app))).store  # noqa: B018 - building it is the point
