"""Real ``celery worker`` processes with the prefork pool: hard kills, time limits, revokes, and a
store that is down on the worker.

Each test starts its worker as a subprocess in its own process group, so a test can SIGKILL one
child (the parent survives and reports WorkerLostError) or the whole worker (nothing survives; the
broker redelivers the acks_late message to the next worker).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from conftest import REDIS_URL, require_rabbitmq, require_server
from shop import COUNTER_URL, effects_key, make_app
from shop_worker import BACKEND, BROKERS
from workers import Worker, wait_for

from celery_idem import Idempotency, State, StoreUnavailableError

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]
GET = 30
SECONDS = 5  # a body killed mid-run, short enough to run again in full after its lease


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(broker: str, store: str, prefix: str, **settings: Any) -> Worker:
        worker = Worker(tmp_path, broker, store, prefix, **settings)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def prefix() -> str:
    return f"p{uuid.uuid4().hex[:10]}"


@pytest.fixture
def counter() -> redis.Redis:
    require_server("redis")
    return redis.Redis.from_url(COUNTER_URL)


def _producer(broker: str, prefix: str, store: str = REDIS_URL, **settings: Any) -> Any:
    return make_app(broker=broker, backend=BACKEND, store=store, prefix=prefix, queue=prefix, **settings)


def _started(counter: redis.Redis, prefix: str, task: str, key: str, times: int = 1) -> Callable[[], bool]:
    return lambda: int(counter.get(effects_key(prefix, task, key)) or 0) >= times


# ---- hard kills -----------------------------------------------------------------------------------


def _hook_leaves_the_live_lease_then_the_next_call_runs(
    app: Any, worker: Worker, counter, prefix, key, task_id
) -> None:
    """The parent's hook (fenced by the task id) may not free an attempt whose lease is live: the
    record stays until the lease runs out (no heartbeat renews it now), then the next call runs.
    shop.held's lease (10 s) outlasts the delay between the kill and the hook on a loaded machine."""
    idem = Idempotency.of(app)
    wait_for(lambda: f"of task {task_id}: record" in worker.output(), "the parent signal hook", 15)
    held = idem.get("shop.held", key)
    assert held is not None and held.state is State.IN_PROGRESS and held.task_id == task_id
    assert re.search(rf"of task {task_id}: record .* left", worker.output()), "the hook freed a live attempt"
    wait_for(lambda: idem.store.now() > held.lease_expires_at, "the dead attempt's lease to run out", 15)
    again = app.tasks["shop.held"].apply_async((SECONDS,), idempotency_key=key)
    assert not again.deduplicated and again.get(timeout=GET) == f"slept {SECONDS}"
    assert int(counter.get(effects_key(prefix, "shop.held", key))) == 2


def test_child_killed_mid_task_keeps_its_lease_until_it_runs_out_then_the_key_runs_again(
    workers, prefix, counter
) -> None:
    # Given a prefork worker running an acks_late task
    app = _producer(BROKERS["redis"], prefix)
    worker = workers(BROKERS["redis"], REDIS_URL, prefix)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.held"].apply_async((SECONDS,), idempotency_key=key)
    wait_for(_started(counter, prefix, "shop.held", key), "task start")
    idem = Idempotency.of(app)
    assert idem.get("shop.held", key).state is State.IN_PROGRESS
    # When its child process is SIGKILLed
    os.kill(int(counter.get(effects_key(prefix, "shop.held", key) + ":pid")), signal.SIGKILL)
    # Then the parent reports WorkerLostError; its hook leaves the live lease, and once the lease
    # has run out the next call runs
    with pytest.raises(WorkerLostError):
        result.get(timeout=GET)
    _hook_leaves_the_live_lease_then_the_next_call_runs(app, worker, counter, prefix, key, result.id)


def test_whole_worker_killed_leaves_the_lease_to_guard_the_redelivered_message(workers, prefix, counter) -> None:
    # RabbitMQ redelivers an unacked (acks_late) message as soon as the dead worker's connection drops.
    require_rabbitmq()
    app = _producer(BROKERS["rabbitmq"], prefix)
    idem = Idempotency.of(app)
    first = workers(BROKERS["rabbitmq"], REDIS_URL, prefix)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.slow"].apply_async((4,), idempotency_key=key)
    effects = effects_key(prefix, "shop.slow", key)
    wait_for(_started(counter, prefix, "shop.slow", key), "first attempt start")
    # When the whole worker dies (no hook can run anywhere)
    first.kill()
    stale = idem.get("shop.slow", key)
    assert stale is not None and stale.state is State.IN_PROGRESS  # never silently gone, never settled wrongly
    # and a new worker receives the redelivered message
    workers(BROKERS["rabbitmq"], REDIS_URL, prefix)
    assert result.get(timeout=GET) == "slept 4"
    # Then it ran again only after the first attempt's lease had run out
    started = [float(t) for t in counter.lrange(effects + ":at", 0, -1)]
    assert len(started) == 2
    assert started[1] >= stale.lease_expires_at, "the redelivered message ran while the first lease was live"
    record = idem.get("shop.slow", key)
    assert record is not None and record.state is State.COMPLETED and record.attempt == 2


