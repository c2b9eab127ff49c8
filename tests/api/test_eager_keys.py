"""Eager mode: keys and scopes. What the body sees of its identity (key, scope, the fingerprint of a
key-less call), scopes as separate identities, and the key rules: a required key, and invalid keys and
scopes refused before anything is claimed.

Each test builds a fresh eager app (task_always_eager, memory store) and counts executions with a list
the task body appends to; the apps and fixtures are tests/eager_apps.py's.
"""

from __future__ import annotations

from typing import Any

import eager_apps
import pytest
from celery import Celery, Task
from eager_apps import metric

from celery_idem import Idempotency, IdempotentTask, InvalidKeyError

app = eager_apps.app
idem = eager_apps.idem
calls = eager_apps.calls
charge = eager_apps.charge


# --- identity inside the body ----------------------------------------------------------------------


@pytest.fixture
def whoami(app: Celery, idem: Idempotency, calls: list[Any]) -> Task:
    @app.task(shared=False, base=IdempotentTask, bind=True)
    def whoami(self: Task, order_id: int) -> list[Any]:
        calls.append(order_id)
        return [self.request.idempotency_key, self.request.idempotency_scope]

    return whoami


def test_body_sees_the_key_of_a_keyed_call(whoami: Task) -> None:
    assert whoami.apply_async((42,), idempotency_key="order-42").get() == ["order-42", None]


def test_body_sees_key_and_scope_of_a_scoped_call(whoami: Task) -> None:
    result = whoami.apply_async((42,), idempotency_key="order-42", idempotency_scope="tenant-a")

    assert result.get() == ["order-42", "tenant-a"]


def test_body_of_a_key_less_call_sees_its_fingerprint(whoami: Task) -> None:
    result = whoami.apply_async((42,))

    key, scope = result.get()
    assert key == result.idempotency_key
    assert len(key) == 64
    assert scope is None


def test_bound_task_fingerprint_ignores_self(whoami: Task, calls: list[Any]) -> None:
    # Positional and keyword forms of a bind=True task are one call: self is not an argument.
    whoami.apply_async((42,))
    whoami.apply_async(kwargs={"order_id": 42})

    assert calls == [42]


# --- scopes ----------------------------------------------------------------------------------------


def test_scopes_separate_identities(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    a = charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-a")
    b = charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-b")
    a_again = charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-a")

    assert calls == [(42, 100), (42, 100)]
    assert a.id != b.id
    assert a_again.id == a.id and a_again.deduplicated is True
    assert idem.get(charge, "order-42", scope="tenant-a").task_id == a.id
    assert idem.get(charge, "order-42", scope="tenant-b").task_id == b.id
    assert idem.get(charge, "order-42") is None  # the unscoped identity is a third one


def test_same_key_with_other_arguments_in_another_scope_is_not_a_mismatch(charge: Task, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-a")

    charge.apply_async((42, 999), idempotency_key="order-42", idempotency_scope="tenant-b")

    assert calls == [(42, 100), (42, 999)]


# --- key rules -------------------------------------------------------------------------------------


def test_require_key_refuses_a_key_less_call(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"require_key": True})
    def pay(order_id: int) -> None:
        calls.append(order_id)

    with pytest.raises(InvalidKeyError, match="require"):
        pay.apply_async((42,))

    assert calls == []
    assert metric(idem, "claims") == 0
    assert pay.apply_async((42,), idempotency_key="order-42").deduplicated is False
    assert calls == [42]


@pytest.mark.parametrize(
    ("bad_key", "rule"),
    [
        ("", "empty"),
        ("k" * 300, "300 characters"),
        ("order 42", "whitespace"),
        (42, "int"),
        (b"order-42", "bytes"),
    ],
    ids=["empty", "300-chars", "space", "int", "bytes"],
)
def test_invalid_key_is_refused_before_anything_is_claimed(
    charge: Task, idem: Idempotency, calls: list[Any], bad_key: object, rule: str
) -> None:
    claims_before = metric(idem, "claims")

    with pytest.raises(InvalidKeyError, match=rule):
        charge.apply_async((42, 100), idempotency_key=bad_key)

    assert metric(idem, "claims") == claims_before
    assert calls == []
    assert len(idem.store) == 0


@pytest.mark.parametrize("bad_scope", ["", "tenant a", 7], ids=["empty", "space", "int"])
def test_invalid_scope_is_refused_before_anything_is_claimed(
    charge: Task, idem: Idempotency, calls: list[Any], bad_scope: object
) -> None:
    with pytest.raises(InvalidKeyError, match="scope"):
        charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope=bad_scope)

    assert metric(idem, "claims") == 0
    assert calls == []
