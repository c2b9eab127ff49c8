"""Through a real worker and a real broker: every main scenario on Redis and again on RabbitMQ.

The worker runs in this process (celery.contrib.testing's start_worker, threads pool); the store is
Redis; executions are counted by the INCR each task body makes (tests/shop.py), never by our records.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chain, group, signals
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore, Reject
from celery.result import AsyncResult
from conftest import RABBITMQ_URL, REDIS_URL, plant_pickle, require_rabbitmq, require_server
from shop import COUNTER_URL, Order, effects_key, make_app
from workers import Worker, execute_as_worker

from celery_idem import (
    Idempotency,
    IdempotentTask,
    InvalidKeyError,
    LockLostError,
    PayloadMismatchError,
    PermanentError,
    RecordGoneError,
    ResultTooLargeError,
    SerializationError,
    State,
    StoreUnavailableError,
)
from celery_idem.records import Identity
from celery_idem.signals import options_to_headers

BROKERS = {"redis": "redis://127.0.0.1:6379/14", "rabbitmq": RABBITMQ_URL}
BACKEND = "redis://127.0.0.1:6379/13"
GET = 20  # seconds a test waits for a result


@dataclass
class Shop:
    app: Any
    idem: Idempotency
    prefix: str
    broker: str
    counter: redis.Redis

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
    with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False, shutdown_timeout=20, queues=queues):
        yield Shop(app, Idempotency.of(app), prefix, request.param, redis.Redis.from_url(COUNTER_URL))


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


# ---- one call, however it is spelled --------------------------------------------------------------


def test_spellings_of_one_call_run_once_under_one_task_id(shop: Shop, key: str, published: list[str]) -> None:
    charge = shop.task("charge")
    results = [
        charge.apply_async((42, 100), idempotency_key=key),
        charge.apply_async(kwargs={"order_id": 42, "amount": 100}, idempotency_key=key),
        charge.apply_async((42,), {"amount": 100}, idempotency_key=key),
        charge.apply_async((42, 100, "EUR"), idempotency_key=key),
        charge.s(42, amount=100).set(idempotency_key=key).apply_async(),
    ]
    assert {r.id for r in results} == {results[0].id}
    assert [r.deduplicated for r in results] == [False, True, True, True, True]
    assert {r.get(timeout=GET)["task_id"] for r in results} == {results[0].id}
    assert shop.effects("charge", key) == 1
    assert published == [results[0].id]


def test_uuid_and_its_string_and_tuple_and_list_are_one_keyless_call(shop: Shop) -> None:
    charge = shop.task("charge")
    order = uuid.uuid4()
    first, second = charge.delay(order, 100), charge.delay(str(order), 100)
    assert second.id == first.id and second.idempotency_key == first.idempotency_key
    assert first.get(timeout=GET) == second.get(timeout=GET)
    third, fourth = charge.delay((1, 2), 5), charge.delay([1, 2], 5)
    assert fourth.id == third.id
    fourth.get(timeout=GET)
    assert shop.effects("charge", first.idempotency_key) == 1
    assert shop.effects("charge", third.idempotency_key) == 1


# ---- a storm: 200 calls, 8 threads in each of 2 processes --------------------------------------------


def _storm_process(broker: str, prefix: str, key: str, calls: int, go: Any, out: Any) -> None:
    app = make_app(broker=broker, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    charge = app.tasks["shop.charge"]
    barrier = threading.Barrier(8)

    def thread(n: int) -> None:
        barrier.wait()
        go.wait()
        for _ in range(n):
            result = charge.apply_async((7, 700), idempotency_key=key)
            out.put((result.id, result.deduplicated, result.get(timeout=GET)))

    threads = [threading.Thread(target=thread, args=(calls // 8 + (i < calls % 8),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.slow
def test_a_storm_of_200_calls_from_two_processes_runs_once_and_answers_everyone(shop: Shop, key: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    storm = (BROKERS[shop.broker], shop.prefix, key, 100, go, out)
    processes = [ctx.Process(target=_storm_process, args=storm) for _ in range(2)]
    for p in processes:
        p.start()
    go.set()
    answers = [out.get(timeout=120) for _ in range(200)]
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert shop.effects("charge", key) == 1
    assert len({task_id for task_id, _, _ in answers}) == 1
    assert sum(1 for _, deduplicated, _ in answers if not deduplicated) == 1
    assert len({repr(result) for _, _, result in answers}) == 1


# ---- mismatch ------------------------------------------------------------------------------------


def test_mismatch_at_publish_publishes_nothing_before_and_after_completion(
    shop: Shop, key: str, published: list[str]
) -> None:
    charge = shop.task("charge")
    # Given a call still queued (countdown), then the same call completed
    first = charge.apply_async((5, 50), idempotency_key=key, countdown=1)
    with pytest.raises(PayloadMismatchError) as while_pending:
        charge.apply_async((5, 51), idempotency_key=key)
    assert while_pending.value.task_id == first.id
    first.get(timeout=GET)
    # When the key comes back with another amount after completion
    with pytest.raises(PayloadMismatchError, match="a new call needs a new key"):
        charge.apply_async((5, 999), idempotency_key=key)
    # Then nothing but the first call was ever published or run
    assert published == [first.id]
    assert shop.effects("charge", key) == 1


# ---- failures ---------------------------------------------------------------------------------------


def test_final_failure_is_stored_and_replayed_without_running(shop: Shop, key: str, published: list[str]) -> None:
    declined = shop.task("declined")
    first = declined.apply_async((3,), idempotency_key=key)
    with pytest.raises(PermanentError, match="card declined for order 3"):
        first.get(timeout=GET)
    second = declined.apply_async((3,), idempotency_key=key)
    assert second.deduplicated and second.id == first.id
    with pytest.raises(PermanentError, match="card declined for order 3"):
        second.get(timeout=GET)
    assert shop.effects("declined", key) == 1
    assert published == [first.id]
    record = shop.idem.get("shop.declined", key)
    assert record is not None and record.state is State.FAILED and record.error.type == "PermanentError"


def test_retryable_failure_is_retried_under_the_same_task_id(shop: Shop, key: str) -> None:
    result = shop.task("flaky").apply_async((1,), idempotency_key=key)
    answer = result.get(timeout=GET)
    assert answer["task_id"] == result.id and answer["retries"] == 1 and answer["attempts"] == 2
    assert shop.effects("flaky", key) == 2
    record = shop.idem.get("shop.flaky", key)
    assert record is not None and record.state is State.COMPLETED and record.attempt == 2


def test_exhausted_retries_release_the_key_so_it_may_run_again(shop: Shop, key: str) -> None:
    flaky = shop.task("flaky")
    with pytest.raises(ConnectionError):
        flaky.apply_async((10,), idempotency_key=key).get(timeout=GET)
    assert shop.effects("flaky", key) == 3  # max_retries=2: three attempts
    assert shop.idem.get("shop.flaky", key) is None
    later = flaky.apply_async((10,), idempotency_key=key)
    assert not later.deduplicated
    with pytest.raises(ConnectionError):
        later.get(timeout=GET)
    assert shop.effects("flaky", key) == 6


def test_self_retry_with_changed_arguments_really_runs(shop: Shop, key: str) -> None:
    rebill = shop.task("rebill")
    result = rebill.apply_async((10,), idempotency_key=key)
    answer = result.get(timeout=GET)
    assert answer == {"amount": 11, "retries": 1, "task_id": result.id}
    assert shop.effects("rebill", key) == 2
    # the caller's call is what the key answers for, with the outcome of its retry
    again = rebill.apply_async((10,), idempotency_key=key)
    assert again.deduplicated and again.get(timeout=GET) == answer
    with pytest.raises(PayloadMismatchError):
        rebill.apply_async((11,), idempotency_key=key)


# ---- results ----------------------------------------------------------------------------------------


def test_ignore_result_duplicate_get_returns_the_stored_result(shop: Shop, key: str) -> None:
    quiet = shop.task("quiet")
    first = quiet.apply_async((5,), idempotency_key=key)
    assert first.get(timeout=GET) == {"quiet": 5}
    second = quiet.apply_async((5,), idempotency_key=key)
    assert second.deduplicated and second.get(timeout=GET) == {"quiet": 5}
    assert shop.effects("quiet", key) == 1
    # nothing was written to the result backend
    assert shop.app.backend.get_task_meta(first.id)["status"] == "PENDING"


def test_ignore_result_get_raises_once_a_retryable_failure_has_freed_the_key(shop: Shop, key: str) -> None:
    # Given a task that keeps no result in the backend and fails retryably until its retries run out
    flaky = shop.task("quiet_flaky")
    first = flaky.apply_async((1,), idempotency_key=key)
    duplicate = flaky.apply_async((1,), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.id == first.id
    # When the callers wait for it (while it runs, and after it has released the key)
    # Then each is told the record is gone and the key may run again, instead of waiting forever
    for result in (first, duplicate):
        with pytest.raises(RecordGoneError, match="is gone") as raised:
            result.get(timeout=GET)
        assert raised.value.key == key and raised.value.task_id == first.id
    assert shop.effects("quiet_flaky", key) == 2  # max_retries=1: two attempts
    assert shop.idem.get("shop.quiet_flaky", key) is None


def test_send_task_by_name_twice_runs_once(shop: Shop, key: str) -> None:
    first = shop.app.send_task("shop.charge", (9, 90), headers={"idempotency_key": key})
    second = shop.app.send_task("shop.charge", (9, 90), headers={"idempotency_key": key})
    assert first.get(timeout=GET) == second.get(timeout=GET)
    # whichever message a worker took first ran; the other replayed its outcome
    assert first.get(timeout=GET)["task_id"] in (first.id, second.id)
    assert shop.effects("charge", key) == 1


def test_send_task_with_other_arguments_under_a_used_key_fails_and_leaves_the_record(shop: Shop, key: str) -> None:
    shop.task("charge").apply_async((9, 90), idempotency_key=key).get(timeout=GET)
    before = shop.idem.get("shop.charge", key)
    stray = shop.app.send_task("shop.charge", (9, 91), headers={"idempotency_key": key})
    with pytest.raises(PayloadMismatchError):
        stray.get(timeout=GET)
    assert shop.idem.get("shop.charge", key) == before
    assert shop.effects("charge", key) == 1


def _one_runs_the_others_mismatch(results: list[Any]) -> list[Any]:
    """The outcome of each result: its value, or the PayloadMismatchError it raised."""
    outcomes: list[Any] = []
    for result in results:
        try:
            outcomes.append(result.get(timeout=GET))
        except PayloadMismatchError as exc:
            outcomes.append(exc)
    return outcomes


def _by_name_producer(shop: Shop) -> Celery:
    """Another service's app: same broker and queue, the task not registered (only its name known)."""
    producer = Celery("producer", broker=BROKERS[shop.broker], backend=BACKEND, set_as_current=False)
    producer.conf.task_default_queue = shop.prefix
    return producer


