"""Races on the worker side that a review found with injected latency (real in-process worker).

Each test slows one store call (never fails it), the way a slow network or a paused client delivers
a command late, to land a race in its window deterministically; each also runs once without the
delay as a control. Executions are counted with an INCR in the task body (outside the library).
The races: a Celery retry message taken for a copy of its own running attempt; a heartbeat beat in
flight that shortened replace()'s stretched lease; a redelivered copy of an attempt that died with a
live lease; a lost reply on complete.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL, REDIS_COUNTER_URL, REDIS_URL
from celery import Celery
from celery.contrib.testing.worker import start_worker
from conftest import require_server

from celery_idem import Idempotency, IdempotentTask, State
from celery_idem.stores.redis import RedisStore

BROKER = REDIS_BROKER_URL
BACKEND = REDIS_BACKEND_URL
STORE = REDIS_URL
COUNTER = REDIS_COUNTER_URL


class SlowStore(RedisStore):
    """A RedisStore whose chosen calls arrive late (latency only; every call still succeeds)."""

    get_delay = 0.0
    release_delay = 0.0
    heartbeat_renew_delay = 0.0

    def get(self, identity: Any) -> Any:
        if self.get_delay and threading.current_thread().name != "MainThread":
            time.sleep(self.get_delay)
        return super().get(identity)

    def release(self, *args: Any, **kwargs: Any) -> Any:
        if self.release_delay:
            time.sleep(self.release_delay)
        return super().release(*args, **kwargs)

    def renew(self, *args: Any, **kwargs: Any) -> Any:
        if self.heartbeat_renew_delay and threading.current_thread().name == "celery-idem-heartbeat":
            time.sleep(self.heartbeat_renew_delay)
        return super().renew(*args, **kwargs)


class Env:
    def __init__(self) -> None:
        self.prefix = f"a2{uuid.uuid4().hex[:10]}"
        self.counter = redis.Redis.from_url(COUNTER)
        self.store = SlowStore.from_url(STORE, key_prefix=self.prefix)
        app = Celery("attack2", broker=BROKER, backend=BACKEND, set_as_current=False)
        app.conf.update(
            task_default_queue=self.prefix,
            worker_prefetch_multiplier=1,
            worker_hijack_root_logger=False,
            broker_connection_retry_on_startup=True,
            result_expires=600,
        )
        self.idem = Idempotency(app, store=self.store)
        self.app = app
        counter, prefix = self.counter, self.prefix

        def effect(name: str, key: str) -> int:
            return int(counter.incr(f"effects:{prefix}:{name}:{key}"))

        @app.task(name="a2.plain", shared=False)
        def plain(order_id: int) -> dict[str, Any]:
            return {"replaced": order_id}

        @app.task(name="a2.retrier", shared=False, base=IdempotentTask, bind=True, max_retries=3)
        def retrier(self: Any, order_id: int) -> dict[str, Any]:
            n = effect("a2.retrier", self.request.idempotency_key)
            if self.request.retries == 0:
                raise self.retry(countdown=0)
            return {"order": order_id, "runs": n}

        @app.task(name="a2.replacer", shared=False, base=IdempotentTask, bind=True, idempotency={"lease_seconds": 3})
        def replacer(self: Any, order_id: int) -> Any:
            effect("a2.replacer", self.request.idempotency_key)
            time.sleep(1.2)  # the heartbeat's first renewal (due at lease/3 = 1 s) is in flight now
            raise self.replace(plain.si(order_id).set(countdown=9))

        @app.task(
            name="a2.ship",
            shared=False,
            base=IdempotentTask,
            bind=True,
            acks_late=True,
            idempotency={"lease_seconds": 2, "busy_wait_seconds": 0.5},
        )
        def ship(self: Any, order_id: int) -> dict[str, Any]:
            return {"order": order_id, "runs": effect("a2.ship", self.request.idempotency_key)}

        @app.task(name="a2.charge", shared=False, base=IdempotentTask, bind=True)
        def charge(self: Any, order_id: int) -> dict[str, Any]:
            return {"order": order_id, "runs": effect("a2.charge", self.request.idempotency_key)}

    def effects(self, name: str, key: str) -> int:
        return int(self.counter.get(f"effects:{self.prefix}:{name}:{key}") or 0)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    require_server("redis")
    e = Env()
    with start_worker(e.app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=20):
        yield e


@pytest.fixture(autouse=True)
def _no_delays(env: Env) -> Iterator[None]:
    yield
    env.store.get_delay = env.store.release_delay = env.store.heartbeat_renew_delay = 0.0


@pytest.mark.parametrize("slow", [False, True], ids=["control", "slow-store"])
def test_a_celery_retry_message_is_never_dropped_as_a_copy_of_its_running_attempt(env: Env, slow: bool) -> None:
    """self.retry(countdown=0): Celery publishes the retry message BEFORE the Retry reaches
    the handler settles it (Settler.ended), so the retry can be acquired while the record is still IN_PROGRESS under the
    same task id. The handler then treats the retry message as a "copy of a running task id"; when
    the first attempt's release to PENDING lands between the copy's acquire and its
    _still_running() read, the copy raises Ignore quietly (handler.py:405-411, 428-435): the only
    retry message is consumed, the record stays PENDING for pending_timeout (3600 s) and the caller
    waits forever. Expected: the retry runs (2 executions) and the record completes."""
    key = f"k-{uuid.uuid4().hex}"
    if slow:
        env.store.release_delay = 0.3  # the first attempt's release to PENDING arrives 0.3 s late
        env.store.get_delay = 0.6  # the copy's _still_running() read arrives after it
    r = env.app.tasks["a2.retrier"].apply_async((1,), idempotency_key=key)
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline and env.effects("a2.retrier", key) < 2:
        time.sleep(0.2)
    record = env.idem.get("a2.retrier", key)
    assert env.effects("a2.retrier", key) == 2, f"retry never ran; record={record and record.state}, r={r.state}"
    assert record is not None and record.state is State.COMPLETED


@pytest.mark.parametrize("slow", [False, True], ids=["control", "slow-heartbeat"])
def test_a_late_heartbeat_beat_never_shortens_a_replaced_attempts_lease(env: Env, slow: bool) -> None:
    """replace(): Settler.ended (the HAND_OVER step) removes the lease from the heartbeat and renews it to
    pending_timeout + lease (handler.py:494-496, 568-578). A heartbeat renewal already in flight
    (taken from the due list before remove(), heartbeat.py:83-90) lands after it and sets the lease
    back to lease_seconds (renew.lua sets, never extends). Nothing renews it after that, so while the
    replacement still waits in the queue the record's lease runs out and a duplicate call claims NEW
    and runs the replaced body a second time. Expected: the duplicate is handed the original id."""
    key = f"k-{uuid.uuid4().hex}"
    if slow:
        env.store.heartbeat_renew_delay = 0.5  # the heartbeat's renewal at t=1.0 s lands at t=1.5 s
    task = env.app.tasks["a2.replacer"]
    first = task.apply_async((7,), idempotency_key=key)
    time.sleep(6)  # replaced at ~1.2 s; the replacement waits its 9 s countdown
    record = env.idem.get("a2.replacer", key)
    lease_left = (record.lease_expires_at or 0) - env.store.now() if record else None
    second = task.apply_async((7,), idempotency_key=key)
    time.sleep(2.5)
    runs = env.effects("a2.replacer", key)
    assert (second.id == first.id, runs) == (True, 1), f"duplicate claimed NEW (lease left: {lease_left}); runs={runs}"


def test_a_redelivered_copy_of_an_attempt_that_died_holding_a_live_lease_runs_once_the_lease_ends(env: Env) -> None:
    # Given task T's attempt that died mid-run (a SIGKILLed child) with its lease still live, so the
    # parent's task-id-fenced release had to leave it
    ship = env.app.tasks["a2.ship"]
    key, task_id = f"k-{uuid.uuid4().hex}", str(uuid.uuid4())
    handler = ship.idempotency_handler
    fp = handler.fingerprint((7,), {})
    identity = handler.identify(key, None, fp)
    assert env.store.acquire(identity, fp, task_id, lease_seconds=2, ttl_seconds=600).decision.value == "RUN"
    assert not env.store.release(identity, task_id, fence="task_id").ok
    # When the broker redelivers T, whose lease outlives the copy's busy wait (0.5 s)
    result = env.app.send_task("a2.ship", (7,), task_id=task_id, headers={"idempotency_key": key})
    # Then the copy is never dropped: it goes back to the broker and runs once the dead lease is over
    assert result.get(timeout=20)["runs"] == 1
    assert env.effects("a2.ship", key) == 1
    record = env.idem.get("a2.ship", key)
    assert record is not None and record.state is State.COMPLETED


class LostReplyOnce:
    """Wraps the store's settle primitive: the write lands on the server, its reply is lost once."""

    def __init__(self, store: RedisStore) -> None:
        self.armed = True
        self.settle = store._settle

    def __call__(self, identity: Any, token: str, outcome: Any) -> Any:
        answer = self.settle(identity, token, outcome)  # really written on the server
        if self.armed:
            self.armed = False
            raise redis.exceptions.TimeoutError("Timeout reading from socket")  # the reply never came
        return answer


def test_a_complete_whose_reply_was_lost_is_the_attempts_own_success(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a store whose complete lands but whose reply is lost once
    monkeypatch.setattr(env.store, "_settle", LostReplyOnce(env.store))
    key = f"k-{uuid.uuid4().hex}"
    # When the task runs and completes
    result = env.app.tasks["a2.charge"].apply_async((1,), idempotency_key=key)
    # Then the attempt succeeds with its own stored value (not LockLostError), once
    assert result.get(timeout=20) == {"order": 1, "runs": 1}
    assert result.state == "SUCCESS"
    record = env.idem.get("a2.charge", key)
    assert record is not None and record.state is State.COMPLETED
    assert env.effects("a2.charge", key) == 1
