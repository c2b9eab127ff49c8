"""One write per outcome: ``results="store"`` (DESIGN §6, policy ``results``; docs/results.md).

Under ``results="store"`` a call's outcome is written once, by the store's ``complete``: Celery's
result-backend write is skipped for every call whose only handle is the one ``apply_async`` returned,
and that handle (``get()``, ``state``, ``ready()``), a duplicate's handle too, answers from the store.
A call Celery's canvas publishes (a chain step, a group or chord member) or one whose task id the
caller chose is waited on through handles that know no key: Celery writes those to the backend.

Through real in-process workers (threads pool), on every store; executions are counted by an INCR
in the body, and backend writes by reading the Redis result backend's own keys. Round trips per
task are counted on the client side, by the Redis database each connection talks to.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group, states
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from celery.signals import task_postrun
from conftest import STORE_KINDS, make_store, require_server, wipe
from services import free_port
from shop import COUNTER_URL, effects_key
from shop_worker import BACKEND, BROKERS, GET
from workers import wait_for

from celery_idem import ConfigurationError, Idempotency, IdempotentTask, PermanentError, RecordGoneError, State
from celery_idem.records import Identity
from celery_idem.stores import Store


class Refused(PermanentError):
    """A final failure: stored as the call's outcome."""


def results_app(*, store: Any, prefix: str, results: str) -> Celery:
    app = Celery("results", broker=BROKERS["redis"], backend=BACKEND, set_as_current=False)
    app.conf.update(
        task_default_queue=prefix,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    # Beats of the worker's liveness record would land among the counted round trips: one an hour.
    Idempotency(app, store=store, key_prefix=prefix, results=results, liveness_seconds=3600)
    counter = redis.Redis.from_url(COUNTER_URL)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="results.charge", idempotency={"key_args": ["order"]})
    def charge(self: Any, order: int, refuse: bool = False, flaky: bool = False, hold: float = 0) -> dict[str, int]:
        n = int(counter.incr(effects_key(prefix, self.name, self.request.idempotency_key)))
        time.sleep(hold)
        if refuse:
            raise Refused(f"order {order} refused")
        if flaky:
            raise ConnectionError(f"order {order}: the provider timed out")  # retryable: frees the key
        return {"order": order, "run": n}

    @app.task(shared=False, name="results.fan_out")
    def fan_out(order: int) -> str:
        charge.apply_async((order,), idempotency_key=f"child-{prefix}-{order}")
        return "spawned"

    @app.task(shared=False, name="results.total")
    def total(values: Any) -> Any:
        return sum(v["order"] for v in values) if isinstance(values, list) else values

    return app


@dataclass
class Running:
    app: Celery
    store: Store
    prefix: str

    @property
    def charge(self) -> Any:
        return self.app.tasks["results.charge"]

    def runs(self, key: str) -> int:
        return int(redis.Redis.from_url(COUNTER_URL).get(effects_key(self.prefix, "results.charge", key)) or 0)


def in_backend(task_id: str) -> bool:
    """Whether Celery wrote an outcome for ``task_id`` to the Redis result backend."""
    return bool(redis.Redis.from_url(BACKEND).exists(f"celery-task-meta-{task_id}"))


@pytest.fixture(params=STORE_KINDS)
def one_write(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Running]:
    require_server("redis")
    prefix = f"o{uuid.uuid4().hex[:10]}"
    store = make_store(str(request.param), tmp_path, prefix)
    app = results_app(store=store, prefix=prefix, results="store")
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=20):
            yield Running(app, store, prefix)
    finally:
        wipe(store)


@pytest.fixture
def key() -> str:
    return f"k-{uuid.uuid4().hex}"