def test_a_message_under_a_calls_task_id_with_other_arguments_never_runs_nor_answers_for_it(
    shop: Shop, key: str
) -> None:
    # Given a call waiting in the queue (a 2 s countdown)
    charge = shop.task("charge")
    first = charge.apply_async((9, 90), idempotency_key=key, countdown=2)
    # When a message under its task id and key, with other arguments and no retry, comes first
    shop.app.send_task("shop.charge", (9, 999), task_id=first.id, headers={"idempotency_key": key})
    time.sleep(1.0)
    # Then it is refused quietly: it neither runs nor writes the id's state; the call answers itself
    assert shop.effects("charge", key) == 0
    assert shop.app.backend.get_task_meta(first.id)["status"] == "PENDING"
    assert first.get(timeout=GET)["charged"] == 90
    assert shop.effects("charge", key) == 1


def test_key_given_as_a_send_task_option_keys_the_call(shop: Shop, key: str) -> None:
    # Given three calls by name under one key with different amounts, the key passed as an option
    results = [shop.app.send_task("shop.charge", (9, amount), idempotency_key=key) for amount in (90, 91, 92)]
    outcomes = _one_runs_the_others_mismatch(results)
    # Then one ran under that key, and the two others were refused as other arguments under a used key
    assert sum(isinstance(outcome, PayloadMismatchError) for outcome in outcomes) == 2
    assert shop.effects("charge", key) == 1
    record = shop.idem.get("shop.charge", key)
    assert record is not None and record.state is State.COMPLETED


def test_key_set_on_a_by_name_signature_keys_the_call(shop: Shop, key: str) -> None:
    producer = _by_name_producer(shop)
    sigs = [producer.signature("shop.charge", (9, amount)).set(idempotency_key=key) for amount in (90, 91, 92)]
    outcomes = _one_runs_the_others_mismatch([sig.apply_async() for sig in sigs])
    assert sum(isinstance(outcome, PayloadMismatchError) for outcome in outcomes) == 2
    assert shop.effects("charge", key) == 1


# Redis only: AMQP drops unknown message properties, so there only the producer's publish hook
# carries the key (the two tests above cover it on both brokers).
@pytest.mark.parametrize("shop", ["redis"], indirect=True)
def test_key_in_the_message_properties_keys_the_call_on_the_worker(shop: Shop, key: str) -> None:
    """A producer without celery-idem sends the option as a message property: the worker reads it."""
    signals.before_task_publish.disconnect(dispatch_uid="celery_idem.options_to_headers")
    try:
        results = [shop.app.send_task("shop.charge", (9, amount), idempotency_key=key) for amount in (90, 91)]
    finally:
        signals.before_task_publish.connect(
            options_to_headers, weak=False, dispatch_uid="celery_idem.options_to_headers"
        )
    outcomes = _one_runs_the_others_mismatch(results)
    assert sum(isinstance(outcome, PayloadMismatchError) for outcome in outcomes) == 1
    assert shop.effects("charge", key) == 1


