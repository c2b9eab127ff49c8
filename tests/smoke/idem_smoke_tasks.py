"""The task of tests/smoke's worker container. pytest-celery copies this file into the container
(``default_worker_tasks``) and the worker's app imports it; the test's process imports it too, so
that its own app (``celery_setup.app``) knows the task and claims its keys at publish.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import shared_task, signals

from celery_idem import Idempotency, IdempotentTask

# What the worker's app.py takes with its "from idem_smoke_tasks import *".
__all__ = ["CHARGE", "STORE_ENV", "charge", "effect_key", "install_on_the_worker"]

CHARGE = "idem_smoke.charge"
# The store's URL as the container reaches it: a database of the result backend's Redis container. The
# test's process opens the same database through the port Docker publishes.
STORE_ENV = "CELERY_IDEM_SMOKE_STORE"


def effect_key(order_id: int) -> str:
    """The counter the task's effect increments, in the store's Redis database."""
    return f"idem_smoke:charges:{order_id}"


@signals.worker_init.connect
def install_on_the_worker(sender: Any = None, **_: Any) -> None:
    """celery-idem on the worker container's app, over the store the test's process uses too."""
    url = os.environ.get(STORE_ENV)
    if url:  # in the container only: a worker started in the test's process is not this module's
        Idempotency(sender.app, store=url)


@shared_task(base=IdempotentTask, name=CHARGE, idempotency={"ttl_seconds": 600})
def charge(order_id: int, amount: int) -> dict[str, int]:
    redis.Redis.from_url(os.environ[STORE_ENV]).incr(effect_key(order_id))
    return {"order_id": order_id, "charged": amount}
