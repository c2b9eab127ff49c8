"""The DESIGN §1 example through celery.contrib.pytest's own fixtures, as a user's test suite
would run it: a real worker (``celery_worker``) on a real Redis broker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL
from conftest import REDIS_URL, require_server, wipe
from shop import COUNTER_URL

from celery_idem import Idempotency, IdempotentTask, PayloadMismatchError, idempotent_task

PREFIX = f"cp{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def celery_config() -> dict[str, Any]:
    require_server("redis")
    return {
        "broker_url": REDIS_BROKER_URL,
        "result_backend": REDIS_BACKEND_URL,
        "task_default_queue": PREFIX,
        "idempotency_store": REDIS_URL,  # the app.conf way to configure celery-idem
        "idempotency_key_prefix": PREFIX,
    }


@pytest.fixture
def counter() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(COUNTER_URL)
    yield client
    client.delete(f"{PREFIX}:charges", f"{PREFIX}:receipts")


@pytest.fixture
def tasks(celery_app: Any, counter: redis.Redis) -> Iterator[dict[str, Any]]:
    @celery_app.task(
        base=IdempotentTask, shared=False, idempotency={"key_args": ["order_id", "amount"], "ttl_seconds": 3600}
    )
    def charge(order_id: int, amount: int) -> dict[str, int]:
        counter.incr(f"{PREFIX}:charges")
        return {"order_id": order_id, "charged": amount}

    @idempotent_task(app=celery_app, shared=False, ttl_seconds=600)
    def send_receipt(order_id: int) -> None:
        counter.incr(f"{PREFIX}:receipts")

    yield {"charge": charge, "send_receipt": send_receipt}
    wipe(Idempotency.of(celery_app).store)


def test_the_design_example_through_celery_contrib_pytest(celery_app, celery_worker, tasks, counter) -> None:
    charge, send_receipt = tasks["charge"], tasks["send_receipt"]
    celery_worker.reload()  # the tasks were defined after the worker started
    r1 = charge.apply_async((42, 100), idempotency_key="order-42-charge")
    r2 = charge.apply_async((42, 100), idempotency_key="order-42-charge")  # duplicate: nothing published
    assert r2.id == r1.id and r2.deduplicated and r2.get(timeout=20) == r1.get(timeout=20)
    with pytest.raises(PayloadMismatchError):
        charge.apply_async((42, 999), idempotency_key="order-42-charge")
    send_receipt.delay(42).get(timeout=20)
    send_receipt.delay(42).get(timeout=20)
    assert int(counter.get(f"{PREFIX}:charges")) == 1
    assert int(counter.get(f"{PREFIX}:receipts")) == 1
    assert Idempotency.of(celery_app).settings.key_prefix == PREFIX