def test_apply_honours_the_idempotency_options_as_apply_async_does(shop: Shop, key: str) -> None:
    charge = shop.task("charge")
    # Given a call run inline with apply() under a key and a scope
    first = charge.apply((42, 100), idempotency_key=key, idempotency_scope="tenant-a")
    # Then the body ran under that key (its effect is counted under it) and the record is the key's,
    # in that scope, under the apply's task id
    assert first.get(timeout=GET)["charged"] == 100 and shop.effects("charge", key) == 1
    record = shop.idem.get(charge, key, scope="tenant-a")
    assert record is not None and record.state is State.COMPLETED and record.task_id == first.id
    # When the same call is sent to the worker under the same key and scope
    again = charge.apply_async((42, 100), idempotency_key=key, idempotency_scope="tenant-a")
    # Then it is the same call: handed the apply's id and outcome, the body not run again
    assert again.deduplicated and again.id == first.id
    assert again.get(timeout=GET) == first.get() and shop.effects("charge", key) == 1
    # When other arguments come under the key, through apply() (raised by get(), or at once with throw)
    with pytest.raises(PayloadMismatchError):
        charge.apply((42, 999), idempotency_key=key, idempotency_scope="tenant-a").get()
    with pytest.raises(PayloadMismatchError):
        charge.apply((42, 999), idempotency_key=key, idempotency_scope="tenant-a", throw=True)
    # Then they were refused without running, and the record is untouched
    assert shop.effects("charge", key) == 1 and shop.idem.get(charge, key, scope="tenant-a") == record
    # When the key comes in another scope, it is another identity: it runs, once
    other = charge.apply((42, 100), idempotency_key=key, idempotency_scope="tenant-b")
    assert other.get(timeout=GET)["charged"] == 100 and shop.effects("charge", key) == 2
    assert charge.apply_async((42, 100), idempotency_key=key, idempotency_scope="tenant-b").id == other.id
    # When apply() bypasses for one call, the body runs, under no key, and no record changes
    unkeyed = shop.effects("charge", "None")
    bypassed = charge.apply((42, 100), idempotency_key=key, idempotency_scope="tenant-a", idempotency=False)
    assert bypassed.get(timeout=GET)["charged"] == 100
    assert shop.effects("charge", "None") == unkeyed + 1 and shop.effects("charge", key) == 2
    assert shop.idem.get(charge, key, scope="tenant-a") == record


def test_pydantic_task_called_with_models_runs_once_per_key(shop: Shop, key: str) -> None:
    place = shop.task("place")
    # When: a pydantic=True task is called with a model, an equal model and the model's dump, under one key
    results = [
        place.apply_async((Order(order_id=3, amount=30),), idempotency_key=key),
        place.apply_async((Order(order_id=3, amount=30),), idempotency_key=key),
        place.apply_async(({"order_id": 3, "amount": 30},), idempotency_key=key),
    ]
    # Then: it is published once (as Celery sends it: the dump) and runs once
    assert [r.deduplicated for r in results] == [False, True, True]
    assert {r.id for r in results} == {results[0].id}
    assert results[0].get(timeout=GET) == {"order": 3, "amount": 30}
    assert shop.effects("place", key) == 1
    with pytest.raises(PayloadMismatchError):
        place.apply_async((Order(order_id=3, amount=31),), idempotency_key=key)


def test_apply_of_a_pydantic_task_with_a_model_is_the_call_apply_async_sends(shop: Shop, key: str) -> None:
    place = shop.task("place")
    # Given a pydantic=True task run inline with apply() and a model, under a key
    first = place.apply((Order(order_id=4, amount=40),), idempotency_key=key)
    assert first.get(timeout=GET) == {"order": 4, "amount": 40}
    # When the same model is sent to the worker under the key
    again = place.apply_async((Order(order_id=4, amount=40),), idempotency_key=key)
    # Then it is the same call (the model dumped as apply_async sends it): the body ran once
    assert again.deduplicated and again.id == first.id and again.get(timeout=GET) == first.get()
    assert shop.effects("place", key) == 1


def test_a_chain_whose_head_is_a_duplicate_still_runs_its_tail(shop: Shop, key: str) -> None:
    charge, add = shop.task("charge"), shop.task("add")
    charge.apply_async((8, 80), idempotency_key=key).get(timeout=GET)
    result = chain(charge.s(8, 80).set(idempotency_key=key), add.s(5)).apply_async()
    assert result.get(timeout=GET) == 85
    assert shop.effects("charge", key) == 1
    assert int(shop.counter.get(effects_key(shop.prefix, "shop.add", "8")) or 0) == 1


def test_a_duplicate_under_a_caller_chosen_task_id_is_answered_under_that_id(shop: Shop, key: str) -> None:
    charge = shop.task("charge")
    original = charge.apply_async((6, 60), idempotency_key=key)
    outcome = original.get(timeout=GET)
    # A caller that chose its task id (a frozen signature) waits on that id: it gets the outcome there.
    chosen = str(uuid.uuid4())
    again = charge.apply_async((6, 60), idempotency_key=key, task_id=chosen)
    assert again.deduplicated and again.id == chosen
    assert again.get(timeout=GET) == outcome
    assert shop.effects("charge", key) == 1


def test_a_worker_never_unpickles_a_stored_result_claiming_pickle(shop: Shop, key: str, tmp_path: Any) -> None:
    # Given a COMPLETED record whose result claims pickle (and would create a directory if unpickled)
    charge = shop.task("charge")
    flag = tmp_path / "unpickled"
    plant_pickle(
        shop.idem.store,
        Identity("", "shop.charge", key),
        charge.idempotency_handler.fingerprint((7, 70), {}),
        str(flag),
    )
    # When a duplicate under a caller-chosen id reaches the worker, which replays the record
    chosen = str(uuid.uuid4())
    again = charge.apply_async((7, 70), idempotency_key=key, task_id=chosen)
    assert again.deduplicated
    # Then the worker fails it clearly, as the caller's get() does, and nothing was unpickled or ran
    with pytest.raises(SerializationError, match="does not accept"):
        AsyncResult(chosen, app=shop.app).get(timeout=GET)
    with pytest.raises(SerializationError, match="application/x-python-serialize"):
        again.get(timeout=GET)
    assert not flag.exists()
    assert shop.effects("charge", key) == 0


def test_a_chain_whose_last_step_is_a_duplicate_finishes_with_the_stored_outcome(shop: Shop, key: str) -> None:
    charge = shop.task("charge")
    outcome = charge.apply_async((7, 70), idempotency_key=key).get(timeout=GET)
    head = f"{key}-head"
    result = chain(charge.si(1, 1).set(idempotency_key=head), charge.si(7, 70).set(idempotency_key=key)).apply_async()
    assert result.get(timeout=GET) == outcome
    assert shop.effects("charge", key) == 1 and shop.effects("charge", head) == 1


def test_a_task_calling_delay_on_itself_gets_its_own_id_back(shop: Shop, key: str) -> None:
    result = shop.task("again").apply_async((3,), idempotency_key=key)
    answer = result.get(timeout=GET)
    assert answer == {"own": result.id, "again": result.id}
    assert shop.effects("again", key) == 1


def test_a_returned_result_object_is_stored_as_the_backend_stores_it(shop: Shop, key: str) -> None:
    # Given a task that returns its child's AsyncResult (the backend stores its [id, parent] form)
    delegating = shop.task("delegating")
    first = delegating.apply_async((31,), idempotency_key=key)
    value = first.get(timeout=GET)
    child_id = value[0][0]
    assert value == [[child_id, None], None]
    assert AsyncResult(child_id, app=shop.app).get(timeout=GET) == {"replaced": 31}
    # Then the record holds that form, and every duplicate gets what the original's get() gave
    record = shop.idem.get("shop.delegating", key)
    assert record is not None and record.state is State.COMPLETED
    again = delegating.apply_async((31,), idempotency_key=key)
    assert again.deduplicated and again.get(timeout=GET) == value
    by_name = shop.app.send_task("shop.delegating", (31,), headers={"idempotency_key": key})
    assert by_name.get(timeout=GET) == value
    assert shop.effects("delegating", key) == 1


