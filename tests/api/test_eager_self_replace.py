"""Eager self-replacement (``return self.replace(self.s(n - 1))``) runs as in plain Celery: the
in-body recursion mark (same task name and id) must not take the inline replacement for a direct
call of the task from its body."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task
from celery.result import allow_join_result

from celery_idem import Idempotency, IdempotentTask, MemoryStore


def _app(idem: bool) -> tuple[Any, list[Any]]:
    app = Celery("a4-replace", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.task_always_eager = True
    if idem:
        Idempotency(app, store=MemoryStore())
    seen: list[Any] = []

    @app.task(bind=True, base=IdempotentTask if idem else Task, shared=False)
    def countdown(self: Any, n: int) -> str:
        seen.append((n, self.request.id, self.request.is_eager))
        if n == 0:
            return "done"
        with allow_join_result():  # Celery's own eager replace calls .get() inside the task
            return self.replace(self.s(n - 1))

    app.finalize()
    return countdown, seen


def test_plain_celery_reference() -> None:
    countdown, seen = _app(idem=False)
    assert countdown.delay(2).get() == "done"
    assert all(eager for _, _, eager in seen) and len({i for _, i, _ in seen}) == 1


def test_idempotent_eager_self_replace() -> None:
    countdown, seen = _app(idem=True)
    result = countdown.delay(2)
    print(seen)
    assert all(eager for _, _, eager in seen), f"an inner replacement body saw a non-eager/blank request: {seen}"
    assert result.get() == "done"
