"""The producer's claim against a real worker and a real broker: what a failed publish may give back,
and how long a claim may wait for a message the broker has dropped.

The worker runs in this process (threads pool); the store is Redis; executions are counted by the
INCR each task body makes (tests/shop.py), never by our records.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import shop_worker
from conftest import REDIS_URL, FakeClock
from kombu.exceptions import OperationalError
from shop import make_app
from shop_worker import BACKEND, BROKERS, GET, Shop

from celery_idem import State
from celery_idem.stores import RedisStore
from celery_idem.timing import EXPIRY_GRACE_SECONDS

# The in-process worker over each broker of tests/worker/test_worker_*.py (tests/shop_worker.py; one per module).
shop = shop_worker.shop
key = shop_worker.key


def _until(predicate: Any, seconds: float = GET) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
    return value


# ---- a publish that fails after the message got through -------------------------------------------


def test_a_failed_publish_gives_back_only_its_own_pending_claim_never_a_running_attempt(
    shop: Shop, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = shop.app.tasks["shop.slow"]
    send, sent = slow._send, []

    def delivered_then_failed(args: Any, kwargs: Any, options: dict[str, Any]) -> Any:
        # Given a publish whose message reaches a worker, and whose broker call fails afterwards
        # (a publisher-confirm timeout, kombu's retried publish)
        sent.append(send(args, kwargs, options).id)
        _until(lambda: (r := shop.idem.get("shop.slow", key)) is not None and r.state is State.IN_PROGRESS)
        raise OperationalError("publisher confirm timed out")

    monkeypatch.setattr(slow, "_send", delivered_then_failed)
    with pytest.raises(OperationalError):
        slow.apply_async((2,), idempotency_key=key)
    monkeypatch.undo()
    # Then the worker's running attempt keeps its record...
    record = shop.idem.get("shop.slow", key)
    assert record is not None and record.state is State.IN_PROGRESS and record.task_id == sent[0]
    # ...a second call is handed the running id, and the body runs once
    again = slow.apply_async((2,), idempotency_key=key)
    assert again.deduplicated and again.id == sent[0]
    assert again.get(timeout=GET) == "slept 2"
    assert shop.effects("slow", key) == 1


# ---- a message the broker drops at its expiry ------------------------------------------------------


@pytest.mark.parametrize("shop", ["rabbitmq"], indirect=True)
def test_a_claim_never_outlives_the_expiry_of_the_message_it_waits_for(shop: Shop, key: str) -> None:
    # A producer on the worker's store whose clock the test moves (the broker's TTL is real time)
    clock = FakeClock()
    producer = make_app(
        broker=BROKERS[shop.broker],
        backend=BACKEND,
        prefix=shop.prefix,
        queue=shop.prefix,
        store=RedisStore.from_url(REDIS_URL, key_prefix=shop.prefix, clock=clock),
    )
    charge = producer.tasks["shop.charge"]
    nobody = f"{shop.prefix}-nobody"
    connection = producer.connection_for_write()
    channel = connection.default_channel
    try:
        # Given a call with expires=1 whose message waits in a queue nobody consumes
        lost = charge.apply_async((1, 10), idempotency_key=key, expires=1, queue=nobody)
        # When RabbitMQ drops it at its TTL (no worker saw it: no task_revoked)
        _until(lambda: channel.queue_declare(nobody, passive=True).message_count == 0)
        record = shop.idem.get("shop.charge", key)
        assert record is not None and record.state is State.PENDING and record.task_id == lost.id
        # Then the claim lapses with the message, not an hour later: past the expiry and its grace,
        # the same call is new and runs once
        clock.advance(1 + EXPIRY_GRACE_SECONDS + 0.5)
        retried = charge.apply_async((1, 10), idempotency_key=key)
        assert not retried.deduplicated and retried.id != lost.id
        assert retried.get(timeout=GET)["task_id"] == retried.id
        assert shop.effects("charge", key) == 1
    finally:
        channel.queue_delete(nobody)
        connection.close()
        producer.close()


def test_a_retry_never_keeps_the_claim_past_the_expiry_its_message_inherits(shop: Shop, key: str) -> None:
    # Given a call with expires=30 whose body asks for a retry an hour later (the retry message
    # inherits the expiry, so the broker drops or the worker revokes it long before it is due)
    later = shop.app.tasks["shop.later"]
    started = time.time()
    later.apply_async((1,), idempotency_key=key, expires=30)
    record = _until(
        lambda: (r := shop.idem.get("shop.later", key)) is not None and r.attempt and r.state is State.PENDING and r
    )
    # Then the claim held for the retry lapses with the message, not an hour and more later
    assert record.lease_expires_at is not None
    assert record.lease_expires_at <= started + 30 + EXPIRY_GRACE_SECONDS + 5
    assert shop.effects("later", key) == 1
