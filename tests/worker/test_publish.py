"""The producer side against real brokers, without a worker: what a claim leaves behind when
publishing fails, and how long a PENDING claim lives when the message is scheduled."""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL
from celery import Celery
from conftest import REDIS_URL, require_server, wipe
from kombu.exceptions import OperationalError

from celery_idem import DuplicateTaskError, Idempotency, IdempotentTask, State, store_from_url

POLICY = {"pending_timeout_seconds": 600, "ttl_seconds": 3600}


def _app(broker: str, prefix: str) -> Celery:
    app = Celery("pub", broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=prefix,
        broker_connection_retry=False,
        broker_connection_max_retries=0,
        broker_connection_timeout=1,
    )
    Idempotency(app, store=REDIS_URL, key_prefix=prefix)

    @app.task(shared=False, base=IdempotentTask, name="pub.charge", idempotency=POLICY)
    def charge(order_id: int, amount: int) -> int:
        return amount

    return app


@pytest.fixture
def prefix() -> Iterator[str]:
    require_server("redis")
    name = f"pub{uuid.uuid4().hex[:10]}"
    yield name
    wipe(store_from_url(REDIS_URL, key_prefix=name))


@pytest.fixture
def dead_broker() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def test_a_failed_publish_releases_the_claim_and_raises_the_brokers_own_error(dead_broker: str, prefix: str) -> None:
    # Given a broker that refuses connections
    app = _app(dead_broker, prefix)
    charge = app.tasks["pub.charge"]
    # When publishing fails after the claim
    with pytest.raises(OperationalError):  # kombu's own error, not wrapped in ours
        charge.apply_async((1, 10), idempotency_key="order-1", retry=False)
    # Then the key is free at once: no lock left for an hour
    idem = Idempotency.of(app)
    assert idem.get("pub.charge", "order-1") is None
    assert idem.metrics()["claims"] == 1


def test_the_next_call_after_a_failed_publish_is_new_not_a_duplicate(dead_broker: str, prefix: str) -> None:
    app = _app(dead_broker, prefix)
    charge = app.tasks["pub.charge"]
    with pytest.raises(OperationalError):
        charge.apply_async((1, 10), idempotency_key="order-1", retry=False)
    # The same call on a working broker is published as a new call.
    working = _app(REDIS_BROKER_URL, prefix)
    result = working.tasks["pub.charge"].apply_async((1, 10), idempotency_key="order-1")
    assert not result.deduplicated
    working.connection_for_write().default_channel.queue_purge(prefix)


@pytest.mark.parametrize("schedule", ["countdown", "eta"])
def test_a_scheduled_call_keeps_its_claim_past_its_eta(prefix: str, schedule: str) -> None:
    app = _app(REDIS_BROKER_URL, prefix)
    charge = app.tasks["pub.charge"]
    delay = 7200
    options: dict[str, Any] = (
        {"countdown": delay}
        if schedule == "countdown"
        else {"eta": datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=delay)}
    )
    before = time.time()
    result = charge.apply_async((2, 20), idempotency_key="order-2", **options)
    record = Idempotency.of(app).get("pub.charge", "order-2")
    assert record is not None and record.state is State.PENDING and record.task_id == result.id
    # the claim outlives the ETA by the pending timeout, so it cannot lapse before the task starts
    assert record.lease_expires_at >= before + delay + POLICY["pending_timeout_seconds"] - 1
    again = charge.apply_async((2, 20), idempotency_key="order-2")
    assert again.deduplicated and again.id == result.id
    app.connection_for_write().default_channel.queue_purge(prefix)


@pytest.fixture
def tokyo() -> Iterator[None]:
    """The process's local zone set to UTC+9 (no DST), restored after."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "JST-9"  # POSIX form: needs no tz database on the machine
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_a_naive_eta_is_read_as_celery_reads_it_in_utc_whatever_the_local_zone(prefix: str, tokyo: None) -> None:
    # Given a process at UTC+9 and a naive ETA two hours ahead in UTC (how Celery reads a naive ETA)
    app = _app(REDIS_BROKER_URL, prefix)
    charge = app.tasks["pub.charge"]
    delay = 7200
    eta = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) + datetime.timedelta(seconds=delay)
    before = time.time()
    # When the call is published for that ETA
    result = charge.apply_async((3, 30), idempotency_key="order-3", eta=eta)
    # Then its PENDING claim is stretched by the two hours, not by the local zone's reading of them
    record = Idempotency.of(app).get("pub.charge", "order-3")
    assert record is not None and record.task_id == result.id
    assert record.lease_expires_at >= before + delay + POLICY["pending_timeout_seconds"] - 1
    assert record.lease_expires_at <= time.time() + delay + POLICY["pending_timeout_seconds"] + 1
    app.connection_for_write().default_channel.queue_purge(prefix)


def test_a_copy_of_a_claimed_task_id_is_sent_only_by_the_outboxs_relay_never_for_an_option(prefix: str) -> None:
    # The outbox's relay publishes a call again under its claimed task id (publish.resending); a
    # producer cannot ask for that with an option (a chain message's options are input too).
    from celery_idem.publish import resending

    app = Celery("pub", broker=REDIS_BROKER_URL, set_as_current=False)
    Idempotency(app, store=REDIS_URL, key_prefix=prefix)

    @app.task(shared=False, base=IdempotentTask, idempotency={**POLICY, "on_duplicate": "raise"})
    def charge(order_id: int, amount: int) -> int:
        return amount

    sent: list[str] = []
    charge._send = lambda args, kwargs, options: (
        sent.append(options["task_id"])
        or charge.AsyncResult(  # type: ignore[method-assign]
            options["task_id"]
        )
    )
    first = charge.apply_async((1, 10), idempotency_key="k", task_id="t-1")
    with pytest.raises(DuplicateTaskError):
        charge.apply_async((1, 10), idempotency_key="k", task_id="t-1", idempotency_resend=True)
    with resending("t-1"):
        again = charge.apply_async((1, 10), idempotency_key="k", task_id="t-1")
    assert first.id == again.id == "t-1" and sent == ["t-1", "t-1"]  # the relay's copy: PENDING, no attempt yet
