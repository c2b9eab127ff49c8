"""Eager mode: which failures are stored and which free the key. Permanent errors (PermanentError, the
classes a policy lists, every error under default_failure="permanent" but connection errors and the
classes listed as retryable) are stored and replayed without running; retryable ones free the key;
Celery retries keep the identity; a stored failure whose class cannot be rebuilt replays as
ReplayedFailureError; and a store down between an eager call's claim and its acquire tells the caller
once and leaves no claim.

Each test builds a fresh eager app (task_always_eager, memory store) and counts executions with a list
the task body appends to; the apps and fixtures are tests/eager_apps.py's.
"""

from __future__ import annotations

import logging
from typing import Any

import eager_apps
import pytest
from celery import Celery, Task
from celery.exceptions import Retry
from eager_apps import make_app, metric

from celery_idem import (
    Idempotency,
    IdempotencyError,
    IdempotentTask,
    MemoryStore,
    PermanentError,
    ReplayedFailureError,
    State,
    StoreUnavailableError,
)
from celery_idem.records import Identity

app = eager_apps.app
idem = eager_apps.idem
calls = eager_apps.calls


class CardDeclined(Exception):
    """A business failure a policy lists as permanent (importable by module and qualname)."""


# --- failures --------------------------------------------------------------------------------------


def failing_task(app: Celery, calls: list[Any], exc: BaseException, **policy: Any) -> Task:
    @app.task(shared=False, base=IdempotentTask, idempotency=policy or None)
    def settle(order_id: int) -> None:
        calls.append(order_id)
        raise exc

    return settle


def test_permanent_error_is_stored_and_replayed_without_running(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, PermanentError("card declined"))

    with pytest.raises(PermanentError, match="card declined"):
        settle.apply_async((42,), idempotency_key="order-42")
    # When: the same call comes again
    with pytest.raises(PermanentError, match="card declined") as excinfo:
        settle.apply_async((42,), idempotency_key="order-42").get()

    # Then: it replays the stored failure as the same class, without running the body
    assert type(excinfo.value) is PermanentError
    assert calls == [42]
    record = idem.get(settle, "order-42")
    assert record is not None and record.state is State.FAILED
    assert record.error is not None and record.error.type == "PermanentError"


def test_class_listed_as_permanent_in_the_policy_is_stored_and_replayed(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, CardDeclined("insufficient funds"), permanent=(CardDeclined,))

    with pytest.raises(CardDeclined):
        settle.apply_async((42,), idempotency_key="order-42")
    replayed = settle.apply_async((42,), idempotency_key="order-42")

    assert replayed.deduplicated is True
    with pytest.raises(CardDeclined, match="insufficient funds"):
        replayed.get()
    assert calls == [42]
    assert idem.get(settle, "order-42").state is State.FAILED


def test_unlisted_error_is_retryable_by_default_so_the_next_call_runs(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, ValueError("flaky"))

    for _ in range(2):
        with pytest.raises(ValueError, match="flaky"):
            settle.apply_async((42,), idempotency_key="order-42")

    assert calls == [42, 42]
    assert idem.get(settle, "order-42") is None


def test_unlisted_error_is_stored_when_default_failure_is_permanent(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, ValueError("bad amount"), default_failure="permanent")

    with pytest.raises(ValueError, match="bad amount"):
        settle.apply_async((42,), idempotency_key="order-42")
    with pytest.raises(ValueError, match="bad amount"):
        settle.apply_async((42,), idempotency_key="order-42").get()

    assert calls == [42]
    assert idem.get(settle, "order-42").state is State.FAILED


def test_app_wide_default_failure_applies_to_tasks_without_their_own(calls: list[Any]) -> None:
    app = make_app()
    idem = Idempotency(app, default_failure="permanent")
    settle = failing_task(app, calls, ValueError("bad amount"))

    with pytest.raises(ValueError):
        settle.apply_async((42,), idempotency_key="order-42")

    assert idem.get(settle, "order-42").state is State.FAILED


def test_connection_error_stays_retryable_even_when_default_failure_is_permanent(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, ConnectionError("provider down"), default_failure="permanent")

    for _ in range(2):
        with pytest.raises(ConnectionError):
            settle.apply_async((42,), idempotency_key="order-42")

    assert calls == [42, 42]
    assert idem.get(settle, "order-42") is None