def test_a_returned_retry_retries_like_a_raised_one(shop: Shop, key: str) -> None:
    # Given a task whose first attempt returns self.retry(throw=False) (Celery has sent the retry)
    result = shop.task("retry_returned").apply_async((12,), idempotency_key=key)
    # Then the retry message acquires the record and runs: its outcome is the call's
    assert result.get(timeout=GET) == {"amount": 12, "retries": 1, "task_id": result.id}
    record = shop.idem.get("shop.retry_returned", key)
    assert record is not None and record.state is State.COMPLETED
    assert shop.effects("retry_returned", key) == 2


def test_a_body_that_calls_its_own_task_as_a_function_runs_it_as_a_plain_call(shop: Shop, key: str) -> None:
    # Given a body that recurses through a direct call of its own task (countdown(n - 1))
    result = shop.task("countdown").apply_async((2,), idempotency_key=key)
    # Then each level runs once, inline, and the call completes: the inner calls were not taken for
    # copies of the running message (which waited, re-published it and stored FAILED(Ignore))
    assert result.get(timeout=GET) == "done"
    assert [shop.effects("countdown", f"{key}:{n}") for n in (2, 1, 0)] == [1, 1, 1]
    record = shop.idem.get("shop.countdown", key)
    assert record is not None and record.state is State.COMPLETED


def test_typing_off_publishes_as_given_and_the_worker_fingerprints_the_same_call(shop: Shop, key: str) -> None:
    untyped = shop.task("untyped")
    # Given typing=False, a call that does not fit the signature is published (plain Celery does)
    # and fails on the worker, where the key is given back (a TypeError is retryable by default)
    misfit = untyped.apply_async((1, 2), {"extra": 3}, idempotency_key=key)
    with pytest.raises(TypeError, match="extra"):
        misfit.get(timeout=GET)
    assert shop.idem.get("shop.untyped", key) is None
    # A key-less call is keyed by the call as given, on the producer and the worker alike
    first, second = untyped.delay(5, 6), untyped.delay(5, 6)
    assert second.deduplicated and second.id == first.id
    by_name = shop.app.send_task("shop.untyped", (5, 6), headers={"idempotency_key": first.idempotency_key})
    assert first.get(timeout=GET) == by_name.get(timeout=GET) == {"order": 5, "amount": 6}
    assert shop.effects("untyped", first.idempotency_key) == 1


# ---- bad input: clear errors, nothing left IN_PROGRESS ----------------------------------------------


@pytest.mark.parametrize("bad", ["", "has space", "x" * 256, "tab\there", 42])
def test_invalid_keys_are_refused_before_anything_is_published(shop: Shop, bad: Any, published: list[str]) -> None:
    with pytest.raises(InvalidKeyError, match="idempotency key must be"):
        shop.task("charge").apply_async((1, 1), idempotency_key=bad)
    assert published == []


def test_unserializable_arguments_are_refused_at_publish(shop: Shop, key: str, published: list[str]) -> None:
    with pytest.raises(SerializationError, match="cannot be encoded with the 'json' serializer"):
        shop.task("charge").apply_async((object(), 1), idempotency_key=key)
    assert published == []
    assert shop.idem.get("shop.charge", key) is None


def test_unserializable_result_settles_a_permanent_failure_and_never_frees_the_key(shop: Shop, key: str) -> None:
    # The body returned (its effect happened) but its value cannot be stored.
    result = shop.task("unencodable").apply_async(("a",), idempotency_key=key)
    with pytest.raises(SerializationError, match="result cannot be encoded"):
        result.get(timeout=GET)
    record = shop.idem.get("shop.unencodable", key)
    assert record is not None and record.state is State.FAILED and record.error.type == "SerializationError"
    # A duplicate is told the failure; the body never runs again.
    again = shop.task("unencodable").apply_async(("a",), idempotency_key=key)
    assert again.deduplicated and again.id == result.id
    with pytest.raises(SerializationError, match="result cannot be encoded"):
        again.get(timeout=GET)
    assert shop.effects("unencodable", key) == 1


def test_result_over_max_result_bytes_settles_a_permanent_failure_and_never_frees_the_key(shop: Shop, key: str) -> None:
    result = shop.task("result_of_size").apply_async((1_100_000,), idempotency_key=key)
    with pytest.raises(ResultTooLargeError, match="over max_result_bytes=1048576"):
        result.get(timeout=GET)
    record = shop.idem.get("shop.result_of_size", key)
    assert record is not None and record.state is State.FAILED and record.error.type == "ResultTooLargeError"
    again = shop.task("result_of_size").apply_async((1_100_000,), idempotency_key=key)
    assert again.deduplicated
    with pytest.raises(ResultTooLargeError, match="over max_result_bytes=1048576"):
        again.get(timeout=GET)
    assert shop.effects("result_of_size", key) == 1


# ---- replace, Reject, Ignore: control flow, not failures (DESIGN §3) ------------------------------------


def test_a_replaced_task_runs_once_and_its_duplicates_get_the_replacements_result(shop: Shop, key: str) -> None:
    replaced = shop.task("replaced")
    order = int(uuid.uuid4().int % 10**9)
    first = replaced.apply_async((order,), idempotency_key=key)
    assert first.get(timeout=GET) == {"replaced": order}
    # The record follows the replacement: COMPLETED with its value (settled by the linked callback).
    _until(lambda: getattr(shop.idem.get("shop.replaced", key), "state", None) is State.COMPLETED)
    again = replaced.apply_async((order,), idempotency_key=key)
    assert again.deduplicated and again.id == first.id and again.get(timeout=GET) == {"replaced": order}
    # A copy sent by name under another task id is answered too, without running anything.
    by_name = shop.app.send_task("shop.replaced", (order,), headers={"idempotency_key": key})
    assert by_name.get(timeout=GET) == {"replaced": order}
    assert shop.effects("replaced", key) == 1
    assert int(shop.counter.get(effects_key(shop.prefix, "shop.replacement", str(order))) or 0) == 1


