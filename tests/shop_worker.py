"""The in-process worker of the tests/worker/test_worker_*.py modules: ``shop`` (tests/shop.py's app) on a
real broker, Redis and again RabbitMQ, with a Redis store.

The worker runs in the test's process (celery.contrib.testing's start_worker, threads pool); executions
are counted by the INCR each task body makes (tests/shop.py), never by the library's records. ``shop`` is
module-scoped: each module that uses it starts its own worker per broker (about 1 s on Redis, 10 s on
RabbitMQ, most of it the RabbitMQ worker's shutdown). A module takes the fixtures by assignment
(``shop = shop_worker.shop``): an imported name shadowed by the test's argument is a redefinition to ruff.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL
from celery import signals
from celery.contrib.testing.worker import start_worker
from conftest import RABBITMQ_URL, REDIS_URL, require_rabbitmq, require_server
from shop import COUNTER_URL, effects_key, make_app

from celery_idem import Idempotency

BROKERS = {"redis": REDIS_BROKER_URL, "rabbitmq": RABBITMQ_URL}
BACKEND = REDIS_BACKEND_URL
GET = 20  # seconds a test waits for a result


@dataclass
class Shop:
    app: Any
    idem: Idempotency
    prefix: str
    broker: str
    counter: redis.Redis
    worker: str = ""  # the in-process worker's name, for control commands sent to it alone

    def task(self, name: str) -> Any:
        return self.app.tasks[f"shop.{name}"]

    def effects(self, task: str, key: str) -> int:
        return int(self.counter.get(effects_key(self.prefix, f"shop.{task}", key)) or 0)


@pytest.fixture(scope="module", params=sorted(BROKERS))
def shop(request: pytest.FixtureRequest) -> Iterator[Shop]:
    require_server("redis")
    if request.param == "rabbitmq":
        require_rabbitmq()
    prefix = f"w{uuid.uuid4().hex[:10]}"
    app = make_app(broker=BROKERS[request.param], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    queues = [prefix, f"{prefix}.heavy"]  # shop.moving moves to the second
    with start_worker(
        app, pool="threads", concurrency=8, perform_ping_check=False, shutdown_timeout=20, queues=queues
    ) as worker:
        counter = redis.Redis.from_url(COUNTER_URL)
        yield Shop(app, Idempotency.of(app), prefix, request.param, counter, worker.hostname)


@pytest.fixture
def key() -> str:
    return f"k-{uuid.uuid4().hex}"


@pytest.fixture
def published(shop: Shop) -> Iterator[list[str]]:
    """Task ids of the messages this process publishes for the shop's app."""
    sent: list[str] = []

    def count(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if str(sender).startswith("shop."):
            sent.append(headers["id"])

    signals.before_task_publish.connect(count, weak=False)
    yield sent
    signals.before_task_publish.disconnect(count)


def until(predicate: Any, seconds: float = GET) -> None:
    """Wait (polling) until ``predicate()`` is true; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
