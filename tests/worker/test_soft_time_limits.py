"""Soft time limits (Celery's ``SoftTimeLimitExceeded``) that strike while an outcome is being stored.

A soft limit lands wherever the worker happens to be once the body has ended: inside the store call
that writes the outcome, or between the tries of that write. Wherever it lands, the task's own outcome
stands: a returned value still succeeds and never frees the key for a second run; a permanent failure
is stored as that failure, never replaced by ``SoftTimeLimitExceeded`` (retryable, so the key would be
freed); a write the limit interrupted is handed to the heartbeat.

Each test runs one call on a memory store (eagerly, or as a worker's pool runs a message:
tests/workers.py ``execute_as_worker``) and makes the limit strike by patching the store's ``_settle``.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, MemoryStore, PermanentError, StoreUnavailableError
from celery_idem.records import Identity, State

# ---- while a returned value is stored ---------------------------------------------------------------


def test_a_soft_time_limit_while_the_value_is_stored_never_frees_the_key_for_a_second_run() -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    now = [1_700_000_000.0]
    store = MemoryStore(clock=lambda: now[0])
    app = Celery("soft-limit-at-complete", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.task_store_eager_result = True
    idem = Idempotency(app, store=store)
    effects: list[int] = []

    @app.task(base=IdempotentTask, shared=False, idempotency={"lease_seconds": 30})
    def pay(order: int) -> str:
        effects.append(order)
        return "paid"

    real_settle, fired = store._settle, []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(1)
            raise SoftTimeLimitExceeded()  # the soft limit lands during the complete round trip
        return real_settle(*args, **kwargs)

    store._settle = interrupted  # type: ignore[method-assign]
    # Given the body returned and the soft limit struck while its value was being stored
    first = pay.apply((7,), task_id="t-1", headers={"idempotency_key": "order-7"})
    # Then the task still succeeds (the value is left in the result backend as evidence)...
    assert first.state == "SUCCESS" and app.backend.get_task_meta("t-1")["status"] == "SUCCESS"
    now[0] += 7200
    idem.reconcile()
    # ...and neither the reconciler nor a later call frees the key for a second run
    again = pay.apply((7,), task_id="t-2", headers={"idempotency_key": "order-7"})
    assert again.get() == "paid" and effects == [7]


# ---- while a permanent failure is stored --------------------------------------------------------------

# Found by an attacker: a soft time limit that strikes while a PERMANENT failure is being stored replaces the task's
# error with SoftTimeLimitExceeded (retryable) and leaves the record IN_PROGRESS; the reconciler then
# reads FAILURE(SoftTimeLimitExceeded) from the result backend and frees the key, and the next call
# runs the body again. 3b01bc8 handled the same strike while a returned VALUE is stored
# (_defer_value); the failure path (Settler.ended -> settle_failure -> write(fail)) was not.


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


# ---- between the tries of an outcome's write --------------------------------------------------------

# Found by an attacker: a soft time limit that strikes anywhere in an outcome's write, between
# its retries included, hands the write to the heartbeat and keeps the task's own error; it never
# replaces a permanent failure with SoftTimeLimitExceeded (retryable, so the key would be freed).


def test_soft_limit_in_the_retry_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    app = Celery("a4-softgap", set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store=store)

    @app.task(base=IdempotentTask, shared=False, idempotency={"lease_seconds": 30})
    def charge(x: int) -> int:
        raise PermanentError("card declined")

    app.finalize()
    real_settle, real_count = store._settle, idem.count
    calls: list[int] = []

    def settle(identity: Any, token: str, outcome: Any) -> Any:
        if not calls:
            calls.append(1)
            raise StoreUnavailableError("blip")
        return real_settle(identity, token, outcome)

    def count(name: str, *a: Any) -> Any:
        if name == "store_errors" and calls == [1]:
            calls.append(2)
            raise SoftTimeLimitExceeded()  # the strike lands on the bookkeeping line after the failed try
        return real_count(name, *a)

    monkeypatch.setattr(store, "_settle", settle)
    monkeypatch.setattr(idem, "count", count)
    execute_as_worker(app, charge.name, "t-1", idempotency_key="k")
    assert calls == [1, 2]
    deferred = idem.heartbeat.deferred
    record = store.get(Identity("", charge.name, "k"))
    assert record is not None
    meta = app.backend.get_task_meta("t-1")
    print(record.state, deferred, meta.get("status"), meta.get("result"))
    assert record.state is State.FAILED or deferred == 1, f"failure neither written nor deferred: {record.state}"
