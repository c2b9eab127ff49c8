"""Eager apps (``task_always_eager``, memory store) and the fixtures the tests/api/test_eager_*.py modules
share: what users' own unit tests see.

Every test builds a fresh Celery app and Idempotency extension, and counts executions with a list
the task body appends to: a side effect outside the library.

Tasks are declared with ``shared=False``: Celery's ``@app.task`` otherwise also registers the function
on every app finalized later in the process, so same-named tasks of different tests would collide
(``DuplicateTaskNameWarning``). The tests of shared tasks (``@idempotent_task`` without ``app=``)
use the ``isolated_shared_tasks`` fixture so their tasks do not leak into later tests' apps.

A module takes the fixtures by assignment (``app = eager_apps.app``), each with those it depends on
(``charge`` needs ``app``, ``idem`` and ``calls``): an imported name shadowed by the test's argument is
a redefinition to ruff.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, Task
from celery import _state as celery_state

from celery_idem import Idempotency, IdempotentTask


def make_app(name: str = "t") -> Celery:
    # set_as_current=False: shared tasks and other tests never resolve to this app by accident.
    app = Celery(name, set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    return app


@pytest.fixture
def app() -> Celery:
    return make_app()


@pytest.fixture
def idem(app: Celery) -> Idempotency:
    return Idempotency(app)


@pytest.fixture
def isolated_shared_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared tasks declared during the test are forgotten by apps created after it."""
    monkeypatch.setattr(celery_state, "_on_app_finalizers", set(celery_state._on_app_finalizers))


@pytest.fixture
def calls() -> list[Any]:
    return []


@pytest.fixture
def charge(app: Celery, idem: Idempotency, calls: list[Any]) -> Task:
    """The DESIGN §1 example task."""

    @app.task(shared=False, base=IdempotentTask, idempotency={"key_args": ["order_id", "amount"], "ttl_seconds": 3600})
    def charge(order_id: int, amount: int) -> dict[str, int]:
        calls.append((order_id, amount))
        return {"order_id": order_id, "charged": amount}

    return charge


def metric(idem: Idempotency, name: str) -> int:
    return idem.metrics()[name]