def test_a_duplicate_while_the_replacement_is_queued_is_handed_the_original_id(shop: Shop, key: str) -> None:
    # Given a replaced task whose replacement has not run yet (the record must not look free)
    seen: list[Any] = []

    def replaced_attempt_ended(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == "shop.replaced" and state == "IGNORED":
            seen.append((task_id, shop.idem.get("shop.replaced", key)))

    signals.task_postrun.connect(replaced_attempt_ended, weak=False)
    shop.task("replaced").__trace__ = None  # its tracer is rebuilt with this receiver
    try:
        first = shop.task("replaced").apply_async((11,), idempotency_key=key)
        first.get(timeout=GET)
        _until(lambda: any(task_id == first.id for task_id, _ in seen))  # the replacement may end first
    finally:
        signals.task_postrun.disconnect(replaced_attempt_ended)
    # (The receiver is process-wide: only this call's attempt counts. Each time an attempt of it
    # ended, a copy quietly acknowledged under load included, the record held the original id.)
    ours = [record for task_id, record in seen if task_id == first.id]
    assert ours and all(record is not None for record in ours)
    assert all(r.state in (State.IN_PROGRESS, State.COMPLETED) and r.task_id == first.id for r in ours)


@contextlib.contextmanager
def busy_lines() -> Iterator[list[str]]:
    """The handler's BUSY decision lines (INFO) while the block runs."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            line = record.getMessage()
            if line.startswith("BUSY"):
                lines.append(line)

    logger = logging.getLogger("celery_idem.handler")
    keep, level = Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
@pytest.mark.parametrize("how", ["queue", "countdown"])
def test_a_task_that_replaces_itself_hands_its_record_over_and_the_replacement_runs_at_once(
    shop: Shop, key: str, how: str, keyed: bool
) -> None:
    # Given a task that replaces itself with its own call on another queue, or after a countdown
    # (the replacement carries the running task id: it used to be taken for a copy of the running
    # attempt and busy-wait 60 s of every 90 s until the replaced attempt's hour-long lease ran out)
    order, moving = int(uuid.uuid4().int % 10**9), shop.task("moving")
    options = {"idempotency_key": key} if keyed else {}
    with busy_lines() as busy:
        first = moving.apply_async((order, how), **options)
        # Then it answers well within the busy wait, from the replacement's run
        value = first.get(timeout=GET)
    assert value["runs"] == 2 and value["order"] == order
    assert how != "queue" or value["queue"] == f"{shop.prefix}.heavy"
    assert not [line for line in busy if first.id in line], busy
    identity_key = key if keyed else first.idempotency_key
    _until(lambda: getattr(shop.idem.get("shop.moving", identity_key), "state", None) is State.COMPLETED)
    # and the record is the replacement's outcome: a duplicate replays it without running
    again = moving.apply_async((order, how), **options)
    assert again.deduplicated and again.id == first.id and again.get(timeout=GET) == value
    assert shop.effects("moving", identity_key) == 2


def test_a_task_that_replaces_itself_during_a_store_outage_is_not_lost(
    shop: Shop, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store that refuses claims and handovers for a while (an outage that starts as the body runs)
    store, down = shop.idem.store, threading.Event()

    def refused(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if down.is_set():
                raise StoreUnavailableError("store down (test)")
            return real(*args, **kwargs)

        return call

    for name in ("claim", "hand_over"):
        monkeypatch.setattr(store, name, refused(getattr(store, name)))
    down.set()
    # When a task replaces itself with its own call (a poll, 1 s later) meanwhile
    order = int(uuid.uuid4().int % 10**9)
    result = shop.app.send_task("shop.moving_brief", (order, "countdown"), headers={"idempotency_key": key})
    _until(lambda: shop.effects("moving_brief", key) >= 1)
    time.sleep(1.0)
    # Then the message is kept while the store cannot take the handover (nothing is published that
    # could not take the record), never consumed: before, the replacement's claim failed closed and
    # the message was consumed as a FAILURE
    assert shop.app.backend.get_task_meta(result.id)["status"] != "FAILURE"
    down.clear()
    # And once the store answers, the call runs again and answers
    assert result.get(timeout=GET)["runs"] >= 2


def test_a_replacement_whose_claim_fails_closed_keeps_the_replaced_message(
    shop: Shop, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store that refuses claims for a while (the replacement's publish claims its own key)
    store, down = shop.idem.store, threading.Event()
    real = store.claim

    def claim(*args: Any, **kwargs: Any) -> Any:
        if down.is_set():
            raise StoreUnavailableError("store down (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "claim", claim)
    down.set()
    # When a task replaces itself with another idempotent call meanwhile
    order = int(uuid.uuid4().int % 10**9)
    result = shop.app.send_task("shop.replaced_by_charge", (order,), headers={"idempotency_key": key})
    _until(lambda: shop.effects("replaced_by_charge", key) >= 1)
    time.sleep(1.0)
    assert shop.app.backend.get_task_meta(result.id)["status"] != "FAILURE"
    down.clear()
    # Then the message was kept (sent back to the broker, not consumed as a FAILURE): once the store
    # answers it runs again and its replacement answers, run once
    assert result.get(timeout=GET)["charged"] == 5
    assert shop.effects("charge", f"{key}-charge") == 1


def test_a_replacement_by_another_call_with_a_countdown_keeps_the_key_past_the_countdown(shop: Shop, key: str) -> None:
    # Given a task (queue wait 1 s, lease 1 s) that replaced itself with another call 3 s later
    order = int(uuid.uuid4().int % 10**9)
    first = shop.task("replaced_later").apply_async((order,), idempotency_key=key)
    _until(lambda: shop.effects("replaced_later", key) == 1)
    time.sleep(2.5)
    # When the call comes again before the replacement has run
    again = shop.task("replaced_later").apply_async((order,), idempotency_key=key)
    # Then it is the same call: handed the original id, and the whole call ran once; before, the
    # record's lease ignored the countdown, so the call ran again and the replacement twice
    assert again.deduplicated and again.id == first.id
    assert first.get(timeout=GET) == {"replaced": order}
    time.sleep(0.5)
    assert shop.effects("replaced_later", key) == 1
    assert int(shop.counter.get(effects_key(shop.prefix, "shop.replacement", str(order))) or 0) == 1


@pytest.mark.parametrize(
    ("keyed", "step_keyed"),
    [(False, False), (True, True), (True, False)],
    ids=["keyless", "keyed", "keyed-call-keyless-step"],
)
def test_a_task_replaced_by_a_chain_that_ends_in_its_own_call_is_answered_by_it(
    shop: Shop, key: str, keyed: bool, step_keyed: bool
) -> None:
    # Given a task that replaces itself with chain(prepare, itself): the chain's last step carries
    # the running task id and is this very call, so the record is handed to it; it is published
    # later, by the worker of the step before it (no attempt of the replaced task runs there, so a
    # key-less step of a keyed call is sent with the call's key: found by an attacker, it ran under
    # its arguments' fingerprint and the keyed record waited out the replacement's whole wait)
    order = int(uuid.uuid4().int % 10**9)
    options = {"idempotency_key": key} if keyed else {}
    result = shop.task("chained").apply_async((order, step_keyed), **options)
    # Then that step is published (the store holds the record under the token it carries: it is no
    # copy of the original) and answers the handle; before, it was taken for a copy and dropped
    assert result.get(timeout=GET) == {"order": order, "runs": 2}
    assert int(shop.counter.get(effects_key(shop.prefix, "shop.replacement", str(order))) or 0) == 1


def test_a_keyed_poll_replacing_itself_with_other_arguments_is_answered(shop: Shop, key: str) -> None:
    # Given a keyed poll that replaces itself with its own call one try later (other arguments, the
    # same key: the same attempt chain, as a Celery retry with changed arguments is)
    order = int(uuid.uuid4().int % 10**9)
    result = shop.task("poll").apply_async((order,), idempotency_key=key)
    # Then the replacement takes the record by its token and answers; before, it was refused as
    # other arguments under the record's own task id and ended quietly: the handle never answered
    assert result.get(timeout=GET) == {"order": order, "runs": 2, "tries": 1}
    record = shop.idem.get("shop.poll", key)
    assert record is not None and record.state is State.COMPLETED


def test_a_chain_ending_in_the_tasks_own_call_with_other_arguments_is_answered_by_it(shop: Shop, key: str) -> None:
    # Given a keyed poll that replaces itself with chain(prepare, itself one try later)
    order = int(uuid.uuid4().int % 10**9)
    result = shop.task("chain_poll").apply_async((order,), idempotency_key=key)
    # Then the last step, published by the first step's worker with other arguments than the
    # record's, is no mismatch (the store holds the record under the token it carries): it runs and
    # answers; before, its publish raised PayloadMismatchError in the prepare step
    assert result.get(timeout=GET) == {"order": order, "runs": 2, "tries": 1}
    again = shop.task("chain_poll").apply_async((order,), idempotency_key=key)
    assert again.deduplicated and again.get(timeout=GET) == {"order": order, "runs": 2, "tries": 1}


def test_a_replacement_with_other_arguments_that_is_requeued_runs_again(shop: Shop, key: str) -> None:
    # Given a keyed poll replaced by its own call one try later, whose replacement is requeued once
    # (Reject(requeue=True): its token is spent, its arguments are not the record's)
    order = int(uuid.uuid4().int % 10**9)
    result = shop.task("poll_requeued").apply_async((order,), idempotency_key=key)
    # Then the requeued copy continues the same attempt chain: it runs and answers; before, it was
    # refused as other arguments and ended quietly, and the handle never answered
    assert result.get(timeout=GET) == {"order": order, "runs": 3, "tries": 1}


def test_a_task_replaced_inside_a_chain_stores_its_replacements_value_not_the_chains(shop: Shop, key: str) -> None:
    # Given chain(a task that replaces itself with another call, then a tail step)
    order = int(uuid.uuid4().int % 10**9)
    outer = chain(shop.task("swap").si(order).set(idempotency_key=key), shop.task("tail").si()).apply_async()
    assert outer.get(timeout=GET) == "tail-value"
    # Then the replaced call's record holds its replacement's value (Celery appends the chain's tail
    # after it, which is not this call's outcome), and a duplicate gets that, not the tail's value
    _until(lambda: getattr(shop.idem.get("shop.swap", key), "state", None) is State.COMPLETED)
    again = shop.task("swap").apply_async((order,), idempotency_key=key)
    assert again.deduplicated and again.get(timeout=GET) == {"replaced": order}


def test_a_replacement_chains_waits_add_up_in_the_replaced_records_lease(shop: Shop, key: str) -> None:
    # Given a task (queue wait 1 s, lease 1 s) replaced by two steps of 2 s countdown each
    order = int(uuid.uuid4().int % 10**9)
    first = shop.task("replaced_by_a_slow_chain").apply_async((order,), idempotency_key=key)
    _until(lambda: shop.effects("replaced_by_a_slow_chain", key) == 1)
    # When the call comes again between the steps (past the longest single wait, 3 s + 1 s)
    time.sleep(4.5)
    again = shop.task("replaced_by_a_slow_chain").apply_async((order,), idempotency_key=key)
    # Then it is the same call: handed the original id, and the whole call ran once
    assert again.deduplicated and again.id == first.id
    assert first.get(timeout=GET) == {"replaced": order}
    time.sleep(0.5)
    assert shop.effects("replaced_by_a_slow_chain", key) == 1
    assert int(shop.counter.get(effects_key(shop.prefix, "shop.replacement", str(order))) or 0) == 2


def test_a_task_that_refuses_duplicates_can_still_replace_itself(shop: Shop, key: str) -> None:
    # on_duplicate="raise" refuses a second call of a running key; the replacement is not one: its
    # publish is not claimed at all (the record is handed to it), as a Celery retry's is not
    first = shop.task("moving_strict").apply_async((int(uuid.uuid4().int % 10**9), "countdown"), idempotency_key=key)
    assert first.get(timeout=GET)["runs"] == 2


def test_a_copy_of_a_message_that_replaced_itself_does_not_run_while_the_replacement_holds_the_record(
    shop: Shop, key: str
) -> None:
    ended: list[Any] = []

    def attempt_ended(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == "shop.moving":
            ended.append((task_id, state))

    signals.task_postrun.connect(attempt_ended, weak=False)
    shop.task("moving").__trace__ = None  # its tracer is rebuilt with this receiver
    try:
        # Given a task that replaced itself with its own call 4 s later
        order = int(uuid.uuid4().int % 10**9)
        first = shop.task("moving").apply_async((order, "later"), idempotency_key=key)
        _until(lambda: (first.id, "IGNORED") in ended)
        # When copies of its message arrive meanwhile (a broker redelivery; one forges a handover)
        for headers in ({}, {"idempotency_handover": "forged"}):
            shop.app.send_task(
                "shop.moving", (order, "later"), task_id=first.id, headers={"idempotency_key": key, **headers}
            )
        # Then the replacement answers, and the copies end quietly without running the body (a copy
        # that meets the record handed to the queued replacement waits through the broker: each of
        # its trips ends quietly too, and the last replays nothing but ends quietly as well)
        assert first.get(timeout=GET)["runs"] == 2
        _until(lambda: ended.count((first.id, "IGNORED")) >= 3)
        time.sleep(3.0)  # past the copies' last trip (0.5 s doubling)
        assert ended.count((first.id, "SUCCESS")) == 1, ended
    finally:
        signals.task_postrun.disconnect(attempt_ended)
    assert shop.effects("moving", key) == 2


def test_error_callbacks_around_a_failing_replacement_run_once_and_the_record_takes_its_failure(
    shop: Shop, key: str
) -> None:
    # Given a replaced task whose replacement fails for good, with a task-id errback (old style)
    # and a (request, exc, traceback) one
    order, old, new = int(uuid.uuid4().int % 10**9), uuid.uuid4().hex, uuid.uuid4().hex
    errbacks = [shop.task("noted").s(old), shop.task("noted_error").s(new)]
    result = shop.task("replaced_declined").apply_async((order,), idempotency_key=key, link_error=errbacks)
    with pytest.raises(PermanentError):
        result.get(timeout=GET)
    # Then the replaced record takes the failure (not left to its lease)
    _until(lambda: getattr(shop.idem.get("shop.replaced_declined", key), "state", None) is State.FAILED)

    def runs(task: str, tag: str) -> int:
        return int(shop.counter.get(effects_key(shop.prefix, f"shop.{task}", tag)) or 0)

    # and each user errback runs once, as in plain Celery
    _until(lambda: runs("noted", old) and runs("noted_error", new))
    time.sleep(1)  # a second run would come right after the first
    assert (runs("noted", old), runs("noted_error", new)) == (1, 1)


def test_a_group_whose_members_replace_themselves_with_groups_completes_in_order(tmp_path: Path) -> None:
    # Celery's test_task_replace_with_group_preserves_group_order, each call three times. (Ten times
    # each, as Celery has it, still takes minutes: the duplicate members wait for their original in 8
    # of the worker's slots, which the replacements' groups need, until their busy wait runs out.)
    # In a worker process of its own: a group replacement's results, dropped in the worker,
    # reconnect to the Redis backend to unsubscribe when collected (an unclosed socket at exit).
    require_server("redis")
    prefix = f"g{uuid.uuid4().hex[:10]}"
    app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, pool="threads", concurrency=8)
    try:
        to_all = app.tasks["shop.to_all"]
        members = [to_all.s([2, 1], 1), to_all.s([4, 3], 1)] * 3
        result = group(members).apply_async()
        _until(result.ready, seconds=60)  # polled: get() would subscribe this process to the backend
        assert [member.result for member in result.results] == [[3, 2], [5, 4]] * 3, worker.output()[-3000:]
    finally:
        worker.stop()


def test_reject_with_requeue_returns_the_record_to_pending_for_the_redelivery(shop: Shop, key: str) -> None:
    seen: list[Any] = []

    def rejected(sender: Any = None, state: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == "shop.rejecting" and state == "REJECTED":
            seen.append(shop.idem.get("shop.rejecting", key))

    signals.task_postrun.connect(rejected, weak=False)
    shop.task("rejecting").__trace__ = None  # its tracer is rebuilt with this receiver
    try:
        result = shop.task("rejecting").apply_async((True,), idempotency_key=key)
        assert result.get(timeout=GET) == {"attempts": 2}  # the redelivered message ran, under its id
        _until(lambda: seen)
    finally:
        signals.task_postrun.disconnect(rejected)
    assert len(seen) == 1 and seen[0] is not None and seen[0].state is State.PENDING
    assert seen[0].task_id == result.id
    again = shop.task("rejecting").apply_async((True,), idempotency_key=key)
    assert again.deduplicated and again.get(timeout=GET) == {"attempts": 2}
    assert shop.effects("rejecting", key) == 2


def test_reject_without_requeue_is_final_and_told_to_every_duplicate(shop: Shop, key: str) -> None:
    result = shop.task("rejecting").apply_async((False,), idempotency_key=key)
    with pytest.raises(Reject):
        result.get(timeout=GET)
    record = shop.idem.get("shop.rejecting", key)
    assert record is not None and record.state is State.FAILED and record.error.type == "Reject"
    again = shop.task("rejecting").apply_async((False,), idempotency_key=key)
    assert again.deduplicated and again.id == result.id
    with pytest.raises(Reject):
        again.get(timeout=GET)
    assert shop.effects("rejecting", key) == 1


def test_ignore_ends_the_call_and_its_duplicates_are_ignored_without_running(shop: Shop, key: str) -> None:
    first = shop.task("ignoring").apply_async((4,), idempotency_key=key)
    _until(lambda: getattr(shop.idem.get("shop.ignoring", key), "state", None) is State.FAILED)
    assert shop.idem.get("shop.ignoring", key).error.type == "Ignore"
    again = shop.task("ignoring").apply_async((4,), idempotency_key=key)
    assert again.deduplicated and again.id == first.id
    with pytest.raises(Ignore):
        again.get(timeout=GET)
    # A copy by name under another id is ignored the same way on the worker: nothing runs, nothing stored.
    copy = shop.app.send_task("shop.ignoring", (4,), headers={"idempotency_key": key})
    _until(lambda: shop.idem.metrics()["replays"] >= 1)
    time.sleep(0.2)
    assert shop.app.backend.get_task_meta(copy.id)["status"] == "PENDING"
    assert shop.effects("ignoring", key) == 1


def _replacing_app(name: str) -> tuple[Celery, Idempotency, list[str]]:
    """An app on the memory broker and store whose task ``move`` replaces itself with ``other``; the
    names of the messages it publishes."""
    app = Celery(name, set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store="memory://", lease_seconds=5, pending_timeout_seconds=100)
    sent: list[str] = []

    @app.task(shared=False, name="other")
    def other(x: int) -> int:
        return x

    def publishing(sender: Any = None, **_: Any) -> None:
        sent.append(sender)

    signals.before_task_publish.connect(publishing, weak=False)
    app.__dict__["_test_publishing"] = publishing
    return app, idem, sent


def test_an_attempt_that_lost_its_lease_sends_no_replacement() -> None:
    # Given an attempt whose record another attempt took while it ran (here: forgotten under it)
    app, idem, sent = _replacing_app("lost-replace")

    @app.task(base=IdempotentTask, shared=False, bind=True, name="move")
    def move(self: Any, x: int) -> Any:
        idem.forget("move", "k")
        raise self.replace(app.tasks["other"].si(x))

    try:
        # When it replaces itself
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k")
        # Then nothing is sent (the attempt that holds the record sends its own), and it ends with
        # LockLostError (before: the replacement was sent anyway, and ran twice)
        assert sent == []
        assert app.AsyncResult("t-1").state == "FAILURE"
        assert isinstance(app.AsyncResult("t-1").result, LockLostError)
    finally:
        signals.before_task_publish.disconnect(app.__dict__["_test_publishing"])
        idem.disconnect()


def test_a_replacement_holds_the_record_for_its_whole_wait_from_before_it_is_sent() -> None:
    # Given a task that replaces itself with another call, and a look at its record as the
    # replacement is being sent
    app, idem, sent = _replacing_app("lease-replace")
    seen: list[float] = []

    @app.task(base=IdempotentTask, shared=False, bind=True, name="move")
    def move(self: Any, x: int) -> Any:
        raise self.replace(app.tasks["other"].si(x))

    def look(sender: Any = None, **_: Any) -> None:
        if sender == "other":
            record = idem.get("move", "k")
            seen.append(record.lease_expires_at - idem.store.now())

    signals.before_task_publish.connect(look, weak=False)
    try:
        # When it runs
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k")
        # Then the token held the record for the replacement's whole wait (100 s + a lease) before
        # the replacement went out: a process killed right after the publish leaves nothing a copy
        # may take while the replacement waits (with one lease until a renewal after the publish, an
        # attacker's kill in between freed it, and the call ran twice)
        assert sent == ["other"]
        assert seen[0] > 100
        record = idem.get("move", "k")
        assert record.state is State.IN_PROGRESS
    finally:
        signals.before_task_publish.disconnect(look)
        signals.before_task_publish.disconnect(app.__dict__["_test_publishing"])
        idem.disconnect()


def test_a_handover_whose_reply_was_lost_is_taken_back_by_the_kept_message_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a task that replaces itself, and a store that hands the record over but whose reply is
    # lost (the first time)
    from celery_idem.handler import Handler

    app, idem, sent = _replacing_app("lost-handover")
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, bind=True, name="move")
    def move(self: Any, x: int) -> Any:
        runs.append(x)
        raise self.replace(app.tasks["other"].si(x))

    store = idem.store
    original = store.hand_over
    lost: list[bool] = []

    def hand_over(*args: Any, **kwargs: Any) -> Any:
        answer = original(*args, **kwargs)
        if not lost:
            lost.append(True)
            raise StoreUnavailableError("the reply was lost")
        return answer

    kept: list[dict[str, Any]] = []
    monkeypatch.setattr(store, "hand_over", hand_over)
    monkeypatch.setattr(
        Handler, "republish", lambda self, a, k, *, countdown, headers=None: kept.append(dict(headers or {}))
    )
    try:
        # When it runs, and its kept message comes back from the broker
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k")
        assert sent == [] and len(kept) == 1
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k", **kept[0])
        # Then the copy took the record back by the token it carries and ran at once (before: it met
        # a record held for the replacement's whole wait, which nothing would ever send, and waited
        # it out), and the replacement was sent once
        assert runs == [1, 1]
        assert sent == ["other"]
    finally:
        signals.before_task_publish.disconnect(app.__dict__["_test_publishing"])
        idem.disconnect()


# ---- a second message while the first attempt runs ---------------------------------------------------


def test_a_message_for_a_running_identity_waits_and_answers_with_its_outcome(shop: Shop, key: str) -> None:
    # Given an attempt that runs past its own 3 s lease (the heartbeat keeps renewing it)
    first = shop.app.send_task("shop.slow", (4,), headers={"idempotency_key": key})
    _until(lambda: shop.effects("slow", key) == 1)
    time.sleep(3.2)  # past the first lease: only the heartbeat keeps the attempt's claim alive
    # When a second message with the key arrives (on_busy="wait")
    second = shop.app.send_task("shop.slow", (4,), headers={"idempotency_key": key})
    # Then it does not run, and answers with the first attempt's outcome
    assert second.get(timeout=GET) == first.get(timeout=GET) == "slept 4"
    assert shop.effects("slow", key) == 1
    assert shop.idem.metrics()["busy_waits"] >= 1


def test_a_failed_renewal_never_stops_the_heartbeat_on_a_worker(
    shop: Shop, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store whose first renewal fails with an error that is not ours (a Redis BUSY)
    store, failures = shop.idem.store, []
    renew = store.renew

    def busy_once(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(1)
            raise redis.exceptions.ResponseError("BUSY Redis is busy running a script")
        return renew(*args, **kwargs)

    monkeypatch.setattr(store, "renew", busy_once)
    errors = shop.idem.metrics()["store_errors"]
    # When an attempt runs past its 3 s lease, and a second message with the key arrives then
    first = shop.app.send_task("shop.slow", (4.5,), headers={"idempotency_key": key})
    _until(lambda: shop.effects("slow", key) == 1)
    _until(lambda: bool(failures))
    time.sleep(3.2)  # past the first lease: only renewals after the failed one keep the claim alive
    second = shop.app.send_task("shop.slow", (4.5,), headers={"idempotency_key": key})
    # Then the lease held: the body ran once, the second message answers with its outcome
    assert second.get(timeout=GET) == first.get(timeout=GET) == "slept 4.5"
    assert shop.effects("slow", key) == 1
    assert shop.idem.metrics()["store_errors"] > errors


def test_on_busy_retry_retries_later_and_then_replays(shop: Shop, key: str) -> None:
    first = shop.app.send_task("shop.slow_retry", (1.5,), headers={"idempotency_key": key})
    _until(lambda: shop.effects("slow_retry", key) == 1)
    second = shop.app.send_task("shop.slow_retry", (1.5,), headers={"idempotency_key": key})
    assert second.get(timeout=GET) == first.get(timeout=GET) == "slept 1.5"
    assert shop.effects("slow_retry", key) == 1


def test_an_attempt_fenced_out_while_running_ends_with_lock_lost(shop: Shop, key: str) -> None:
    # Given a running attempt whose record is forgotten under it (an operator's forget)
    result = shop.task("slow").apply_async((1,), idempotency_key=key)
    _until(lambda: shop.effects("slow", key) == 1)
    assert shop.idem.forget("shop.slow", key)
    # Then its outcome is not stored, and it says so
    with pytest.raises(LockLostError, match="lost its lease"):
        result.get(timeout=GET)
    assert shop.idem.get("shop.slow", key) is None
    assert shop.effects("slow", key) == 1


def _until(predicate: Any, seconds: float = GET) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# ---- one answer per task id: a copy of a running task id --------------------------------------------


def test_a_copy_of_a_running_task_id_never_writes_that_ids_state(shop: Shop, key: str) -> None:
    # Given a running attempt whose policy retries BUSY messages (max_retries=1, lease 1 s)
    ended: list[tuple[str, str]] = []

    def postrun(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == "shop.slow_busy_retry":
            ended.append((task_id, state))

    signals.task_postrun.connect(postrun, weak=False)
    busy = shop.task("slow_busy_retry")
    busy.__trace__ = None  # its tracer is rebuilt with this receiver
    try:
        first = busy.apply_async((4,), idempotency_key=key, link_error=shop.task("noted").s(tag=key))
        _until(lambda: shop.effects("slow_busy_retry", key) == 1)
        # When the broker hands a worker a copy of the same message (same task id) while it runs
        shop.app.send_task("shop.slow_busy_retry", (4,), task_id=first.id, headers={"idempotency_key": key})
        # Then the copy never retries nor fails that id: the attempt ends SUCCESS with its value
        assert first.get(timeout=GET) == "slept 4"
        _until(lambda: len(ended) == 2)
    finally:
        signals.task_postrun.disconnect(postrun)
    assert sorted(state for _, state in ended) == ["IGNORED", "SUCCESS"]
    assert shop.app.backend.get_task_meta(first.id)["status"] == "SUCCESS"
    assert int(shop.counter.get(effects_key(shop.prefix, "shop.noted", key)) or 0) == 0
    assert shop.effects("slow_busy_retry", key) == 1


@pytest.mark.parametrize("how", ["redelivered", "published again under its id"])
def test_a_copy_of_a_settled_task_id_ends_quietly_and_its_link_runs_once(shop: Shop, key: str, how: str) -> None:
    # Given a call with a link, completed, its link run once
    charge, add = shop.task("charge"), shop.task("add")
    order = int(uuid.uuid4().int % 10**9)
    first = charge.apply_async((order, 70), idempotency_key=key, link=add.s(1))
    assert first.get(timeout=GET)["charged"] == 70
    links = effects_key(shop.prefix, "shop.add", str(order))
    _until(lambda: shop.counter.get(links) is not None)
    done = shop.app.backend.get_task_meta(first.id)["date_done"]
    # When a copy of that message comes (the broker again, or a caller re-sending the same task id)
    if how == "redelivered":
        shop.app.send_task(
            "shop.charge",
            (order, 70),
            task_id=first.id,
            headers={"idempotency_key": key},
            link=add.s(1),
            queue=shop.prefix,
        )
    else:
        again = charge.apply_async((order, 70), idempotency_key=key, task_id=first.id, link=add.s(1))
        assert again.deduplicated and again.id == first.id and again.get(timeout=GET) == first.get()
    time.sleep(1.5)
    # Then it ends quietly: the body and the link ran once, and the id's state was not rewritten
    assert shop.effects("charge", key) == 1
    assert int(shop.counter.get(links) or 0) == 1, "the link of the one call ran again for a copy of its id"
    assert shop.app.backend.get_task_meta(first.id)["date_done"] == done


# ---- the store fails while the outcome is written ---------------------------------------------------


@pytest.fixture
def flaky_complete(shop: Shop, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The worker's store refuses its next ``fails`` complete calls, as a restarting store does."""
    store = shop.idem.store
    real = store.complete
    state = {"fails": 0}

    def complete(*args: Any, **kwargs: Any) -> Any:
        if state["fails"] > 0:
            state["fails"] -= 1
            raise StoreUnavailableError("store restarting (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "complete", complete)
    return state


def test_an_outage_while_completing_is_retried_and_the_body_runs_once(shop: Shop, key: str, flaky_complete) -> None:
    flaky_complete["fails"] = 3
    charge = shop.task("charge")
    first = charge.apply_async((31, 310), idempotency_key=key)
    assert first.get(timeout=GET)["charged"] == 310
    record = shop.idem.get("shop.charge", key)
    assert record is not None and record.state is State.COMPLETED
    again = charge.apply_async((31, 310), idempotency_key=key)
    assert again.deduplicated and again.get(timeout=GET)["charged"] == 310
    assert shop.effects("charge", key) == 1


def test_an_outage_past_the_lease_leaves_the_value_in_the_backend_for_the_reconciler(
    shop: Shop, key: str, flaky_complete
) -> None:
    # Given a store that refuses every complete for longer than the lease (slow: lease 3 s)
    flaky_complete["fails"] = 10**6
    result = shop.task("slow").apply_async((0,), idempotency_key=key)
    # Then the task still ends SUCCESS with its value (evidence the reconciler settles from), never
    # FAILURE(StoreUnavailableError), which would read as "may run again"
    assert result.get(timeout=GET) == "slept 0"
    assert shop.app.backend.get_task_meta(result.id)["status"] == "SUCCESS"
    record = shop.idem.get("shop.slow", key)
    assert record is not None and record.state is State.IN_PROGRESS
    assert shop.effects("slow", key) == 1
