"""A handle answers for its own task id (DESIGN, rules at the task level).

``get()``, ``state``, ``ready()`` on the handle ``apply_async`` returned answer with the outcome of
the task id the handle names (a duplicate's handle: the original's), never with a later call's under
the same key after the TTL; where nothing can answer for that id, ``get()`` raises
``RecordGoneError``. And a handle waits on whatever can answer it: the store when the result
backend cannot (``rpc://`` read from another process, an original sent with ``ignore_result``).

Through real in-process workers (threads pool); executions are counted by an INCR in the body.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery, states
from celery.contrib.testing.worker import start_worker
from conftest import REDIS_URL, STORE_KINDS, make_store, require_rabbitmq, require_server, wipe
from shop import COUNTER_URL, effects_key
from shop_worker import BACKEND, BROKERS, GET
from workers import wait_for

from celery_idem import Idempotency, IdempotentTask, PermanentError, RecordGoneError, State
from celery_idem.ledger import Ledger
from celery_idem.stores import MemoryStore, Store

TTL = 60.0  # seconds; the tests move the store's clock past it instead of sleeping


def handles_app(*, broker: str, backend: str, store: Any, prefix: str) -> Celery:
    """An app with one task whose answer says which execution of its key it was: {"run": n}."""
    app = Celery("handles", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=prefix,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    Idempotency(app, store=store, key_prefix=prefix)
    counter = redis.Redis.from_url(COUNTER_URL)

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="handles.run",
        idempotency={"key_args": ["order_id"], "ttl_seconds": TTL},
    )
    def run(self: Any, order_id: int, hold: float = 0) -> dict[str, int]:
        n = int(counter.incr(effects_key(prefix, self.name, self.request.idempotency_key)))
        time.sleep(hold)
        return {"run": n}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="handles.retry_once")
    def retry_once(self: Any, order_id: int, hold: float) -> dict[str, int]:
        if self.request.retries == 0:
            raise self.retry(countdown=0.1, max_retries=1)
        time.sleep(hold)
        return {"retries": self.request.retries}

    @app.task(shared=False, name="handles.then")
    def then(value: Any) -> Any:
        return value

    return app


@dataclass
class Running:
    app: Celery
    store: Store
    prefix: str

    @property
    def run(self) -> Any:
        return self.app.tasks["handles.run"]

    def settled(self, key: str, task_id: str) -> bool:
        record = Idempotency.of(self.app).get("handles.run", key)
        return record is not None and record.state is State.COMPLETED and record.task_id == task_id


@pytest.fixture
def key() -> str:
    return f"k-{uuid.uuid4().hex}"


@pytest.fixture(params=STORE_KINDS)
def on_every_store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Running]:
    """A worker (Redis broker) whose store is each store in turn; the test moves that store's clock."""
    require_server("redis")
    prefix = f"h{uuid.uuid4().hex[:10]}"
    store = make_store(str(request.param), tmp_path, prefix)
    app = handles_app(broker=BROKERS["redis"], backend=BACKEND, store=store, prefix=prefix)
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=20):
            yield Running(app, store, prefix)
    finally:
        wipe(store)


# ---- a handle answers for its own task id -----------------------------------------------------------


