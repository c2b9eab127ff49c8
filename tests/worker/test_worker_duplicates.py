"""Through a real worker and a real broker, on Redis and again on RabbitMQ: one call runs once, however
it is spelled or sent (by name, with the key as a header, an option or a message property, as a
signature, through apply(), with pydantic models, as a step of a chain, under a task id the caller
chose), and every copy is answered with its outcome; the same key with other arguments is refused, and
bad input is refused before anything is published.

The worker runs in this process (tests/shop_worker.py: start_worker, threads pool, one per broker for
the module); the store is Redis; executions are counted by the INCR each task body makes
(tests/shop.py), never by our records.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from typing import Any

import pytest
import shop_worker
from celery import Celery, chain, signals
from conftest import REDIS_URL
from shop import Order, effects_key, make_app
from shop_worker import BACKEND, BROKERS, GET, Shop, until

from celery_idem import InvalidKeyError, PayloadMismatchError, SerializationError, State
from celery_idem.signals import options_to_headers

shop = shop_worker.shop
key = shop_worker.key
published = shop_worker.published


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


# ---- by name, by header, option or property, through apply(), as models, in chains, under a chosen id ----


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


def test_a_message_under_a_calls_task_id_that_cannot_be_bound_neither_frees_its_key_nor_answers_for_it(
    shop: Shop, key: str
) -> None:
    # Given a call waiting in the queue (a 3 s countdown)
    charge = shop.task("charge")
    first = charge.apply_async((9, 90), idempotency_key=key, countdown=3)
    # When a message under its task id and key that the signature cannot bind (as a worker of a
    # release that removed a parameter binds it) comes first, without the call's claim token
    shop.app.send_task("shop.charge", (9, 999, "EUR", "", "extra"), task_id=first.id, headers={"idempotency_key": key})
    time.sleep(1.0)
    # Then the queued call keeps its claim and its task id's state: the message ends quietly
    record = shop.idem.get("shop.charge", key)
    assert record is not None and record.state is State.PENDING
    assert shop.app.backend.get_task_meta(first.id)["status"] == "PENDING"
    with pytest.raises(PayloadMismatchError):
        charge.apply_async((9, 555), idempotency_key=key)  # the key still answers the queued call
    assert first.get(timeout=GET)["charged"] == 90
    assert shop.effects("charge", key) == 1


def test_a_copy_of_a_running_call_that_cannot_be_bound_does_not_answer_for_it(shop: Shop, key: str) -> None:
    # Given a call running
    slow = shop.task("slow")
    first = slow.apply_async((2.0,), {"tag": key}, idempotency_key=key)
    until(lambda: (r := shop.idem.get("shop.slow", key)) is not None and r.state is State.IN_PROGRESS)
    # When a copy of its message comes as a release whose signature lost `tag` binds it
    shop.app.send_task("shop.slow", (2.0, key, "gone"), task_id=first.id, headers={"idempotency_key": key})
    # Then the copy ends quietly: the call's handle gets the call's own answer, and it ran once
    assert first.get(timeout=GET) == "slept 2.0"
    assert shop.effects("slow", key) == 1


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


def test_a_chain_whose_last_step_is_a_duplicate_finishes_with_the_stored_outcome(shop: Shop, key: str) -> None:
    charge = shop.task("charge")
    outcome = charge.apply_async((7, 70), idempotency_key=key).get(timeout=GET)
    head = f"{key}-head"
    result = chain(charge.si(1, 1).set(idempotency_key=head), charge.si(7, 70).set(idempotency_key=key)).apply_async()
    assert result.get(timeout=GET) == outcome
    assert shop.effects("charge", key) == 1 and shop.effects("charge", head) == 1


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
