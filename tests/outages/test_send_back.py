"""What a worker sends back to the broker (celery_idem/send_back.py), on every broker and queue type
the docs give: a message sent back is kept, and every call runs exactly once (DESIGN §3, "Nothing
lost": fail closed never means fail lost). Sent back are a store outage's trips (a store blip,
alone, with native delayed delivery refusing every countdown, with the broker refusing every send
for a while) and a BUSY duplicate's trips (the other countdown the library sends).

Each layout runs a real ``celery -A chaos_shop worker`` whose store is the shared Redis behind a
TCP proxy (tests/proxy.py) the test cuts for a few seconds while calls arrive; the callers reach the
store directly, so they are not refused. Two tasks per call batch: ``shop.charge`` (early ack: once
the worker has the message, the broker has forgotten it) and ``chaos.work`` (``acks_late``). Runs are
counted by the INCR each body makes on the counter Redis, never by the library's records.

Layouts (``LAYOUTS``): RabbitMQ quorum queues behind a topic exchange (Celery's native delayed
delivery carries countdowns through the ``celery_delayed_*`` queues), the same behind a direct
exchange (no native delayed delivery), each with a delivery limit as RabbitMQ 4 sets by default,
RabbitMQ classic queues (no native delayed delivery: the worker holds a countdown message), and a
Redis broker. Each RabbitMQ queue and exchange is the test's own and deleted after it.
"""

from __future__ import annotations

import gc
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from addresses import REDIS_BROKER_URL
from chaos_shop import make_chaos_app, refused_sends_flag
from conftest import RABBITMQ_URL, REDIS_URL, require_rabbitmq, require_server, wipe
from kombu import Connection
from proxy import Proxy
from shop import COUNTER_URL, effects_key
from workers import BACKEND, Worker, wait_for

from celery_idem import Idempotency

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

GET = 40  # seconds a caller waits for a result
BLIP = 3.0  # seconds the store link is cut
DELIVERY_LIMIT = 20  # RabbitMQ 4.0+'s default for quorum queues; set here on 3.x


def _queues(layout: str, name: str) -> dict[str, Any]:
    """``task_queues`` of a layout, as JSON (Celery builds a Queue of each entry)."""
    if layout == "redis":
        return {name: {"exchange": name, "routing_key": name}}
    quorum = layout.startswith("quorum")
    arguments = {"x-queue-type": "quorum", "x-delivery-limit": DELIVERY_LIMIT} if quorum else {}
    kind = "direct" if layout == "quorum-direct" else "topic"
    return {name: {"exchange": name, "exchange_type": kind, "routing_key": name, "queue_arguments": arguments}}


# quorum: the production guide's layout, native delayed delivery on; quorum-direct: native delayed
# delivery off (Celery uses it for topic and fanout exchanges only: the worker holds a countdown
# message); classic: off too (no quorum queue in the app); redis: a Redis broker.
LAYOUTS = {"quorum": RABBITMQ_URL, "quorum-direct": RABBITMQ_URL, "classic": RABBITMQ_URL, "redis": REDIS_BROKER_URL}


def _delete_rabbitmq_queue(name: str) -> None:
    with Connection(RABBITMQ_URL) as connection:
        channel = connection.default_channel
        channel.queue_delete(name)
        channel.exchange_delete(name)


