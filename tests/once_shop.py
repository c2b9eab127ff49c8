"""celery-once's QueueOnce and celery_idem.compat.once's, each on an app declared exactly as a
celery-once app (``app.conf.ONCE``, ``once={...}``): tests/compat/test_once.py runs every scenario
on both. ``celery -A once_shop worker`` runs the variant ``ONCE_VARIANT`` under ``SHOP_PREFIX``.

Bodies count their runs outside both libraries (an INCR), flag two runs of one order at once, and
keep the pid of the process that runs them (for a test to kill it).
"""

from __future__ import annotations

import os
import time
from typing import Any

import celery_once
import redis
from addresses import REDIS_URL
from celery import Celery
from shop import COUNTER_URL
from shop_worker import BACKEND, BROKERS

from celery_idem.compat import once as adapter

VARIANTS = {"celery_once": celery_once, "adapter": adapter}
ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": REDIS_URL, "default_timeout": 3600}}


class Declined(Exception):
    """A run that fails."""


def once_app(variant: str, prefix: str, lease_seconds: float | None = None) -> Celery:
    """One app per variant, declared exactly as a celery-once app: only ``QueueOnce`` differs."""
    queue_once = VARIANTS[variant].QueueOnce
    app = Celery(prefix, broker=BROKERS["redis"], backend=BACKEND, set_as_current=False)
    app.conf.update(
        ONCE=ONCE,
        task_default_queue=prefix,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    if lease_seconds is not None:  # celery-idem's own setting (celery-once has none): a crash test's
        app.conf.idempotency_lease_seconds = lease_seconds
    counter = redis.Redis.from_url(COUNTER_URL)

    def effect(order: str, hold: float = 0.0, fail: bool = False) -> int:
        n = int(counter.incr(f"{prefix}:runs:{order}"))
        counter.set(f"{prefix}:pid:{order}", os.getpid())
        running = counter.incr(f"{prefix}:running:{order}")
        counter.set(f"{prefix}:overlap:{order}", 1) if running > 1 else None
        try:
            time.sleep(hold)
        finally:
            counter.decr(f"{prefix}:running:{order}")
        if fail:
            raise Declined(f"run {n} declined")
        return n

    def task(name: str, **options: Any) -> Any:
        return app.task(shared=False, base=queue_once, name=f"{prefix}.{name}", **options)

    task("hold")(effect)
    task("graceful", once={"graceful": True})(effect)
    task("short", once={"timeout": 2})(effect)

    @task("keyed", once={"keys": ["order"]})
    def keyed(order: str, note: str, hold: float = 0.0) -> int:
        return effect(order, hold)

    @task("whole", once={"keys": []})
    def whole(order: str, hold: float = 0.0) -> int:
        return effect("whole", hold)

    @task("retried", bind=True)
    def retried(self: Any, order: str, step: int = 0, move: bool = False) -> int:
        if self.request.retries == 0:
            # celery-once keys the retry by its own arguments: move=True retries with others
            raise self.retry(kwargs={"order": order, "step": 1, "move": move} if move else None, countdown=1)
        return effect(order)

    return app


_lease = os.environ.get("ONCE_LEASE_SECONDS")
app = once_app(
    os.environ.get("ONCE_VARIANT", "adapter"), os.environ.get("SHOP_PREFIX", "once"), float(_lease) if _lease else None
)
