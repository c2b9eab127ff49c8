"""Found by an attacker: the in-body flag ``idempotency_running`` is read from the request, and a worker merges
every message header into the request: a message that carries the header runs its body unprotected,
every copy of it, with no bypass recorded (the documented bypass is ``idempotency=False``)."""

from __future__ import annotations

from celery import Celery
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, MemoryStore


def test_running_flag_from_a_header_does_not_skip_dedup() -> None:
    app = Celery("a3-flag", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=MemoryStore())
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    app.finalize()
    for task_id in ("t-1", "t-2"):
        execute_as_worker(app, charge.name, task_id, idempotency_key="k", idempotency_running=True)
    assert runs == [1], f"body ran {len(runs)} times for one key"
