"""Through a real worker and a real broker, on Redis and again on RabbitMQ: replace(), Reject and Ignore
are control flow, not failures (DESIGN §3). A task that replaces itself hands its record to its
replacement (another call, its own call on another queue or later, a chain ending in its own call, a
call with other arguments), through store outages and copies of its message, and the record takes the
replacement's outcome; Reject with requeue returns the record to PENDING for the redelivery, without it
is final; Ignore ends the call. A call revoked while its replacement waits in a queue frees its key,
and a revoke never frees a record its replacement took. (The group of self-replacing members, and a
replacement terminated while it runs, run in `celery worker` subprocesses of their own.)

The worker runs in this process (tests/shop_worker.py: start_worker, threads pool, one per broker for
the module); the store is Redis; executions are counted by the INCR each task body makes
(tests/shop.py), never by our records.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import shop_worker
from celery import chain, group, signals
from celery.exceptions import Ignore, Reject
from conftest import REDIS_URL, require_server
from shop import COUNTER_URL, effects_key, make_app
from shop_worker import BACKEND, BROKERS, GET, Shop
from shop_worker import until as _until
from workers import Worker, wait_for

from celery_idem import Idempotency, PermanentError, State, StoreUnavailableError

shop = shop_worker.shop
key = shop_worker.key


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


def busy_lines() -> contextlib.AbstractContextManager[list[str]]:
    """The handler's BUSY decision lines (INFO) while the block runs."""
    return logged("celery_idem.handler", "BUSY")


