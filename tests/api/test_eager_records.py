"""Eager mode: the records an app keeps and what it says of them. A direct function call touches no
store; get() and forget() by task or name; the metrics counters and their snapshot; a memory store
given to the app holds the records.

Each test builds a fresh eager app (task_always_eager, memory store) and counts executions with a list
the task body appends to; the apps and fixtures are tests/eager_apps.py's.
"""

from __future__ import annotations

from typing import Any

import eager_apps
import pytest
from celery import Celery, Task
from eager_apps import metric

from celery_idem import Idempotency, IdempotentTask, InvalidKeyError, MemoryStore, PayloadMismatchError, State

app = eager_apps.app
idem = eager_apps.idem
calls = eager_apps.calls
charge = eager_apps.charge


# --- direct calls, get and forget ------------------------------------------------------------------


def test_direct_function_call_just_runs_and_touches_no_store(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    assert charge(1, 2) == {"order_id": 1, "charged": 2}
    assert charge(1, 2) == {"order_id": 1, "charged": 2}

    assert calls == [(1, 2), (1, 2)]
    assert metric(idem, "claims") == 0
    assert len(idem.store) == 0
    # And a later protected call is not a duplicate of the direct ones
    assert charge.apply_async((1, 2)).deduplicated is False


def test_forget_lets_the_same_key_run_again(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100), idempotency_key="order-42")

    assert idem.forget(charge, "order-42") is True
    again = charge.apply_async((42, 100), idempotency_key="order-42")

    assert again.deduplicated is False
    assert again.id != first.id
    assert calls == [(42, 100), (42, 100)]


def test_forget_of_an_unknown_key_returns_false(charge: Task, idem: Idempotency) -> None:
    assert idem.forget(charge, "never-used") is False


def test_forget_lets_other_arguments_use_the_key(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42")
    idem.forget(charge.name, "order-42")

    charge.apply_async((42, 999), idempotency_key="order-42")  # no PayloadMismatchError

    assert calls == [(42, 100), (42, 999)]


def test_get_takes_the_task_or_its_name(charge: Task, idem: Idempotency) -> None:
    result = charge.apply_async((42, 100), idempotency_key="order-42")

    by_task = idem.get(charge, "order-42")
    by_name = idem.get(charge.name, "order-42")

    assert by_task == by_name
    assert by_name is not None
    assert (by_name.key, by_name.task_name, by_name.task_id) == ("order-42", charge.name, result.id)
    assert by_name.state is State.COMPLETED


def test_get_of_an_unknown_key_is_none(charge: Task, idem: Idempotency) -> None:
    assert idem.get(charge, "never-used") is None


def test_get_validates_the_key(charge: Task, idem: Idempotency) -> None:
    with pytest.raises(InvalidKeyError):
        idem.get(charge, "has space")


# --- metrics ---------------------------------------------------------------------------------------


def test_metrics_count_claims_replays_and_mismatches(charge: Task, idem: Idempotency) -> None:
    assert idem.metrics()["claims"] == 0

    # NEW: one claim, nothing else
    charge.apply_async((42, 100), idempotency_key="order-42")
    assert (metric(idem, "claims"), metric(idem, "replays"), metric(idem, "mismatches")) == (1, 0, 0)

    # Duplicate of a completed call: in eager mode that is a REPLAY (claims count every claim)
    charge.apply_async((42, 100), idempotency_key="order-42")
    assert (metric(idem, "claims"), metric(idem, "replays"), metric(idem, "mismatches")) == (2, 1, 0)

    # Same key, other arguments: a mismatch
    with pytest.raises(PayloadMismatchError):
        charge.apply_async((42, 999), idempotency_key="order-42")
    assert (metric(idem, "claims"), metric(idem, "replays"), metric(idem, "mismatches")) == (3, 1, 1)
    assert metric(idem, "duplicates") == 0


def test_metrics_is_a_snapshot_with_every_documented_counter(idem: Idempotency) -> None:
    snapshot = idem.metrics()
    snapshot["claims"] = 99

    assert idem.metrics()["claims"] == 0
    assert {
        "claims",
        "duplicates",
        "replays",
        "mismatches",
        "busy_waits",
        "lost_locks",
        "store_errors",
        "reconciled_completed",
        "reconciled_failed",
        "reconciled_released",
    } <= set(snapshot)


def test_a_given_memory_store_holds_the_records(app: Celery, calls: list[Any]) -> None:
    store = MemoryStore()
    idem = Idempotency(app, store=store)

    @app.task(shared=False, base=IdempotentTask)
    def ping(n: int) -> int:
        calls.append(n)
        return n

    ping.apply_async((1,), idempotency_key="p-1")

    assert len(store) == 1
    assert idem.get(ping, "p-1") is not None