def test_the_outcome_is_written_once_and_every_handle_reads_it_from_the_store(one_write: Running, key: str) -> None:
    shop = one_write
    # When a call runs under results="store"
    result = shop.charge.apply_async((7,), idempotency_key=key)
    # Then its handle answers from the store, state and ready() too
    assert result.get(timeout=GET) == {"order": 7, "run": 1}
    assert result.state == states.SUCCESS and result.ready() and result.successful()
    # as do Celery's other ways to read it: result, info, wait()
    assert result.result == result.info == result.wait(timeout=GET) == {"order": 7, "run": 1}
    # And a duplicate's handle answers the same, without running the body again
    duplicate = shop.charge.apply_async((7,), idempotency_key=key)
    assert duplicate.deduplicated and duplicate.id == result.id
    assert duplicate.get(timeout=GET) == {"order": 7, "run": 1}
    assert shop.runs(key) == 1
    # And the outcome was written once: the store holds it, Celery's result backend never heard of it
    record = Idempotency.of(shop.app).get("results.charge", key)
    assert record is not None and record.state is State.COMPLETED and record.task_id == result.id
    assert not in_backend(result.id)


def test_a_waiting_duplicate_listens_to_the_store_not_the_backend(one_write: Running, key: str) -> None:
    # Given an original that runs for 2 s, and a duplicate of it waiting for its outcome
    shop = one_write
    original = shop.charge.apply_async((12,), {"hold": 2}, idempotency_key=key)
    wait_for(lambda: _state(shop, key) is State.IN_PROGRESS, "the original to start", GET)
    duplicate = shop.charge.apply_async((12,), {"hold": 2}, idempotency_key=key)
    assert duplicate.deduplicated and duplicate.id == original.id
    answers: list[Any] = []
    waiting = threading.Thread(target=lambda: answers.append(duplicate.get(timeout=GET)))
    waiting.start()
    # Then, while it waits, nothing listens for the id on the backend (which will never hear of it);
    # on Redis the duplicate listens to the record's channel, where settling it is announced
    backend = redis.Redis.from_url(BACKEND)
    channel = f"celery-task-meta-{original.id}"
    if type(shop.store).__name__ == "RedisStore":
        record_key = shop.store.keys_for(Identity("", "results.charge", key))[0]  # type: ignore[attr-defined]
        wait_for(lambda: dict(shop.store.client.pubsub_numsub(record_key))[record_key.encode()] >= 1,  # type: ignore[attr-defined]
                 "the duplicate to listen on the record's channel", GET)  # fmt: skip
    assert dict(backend.pubsub_numsub(channel))[channel.encode()] == 0
    waiting.join(GET)
    assert answers == [{"order": 12, "run": 1}] and shop.runs(key) == 1


def _state(shop: Running, key: str) -> State | None:
    record = Idempotency.of(shop.app).get("results.charge", key)
    return None if record is None else record.state


def test_a_final_failure_is_stored_once_and_raised_by_the_handle(one_write: Running, key: str) -> None:
    shop = one_write
    result = shop.charge.apply_async((8,), {"refuse": True}, idempotency_key=key)
    with pytest.raises(Refused, match="order 8 refused"):
        result.get(timeout=GET)
    assert result.state == states.FAILURE and result.failed()
    assert isinstance(result.get(timeout=GET, propagate=False), Refused)
    assert isinstance(result.result, Refused) and isinstance(result.info, Refused)
    assert not in_backend(result.id)
    assert shop.runs(key) == 1


def test_a_retryable_failure_frees_the_key_and_the_handle_says_so_at_once(one_write: Running, key: str) -> None:
    # Given a call whose body fails with a retryable error (no retries left): the key is freed and,
    # under results="store", nothing keeps the exception
    shop = one_write
    result = shop.charge.apply_async((11,), {"flaky": True}, idempotency_key=key)
    # Then get() raises RecordGoneError once the record is released, well before its timeout
    with pytest.raises(RecordGoneError, match="retryable error"):
        result.get(timeout=GET)
    assert shop.runs(key) == 1 and not in_backend(result.id)
    # And the key runs again for a new call
    again = shop.charge.apply_async((11,), idempotency_key=key)
    assert not again.deduplicated and again.get(timeout=GET) == {"order": 11, "run": 2}


