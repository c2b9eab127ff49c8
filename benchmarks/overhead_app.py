"""The Celery app of ``benchmarks/overhead.py``: one no-op task and one counting task per variant.

The benchmark imports this module to publish, and starts ``celery -A overhead_app worker`` (with
``benchmarks/`` on ``PYTHONPATH``) to consume. Every variant runs on the same broker, result
backend, queue and worker; only the task's base class, its task options and how the benchmark
calls it differ. :data:`VARIANTS` is the table of them: one line per variant.

The ``count_*`` tasks INCR a counter on db 6 per execution of their body (the side effect the
duplicate-heavy workload counts); the ``noop_*`` tasks do nothing. ``overhead.sentinel`` is a plain
no-op task with a result, published after each batch: it tells when a batch of a variant that
keeps no result (``ignore_result=True``) has run.

The servers come from the environment, which overhead.py sets before it imports this module and
hands on to the worker:

- ``CELERY_IDEM_BENCH_REDIS`` (default ``redis://127.0.0.1:6379``): databases 6 counters,
  7 celery-singleton, 8 celery-once, 9 celery-idem, 10 broker, 11 result backend;
- ``CELERY_IDEM_BENCH_STORE``: celery-idem's store, a SQL URL (``postgresql+psycopg://...``), with
  ``CELERY_IDEM_BENCH_TABLE`` the records table of the run; unset: Redis db 9.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery, Task

from celery_idem import Idempotency, IdempotentTask, store_from_url

REDIS = os.environ.get("CELERY_IDEM_BENCH_REDIS", "redis://127.0.0.1:6379").rstrip("/")
SQL_STORE = os.environ.get("CELERY_IDEM_BENCH_STORE", "")
SQL_TABLE = os.environ.get("CELERY_IDEM_BENCH_TABLE", "celery_idem_overhead")
DB_COUNTER, DB_SINGLETON, DB_ONCE, DB_IDEM, DB_BROKER, DB_BACKEND = 6, 7, 8, 9, 10, 11
DBS = (DB_COUNTER, DB_SINGLETON, DB_ONCE, DB_IDEM, DB_BROKER, DB_BACKEND)
# Only this benchmark uses these; the broker and backend databases may be shared with other clients
# (tests/test_demo.py uses 10 and 11 too), so the benchmark never flushes those two.
OWN_DBS = (DB_COUNTER, DB_SINGLETON, DB_ONCE, DB_IDEM)
QUEUE = "celery-idem-overhead"
HELD_QUEUE = "celery-idem-overhead-held"  # no worker consumes it: the latency phase's originals wait there
SENTINEL = "overhead.sentinel"


@dataclass(frozen=True)
class Variant:
    """One way of running the same no-op task.

    ``library``: whose base class the task has (``celery``, ``idem``, ``once``, ``singleton``);
    ``keyed``: the benchmark passes ``idempotency_key`` (celery-idem only); ``options``: task
    options given to ``@app.task`` (``ignore_result``, a celery-idem ``idempotency`` policy, ...).
    """

    name: str
    label: str
    library: str
    keyed: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def stores_result(self) -> bool:
        """Whether a run of it writes its result to the result backend (what the benchmark polls)."""
        one_write = self.options.get("idempotency", {}).get("results") == "store"
        return not (self.options.get("ignore_result", False) or one_write)


VARIANTS = (
    Variant("plain", "plain Celery (`@app.task`)", "celery"),
    Variant("plain_noresult", "plain Celery, `ignore_result=True`", "celery", options={"ignore_result": True}),
    Variant("idem", "IdempotentTask, `idempotency_key`", "idem", keyed=True),
    Variant("idem_keyless", "IdempotentTask, key-less (argument fingerprint)", "idem"),
    Variant("once", "celery-once `QueueOnce`", "once"),
    Variant("singleton", "celery-singleton `Singleton`", "singleton"),
    Variant(
        "idem_store",
        'IdempotentTask, `idempotency_key`, `results="store"`',
        "idem",
        keyed=True,
        options={"idempotency": {"results": "store"}},
    ),
    Variant(
        "idem_store_keyless",
        'IdempotentTask, key-less, `results="store"`',
        "idem",
        options={"idempotency": {"results": "store"}},
    ),
)
BY_NAME = {v.name: v for v in VARIANTS}
NAMES = tuple(BY_NAME)
STORE_DB = {"once": DB_ONCE, "singleton": DB_SINGLETON, "idem": None if SQL_STORE else DB_IDEM}


def url(db: int) -> str:
    return f"{REDIS}/{db}"


def counter_key(variant: str) -> str:
    return f"executions:{variant}"


def store_db(variant: Variant) -> int | None:
    """The Redis database of the variant's own store (None: no store, or a SQL one)."""
    return STORE_DB.get(variant.library)


def idem_store() -> Any:
    """celery-idem's store: Redis db 9, or the SQL URL of the run with a records table of its own
    (the shared ``celery_idem_records`` is the test suites'; the run drops its table at the end)."""
    if not SQL_STORE:
        return url(DB_IDEM)
    return store_from_url(
        SQL_STORE, table_name=SQL_TABLE, liveness_table_name=f"{SQL_TABLE}_liveness", key_prefix="overhead"
    )


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
IDEM_STORE = idem_store()
Idempotency(app, store=IDEM_STORE, key_prefix="overhead" if SQL_STORE else "idem")

_UNAVAILABLE: dict[str, str] = {}  # library: why it is not importable
_counter: redis.Redis | None = None


def _count(variant: str) -> None:
    global _counter
    if _counter is None:
        _counter = redis.Redis.from_url(url(DB_COUNTER))
    _counter.incr(counter_key(variant))


def _bases() -> dict[str, type[Task]]:
    """The base class of each library; a peer that is not installed is left out (and reported)."""
    bases: dict[str, type[Task]] = {"celery": app.Task, "idem": IdempotentTask}
    try:
        from celery_once import QueueOnce

        bases["once"] = QueueOnce
    except ImportError as exc:
        _UNAVAILABLE["once"] = f"celery-once is not importable: {exc}"
    try:
        from celery_singleton import Singleton

        bases["singleton"] = Singleton
    except ImportError as exc:
        _UNAVAILABLE["singleton"] = f"celery-singleton is not importable: {exc}"
    return bases


def _define(variant: Variant, base: type[Task]) -> tuple[Any, Any]:
    @app.task(name=f"overhead.noop_{variant.name}", base=base, shared=False, **variant.options)
    def noop(x: int) -> None:
        return None

    @app.task(name=f"overhead.count_{variant.name}", base=base, shared=False, **variant.options)
    def count(x: int) -> None:
        _count(variant.name)

    return noop, count


@app.task(name=SENTINEL, shared=False)
def sentinel() -> None:
    return None


_BASES = _bases()
TASKS: dict[str, tuple[Any, Any]] = {v.name: _define(v, _BASES[v.library]) for v in VARIANTS if v.library in _BASES}
MISSING = {v.name: _UNAVAILABLE[v.library] for v in VARIANTS if v.library in _UNAVAILABLE}  # variant: why
