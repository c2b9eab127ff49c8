"""Through a real worker and a real broker, on Redis and again on RabbitMQ: a message that comes while
an attempt of its call runs. A second message of the identity waits (or retries) and answers with the
running attempt's outcome, the heartbeat keeping the lease whatever a renewal raises; an attempt fenced
out while it runs ends with LockLostError; a copy of a running or settled task id never writes that id's
state; a body calling its own task gets its own id back, or runs it inline as a plain call.

The worker runs in this process (tests/shop_worker.py: start_worker, threads pool, one per broker for
the module); the store is Redis; executions are counted by the INCR each task body makes
(tests/shop.py), never by our records.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis
import shop_worker
from celery import signals
from conftest import POSTGRES_URL, REDIS_URL, require_server, wipe
from shop import COUNTER_URL, effects_key, make_app
from shop_worker import BACKEND, BROKERS, GET, Shop
from shop_worker import until as _until
from workers import Worker, wait_for

from celery_idem import Idempotency, LockLostError, State

shop = shop_worker.shop
key = shop_worker.key


# ---- a second message while the first attempt runs ---------------------------------------------------


def test_a_message_for_a_running_identity_waits_and_answers_with_its_outcome(shop: Shop, key: str) -> None:
    # Given an attempt that runs past its own 3 s lease (the heartbeat keeps renewing it)
    waits = shop.idem.metrics()["busy_waits"]  # the module's count so far
    first = shop.app.send_task("shop.slow", (4,), headers={"idempotency_key": key})
    _until(lambda: shop.effects("slow", key) == 1)
    time.sleep(3.2)  # past the first lease: only the heartbeat keeps the attempt's claim alive
    # When a second message with the key arrives (on_busy="wait")
    second = shop.app.send_task("shop.slow", (4,), headers={"idempotency_key": key})
    # Then it does not run, and answers with the first attempt's outcome
    assert second.get(timeout=GET) == first.get(timeout=GET) == "slept 4"
    assert shop.effects("slow", key) == 1
    assert shop.idem.metrics()["busy_waits"] > waits


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
    # Celery sends the link before it stores the result, and get() answered from the store: the
    # backend's entry may come a moment after both.
    _until(lambda: shop.app.backend.get_task_meta(first.id).get("date_done") is not None)
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


@pytest.mark.parametrize("when", ["once the duplicate was answered", "while the duplicate is answered"])
def test_a_copy_of_a_duplicate_carrying_a_link_runs_that_link_once(shop: Shop, key: str, when: str) -> None:
    # Given a completed call, and a duplicate of it with a link of its own: published anyway under its
    # own task id, so that the worker replays the outcome into that link
    charge, add = shop.task("charge"), shop.task("add")
    order = int(uuid.uuid4().int % 10**9)
    assert charge.apply_async((order, 70), idempotency_key=key).get(timeout=GET)["charged"] == 70
    duplicate = charge.apply_async((order, 70), idempotency_key=key, link=add.s(1))
    links = effects_key(shop.prefix, "shop.add", str(order))
    if when == "once the duplicate was answered":
        _until(lambda: shop.counter.get(links) is not None)
        _until(lambda: shop.app.backend.get_task_meta(duplicate.id).get("date_done") is not None)
    # When a copy of the duplicate's message comes (the broker again, or its caller re-sending it)
    shop.app.send_task(
        "shop.charge",
        (order, 70),
        task_id=duplicate.id,
        headers={"idempotency_key": key},
        link=add.s(1),
        queue=shop.prefix,
    )
    _until(lambda: shop.counter.get(links) is not None)
    time.sleep(1.5)
    # Then the body ran once, and the duplicate's link once: a copy of a message is not another call
    assert shop.effects("charge", key) == 1
    assert int(shop.counter.get(links) or 0) == 1, "the link of the duplicate ran again for a copy of its message"


def test_a_copy_of_a_duplicate_under_a_long_chosen_task_id_runs_its_link_once_on_postgresql(tmp_path) -> None:
    # Given a worker on a PostgreSQL store, a completed call, and a duplicate of it with a link under a
    # task id its caller chose: 250 characters (Celery takes any string; the main record keeps it whole)
    require_server("postgresql")
    prefix = f"c{uuid.uuid4().hex[:10]}"
    worker = Worker(tmp_path, BROKERS["redis"], POSTGRES_URL, prefix)
    app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=POSTGRES_URL, prefix=prefix, queue=prefix)
    try:
        charge, add = app.tasks["shop.charge"], app.tasks["shop.add"]
        order, key = int(uuid.uuid4().int % 10**9), f"k-{uuid.uuid4().hex}"
        assert charge.apply_async((order, 70), idempotency_key=key).get(timeout=GET)["charged"] == 70
        task_id = f"order-{order}-" + "x" * (250 - len(f"order-{order}-"))
        duplicate = charge.apply_async((order, 70), idempotency_key=key, task_id=task_id, link=add.s(1))
        assert duplicate.deduplicated and duplicate.id == task_id
        links = effects_key(prefix, "shop.add", str(order))
        counter = redis.Redis.from_url(COUNTER_URL)
        wait_for(lambda: counter.get(links) is not None, "the duplicate's link")
        # When a copy of the duplicate's message comes (its caller re-sending it under the same id)
        charge.apply_async((order, 70), idempotency_key=key, task_id=task_id, link=add.s(1))
        ended = lambda: "acknowledged quietly" in worker.output() or int(counter.get(links) or 0) > 1  # noqa: E731
        wait_for(ended, "the copy's end")
        # Then the link ran once (the fence's key was once the task id and a suffix, too long for the SQL
        # store's 255-character key column: its acquire failed as an "outage" and every copy replayed)
        assert int(counter.get(links) or 0) == 1, "the link ran again for a copy of its message"
        assert int(counter.get(effects_key(prefix, "shop.charge", key))) == 1
    finally:
        worker.stop()
        wipe(Idempotency.of(app).store)


def test_a_duplicates_link_the_broker_refused_runs_when_its_message_is_sent_again(tmp_path) -> None:
    # Given a completed call, and a duplicate of it with a link whose send the broker refuses once (Celery
    # marks the duplicate FAILED with the broker's OperationalError: the link was never sent)
    from dying_link_shop import add_linked, refused

    require_server("redis")
    prefix = f"c{uuid.uuid4().hex[:10]}"
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, app="dying_link_shop")
    app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    linked = add_linked(app, prefix)
    counter = redis.Redis.from_url(COUNTER_URL)
    try:
        key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
        assert linked.apply_async((7,), idempotency_key=key).get(timeout=GET) == {"order": "7", "charged": 1}
        counter.set(refused(prefix, tag), 1)
        link = app.tasks["shop.noted_once"].si("x", tag)
        duplicate = linked.apply_async((7,), idempotency_key=key, link=link)
        wait_for(lambda: app.backend.get_task_meta(duplicate.id)["status"] == "FAILURE", "the failed link send")
        assert not counter.exists(refused(prefix, tag))
        assert "refused the message" in repr(app.backend.get_task_meta(duplicate.id)["result"])
        # When its caller (or a dead-letter re-drive) sends that message again under its task id
        app.send_task("shop.linked", (7,), task_id=duplicate.id, headers={"idempotency_key": key}, link=link)
        # Then the link runs (once): its first send never happened, so the copy must not end quietly
        links = effects_key(prefix, "shop.noted_once", tag)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not counter.get(links):
            time.sleep(0.1)
        quiet = "a copy of a duplicate already answered" in worker.output()
        assert int(counter.get(links) or 0) == 1, f"the link was never sent (the copy ended quietly: {quiet})"
    finally:
        worker.stop()
        wipe(Idempotency.of(app).store)


def test_a_copy_of_a_duplicate_whose_link_send_outlasts_the_lease_runs_that_link_once(tmp_path) -> None:
    # Given a completed call (a task with a 1 s lease), and a duplicate of it with a link, whose worker
    # process is held up sending the link (the broker holds the publish) past that lease
    from dying_link_shop import add_linked, go, holding, stalled

    from celery_idem.continuations import FENCES
    from celery_idem.records import Identity

    require_server("redis")
    prefix = f"c{uuid.uuid4().hex[:10]}"
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, app="dying_link_shop")
    app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    add_linked(app, prefix)
    brief, idem = app.tasks["shop.linked_brief"], Idempotency.of(app)
    counter = redis.Redis.from_url(COUNTER_URL)
    try:
        key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
        assert brief.apply_async((7,), idempotency_key=key).get(timeout=GET) == {"order": "7", "charged": 1}
        counter.set(stalled(prefix, tag), 1)
        link = app.tasks["shop.noted"].si("x", tag)
        duplicate = brief.apply_async((7,), idempotency_key=key, link=link)
        wait_for(lambda: counter.exists(holding(prefix, tag)), "the duplicate held up sending its link")
        fence = idem.store.get(Identity("", FENCES, duplicate.id))
        assert fence is not None and fence.lease_expires_at is not None
        wait_for(lambda: idem.store.now() > fence.lease_expires_at + 0.5, "the fence's lease to pass")
        # When a copy of the duplicate's message comes meanwhile (the first copy is alive, still sending)
        app.send_task("shop.linked_brief", (7,), task_id=duplicate.id, headers={"idempotency_key": key}, link=link)
        time.sleep(2)
        counter.set(go(prefix, tag), 1)
        # Then the link ran once: the first copy still held the fence, which no heartbeat kept
        links = effects_key(prefix, "shop.noted", tag)
        wait_for(lambda: counter.get(links) is not None, "the link")
        time.sleep(2)
        assert int(counter.get(links) or 0) == 1, "the link ran again for a copy of its message"
    finally:
        counter.set(go(prefix, tag), 1)
        worker.stop()
        wipe(idem.store)


def test_a_store_blip_at_the_continuation_fence_never_lets_a_copy_run_the_link_again(tmp_path) -> None:
    # Given a worker (on_store_error="raise", the default: fail closed) whose store refuses one call, the
    # first acquire of a duplicate's continuation fence, and a completed call
    require_server("redis")
    prefix = f"c{uuid.uuid4().hex[:10]}"
    task_id = str(uuid.uuid4())
    blip = [{"method": "acquire", "fault": "refused", "key": task_id}]  # the fence's key: the message's id
    env = {"CELERY_IDEM_FAULTS": json.dumps(blip)}
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, pool="threads", env=env)
    app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    counter = redis.Redis.from_url(COUNTER_URL)
    try:
        charge, add = app.tasks["shop.charge"], app.tasks["shop.add"]
        order, key = int(uuid.uuid4().int % 10**9), f"k-{uuid.uuid4().hex}"
        assert charge.apply_async((order, 70), idempotency_key=key).get(timeout=GET)["charged"] == 70
        # When a duplicate with a link comes (the blip strikes at its fence), then a copy of its message
        duplicate = charge.apply_async((order, 70), idempotency_key=key, task_id=task_id, link=add.s(1))
        assert duplicate.deduplicated
        links = effects_key(prefix, "shop.add", str(order))
        # (the message the store could not fence went back to the broker, and then sent the link)
        wait_for(lambda: counter.get(links) is not None, "the link")
        charge.apply_async((order, 70), idempotency_key=key, task_id=task_id, link=add.s(1))
        wait_for(lambda: counter.get(links) is not None, "the link")
        time.sleep(3)
        # Then the link ran once: fail closed keeps a message the store could not fence, as it keeps
        # one whose key it could not look up; it never runs it unfenced
        assert int(counter.get(links) or 0) == 1, "the link ran again for a copy of its message"
    finally:
        worker.stop()
        wipe(Idempotency.of(app).store)


# ---- a body calling its own task ---------------------------------------------------------------------


def test_a_task_calling_delay_on_itself_gets_its_own_id_back(shop: Shop, key: str) -> None:
    result = shop.task("again").apply_async((3,), idempotency_key=key)
    answer = result.get(timeout=GET)
    assert answer == {"own": result.id, "again": result.id}
    assert shop.effects("again", key) == 1


def test_a_body_that_calls_its_own_task_as_a_function_runs_it_as_a_plain_call(shop: Shop, key: str) -> None:
    # Given a body that recurses through a direct call of its own task (countdown(n - 1))
    result = shop.task("countdown").apply_async((2,), idempotency_key=key)
    # Then each level runs once, inline, and the call completes: the inner calls were not taken for
    # copies of the running message (which waited, re-published it and stored FAILED(Ignore))
    assert result.get(timeout=GET) == "done"
    assert [shop.effects("countdown", f"{key}:{n}") for n in (2, 1, 0)] == [1, 1, 1]
    record = shop.idem.get("shop.countdown", key)
    assert record is not None and record.state is State.COMPLETED
