"""The Celery app of the django-celery-outbox interop project: an ``OutboxCelery`` (its
``send_task`` writes a ``celery_outbox`` row in the caller's transaction) with celery-idem installed,
for the child processes of tests/contrib_django/test_django_celery_outbox.py: the producer
(``dco_call.py``), the relay (``dco_relay.py``) and ``celery -A contrib_django.dco_app worker``
(tests/workers.py's ``SHOP_*`` variables; ``DCO_COUNTER`` is the Redis the counts go to).

Everything is counted in Redis, outside the library: each delivery of a message to the worker, with
the ``idempotency_key`` header it carried (``task_received``, in the worker's main process); each
message the pool finished (``task_postrun``); and each run of the body, the effect.
"""

from __future__ import annotations

import json
import os
from typing import Any

import django
from django.conf import settings

if not settings.configured:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "contrib_django.dco_settings")
    django.setup()

import redis  # noqa: E402
from celery import signals  # noqa: E402
from django_celery_outbox import OutboxCelery  # noqa: E402

from celery_idem import Idempotency, IdempotentTask  # noqa: E402

PREFIX = os.environ["SHOP_PREFIX"]
counter = redis.Redis.from_url(os.environ["DCO_COUNTER"])


def counted(name: str) -> str:
    """The Redis key of one count of this project (``effect:<order>``, ``deliveries``, ``finished``)."""
    return f"dco:{PREFIX}:{name}"


app = OutboxCelery("dco", set_as_current=True)
app.conf.update(
    broker_url=os.environ["SHOP_BROKER"],
    task_default_queue=os.environ.get("SHOP_QUEUE", PREFIX),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
Idempotency(app, store=os.environ["SHOP_STORE"], key_prefix=PREFIX)


@app.task(base=IdempotentTask, bind=True, name="dco.ship")
def ship(self: Any, order_id: int) -> int:
    counter.incr(counted(f"effect:{order_id}"))
    return order_id


@signals.task_received.connect
def _delivered(request: Any = None, **_: Any) -> None:
    headers = request.request_dict
    delivery = {"task_id": request.id, "idempotency_key": headers.get("idempotency_key")}
    counter.rpush(counted("deliveries"), json.dumps(delivery))


@signals.task_postrun.connect
def _finished(task_id: str | None = None, **_: Any) -> None:
    counter.rpush(counted("finished"), str(task_id))
