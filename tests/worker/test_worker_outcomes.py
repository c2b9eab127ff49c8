"""Through a real worker and a real broker, on Redis and again on RabbitMQ: which outcome a call leaves
and what every duplicate is handed. A final failure is stored and replayed; a retryable one is retried
under the same task id or, once its retries are spent, frees the key; a result the backend does not
keep is answered from the store; a returned result object or Retry is stored as Celery would; a result
that cannot be stored is a permanent failure (the effect happened), and a stored one is never
unpickled; an outcome written through a store outage is stored once the store answers, or left in the
result backend for the reconciler.

The worker runs in this process (tests/shop_worker.py: start_worker, threads pool, one per broker for
the module); the store is Redis; executions are counted by the INCR each task body makes
(tests/shop.py), never by our records.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import shop_worker
from celery.result import AsyncResult
from conftest import plant_pickle
from shop_worker import GET, Shop

from celery_idem import (
    PayloadMismatchError,
    PermanentError,
    RecordGoneError,
    ResultTooLargeError,
    SerializationError,
    State,
    StoreUnavailableError,
)
from celery_idem.records import Identity

shop = shop_worker.shop
key = shop_worker.key
published = shop_worker.published


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


# ---- a result that cannot be stored: a permanent failure, never a freed key --------------------------


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
