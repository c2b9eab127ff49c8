"""Found by an attacker: a soft time limit that strikes anywhere in an outcome's write, between
its retries included, hands the write to the heartbeat and keeps the task's own error; it never
replaces a permanent failure with SoftTimeLimitExceeded (retryable, so the key would be freed)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, MemoryStore, PermanentError, StoreUnavailableError
from celery_idem.records import Identity, State


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