def test_hard_time_limit_frees_the_key_through_the_attempts_own_release(workers, prefix, counter) -> None:
    # The hard time limit ends the child with SIGTERM first: the attempt sees SystemExit and gives
    # its record back under its own owner token. The parent's hook (fenced by the task id) comes
    # while that lease may still be live, so it may only leave the record alone.
    app = _producer(BROKERS["redis"], prefix)
    idem = Idempotency.of(app)
    worker = workers(BROKERS["redis"], REDIS_URL, prefix)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.slow"].apply_async((30,), idempotency_key=key, time_limit=1)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=GET)
    wait_for(lambda: idem.get("shop.slow", key) is None, "release after the hard time limit", 10)
    assert int(counter.get(effects_key(prefix, "shop.slow", key))) == 1
    wait_for(lambda: f"of task {result.id}: record" in worker.output(), "the parent signal hook", 15)


def test_revoke_with_terminate_keeps_the_lease_until_it_runs_out_then_the_key_runs_again(
    workers, prefix, counter
) -> None:
    app = _producer(BROKERS["redis"], prefix)
    worker = workers(BROKERS["redis"], REDIS_URL, prefix)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.held"].apply_async((SECONDS,), idempotency_key=key)
    wait_for(_started(counter, prefix, "shop.held", key), "task start")
    app.control.revoke(result.id, terminate=True, signal="SIGKILL")
    _hook_leaves_the_live_lease_then_the_next_call_runs(app, worker, counter, prefix, key, result.id)


def test_a_revoked_copy_of_a_running_task_never_frees_the_running_attempts_record(workers, prefix, counter) -> None:
    # Given task T running with a live lease
    app = _producer(BROKERS["redis"], prefix)
    worker = workers(BROKERS["redis"], REDIS_URL, prefix)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.slow"].apply_async((4,), idempotency_key=key)
    wait_for(_started(counter, prefix, "shop.slow", key), "task start")
    # When T is revoked without terminate (T itself keeps running) and a copy of T arrives (a
    # redelivery, a BUSY retry): the worker drops the copy as revoked and the parent hook fires
    assert app.control.revoke(result.id, reply=True, timeout=5)
    app.send_task("shop.slow", (4,), task_id=result.id, headers={"idempotency_key": key}, queue=prefix)
    wait_for(lambda: f"revoke of task {result.id}: record" in worker.output(), "the revoke hook", 15)
    # Then T's record is untouched, and T completes normally, once
    idem = Idempotency.of(app)
    wait_for(lambda: getattr(idem.get("shop.slow", key), "state", None) is not State.IN_PROGRESS, "T's end", GET)
    record = idem.get("shop.slow", key)
    assert record is not None and record.state is State.COMPLETED and record.task_id == result.id
    assert int(counter.get(effects_key(prefix, "shop.slow", key))) == 1
    again = app.tasks["shop.slow"].apply_async((4,), idempotency_key=key)
    assert again.deduplicated and again.id == result.id
    assert int(counter.get(effects_key(prefix, "shop.slow", key))) == 1


def test_a_duplicates_link_lost_with_its_child_runs_when_the_requeued_message_comes_back(
    workers, prefix, counter
) -> None:
    # Given a completed call, and a duplicate of it with a link (published anyway: the worker replays
    # the outcome into the link) on an acks_late task whose message is requeued when its child is lost
    from dying_link_shop import add_linked, armed

    app = _producer(BROKERS["redis"], prefix)
    linked = add_linked(app, prefix)
    worker = workers(BROKERS["redis"], REDIS_URL, prefix, app="dying_link_shop")
    key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
    assert linked.apply_async((7,), idempotency_key=key).get(timeout=GET) == {"order": "7", "charged": 1}
    # When the child answering the duplicate is SIGKILLed after the replay, before the link is sent
    counter.set(armed(prefix, tag), 1)
    duplicate = linked.apply_async((7,), idempotency_key=key, link=app.tasks["shop.noted"].si("x", tag))
    assert duplicate.deduplicated
    wait_for(lambda: not counter.exists(armed(prefix, tag)), "the child's death while sending the link")
    # Then the requeued message (at least once, as plain Celery) sends the link: never lost. (Its
    # fence is still held under the dead child's lease, so the copy ended quietly instead.)
    links = effects_key(prefix, "shop.noted", tag)
    deadline = time.monotonic() + 25  # past the task's 10 s lease too
    while time.monotonic() < deadline and not counter.get(links):
        time.sleep(0.1)
    quiet = "a copy of a duplicate already answered" in worker.output()
    assert int(counter.get(links) or 0) == 1, f"the link never ran (the redelivery ended quietly: {quiet})"
    assert int(counter.get(effects_key(prefix, "shop.linked", key))) == 1


