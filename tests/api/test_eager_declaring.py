"""Eager mode: declaring an idempotent task and its policy. The decorator (bare, with policy keywords,
without an app, with other Celery options, with a base class), a policy refining its base class's, and
the mistakes a declaration can hold, refused by the first call with the field named.

Each test builds a fresh eager app (task_always_eager, memory store) and counts executions with a list
the task body appends to; the apps and fixtures are tests/eager_apps.py's.
"""

from __future__ import annotations

from typing import Any

import eager_apps
import pytest
from celery import Celery, Task
from celery.utils.imports import gen_task_name
from eager_apps import make_app, metric

from celery_idem import (
    ConfigurationError,
    DuplicateTaskError,
    Idempotency,
    IdempotencyPolicy,
    IdempotentTask,
    idempotent_task,
)

app = eager_apps.app
idem = eager_apps.idem
calls = eager_apps.calls
charge = eager_apps.charge
isolated_shared_tasks = eager_apps.isolated_shared_tasks


# --- declaring idempotent tasks --------------------------------------------------------------------


def test_app_task_with_idempotent_base_and_policy_dict(charge: Task, idem: Idempotency) -> None:
    assert isinstance(charge, IdempotentTask)
    assert idem.policy_for(charge).key_args == ["order_id", "amount"]
    assert idem.policy_for(charge).ttl_seconds == 3600


@pytest.mark.usefixtures("isolated_shared_tasks")
def test_bare_decorator_makes_a_shared_idempotent_task(calls: list[Any]) -> None:
    # Given: a bare @idempotent_task (no app: a shared task)
    def send_receipt_bare(order_id: int) -> str:
        calls.append(order_id)
        return f"receipt-{order_id}"

    idempotent_task(send_receipt_bare)

    # When: an app is created afterwards
    later = make_app("later")
    Idempotency(later)
    task = later.tasks[gen_task_name(later, send_receipt_bare.__name__, send_receipt_bare.__module__)]

    # Then: the task is on it, idempotent, and runs once per key
    assert isinstance(task, IdempotentTask)
    first = task.apply_async((42,), idempotency_key="receipt-42")
    second = task.apply_async((42,), idempotency_key="receipt-42")
    assert first.get() == second.get() == "receipt-42"
    assert second.deduplicated is True
    assert calls == [42]


@pytest.mark.usefixtures("isolated_shared_tasks")
def test_decorator_with_policy_keywords_sets_the_policy(calls: list[Any]) -> None:
    @idempotent_task(ttl_seconds=600)
    def send_receipt_ttl(order_id: int) -> None:
        calls.append(order_id)

    later = make_app("later")
    idem = Idempotency(later)
    task = later.tasks[gen_task_name(later, send_receipt_ttl.__name__, send_receipt_ttl.__module__)]

    task.apply_async((42,), idempotency_key="receipt-42").get()
    task.apply_async((42,), idempotency_key="receipt-42").get()

    assert idem.policy_for(task).ttl_seconds == 600
    record = idem.get(task, "receipt-42")
    assert record is not None and record.ttl_seconds == 600
    assert calls == [42]


@pytest.mark.usefixtures("isolated_shared_tasks")
def test_decorator_without_app_registers_on_apps_created_afterwards() -> None:
    @idempotent_task(name="test_eager.shared_notify")
    def shared_notify(order_id: int) -> int:
        return order_id

    first, second = make_app("first"), make_app("second")

    assert "test_eager.shared_notify" in first.tasks
    assert "test_eager.shared_notify" in second.tasks
    assert isinstance(second.tasks["test_eager.shared_notify"], IdempotentTask)


