"""The Celery app of ``benchmarks/overhead.py``: one no-op task and one counting task per variant.

The benchmark imports this module to publish, and starts ``celery -A overhead_app worker`` (with
``benchmarks/`` on ``PYTHONPATH``) to consume. Every variant runs on the same broker, result
backend, queue and worker; only the task's base class differs:

- ``plain``: ``@app.task``;
- ``idem``, ``idem_keyless``: ``@app.task(base=IdempotentTask)`` (celery-idem, store on db 9; the
  two variants differ only in how the benchmark calls them: with or without ``idempotency_key``);
- ``once``: ``@app.task(base=QueueOnce)`` (celery-once, its Redis backend on db 8);
- ``singleton``: ``@app.task(base=Singleton)`` (celery-singleton, its Redis backend on db 7).

The ``count_*`` tasks INCR a counter on db 6 per execution of their body (the side effect the
duplicate-heavy workload counts); the ``noop_*`` tasks do nothing.

Redis databases (``CELERY_IDEM_BENCH_REDIS``, default ``redis://127.0.0.1:6379``): 6 counters,
7 celery-singleton, 8 celery-once, 9 celery-idem, 10 broker, 11 result backend.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery, Task

from celery_idem import Idempotency, IdempotentTask

REDIS = os.environ.get("CELERY_IDEM_BENCH_REDIS", "redis://127.0.0.1:6379").rstrip("/")
DB_COUNTER, DB_SINGLETON, DB_ONCE, DB_IDEM, DB_BROKER, DB_BACKEND = 6, 7, 8, 9, 10, 11
DBS = (DB_COUNTER, DB_SINGLETON, DB_ONCE, DB_IDEM, DB_BROKER, DB_BACKEND)
# Only this benchmark uses these; the broker and backend databases may be shared with other clients
# (tests/test_demo.py uses 10 and 11 too), so the benchmark never flushes those two.
OWN_DBS = (DB_COUNTER, DB_SINGLETON, DB_ONCE, DB_IDEM)
QUEUE = "celery-idem-overhead"
HELD_QUEUE = "celery-idem-overhead-held"  # no worker consumes it: the latency phase's originals wait there
VARIANTS = ("plain", "idem", "idem_keyless", "once", "singleton")
STORE_DB = {"idem": DB_IDEM, "idem_keyless": DB_IDEM, "once": DB_ONCE, "singleton": DB_SINGLETON}


def url(db: int) -> str:
    return f"{REDIS}/{db}"


def counter_key(variant: str) -> str:
    return f"executions:{variant}"


app = Celery("overhead_app", broker=url(DB_BROKER), backend=url(DB_BACKEND), set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    # celery-once, configured as its README says.
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": url(DB_ONCE), "default_timeout": 3600}},
    # celery-singleton, configured as its README says.
    singleton_backend_url=url(DB_SINGLETON),
)
Idempotency(app, store=url(DB_IDEM))

MISSING: dict[str, str] = {}
_counter: redis.Redis | None = None


def _count(variant: str) -> None:
    global _counter
    if _counter is None:
        _counter = redis.Redis.from_url(url(DB_COUNTER))
    _counter.incr(counter_key(variant))


def _bases() -> dict[str, type[Task]]:
    """The base class of each variant; a peer that is not installed is left out (and reported)."""
    bases: dict[str, type[Task]] = {"plain": app.Task, "idem": IdempotentTask, "idem_keyless": IdempotentTask}
    try:
        from celery_once import QueueOnce

        bases["once"] = QueueOnce
    except ImportError as exc:
        MISSING["once"] = f"celery-once is not importable: {exc}"
    try:
        from celery_singleton import Singleton

        bases["singleton"] = Singleton
    except ImportError as exc:
        MISSING["singleton"] = f"celery-singleton is not importable: {exc}"
    return bases


def _define(variant: str, base: type[Task]) -> tuple[Any, Any]:
    @app.task(name=f"overhead.noop_{variant}", base=base, shared=False)
    def noop(x: int) -> None:
        return None

    @app.task(name=f"overhead.count_{variant}", base=base, shared=False)
    def count(x: int) -> None:
        _count(variant)

    return noop, count


TASKS: dict[str, tuple[Any, Any]] = {variant: _define(variant, base) for variant, base in _bases().items()}