def test_an_old_handle_answers_its_own_call_after_a_later_call_reused_the_key(
    on_every_store: Running, key: str
) -> None:
    shop = on_every_store
    # Given a call and its duplicate (made while it ran), completed with {"run": 1}, untouched since
    first = shop.run.apply_async((1,), {"hold": 0.5}, idempotency_key=key)
    duplicate = shop.run.apply_async((1,), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.id == first.id
    wait_for(lambda: shop.settled(key, first.id), "the first call's completion", GET)
    # When the key's TTL passes and a later call under it runs again with {"run": 2}
    shop.store.advance_clock_for_tests(TTL + 1)
    second = shop.run.apply_async((1,), idempotency_key=key)
    assert not second.deduplicated and second.id != first.id
    assert second.get(timeout=GET) == {"run": 2}
    # Then the first call's handles still answer the first call: the backend holds it for that id
    for handle in (first, duplicate):
        assert handle.get(timeout=GET) == {"run": 1}
        assert handle.state == states.SUCCESS and handle.ready() and handle.successful() and not handle.failed()
    assert shop.run.AsyncResult(first.id).get(timeout=GET) == {"run": 1}


def test_an_old_handle_that_nothing_answers_for_raises_record_gone_never_a_later_outcome(
    on_every_store: Running, key: str
) -> None:
    shop = on_every_store
    # Given a call sent with ignore_result (its outcome lives in the store only) and its duplicate
    first = shop.run.apply_async((1,), {"hold": 0.5}, idempotency_key=key, ignore_result=True)
    duplicate = shop.run.apply_async((1,), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.id == first.id
    wait_for(lambda: shop.settled(key, first.id), "the first call's completion", GET)
    # When its record expires and a later call under the key completes with {"run": 2}
    shop.store.advance_clock_for_tests(TTL + 1)
    second = shop.run.apply_async((1,), idempotency_key=key)
    assert second.get(timeout=GET) == {"run": 2}
    # Then nothing answers for the first task id any more: a clear error, never the later outcome
    for handle in (first, duplicate):
        with pytest.raises(RecordGoneError) as gone:
            handle.get(timeout=GET)
        assert gone.value.task_id == first.id
        assert handle.state != states.SUCCESS and not handle.ready() and not handle.successful()


def test_a_duplicate_published_under_its_own_id_reads_the_record_it_was_handed(
    on_every_store: Running, key: str
) -> None:
    shop = on_every_store
    # Given a running call, and a duplicate with a continuation: published anyway under its own id,
    # its worker replays the original's outcome into it (both sent with ignore_result: only the
    # store can answer either handle)
    first = shop.run.apply_async((1,), {"hold": 1}, idempotency_key=key, ignore_result=True)
    linked = shop.run.apply_async(
        (1,), idempotency_key=key, ignore_result=True, link=shop.app.signature("handles.then")
    )
    assert linked.deduplicated and linked.id != first.id
    # Then its handle answers with the record it was handed (the original's task id is on it)
    assert linked.get(timeout=GET) == {"run": 1}
    assert first.get(timeout=GET) == {"run": 1}


def test_a_later_calls_ledger_commit_never_overrules_an_old_handles_failure(tmp_path: Any, key: str) -> None:
    # An eager app on the memory store (its clock moved past the TTL) with a ledger on SQLite
    ledger = Ledger(sa.create_engine(f"sqlite:///{tmp_path}/ledger.db"), table_name="ledger_handles")
    ledger.create_schema()
    store = MemoryStore()
    app = Celery("handles-ledger", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True)
    Idempotency(app, store=store, ledger=ledger)
    commit = [False]

    @app.task(base=IdempotentTask, bind=True, shared=False, name="handles.pay", idempotency={"ttl_seconds": TTL})
    def pay(self: Any, order_id: int) -> dict[str, int]:
        if not commit[0]:
            raise PermanentError(f"card declined for order {order_id}")
        return ledger.run_once(self, lambda session: {"paid": order_id})  # type: ignore[no-any-return]

    # Given a call that failed for good, and its duplicate's handle (its failure not read yet)
    with pytest.raises(PermanentError):
        pay.apply_async((3,), idempotency_key=key)
    duplicate = pay.apply_async((3,), idempotency_key=key)
    assert duplicate.deduplicated
    # When the key's TTL passes and a later call commits its effect through the ledger
    store.advance_clock_for_tests(TTL + 1)
    commit[0] = True
    assert pay.apply_async((3,), idempotency_key=key).get() == {"paid": 3}
    # Then the old handle still answers its own call: the failure, not the later call's commit
    assert duplicate.state == states.FAILURE and duplicate.failed()
    with pytest.raises(PermanentError, match="card declined"):
        duplicate.get()


# ---- a handle waits on whatever can answer it --------------------------------------------------------


def _publish_original(broker: str, backend: str, prefix: str, key: str, options: dict[str, Any], out: Any) -> None:
    """Another process's call: its app, its producer, its rpc reply queue."""
    app = handles_app(broker=broker, backend=backend, store=REDIS_URL, prefix=prefix)
    result = app.tasks["handles.run"].apply_async((7,), {"hold": 2}, idempotency_key=key, **options)
    out.put(result.id)


def _original_from_another_process(shop: Running, broker: str, backend: str, key: str, **options: Any) -> str:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    process = ctx.Process(target=_publish_original, args=(broker, backend, shop.prefix, key, options, out))
    process.start()
    task_id = str(out.get(timeout=60))
    process.join(timeout=60)
    assert process.exitcode == 0
    return task_id


def _worker(broker: str, backend: str) -> Any:
    require_server("redis")
    prefix = f"h{uuid.uuid4().hex[:10]}"
    store = make_store("redis", None, prefix)
    app = handles_app(broker=broker, backend=backend, store=store, prefix=prefix)
    return Running(app, store, prefix), start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=20
    )


@pytest.mark.parametrize("timeout", [10, None], ids=["get-timeout-10", "get-without-timeout"])
@pytest.mark.parametrize(
    ("broker", "backend", "options"),
    [
        pytest.param("rabbitmq", "rpc://", {}, id="rpc-backend-of-another-process"),
        pytest.param("redis", BACKEND, {"ignore_result": True}, id="original-sent-with-ignore_result"),
    ],
)
def test_a_duplicate_handle_waits_on_the_store_when_the_backend_cannot_answer_it(
    broker: str, backend: str, options: dict[str, Any], timeout: float | None, key: str
) -> None:
    if broker == "rabbitmq":
        require_rabbitmq()
    shop, worker = _worker(BROKERS[broker], backend)
    try:
        with worker:
            # Given an original call published by another process (rpc: its result goes to that
            # process's reply queue; ignore_result: nowhere), running for 2 s
            original = _original_from_another_process(shop, BROKERS[broker], backend, key, **options)
            # When this process calls again: a duplicate, handed the original's id
            duplicate = shop.run.apply_async((7,), idempotency_key=key)
            assert duplicate.deduplicated and duplicate.id == original
            # Then get() answers once the record settles (without a timeout, a hang would end at
            # pytest-timeout's limit: the test fails instead of waiting forever)
            assert duplicate.get(timeout=timeout) == {"run": 1}
            assert duplicate.state == states.SUCCESS and duplicate.ready()
            assert int(redis.Redis.from_url(COUNTER_URL).get(effects_key(shop.prefix, "handles.run", key)) or 0) == 1
    finally:
        wipe(shop.store)


def test_a_handle_reads_pending_while_its_call_runs_as_celerys_own_does(on_every_store: Running, key: str) -> None:
    # Given a call whose body runs for a while (without task_track_started the backend knows nothing)
    shop = on_every_store
    original = shop.run.apply_async((3, 1.5), idempotency_key=key)
    duplicate = shop.run.apply_async((3, 1.5), idempotency_key=key)
    wait_for(
        lambda: (
            (record := Idempotency.of(shop.app).get("handles.run", key)) is not None
            and record.state is State.IN_PROGRESS
        ),
        "the worker took the call",
    )
    # Then both handles read PENDING, as Celery's do: code that polls "while state == PENDING" for
    # the next state Celery writes (RETRY, SUCCESS) must not stop at a STARTED Celery never wrote
    # (Celery's integration test test_retry_with_unpickleable_exception does). The store's
    # IN_PROGRESS is Idempotency.get()'s, or STARTED comes with task_track_started (results guide).
    assert original.state == duplicate.state == states.PENDING
    assert original.get(timeout=GET) == duplicate.get(timeout=GET) == {"run": 1}
    assert original.state == duplicate.state == states.SUCCESS


def test_a_handle_says_what_the_backend_says_of_a_running_retry(on_every_store: Running, key: str) -> None:
    # Given a call that retried once and whose second attempt runs: the backend says RETRY (Celery
    # wrote it at the retry, and writes nothing when the retry starts without task_track_started)
    shop = on_every_store
    handle = shop.app.tasks["handles.retry_once"].apply_async((4, 1.5), idempotency_key=key)
    wait_for(
        lambda: (
            (record := Idempotency.of(shop.app).get("handles.retry_once", key)) is not None
            and record.state is State.IN_PROGRESS
            and record.attempt == 2
            # the retry's message is sent before the first attempt's trace writes RETRY to the
            # backend, so the second attempt can start a moment before the backend says so
            and shop.app.backend.get_task_meta(handle.id)["status"] == states.RETRY
        ),
        "the retry to run and the backend to say RETRY",
    )
    # Then the handle says RETRY, as Celery's own would
    assert handle.state == states.RETRY
    assert handle.get(timeout=GET) == {"retries": 1}


def test_a_handle_answered_from_the_store_stops_listening_for_its_id(on_every_store: Running, key: str) -> None:
    # Given a call whose outcome is settled (the backend holds it too), its handle not yet asked
    shop = on_every_store
    result = shop.run.apply_async((1,), idempotency_key=key)
    wait_for(lambda: shop.settled(key, result.id), "the call's completion", GET)
    channel = f"celery-task-meta-{result.id}"
    listener = redis.Redis.from_url(BACKEND)
    # When get() answers it from the store's settled record
    assert result.get(timeout=GET) == {"run": 1}
    # Then the handle no longer listens for its id (Celery's own get() unsubscribes once it answers;
    # before, every such get() left the id's channel subscribed on the Redis result backend)
    assert listener.pubsub_channels(channel) == []
    listener.close()