def test_a_duplicates_link_lost_with_its_whole_worker_runs_on_the_worker_rabbitmq_redelivers_it_to(
    workers, prefix, counter
) -> None:
    # Given a completed call, and a duplicate of it with a link on an acks_late task, answered by a
    # prefork worker on RabbitMQ that is about to send the link
    from dying_link_shop import add_linked, held, holding

    require_rabbitmq()
    app = _producer(BROKERS["rabbitmq"], prefix)
    linked = add_linked(app, prefix)
    first = workers(BROKERS["rabbitmq"], REDIS_URL, prefix, app="dying_link_shop")
    key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
    assert linked.apply_async((7,), idempotency_key=key).get(timeout=GET) == {"order": "7", "charged": 1}
    counter.set(held(prefix, tag), 1)
    linked.apply_async((7,), idempotency_key=key, link=app.tasks["shop.noted"].si("x", tag))
    wait_for(lambda: counter.exists(holding(prefix, tag)), "the duplicate about to send its link")
    # When the whole worker is SIGKILLed (a node lost), and RabbitMQ redelivers the unacked message at
    # once to the next worker
    first.kill()
    second = workers(BROKERS["rabbitmq"], REDIS_URL, prefix, app="dying_link_shop")
    # Then the redelivered message sends the link (at least once, as plain Celery would)
    links = effects_key(prefix, "shop.noted", tag)
    deadline = time.monotonic() + 25  # past the task's 10 s lease too
    while time.monotonic() < deadline and not counter.get(links):
        time.sleep(0.1)
    quiet = "a copy of a duplicate already answered" in second.output()
    assert int(counter.get(links) or 0) == 1, f"the link never ran (the redelivery ended quietly: {quiet})"


def test_a_duplicates_link_is_not_lost_when_a_concurrent_copy_ended_on_the_same_threads_worker(
    workers, prefix, counter
) -> None:
    # Given a completed call, and a duplicate of it with a link, answered on a threads-pool worker (one
    # process) that is about to send the link; a copy of the duplicate's message comes meanwhile, to
    # the same process (the fence is held: it waits)
    from dying_link_shop import add_linked, go, held, holding

    from celery_idem.continuations import FENCES
    from celery_idem.records import Identity

    require_rabbitmq()
    app = _producer(BROKERS["rabbitmq"], prefix)
    linked = add_linked(app, prefix)
    first = workers(BROKERS["rabbitmq"], REDIS_URL, prefix, app="dying_link_shop", pool="threads", concurrency=4)
    key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
    assert linked.apply_async((7,), idempotency_key=key).get(timeout=GET) == {"order": "7", "charged": 1}
    counter.set(held(prefix, tag), 1)
    noted = app.tasks["shop.noted"].si("x", tag)
    duplicate = linked.apply_async((7,), idempotency_key=key, link=noted)
    wait_for(lambda: counter.exists(holding(prefix, tag)), "the duplicate about to send its link")
    app.send_task("shop.linked", (7,), task_id=duplicate.id, headers={"idempotency_key": key}, link=noted, queue=prefix)
    # (the copy waits on the held fence, in the same process)
    wait_for(lambda: first.output().count(f"[{duplicate.id}] received") >= 2, "the copy at the same worker")
    # When the worker dies before the link is sent (acks_late: RabbitMQ keeps the message), and the
    # message comes to the next worker once the dead attempt's fence lease has run out
    counter.set(go(prefix, tag), 1)
    first.process.wait(timeout=30)
    idem = Idempotency.of(app)
    fence = idem.store.get(Identity("", FENCES, duplicate.id))
    assert fence is not None
    if fence.lease_expires_at is not None:
        wait_for(lambda: idem.store.now() > fence.lease_expires_at, "the dead attempt's fence lease to run out")
    second = workers(BROKERS["rabbitmq"], REDIS_URL, prefix, app="dying_link_shop")
    # Then the redelivered message sends the link (at least once): the copy did not settle the fence
    # for the attempt that was still sending it
    links = effects_key(prefix, "shop.noted", tag)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not counter.get(links):
        time.sleep(0.1)
    quiet = "a copy of a duplicate already answered" in second.output()
    assert int(counter.get(links) or 0) == 1, (
        f"the link never ran: the fence was {fence.state.value} at the death; the redelivery ended quietly: {quiet}"
    )


# ---- the store is down on the worker ------------------------------------------------------------


@pytest.fixture
def closed_store() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


