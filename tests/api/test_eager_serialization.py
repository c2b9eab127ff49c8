"""Eager mode: what cannot be encoded. An argument is refused at publish (kombu's EncodeError, as plain
Celery raises it) and nothing is claimed; a result that cannot be stored, or is over max_result_bytes,
settles a permanent failure (the body ran); the pickle serializer only with accept_pickle=True.

Each test builds a fresh eager app (task_always_eager, memory store) and counts executions with a list
the task body appends to; the apps and fixtures are tests/eager_apps.py's.
"""

from __future__ import annotations

from typing import Any

import eager_apps
import pytest
from celery import Celery
from eager_apps import make_app, metric

from celery_idem import (
    ConfigurationError,
    Idempotency,
    IdempotencyError,
    IdempotentTask,
    ResultTooLargeError,
    SerializationError,
    State,
)

app = eager_apps.app
idem = eager_apps.idem
calls = eager_apps.calls


# --- serialization ---------------------------------------------------------------------------------


def test_unserializable_argument_is_refused_at_publish_and_nothing_is_claimed(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def store_blob(blob: Any) -> None:
        calls.append(blob)

    with pytest.raises(SerializationError):
        store_blob.apply_async((object(),), idempotency_key="blob-1")

    assert calls == []
    assert metric(idem, "claims") == 0
    assert len(idem.store) == 0


def test_unserializable_argument_is_the_encode_error_plain_celery_raises(app: Celery, idem: Idempotency) -> None:
    # Given code written for plain Celery, which catches kombu's EncodeError around apply_async
    from kombu.exceptions import EncodeError

    @app.task(shared=False, base=IdempotentTask)
    def store_blob(blob: Any) -> None: ...

    # When an argument cannot be encoded, Then that same except clause catches our error
    with pytest.raises(EncodeError) as excinfo:
        store_blob.apply_async((object(),), idempotency_key="blob-1")
    assert isinstance(excinfo.value, SerializationError)
    assert "cannot" in str(excinfo.value)
    assert len(idem.store) == 0


def test_unserializable_result_raises_and_settles_a_permanent_failure(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def make_handle(order_id: int) -> object:
        calls.append(order_id)
        return object()

    with pytest.raises(SerializationError):
        make_handle.apply_async((42,), idempotency_key="order-42")

    record = idem.get(make_handle, "order-42")
    assert record is not None and record.state is State.FAILED and record.error.type == "SerializationError"
    # The body returned (its effect happened): the next call is told the failure, never run again
    again = make_handle.apply_async((42,), idempotency_key="order-42")
    assert again.deduplicated
    with pytest.raises(SerializationError):
        again.get()
    assert calls == [42]


def test_result_over_max_result_bytes_raises_and_settles_a_permanent_failure(calls: list[Any]) -> None:
    app = make_app()
    idem = Idempotency(app, max_result_bytes=100)

    @app.task(shared=False, base=IdempotentTask)
    def report(order_id: int) -> str:
        calls.append(order_id)
        return "x" * 500

    with pytest.raises(ResultTooLargeError) as excinfo:
        report.apply_async((42,), idempotency_key="order-42")

    assert isinstance(excinfo.value, SerializationError)
    assert "max_result_bytes" in str(excinfo.value)
    record = idem.get(report, "order-42")
    assert record is not None and record.state is State.FAILED and record.error.type == "ResultTooLargeError"
    assert calls == [42]


def test_result_within_max_result_bytes_is_stored(calls: list[Any]) -> None:
    app = make_app()
    idem = Idempotency(app, max_result_bytes=100)

    @app.task(shared=False, base=IdempotentTask)
    def report(order_id: int) -> str:
        calls.append(order_id)
        return "x" * 50

    report.apply_async((42,), idempotency_key="order-42")

    assert idem.get(report, "order-42").state is State.COMPLETED


def test_pickle_serializer_is_refused_at_first_call_by_default(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, serializer="pickle")
    def snapshot(order_id: int) -> set[int]:
        calls.append(order_id)
        return {order_id}

    with pytest.raises(ConfigurationError, match="pickle") as excinfo:
        snapshot.apply_async((42,), idempotency_key="order-42")

    assert isinstance(excinfo.value, IdempotencyError)
    assert "accept_pickle" in str(excinfo.value)
    assert calls == []
    assert len(idem.store) == 0


def test_pickle_serializer_works_when_accept_pickle_is_set(calls: list[Any]) -> None:
    app = make_app()
    Idempotency(app, accept_pickle=True)

    @app.task(shared=False, base=IdempotentTask, serializer="pickle")
    def snapshot(order_id: int) -> set[int]:
        calls.append(order_id)
        return {order_id}

    first = snapshot.apply_async((42,), idempotency_key="order-42")
    replayed = snapshot.apply_async((42,), idempotency_key="order-42")

    assert first.get() == replayed.get() == {42}  # a set survives: the pickle serializer stored it
    assert replayed.deduplicated is True
    assert calls == [42]
