"""Eager mode: a duplicate call runs nothing and gets the original's answer (DESIGN §1). One call however
its arguments are spelled (positional, keyword, defaults, pydantic models), keyed or by its
fingerprint; the same key with other arguments is refused; a bypassed call runs and stores nothing;
on_duplicate="raise", a key in a header, a chain whose head is a duplicate, a result the backend does
not keep; a body calling its own task runs it as a plain call.

Each test builds a fresh eager app (task_always_eager, memory store) and counts executions with a list
the task body appends to; the apps and fixtures are tests/eager_apps.py's.
"""

from __future__ import annotations

from typing import Any

import eager_apps
import pytest
from celery import Celery, Task
from celery.result import AsyncResult
from eager_apps import metric
from pydantic import BaseModel

from celery_idem import (
    DuplicateTaskError,
    Idempotency,
    IdempotencyRecord,
    IdempotentResult,
    IdempotentTask,
    PayloadMismatchError,
    State,
)
from celery_idem.fingerprint import fingerprint
from celery_idem.records import Identity

app = eager_apps.app
idem = eager_apps.idem
calls = eager_apps.calls
charge = eager_apps.charge


# --- the DESIGN §1 example -------------------------------------------------------------------------


def test_duplicate_call_returns_the_original_without_running_again(charge: Task, calls: list[Any]) -> None:
    r1 = charge.apply_async((42, 100), idempotency_key="order-42-charge")
    r2 = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    assert isinstance(r1, AsyncResult) and isinstance(r2, AsyncResult)
    assert isinstance(r2, IdempotentResult)
    assert r2.id == r1.id
    assert r1.deduplicated is False
    assert r2.deduplicated is True
    assert r2.get() == r1.get() == {"order_id": 42, "charged": 100}
    assert calls == [(42, 100)]


def test_same_key_with_other_arguments_raises_payload_mismatch(charge: Task, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    with pytest.raises(PayloadMismatchError) as excinfo:
        charge.apply_async((42, 999), idempotency_key="order-42-charge")

    assert calls == [(42, 100)]
    assert excinfo.value.key == "order-42-charge"
    assert excinfo.value.task_name == charge.name
    assert excinfo.value.task_id == first.id


def test_idempotency_key_of_a_keyed_call_is_the_key(charge: Task) -> None:
    result = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    assert result.idempotency_key == "order-42-charge"


def test_key_less_call_is_keyed_by_its_fingerprint(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100))
    second = charge.apply_async((42, 100))

    # The fingerprint is a SHA-256 hex digest, usable with get()
    assert len(first.idempotency_key) == 64
    assert int(first.idempotency_key, 16) >= 0
    assert second.idempotency_key == first.idempotency_key
    assert second.deduplicated is True
    assert calls == [(42, 100)]
    record = idem.get(charge, first.idempotency_key)
    assert isinstance(record, IdempotencyRecord)
    assert record.state is State.COMPLETED
    assert record.task_id == first.id
    assert record.fingerprint == first.idempotency_key


