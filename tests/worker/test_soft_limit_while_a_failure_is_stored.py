"""Found by an attacker: a soft time limit that strikes while a PERMANENT failure is being stored replaces the task's
error with SoftTimeLimitExceeded (retryable) and leaves the record IN_PROGRESS; the reconciler then
reads FAILURE(SoftTimeLimitExceeded) from the result backend and frees the key, and the next call
runs the body again. 3b01bc8 handled the same strike while a returned VALUE is stored
(_defer_value); the failure path (_settle_exception -> settle_failure -> _write(fail)) was not.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, MemoryStore, PermanentError
from celery_idem.records import Identity, State


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _deliver(app: Any, name: str, task_id: str) -> None:
    execute_as_worker(app, name, task_id, idempotency_key="k")


def test_soft_limit_while_storing_a_permanent_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    app = Celery("a3-softfail", set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store=store)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, idempotency={"lease_seconds": 30})
    def charge(x: int) -> int:
        runs.append(x)
        raise PermanentError("card declined after the hold was placed")

    app.finalize()
    real_settle = store._settle
    struck = []

    def settle(identity: Any, token: str, outcome: Any) -> Any:
        if outcome.state is State.FAILED and not struck:
            struck.append(1)
            raise SoftTimeLimitExceeded()  # the soft limit strikes inside the store call
        return real_settle(identity, token, outcome)

    monkeypatch.setattr(store, "_settle", settle)
    _deliver(app, charge.name, "t-1")
    assert runs == [1] and struck
    clock.t += 60  # the lease has run out; nobody will settle the record
    monkeypatch.setattr(app.control, "inspect", lambda **k: type("I", (), {"query_task": lambda self, *a: {}})())
    idem.reconcile()
    _deliver(app, charge.name, "t-2")  # a later call with the same key
    assert runs == [1], "the permanent failure was never stored and the key was freed: the body ran again"
    # and the outcome every duplicate is told is the task's own failure, not the time limit's
    record = store.get(Identity("", charge.name, "k"))
    assert record is not None and record.state is State.FAILED
    assert record.error is not None and record.error.type == "PermanentError"