def test_a_plain_async_result_of_the_id_hears_nothing_from_the_backend(one_write: Running, key: str) -> None:
    # What docs/results.md says a handle that does not know the key sees: Celery's own AsyncResult
    # reads the backend only, which this call never wrote.
    shop = one_write
    result = shop.charge.apply_async((9,), idempotency_key=key)
    assert result.get(timeout=GET)["order"] == 9
    assert AsyncResult(result.id, app=shop.app).state == states.PENDING


def test_canvas_calls_are_written_to_the_backend_where_celery_reads_them(one_write: Running) -> None:
    # A chain step, a group and a chord member are waited on through handles that know no key (and
    # a chord counts its members in the backend): under results="store" Celery still writes them.
    shop = one_write
    assert chain(shop.charge.s(1), shop.app.tasks["results.total"].s()).apply_async().get(timeout=GET)["order"] == 1
    members = group(shop.charge.s(n) for n in (2, 3)).apply_async()
    assert [v["order"] for v in members.get(timeout=GET)] == [2, 3]
    assert all(in_backend(child.id) for child in members.results)
    assert (
        chord([shop.charge.s(4), shop.charge.s(5)], shop.app.tasks["results.total"].s()).apply_async().get(timeout=GET)
        == 9
    )


def test_a_caller_that_chose_the_task_id_is_answered_through_the_backend(one_write: Running, key: str) -> None:
    shop = one_write
    task_id = str(uuid.uuid4())
    result = shop.charge.apply_async((10,), idempotency_key=key, task_id=task_id)
    assert AsyncResult(task_id, app=shop.app).get(timeout=GET)["order"] == 10
    # and its own handle, first asked once the record's TTL has passed, still answers: from the
    # backend, which holds the outcome longer than the store
    shop.store.advance_clock_for_tests(2 * 86400)
    assert Idempotency.of(shop.app).get("results.charge", key) is None
    assert result.get(timeout=GET)["order"] == 10


def test_a_duplicate_published_under_its_own_id_is_answered_for_that_id(one_write: Running, key: str) -> None:
    # Given a duplicate published anyway under a task id its caller chose (its own message, written
    # to the backend), whose original's record is then freed (a retryable failure) before the copy
    # runs and succeeds: here on a queue no worker reads, the copy's outcome written as Celery would
    shop = one_write
    held = f"{shop.prefix}-held"
    shop.charge.apply_async((14,), idempotency_key=key, queue=held)
    mine = str(uuid.uuid4())
    duplicate = shop.charge.apply_async((14,), idempotency_key=key, task_id=mine, queue=held)
    assert duplicate.deduplicated and duplicate.id == mine
    assert Idempotency.of(shop.app).forget("results.charge", key)
    shop.app.backend.store_result(mine, {"order": 14, "run": 2}, states.SUCCESS)
    # Then its handle answers for its own task id, from the backend, instead of "gone"
    assert duplicate.get(timeout=GET) == {"order": 14, "run": 2}


def test_a_call_made_inside_a_running_task_is_answered_through_its_parents_children(one_write: Running) -> None:
    # Celery records a call made in a task body in the parent's children (parent.children,
    # collect()): handles that know no key, read from the backend, which under "store" is written
    shop = one_write
    parent = shop.app.tasks["results.fan_out"].delay(13)
    assert parent.get(timeout=GET) == "spawned"
    assert [child.get(timeout=GET)["order"] for child in parent.children] == [13]


def test_a_call_published_unprotected_while_the_store_is_down_is_answered_through_the_backend() -> None:
    require_server("redis")
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    prefix = f"d{uuid.uuid4().hex[:10]}"
    app = Celery("results-down", broker=BROKERS["redis"], backend=BACKEND, set_as_current=False)
    app.conf.update(task_default_queue=prefix, worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)
    Idempotency(app, store=down, results="store", on_store_error="proceed", store_timeout_seconds=0.2)

    @app.task(shared=False, base=IdempotentTask, name="results.down")
    def multiply(x: int, y: int) -> int:
        return x * y

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False, shutdown_timeout=20):
        result = multiply.apply_async((6, 7), idempotency_key="k-down")
        assert result.get(timeout=GET) == 42