def test_positional_keyword_and_default_forms_are_one_call(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def refund(order_id: int, amount: int, currency: str = "EUR") -> str:
        calls.append((order_id, amount, currency))
        return "refunded"

    results = [
        refund.apply_async((42, 100)),
        refund.apply_async(kwargs={"order_id": 42, "amount": 100}),
        refund.apply_async((42,), {"amount": 100}),
        refund.apply_async((42, 100, "EUR")),
        refund.delay(42, amount=100, currency="EUR"),
    ]

    assert calls == [(42, 100, "EUR")]
    assert len({r.idempotency_key for r in results}) == 1
    assert len({r.id for r in results}) == 1
    assert [r.deduplicated for r in results] == [False, True, True, True, True]


@pytest.mark.parametrize("spelling", [((42, 100), {}), ((42,), {"amount": 100, "currency": "EUR"})])
def test_a_record_written_before_defaults_were_left_out_still_answers_its_call(
    app: Celery, idem: Idempotency, calls: list[Any], spelling: Any
) -> None:
    # Given a record that celery-idem before 0.2 wrote for refund(42, 100): its fingerprint holds the default
    @app.task(shared=False, base=IdempotentTask)
    def refund(order_id: int, amount: int, currency: str = "EUR") -> str:
        calls.append((order_id, amount, currency))
        return "refunded"

    earlier = fingerprint(refund.run, (42, 100), {}, keep_defaults=True)
    assert earlier != fingerprint(refund.run, (42, 100), {})
    idem.store.claim(Identity("", refund.name, "k-upgrade"), earlier, "t-before", pending_seconds=60, ttl_seconds=60)
    # When the same call comes after the upgrade, spelled either way
    again = refund.apply_async(*spelling, idempotency_key="k-upgrade")
    # Then it is that call's duplicate, never a PayloadMismatchError; other arguments still are one
    assert again.deduplicated and again.id == "t-before"
    assert calls == []
    with pytest.raises(PayloadMismatchError):
        refund.apply_async((42, 100, "USD"), idempotency_key="k-upgrade")


class ShipOptions(BaseModel):
    """A model argument with a default (module level: Celery's pydantic support resolves it by name)."""

    express: bool = False


def test_one_call_spelled_with_or_without_its_model_default_runs_once(app: Celery, idem: Idempotency) -> None:
    received: list[Any] = []

    @app.task(base=IdempotentTask, bind=True, pydantic=True, shared=False)
    def ship(self: Any, order_id: int, options: ShipOptions = ShipOptions()) -> int:  # noqa: B008 - the case under test
        received.append((order_id, options))
        return order_id

    calls = [ship.delay(7), ship.delay(7, options={"express": False}), ship.delay(7, options=ShipOptions())]

    assert len(received) == 1, f"{len(received)} runs of one call"
    assert [c.deduplicated for c in calls] == [False, True, True]
    assert ship.delay(7, options={"express": True}).deduplicated is False


def test_same_key_in_keyword_form_is_not_a_mismatch(charge: Task, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42-charge")

    again = charge.apply_async(kwargs={"amount": 100, "order_id": 42}, idempotency_key="order-42-charge")

    assert again.deduplicated is True
    assert calls == [(42, 100)]


def test_bypass_runs_every_time_and_stores_nothing(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    for _ in range(3):
        charge.apply_async((42, 100), idempotency_key="order-42-charge", idempotency=False).get()

    assert calls == [(42, 100)] * 3
    assert idem.get(charge, "order-42-charge") is None
    assert metric(idem, "claims") == 0
    assert len(idem.store) == 0


def test_bypassed_call_does_not_block_a_later_protected_call(charge: Task, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42-charge", idempotency=False)

    result = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    assert result.deduplicated is False
    assert len(calls) == 2


# --- duplicates ------------------------------------------------------------------------------------


def test_on_duplicate_raise_refuses_the_second_call_with_the_original_task_id(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"on_duplicate": "raise"})
    def ship(order_id: int) -> str:
        calls.append(order_id)
        return "shipped"

    first = ship.apply_async((42,), idempotency_key="order-42")

    with pytest.raises(DuplicateTaskError) as excinfo:
        ship.apply_async((42,), idempotency_key="order-42")

    assert excinfo.value.task_id == first.id
    assert excinfo.value.key == "order-42"
    assert first.id in str(excinfo.value)
    assert calls == [42]


def test_key_in_the_message_header_is_honoured(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100), headers={"idempotency_key": "order-42"})
    second = charge.apply_async((42, 100), idempotency_key="order-42")

    assert first.idempotency_key == "order-42"
    assert second.deduplicated is True and second.id == first.id
    assert calls == [(42, 100)]


def test_duplicate_head_of_a_chain_still_feeds_its_continuation(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def add(x: int, y: int) -> int:
        calls.append((x, y))
        return x + y

    @app.task(shared=False)
    def double(total: int) -> int:
        return total * 2

    first = (add.s(1, 2).set(idempotency_key="sum-1") | double.s()).apply_async()
    # When: the same head is called again inside a new chain
    second = (add.s(1, 2).set(idempotency_key="sum-1") | double.s()).apply_async()

    # Then: the head ran once, and the continuation got its outcome both times
    assert first.get() == second.get() == 6
    assert calls == [(1, 2)]


def test_ignore_result_task_answers_from_the_store(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, ignore_result=True)
    def tally(n: int) -> int:
        calls.append(n)
        return n * 10

    first = tally.apply_async((3,), idempotency_key="tally-3")
    replayed = tally.apply_async((3,), idempotency_key="tally-3")

    assert first.get() == replayed.get() == 30
    assert replayed.state == "SUCCESS"
    assert calls == [3]


class Order(BaseModel):
    """The argument of a pydantic=True task (module level: Celery resolves the annotation by name)."""

    order_id: int
    amount: int


# --- pydantic=True tasks ------------------------------------------------------------------------------


def test_pydantic_task_is_fingerprinted_as_celery_sends_it(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, pydantic=True)
    def place(order: Order) -> dict[str, int]:
        calls.append(order)
        return {"order": order.order_id, "amount": order.amount}

    # When: the task is called with a model, an equal model, and the model's dump, under one key
    first = place.apply_async((Order(order_id=1, amount=5),), idempotency_key="order-1")
    again = place.apply_async((Order(order_id=1, amount=5),), idempotency_key="order-1")
    by_dict = place.apply_async(kwargs={"order": {"order_id": 1, "amount": 5}}, idempotency_key="order-1")
    # Then: it is one call (as plain Celery, which dumps the models, would send it), run once
    assert [first.deduplicated, again.deduplicated, by_dict.deduplicated] == [False, True, True]
    assert first.get() == again.get() == by_dict.get() == {"order": 1, "amount": 5}
    assert calls == [Order(order_id=1, amount=5)]
    # And: another model under the key is other arguments; without a key, equal models are one call
    with pytest.raises(PayloadMismatchError):
        place.apply_async((Order(order_id=1, amount=6),), idempotency_key="order-1")
    assert place.delay(Order(order_id=2, amount=7)).get() == place.delay({"order_id": 2, "amount": 7}).get()
    assert len(calls) == 2


def test_an_eager_body_that_calls_its_own_task_as_a_function_runs_it_as_a_plain_call() -> None:
    app = Celery("eager-recursion", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app)
    levels: list[int] = []

    @app.task(base=IdempotentTask, shared=False, idempotency={"busy_wait_seconds": 1})
    def countdown(n: int) -> str:
        levels.append(n)
        return countdown(n - 1) if n > 0 else "done"  # type: ignore[no-any-return]

    # Before, the inner call was taken for a copy of the running message: it waited on its own lease
    assert countdown.apply_async((2,), idempotency_key="k").get() == "done"
    assert levels == [2, 1, 0]


def test_a_call_under_the_task_id_of_an_ended_until_done_call_is_that_call_again_and_does_not_run() -> None:
    from celery_idem import Idempotency, IdempotentTask

    app = Celery("eager-single", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, name="eager.single", idempotency={"mode": "until_done"})
    def single(order: int) -> int:
        runs.append(order)
        return order

    # Given an until_done call whose run ended
    first = single.apply_async((1,), idempotency_key="k")
    assert first.get() == 1 and runs == [1]
    # When the caller sends it again under its own task id (a resend, the outbox relay's second pass)
    again = single.apply_async((1,), idempotency_key="k", task_id=first.id)
    # Then it is that call, not a new one: its body does not run again (the ended run's record is
    # kept for that call's own messages); a new call is one under a new task id
    assert again.get() == 1 and runs == [1]