class _StoreComesBack:
    """A TCP port that refuses connections until ``open()``, then forwards them to the real Redis:
    a store that is down at first and comes back."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: socket.socket | None = None

    def open(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        assert self.server is not None
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", 6379))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            # Closed here, not left to the garbage collector: its ResourceWarning would land in the
            # teardown of whichever test runs then (on the oldest versions, this one's).
            for s in (source, target):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def test_store_down_at_the_worker_keeps_the_message_until_the_store_answers(workers, prefix, counter) -> None:
    # Given a worker whose store (the same Redis database as the producer's, behind a port that is
    # closed for now) does not answer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    comes_back = _StoreComesBack(port)
    app = _producer(BROKERS["redis"], prefix)
    worker = workers(
        BROKERS["redis"], f"redis://127.0.0.1:{port}/{REDIS_URL.rsplit('/', 1)[1]}", prefix, store_timeout_seconds=0.5
    )
    wait_for(lambda: "store does not answer at worker start" in worker.output(), "the start-up store check")
    key = f"k-{uuid.uuid4().hex}"
    try:
        # When a task arrives (on_store_error="raise", the default)
        result = app.tasks["shop.charge"].apply_async((1, 10), idempotency_key=key)
        # Then it is not run and not consumed as a failure: it goes back to the broker, again and again
        wait_for(lambda: worker.output().count("back to the broker") >= 3, "three store-outage retries")
        assert int(counter.get(effects_key(prefix, "shop.charge", key)) or 0) == 0
        assert result.state == "RETRY"
        # And each trip is one line of ours saying what the store answered and how long it took: no
        # warning about giving back an acquire that never landed, no traceback, no advice to run
        # unprotected (docs/operations.md, Logs)
        trips = [line for line in worker.output().splitlines() if "back to the broker" in line]
        assert all(re.search(r"ConnectionError: .*\(after \d+\.\d\ds, timeout 0\.5s\)", t) for t in trips), trips
        assert "could not release" not in worker.output() and "proceed" not in worker.output()
        # And once the store answers, it runs exactly once
        comes_back.open()
        assert result.get(timeout=GET + 30)["charged"] == 10
    finally:
        comes_back.close()
    assert int(counter.get(effects_key(prefix, "shop.charge", key))) == 1
    assert Idempotency.of(app).get("shop.charge", key).state is State.COMPLETED


def test_store_down_at_the_worker_proceeds_when_configured(workers, prefix, counter, closed_store) -> None:
    app = _producer(BROKERS["redis"], prefix)
    workers(BROKERS["redis"], closed_store, prefix, store_timeout_seconds=0.5, on_store_error="proceed")
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.charge"].apply_async((1, 10), idempotency_key=key)
    assert result.get(timeout=GET)["charged"] == 10
    assert int(counter.get(effects_key(prefix, "shop.charge", key))) == 1


def test_store_down_at_publish_raises_within_the_timeout_or_proceeds(workers, prefix, counter, closed_store) -> None:
    down = _producer(BROKERS["redis"], prefix, store=closed_store, store_timeout_seconds=0.5)
    key = f"k-{uuid.uuid4().hex}"
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        down.tasks["shop.charge"].apply_async((2, 20), idempotency_key=key)
    assert time.monotonic() - started < 5
    # With on_store_error="proceed" the call is published unprotected, and a worker runs it.
    lenient = _producer(
        BROKERS["redis"], prefix, store=closed_store, store_timeout_seconds=0.5, on_store_error="proceed"
    )
    workers(BROKERS["redis"], REDIS_URL, prefix)
    result = lenient.tasks["shop.charge"].apply_async((2, 20), idempotency_key=key)
    assert result.get(timeout=GET)["charged"] == 20
    assert int(counter.get(effects_key(prefix, "shop.charge", key))) == 1
    assert Idempotency.of(lenient).metrics()["store_errors"] == 1


def test_store_down_at_the_worker_is_retried_past_the_tasks_own_max_retries(
    workers, prefix, counter, closed_store
) -> None:
    # Given a task with max_retries=2 (and autoretry_for=(StoreUnavailableError,)) and a worker whose
    # store is down
    app = _producer(BROKERS["redis"], prefix)
    worker = workers(BROKERS["redis"], closed_store, prefix, store_timeout_seconds=0.5)
    key = f"k-{uuid.uuid4().hex}"
    result = app.tasks["shop.patient"].apply_async((3,), idempotency_key=key)
    # Then the message keeps going back to the broker past the task's own max_retries (the task did
    # not fail: the store is down), never run unprotected, never consumed as a failure
    wait_for(lambda: worker.output().count("back to the broker") >= 4, "four store-outage retries", 60)
    assert result.state == "RETRY"
    assert int(counter.get(effects_key(prefix, "shop.patient", key)) or 0) == 0