@contextlib.contextmanager
def logged(name: str, start: str) -> Iterator[list[str]]:
    """The lines (INFO and up) of logger ``name`` that start with ``start``, while the block runs."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            line = record.getMessage()
            if line.startswith(start):
                lines.append(line)

    logger = logging.getLogger(name)
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


@contextlib.contextmanager
def ended_attempts(shop: Shop, name: str) -> Iterator[list[tuple[str, str]]]:
    """(task id, state) of each attempt of task ``shop.<name>`` that ends while the block runs."""
    ended: list[tuple[str, str]] = []

    def attempt_ended(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == f"shop.{name}":
            ended.append((task_id, state))

    signals.task_postrun.connect(attempt_ended, weak=False)
    shop.task(name).__trace__ = None  # its tracer is rebuilt with this receiver
    try:
        yield ended
    finally:
        signals.task_postrun.disconnect(attempt_ended)


@contextlib.contextmanager
def handover_headers(shop: Shop, name: str) -> Iterator[list[dict[str, Any]]]:
    """The idempotency headers of each replacement of task ``shop.<name>`` published while the block
    runs (the in-process worker publishes it here), token included."""
    sent: list[dict[str, Any]] = []

    def keep(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == f"shop.{name}" and (headers or {}).get("idempotency_handover"):
            sent.append({k: v for k, v in headers.items() if k.startswith("idempotency_")})

    signals.before_task_publish.connect(keep, weak=False)
    try:
        yield sent
    finally:
        signals.before_task_publish.disconnect(keep)


@pytest.mark.parametrize("terminate", [False, True], ids=["revoke", "revoke-terminate"])
def test_a_call_revoked_while_its_replacement_waits_in_a_queue_frees_its_key(
    shop: Shop, key: str, terminate: bool
) -> None:
    # Given a task that replaced itself with its own call on a queue no worker consumes yet
    order, moving, parked = int(uuid.uuid4().int % 10**9), shop.task("moving"), f"{shop.prefix}.parked"
    with ended_attempts(shop, "moving") as ended:
        first = moving.apply_async((order, "parked"), idempotency_key=key)
        _until(lambda: (first.id, "IGNORED") in ended)
    # When the caller revokes the call (its own task id, which the replacement carries), and the
    # worker then consumes the queue: it drops the replacement as revoked
    assert shop.app.control.revoke(first.id, terminate=terminate, destination=[shop.worker], reply=True, timeout=10)
    assert shop.app.control.add_consumer(parked, destination=[shop.worker], reply=True, timeout=10)
    try:
        _until(lambda: shop.app.backend.get_task_meta(first.id)["status"] == "REVOKED")
        # Then the key is free, as a call revoked before it ran frees it: the next call runs the body.
        # Before, the record stayed IN_PROGRESS for the replacement's whole wait (an hour), and every
        # call was handed the revoked id and TaskRevokedError
        _until(lambda: shop.idem.get("shop.moving", key) is None, seconds=10)
        again = moving.apply_async((order, "parked"), idempotency_key=key)
        assert not again.deduplicated and again.id != first.id
        assert again.get(timeout=GET)["runs"] == 2
    finally:
        shop.app.control.cancel_consumer(parked, destination=[shop.worker], reply=True, timeout=10)
    assert shop.effects("moving", key) == 2


@pytest.mark.parametrize("when", ["after-it-ran", "while-it-runs"])
def test_a_revoked_copy_of_a_replacement_that_took_its_record_never_frees_it(shop: Shop, key: str, when: str) -> None:
    # Given a task that replaced itself with its own call on another queue, which took the record
    # (and ran, or is running: 3 s of work)
    order, moving = int(uuid.uuid4().int % 10**9), shop.task("moving_held")
    seconds = 0.0 if when == "after-it-ran" else 3.0
    with handover_headers(shop, "moving_held") as sent:
        first = moving.apply_async((order, seconds), idempotency_key=key)
        _until(lambda: shop.effects("moving_held", key) == 2)
    if when == "after-it-ran":
        assert first.get(timeout=GET)["runs"] == 2
    # When the call is revoked and a copy of the replacement's message arrives (a redelivery, with
    # the token it carries): the worker drops the copy as revoked, and its revoke hook runs
    assert len(sent) == 1
    with logged("celery_idem.signals", f"revoke of task {first.id}") as hooks:
        assert shop.app.control.revoke(first.id, destination=[shop.worker], reply=True, timeout=10)
        shop.app.send_task(
            "shop.moving_held", (order, seconds), task_id=first.id, headers=sent[0], queue=f"{shop.prefix}.heavy"
        )
        _until(lambda: hooks)
    # Then the record its replacement took is left (its token is spent): the replacement's outcome
    # is stored (the dropped copy wrote REVOKED for the task id in the result backend meanwhile),
    # and the next call is handed it without running
    _until(lambda: getattr(shop.idem.get("shop.moving_held", key), "state", None) is State.COMPLETED)
    _until(lambda: shop.app.backend.get_task_meta(first.id)["status"] == "SUCCESS" or when == "after-it-ran")
    again = moving.apply_async((order, seconds), idempotency_key=key)
    assert again.deduplicated and again.id == first.id and again.get(timeout=GET) == {"order": order, "runs": 2}
    assert shop.effects("moving_held", key) == 2


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_a_replacement_terminated_while_it_runs_frees_the_key_once_its_attempt_is_gone(
    tmp_path: Path, signal_name: str
) -> None:
    # (Prefork workers of their own: the threads pool cannot terminate a task. The replacement runs
    # on a second worker: a worker that receives it before the replaced attempt under the same task
    # id has ended forgets it when that attempt ends, and Celery's terminate no longer finds it.)
    require_server("redis")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    app = make_app(broker=BROKERS["redis"], backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
    worker = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix)
    heavy = Worker(tmp_path, BROKERS["redis"], REDIS_URL, prefix, queue=f"{prefix}.heavy")
    idem, counter, key = Idempotency.of(app), redis.Redis.from_url(COUNTER_URL), f"k-{uuid.uuid4().hex}"
    moving, order = app.tasks["shop.moving_held"], int(uuid.uuid4().int % 10**9)
    try:
        # Given a task that replaced itself with its own call on another queue, whose replacement
        # runs (30 s of work; lease 2 s)
        first = moving.apply_async((order, 30), idempotency_key=key)
        _until(lambda: int(counter.get(effects_key(prefix, "shop.moving_held", key)) or 0) == 2)
        # When the caller revokes the call with terminate=True
        replies = app.control.revoke(
            first.id, terminate=True, signal=signal_name, destination=[heavy.name], reply=True, timeout=10
        )
        assert replies and "terminate: tasks unknown" not in str(replies), replies
        wait_for(lambda: f"revoke of task {first.id}: record" in heavy.output(), "the revoke hook", GET)
        # Then the record the replacement took is its attempt's to free: SIGTERM, the attempt sees
        # SystemExit and releases it; SIGKILL, its lease runs out (2 s, not the replacement's wait)
        # and the next call runs the body
        _until(lambda: (r := idem.get("shop.moving_held", key)) is None or r.lease_expires_at < idem.store.now(), 10)
        again = moving.apply_async((order, 30), idempotency_key=key)
        assert not again.deduplicated and again.get(timeout=GET) == {"order": order, "runs": 3}
    finally:
        worker.stop()
        heavy.stop()


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


# ---- Reject, Ignore ----------------------------------------------------------------------------------


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
    replays = shop.idem.metrics()["replays"]  # the module's count so far: this copy's replay comes on top
    copy = shop.app.send_task("shop.ignoring", (4,), headers={"idempotency_key": key})
    _until(lambda: shop.idem.metrics()["replays"] > replays)
    time.sleep(0.2)
    assert shop.app.backend.get_task_meta(copy.id)["status"] == "PENDING"
    assert shop.effects("ignoring", key) == 1