@pytest.fixture
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``start(layout, worker_env)``: the callers' app, a worker of that layout whose store link the
    returned proxy cuts, and a list for the callers' handles; everything it made is removed afterwards."""
    require_server("redis")
    made: list[tuple[Any, Worker | None, Proxy, str]] = []
    results: list[Any] = []

    def start(layout: str, env: dict[str, str] | None = None) -> tuple[Any, Worker, Proxy, list[Any]]:
        if layout != "redis":
            require_rabbitmq()
        prefix = f"b{uuid.uuid4().hex[:10]}"
        broker, conf = LAYOUTS[layout], {"task_queues": _queues(layout, prefix)}
        store_port = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
        proxy = Proxy(store_port)
        store_through_proxy = proxy.url(int(REDIS_URL.rsplit("/", 1)[1]))
        app = make_chaos_app(conf=conf, broker=broker, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
        made.append((app, None, proxy, layout))
        worker_env = {"CHAOS_CONF": json.dumps(conf), **(env or {})}
        worker = Worker(tmp_path, broker, store_through_proxy, prefix, app="chaos_shop", env=worker_env)
        made[-1] = (app, worker, proxy, layout)
        return app, worker, proxy, results

    yield start
    for app, worker, proxy, layout in made:
        if worker is not None:
            worker.stop()
        proxy.close()
        idem = Idempotency.of(app)
        counter = redis.Redis.from_url(COUNTER_URL)
        for key in counter.scan_iter(match=f"effects:{idem.settings.key_prefix}:*", count=1000):
            counter.delete(key)
        counter.close()
        wipe(idem.store, app.backend)
        if layout != "redis":
            _delete_rabbitmq_queue(idem.settings.key_prefix)
    # Celery's app.backend is one per thread: results first (their __del__ unsubscribes), then backends.
    backends = {id(r.backend): r.backend for r in results}.values()
    results.clear()
    gc.collect()
    for backend in backends:
        backend.result_consumer.stop()
        backend.client.connection_pool.disconnect()


def runs(app: Any, task: str, key: str) -> int:
    counter = redis.Redis.from_url(COUNTER_URL)
    try:
        return int(counter.get(effects_key(Idempotency.of(app).settings.key_prefix, task, key)) or 0)
    finally:
        counter.close()


def calls_through_a_blip(app: Any, proxy: Proxy, results: list[Any], per_task: int = 3) -> dict[tuple[str, str], Any]:
    """One warm-up call (the worker consumes and reaches its store), then the store link cut for
    :data:`BLIP` seconds while ``per_task`` calls of each task arrive. Returns the calls' handles."""
    charge, work = app.tasks["shop.charge"], app.tasks["chaos.work"]
    warm = work.apply_async((0.0,), idempotency_key=f"warm-{uuid.uuid4().hex}")
    results.append(warm)
    assert warm.get(timeout=GET) == "worked 0.0"
    proxy.cut(BLIP)
    sent: dict[tuple[str, str], Any] = {}
    for n in range(per_task):
        key = f"c{n}-{uuid.uuid4().hex}"
        sent["shop.charge", key] = charge.apply_async((n, 100), idempotency_key=key)
        key = f"w{n}-{uuid.uuid4().hex}"
        sent["chaos.work", key] = work.apply_async((0.0,), idempotency_key=key)
    results.extend(sent.values())
    return sent


def each_ran_once(app: Any, sent: dict[tuple[str, str], Any]) -> None:
    """Every call of ``sent`` answered (none lost), and each body ran exactly once."""
    missing, deadline = [], time.monotonic() + GET
    for (task, key), handle in sent.items():
        try:
            handle.get(timeout=max(deadline - time.monotonic(), 0.1))
        except Exception as exc:  # a lost message: the call never ran
            missing.append(f"{task} {key}: {type(exc).__name__}")
    assert not missing, f"lost: {missing}"
    assert {key: runs(app, task, key) for task, key in sent} == {key: 1 for _, key in sent}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_store_blip_keeps_every_message_and_each_call_runs_once(layout: str, deployment) -> None:
    # Given a worker of the layout, early-ack and acks_late tasks, and calls arriving while its store
    # link is cut for a few seconds (each goes back to the broker with the outage's countdown)
    app, _, proxy, results = deployment(layout)
    sent = calls_through_a_blip(app, proxy, results)
    # Then no message is lost (on quorum queues: neither refused by native delayed delivery nor
    # dropped at the delivery limit): every call runs once the store answers, exactly once
    each_ran_once(app, sent)


def test_a_send_back_the_broker_refuses_waits_in_the_worker_and_keeps_every_message(deployment) -> None:
    # Given a worker on quorum queues whose native delayed delivery refuses every countdown (fault
    # injected in the worker: kombu's routing raises, as it did for the outage's old 0.5 s), and
    # calls arriving while its store link is cut
    app, worker, proxy, results = deployment("quorum", {"CHAOS_REFUSE_DELAYED": "1"})
    sent = calls_through_a_blip(app, proxy, results)
    # Then no message is lost: the worker waits each countdown itself and sends the message without
    # one (early ack: it held the only copy; acks_late: a requeue would have looped into the
    # delivery limit), and every call runs once the store answers, exactly once
    each_ran_once(app, sent)
    log = worker.output()
    assert "the worker waits 1s and sends it without one" in log
    assert "sent back to the broker without a countdown, after the worker waited for it" in log


def test_a_broker_that_refuses_every_send_for_a_while_loses_no_message(deployment) -> None:
    # Given a worker on quorum queues, and calls arriving while its store link is cut, and while its
    # broker refuses every message the worker sends (fault injected in the worker, for 5 s: longer
    # than the cut, so every trip back meets it)
    app, worker, proxy, results = deployment("quorum", {"CHAOS_REFUSE_SENDS": "1"})
    counter = redis.Redis.from_url(COUNTER_URL)
    try:
        counter.set(refused_sends_flag(Idempotency.of(app).settings.key_prefix), 1, px=5000)
        sent = calls_through_a_blip(app, proxy, results)
    finally:
        counter.close()
    # Then the worker keeps each message (early ack: its only copy; acks_late: no requeue loop into
    # the delivery limit), tries again with a growing wait, and sends it once the broker takes it:
    # every call runs once the store answers, exactly once
    each_ran_once(app, sent)
    log = worker.output()
    assert "the worker keeps it and tries again in 2s" in log
    assert "sent back to the broker without a countdown, after the worker waited for it" in log


def test_a_busy_duplicate_goes_back_with_a_countdown_every_broker_takes(deployment) -> None:
    # Given, on quorum queues, a call that replaced itself with another call 3 s later: its record is
    # held for the replacement, which waits in native delayed delivery meanwhile
    app, worker, _, results = deployment("quorum")
    key, order = f"r-{uuid.uuid4().hex}", uuid.uuid4().int % 10**9
    first = app.tasks["shop.replaced_later"].apply_async((order,), idempotency_key=key)
    results.append(first)
    wait_for(lambda: runs(app, "shop.replaced_later", key) == 1, "the first attempt")
    # When a copy of the call under another task id arrives meanwhile (a send_task duplicate): it is
    # BUSY with a replacement still in a queue, so it goes back to the broker at once, to look again
    copy = app.send_task("shop.replaced_later", (order,), headers={"idempotency_key": key})
    results.append(copy)
    # Then the copy is not lost (its countdown, under a second before, was refused by native delayed
    # delivery): it comes back until the replacement has settled the call, and gets its outcome
    assert first.get(timeout=GET) == {"replaced": order}
    assert copy.get(timeout=GET) == {"replaced": order}
    assert "is BUSY with task" in worker.output() and "back to the broker for 1s" in worker.output()
    assert runs(app, "shop.replaced_later", key) == 1
    assert runs(app, "shop.replacement", str(order)) == 1