# Celery 5.x deprecates the ``queue`` task attribute at bind time; it is still the plainest option to
# prove that non-policy keywords reach app.task, so only that one warning is silenced here.
@pytest.mark.filterwarnings(r"ignore:\s*The 'queue' task attribute is deprecated:celery.exceptions.CDeprecationWarning")
def test_decorator_passes_other_options_to_app_task(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @idempotent_task(app=app, shared=False, name="x.y", queue="q", ttl_seconds=600)
    def notify(order_id: int) -> None:
        calls.append(order_id)

    assert notify.name == "x.y"
    assert notify.queue == "q"
    registered = app.tasks["x.y"]  # the app's own task object (``notify`` is Celery's lazy proxy to it)
    assert isinstance(registered, IdempotentTask)
    assert registered.queue == "q"
    assert idem.policy_for(notify).ttl_seconds == 600


def test_decorator_refuses_a_base_that_is_not_an_idempotent_task(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="base"):
        idempotent_task(app=app, base=Task)


def test_decorator_refuses_a_task_instance_as_base(app: Celery) -> None:
    # An instance is not a class: refused with the same error, not a TypeError from issubclass.
    with pytest.raises(ConfigurationError, match="base"):
        idempotent_task(app=app, base=IdempotentTask())


def test_decorator_accepts_a_subclass_of_idempotent_task_as_base(app: Celery, idem: Idempotency) -> None:
    class AuditedTask(IdempotentTask):
        pass

    @idempotent_task(app=app, shared=False, base=AuditedTask)
    def audited(order_id: int) -> int:
        return order_id

    assert isinstance(audited, AuditedTask)
    assert audited.apply_async((1,), idempotency_key="k").get() == 1


def test_decorator_refuses_the_policy_given_twice(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        idempotent_task(app=app, ttl_seconds=600, idempotency={"lease_seconds": 5})


def test_a_task_policy_refines_its_base_class_policy(app: Celery, idem: Idempotency) -> None:
    class Payments(IdempotentTask):
        idempotency = {"ttl_seconds": 7200, "permanent": (KeyError,)}

    @app.task(shared=False, base=Payments, idempotency={"lease_seconds": 5})
    def refund(order_id: int) -> None: ...

    policy = idem.policy_for(refund)
    assert (policy.ttl_seconds, policy.lease_seconds, policy.permanent) == (7200, 5, (KeyError,))


# --- configuration errors at first call ------------------------------------------------------------


def test_key_args_naming_a_missing_parameter_fails_at_first_call(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"key_args": ["order_id", "ammount"]})
    def capture(order_id: int, amount: int) -> None:
        calls.append(order_id)

    with pytest.raises(ConfigurationError, match="ammount") as excinfo:
        capture.apply_async((42, 100), idempotency_key="order-42")

    assert "amount" in str(excinfo.value)  # it shows the real signature
    assert calls == []
    assert metric(idem, "claims") == 0


def test_invalid_task_policy_fails_at_first_call_naming_the_field(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"ttl_seconds": 0})
    def capture(order_id: int) -> None:
        calls.append(order_id)

    with pytest.raises(ConfigurationError, match="ttl_seconds"):
        capture.apply_async((42,), idempotency_key="order-42")
    assert calls == []


def test_idempotency_option_of_the_wrong_type_fails_at_first_call(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency="yes please")
    def capture(order_id: int) -> None:
        calls.append(order_id)

    with pytest.raises(ConfigurationError, match="dict or IdempotencyPolicy"):
        capture.apply_async((42,), idempotency_key="order-42")
    assert calls == []


def test_policy_model_as_the_task_option(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency=IdempotencyPolicy(on_duplicate="raise"))
    def capture(order_id: int) -> None:
        calls.append(order_id)

    capture.apply_async((42,), idempotency_key="order-42")
    with pytest.raises(DuplicateTaskError):
        capture.apply_async((42,), idempotency_key="order-42")
    assert calls == [42]


def test_key_args_narrow_the_fingerprint(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"key_args": ["order_id"]})
    def capture(order_id: int, note: str = "") -> None:
        calls.append((order_id, note))

    charge_a = capture.apply_async((42, "first"), idempotency_key="order-42")
    charge_b = capture.apply_async((42, "second"), idempotency_key="order-42")  # not a mismatch

    assert charge_b.deduplicated is True and charge_b.id == charge_a.id
    assert calls == [(42, "first")]