def test_failure_whose_class_cannot_be_rebuilt_replays_as_replayed_failure_error(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    # Given: a permanent error class defined inside this function (import by module+qualname fails)
    class LocalDeclined(PermanentError):
        pass

    settle = failing_task(app, calls, LocalDeclined("card declined"))
    with pytest.raises(LocalDeclined):
        settle.apply_async((42,), idempotency_key="order-42")

    # When: the stored failure is replayed
    with pytest.raises(ReplayedFailureError) as excinfo:
        settle.apply_async((42,), idempotency_key="order-42").get()

    # Then: the generic error names the original module, type and message
    message = str(excinfo.value)
    assert __name__ in message
    assert "LocalDeclined" in message
    assert "card declined" in message
    assert isinstance(excinfo.value, IdempotencyError)
    assert calls == [42]


# Regression: an exception out of an eager send() used to be released twice, with a stale token.
@pytest.mark.parametrize("exc", [ValueError("flaky"), PermanentError("declined")], ids=["retryable", "permanent"])
def test_ordinary_failure_counts_no_lost_lock(
    app: Celery, idem: Idempotency, calls: list[Any], caplog: pytest.LogCaptureFixture, exc: Exception
) -> None:
    settle = failing_task(app, calls, exc)

    with caplog.at_level(logging.WARNING, logger="celery_idem"), pytest.raises(type(exc)):
        settle.apply_async((42,), idempotency_key="order-42")

    # Nobody took over the record: nothing was lost, and nothing says so.
    assert metric(idem, "lost_locks") == 0
    assert not [r.getMessage() for r in caplog.records if "LOST" in r.getMessage()]


def test_celery_retry_keeps_the_identity_and_the_retry_runs(calls: list[Any]) -> None:
    # Given: eager mode without propagation, so Celery runs the retry in place (as plain Celery does)
    app = make_app()
    app.conf.task_eager_propagates = False
    idem = Idempotency(app)

    @app.task(shared=False, base=IdempotentTask, bind=True, max_retries=3)
    def flaky(self: Task, order_id: int) -> str:
        calls.append(order_id)
        if len(calls) == 1:
            raise self.retry(countdown=0, exc=ConnectionError("provider timeout"))
        return "charged"

    # When: the first attempt asks Celery to retry
    result = flaky.apply_async((42,), idempotency_key="order-42")

    # Then: the retry ran under the same identity (no second claim) and its outcome is stored
    assert result.get() == "charged"
    assert calls == [42, 42]
    assert metric(idem, "claims") == 1
    assert idem.get(flaky, "order-42").state is State.COMPLETED
    assert flaky.apply_async((42,), idempotency_key="order-42").get() == "charged"
    assert calls == [42, 42]


def test_autoretry_for_error_is_retried_then_stored(calls: list[Any]) -> None:
    app = make_app()
    app.conf.task_eager_propagates = False
    idem = Idempotency(app)

    @app.task(shared=False, base=IdempotentTask, autoretry_for=(KeyError,), max_retries=2, default_retry_delay=0)
    def lookup(order_id: int) -> str:
        calls.append(order_id)
        if len(calls) == 1:
            raise KeyError("not yet")
        return "found"

    assert lookup.apply_async((42,), idempotency_key="order-42").get() == "found"
    assert calls == [42, 42]
    assert idem.get(lookup, "order-42").state is State.COMPLETED


# Regression: a propagated eager retry used to leave the key PENDING for the pending timeout.
def test_propagated_celery_retry_in_eager_mode_frees_the_key(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, max_retries=3)
    def flaky(self: Task, order_id: int) -> str:
        calls.append(order_id)
        if len(calls) == 1:
            raise self.retry(countdown=0, exc=ConnectionError("provider timeout"))
        return "charged"

    # Given: eager propagation hands Celery's Retry to the caller; nothing is queued (plain Celery too)
    with pytest.raises(Retry):
        flaky.apply_async((42,), idempotency_key="order-42")

    # When: the caller tries again with the same key
    again = flaky.apply_async((42,), idempotency_key="order-42")

    # Then: it runs, instead of waiting on an attempt that will never come
    assert again.deduplicated is False
    assert calls == [42, 42]
    assert again.get(timeout=1) == "charged"


@pytest.mark.parametrize("exc", [ValueError("flaky"), CardDeclined("retry me")], ids=["value-error", "custom"])
def test_class_listed_as_retryable_beats_default_failure_permanent(
    app: Celery, idem: Idempotency, calls: list[Any], exc: Exception
) -> None:
    settle = failing_task(app, calls, exc, retryable=(type(exc),), default_failure="permanent")

    for _ in range(2):
        with pytest.raises(type(exc)):
            settle.apply_async((42,), idempotency_key="order-42")

    assert calls == [42, 42]
    assert idem.get(settle, "order-42") is None


# ---- the store down between an eager call's claim and its acquire ---------------------------------


@pytest.mark.parametrize("blips", [1, 1000])
def test_an_eager_call_whose_acquire_fails_tells_the_caller_once_and_leaves_no_claim(
    blips: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No broker keeps an eager call's message, so "back to the broker" would recurse into the call
    # itself (hundreds of nested acquires) and hide the error: the caller is told, as at publish.
    app = Celery("eager-acquire-down", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    store = MemoryStore()
    Idempotency(app, store=store)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def times_ten(x: int) -> int:
        runs.append(x)
        return x * 10

    real, acquires = store._acquire, [0]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        acquires[0] += 1
        if acquires[0] <= blips:
            raise ConnectionError("store down")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "_acquire", flaky)
    with pytest.raises(StoreUnavailableError, match="failed acquire"):
        times_ten.apply_async((4,), idempotency_key="k")
    assert acquires[0] == 1 and runs == []
    record = store.get(Identity("", times_ten.name, "k"))
    assert record is None  # the claim is given back: a new call runs (once the store answers)
    monkeypatch.setattr(store, "_acquire", real)
    assert times_ten.apply_async((4,), idempotency_key="k").get() == 40