# ---- round trips per task --------------------------------------------------------------------------

DB_OF = {"store": 15, "backend": 13}
# celery-once and celery-singleton per task: SET NX (lock), DEL (unlock), and Celery's own result
# write (SETEX + PUBLISH in one pipeline) = 3 round trips beside the publish and the delivery.
PEERS_ROUND_TRIPS = 3
CALLS = 10


@pytest.mark.parametrize("results", ["store", "both"])
def test_round_trips_per_task_in_the_one_write_mode_are_no_more_than_the_peers(results: str) -> None:
    require_server("redis")
    prefix = f"r{uuid.uuid4().hex[:10]}"
    store = make_store("redis", None, prefix)
    app = results_app(store=store, prefix=prefix, results=results)
    done = threading.Semaphore(0)

    def finished(sender: Any = None, **_: Any) -> None:
        if sender is not None and sender.name == "results.charge":
            done.release()  # after the body, the store's complete and Celery's backend write

    task_postrun.connect(finished, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False, shutdown_timeout=20):
            charge = app.tasks["results.charge"]
            for n in range(3):  # warm up: connections, scripts, the worker's first liveness beat
                charge.apply_async((n,), idempotency_key=f"warm-{n}-{prefix}")
                assert done.acquire(timeout=GET)
            with _requests_by_db() as sent:
                for n in range(CALLS):
                    charge.apply_async((n,), idempotency_key=f"k-{n}-{prefix}")
                    assert done.acquire(timeout=GET)
    finally:
        task_postrun.disconnect(finished)
        wipe(store)
    per_task = {part: sent[db] / CALLS for part, db in DB_OF.items()}
    # A worker process's liveness beat is periodic (once per beat interval, whatever the task
    # count), so one may fall inside the window on a slow machine: it is counted apart, and every
    # other request, whatever it is, counts against the task
    shown = f"requests: {sent.requests}"
    if results == "store":
        # claim, acquire, complete; nothing to the backend (no result write, no subscription)
        assert per_task == {"store": 3, "backend": 0}, shown
        assert per_task["store"] + per_task["backend"] <= PEERS_ROUND_TRIPS
    else:
        # Today's default writes the outcome twice: the counting sees the backend's write
        assert per_task["store"] == 3 and per_task["backend"] >= 1, shown
    assert sent.beats <= 2, shown


LIVENESS = b":live}:"  # in every liveness key (RedisStoreBase.liveness_key)


class _Sent(Counter[int]):
    """Requests by database, with the per-process liveness beats counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.beats = 0
        self.requests: list[tuple[int, bytes]] = []

    def add(self, db: int, packed: Any) -> None:
        chunks = [packed] if isinstance(packed, (bytes, bytearray, memoryview)) else list(packed)
        raw = b"".join(bytes(chunk) for chunk in chunks)
        self.requests.append((db, raw[:120]))
        if LIVENESS in raw:
            self.beats += 1
        else:
            self[db] += 1


class _requests_by_db:  # noqa: N801 - reads as the context manager it is
    """Counts the requests redis-py writes (one per command, one per pipeline), by database."""

    def __enter__(self) -> _Sent:
        from redis.connection import AbstractConnection

        self.sent = _Sent()
        self.original = AbstractConnection.send_packed_command
        original, sent = self.original, self.sent

        def send_packed_command(conn: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            sent.add(int(conn.db or 0), command)
            return original(conn, command, *args, **kwargs)

        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
        return sent

    def __exit__(self, *exc: object) -> None:
        from redis.connection import AbstractConnection

        AbstractConnection.send_packed_command = self.original  # type: ignore[method-assign]


def test_results_must_be_a_known_mode() -> None:
    with pytest.raises(ConfigurationError, match=r"results: Input should be 'both' or 'store'"):
        Idempotency(Celery("bad", set_as_current=False), store="memory://", results="backend-only")
