"""Worker events (what Flower and ``celery events`` show): a message answered with its key's stored
outcome sends ``task-replayed``, one whose key belongs to other arguments ``task-mismatched``, each
through the real broker's event exchange, with a hash of the key and never the key; nothing is sent
when the worker sends no task events."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL
from celery import Celery
from conftest import REDIS_URL, require_server, wipe
from workers import execute_as_worker, wait_for

from celery_idem import Idempotency, IdempotentTask, store_from_url
from celery_idem.events import key_hash
from celery_idem.records import Identity

BROKER = REDIS_BROKER_URL


@pytest.fixture
def app() -> Iterator[Celery]:
    require_server("redis")
    prefix = f"ev{uuid.uuid4().hex[:10]}"
    app = Celery("ev", broker=BROKER, backend="cache+memory://", set_as_current=False)
    app.conf.update(worker_send_task_events=True, task_default_queue=prefix)
    Idempotency(app, store=REDIS_URL, key_prefix=prefix)

    @app.task(base=IdempotentTask, shared=False, name="ev.charge")
    def charge(order_id: int) -> int:
        return order_id

    yield app
    wipe(store_from_url(REDIS_URL, key_prefix=prefix))


@pytest.fixture
def received(app: Celery) -> Iterator[list[dict[str, Any]]]:
    """The task events the broker delivers while the test runs (from once a probe event came back)."""
    seen: list[dict[str, Any]] = []
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": seen.append})
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False))
        thread.start()

        def probed() -> bool:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("task-probe", uuid="probe")
            return any(event.get("type") == "task-probe" for event in seen)

        wait_for(probed, "the event receiver", 10)
        yield seen
        receiver.should_stop = True
        thread.join(10)


def test_replayed_and_mismatched_messages_send_their_events_with_a_hashed_key(
    app: Celery, received: list[dict[str, Any]]
) -> None:
    key = f"order-{uuid.uuid4().hex}"
    execute_as_worker(app, "ev.charge", "t-first", args=(1,), idempotency_key=key)
    execute_as_worker(app, "ev.charge", "t-again", args=(1,), idempotency_key=key)  # replayed
    execute_as_worker(app, "ev.charge", "t-other", args=(2,), idempotency_key=key)  # other arguments

    def ours() -> list[dict[str, Any]]:
        return [event for event in received if event["type"] in ("task-replayed", "task-mismatched")]

    wait_for(lambda: len(ours()) == 2, "two events", 10)
    replayed, mismatched = sorted(ours(), key=lambda event: event["type"], reverse=True)
    expected_hash = key_hash(Identity("", "ev.charge", key))
    assert (replayed["type"], replayed["uuid"], replayed["original"], replayed["state"]) == (
        "task-replayed",
        "t-again",
        "t-first",
        "COMPLETED",
    )
    assert (mismatched["type"], mismatched["uuid"], mismatched["original"]) == ("task-mismatched", "t-other", "t-first")
    assert replayed["key_hash"] == mismatched["key_hash"] == expected_hash
    assert not any(key in repr(event) for event in received)


def test_no_event_when_the_worker_sends_no_task_events(app: Celery, received: list[dict[str, Any]]) -> None:
    app.conf.worker_send_task_events = False
    key = f"order-{uuid.uuid4().hex}"
    execute_as_worker(app, "ev.charge", "t-first", args=(1,), idempotency_key=key)
    execute_as_worker(app, "ev.charge", "t-again", args=(1,), idempotency_key=key)
    app.conf.worker_send_task_events = True
    execute_as_worker(app, "ev.charge", "t-third", args=(1,), idempotency_key=key)  # a marker that is sent
    wait_for(lambda: any(event.get("uuid") == "t-third" for event in received), "the marker event", 10)
    assert not any(event.get("uuid") == "t-again" for event in received)
