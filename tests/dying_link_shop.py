"""A ``celery worker`` app (tests/workers.py, ``app="dying_link_shop"``): tests/shop.py's app, built from
the SHOP_* environment, with ``shop.linked`` (acks_late, requeued when its child is lost) and a child
that SIGKILLs itself while it sends an armed link: after the worker replayed the key's outcome for a
duplicate, before Celery has sent the duplicate's link (so before ``task_postrun``).

A link ``shop.noted.si(task_id, tag)`` is armed by ``counter.set(armed(prefix, tag), 1)``; the first
child that sends it takes the arm (DEL) and dies, so the redelivered message may send it. Armed by
``counter.set(held(prefix, tag), 1)`` instead, the sender says so (``holding(prefix, tag)``) and waits
for ``go(prefix, tag)`` before it dies (with the threads pool: the whole worker). ``shop.noted_once``
is a link whose send fails once as the broker's would (kombu's OperationalError) when armed by
``counter.set(refused(prefix, tag), 1)``. Armed by ``counter.set(stalled(prefix, tag), 1)``, the
sender says so (``holding``) and waits for ``go`` before it sends the link (a publish the broker
holds up, as RabbitMQ does under a resource alarm); ``shop.linked_brief`` is ``shop.linked`` with a 1 s lease.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import redis
from celery import signals
from kombu.exceptions import OperationalError
from shop import COUNTER_URL, effects_key

from celery_idem import IdempotentTask


def armed(prefix: str, tag: str) -> str:
    return f"dying-link:{prefix}:{tag}"


def held(prefix: str, tag: str) -> str:
    return f"dying-link:{prefix}:{tag}:held"


def holding(prefix: str, tag: str) -> str:
    return f"dying-link:{prefix}:{tag}:holding"


def go(prefix: str, tag: str) -> str:
    return f"dying-link:{prefix}:{tag}:go"


def stalled(prefix: str, tag: str) -> str:
    return f"dying-link:{prefix}:{tag}:stalled"


def refused(prefix: str, tag: str) -> str:
    return f"dying-link:{prefix}:{tag}:refused"


def add_linked(app: Any, prefix: str) -> Any:
    """``shop.linked`` on ``app``: counts its body, takes a link; acks_late, requeued on a lost child."""
    counter = redis.Redis.from_url(COUNTER_URL)

    @app.task(
        base=IdempotentTask,
        bind=True,
        shared=False,
        name="shop.linked",
        acks_late=True,
        reject_on_worker_lost=True,
        idempotency={"lease_seconds": 10},
    )
    def linked(self: Any, order_id: int) -> dict[str, Any]:
        counter.incr(effects_key(prefix, "shop.linked", self.request.idempotency_key))
        return {"order": str(order_id), "charged": 1}

    class RefusedOnce(app.Task):  # type: ignore[name-defined,misc]
        def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
            if args and counter.delete(refused(prefix, str(args[-1]))):
                raise OperationalError("the broker refused the message (injected)")
            return super().apply_async(args, kwargs, **options)

    @app.task(base=RefusedOnce, shared=False, name="shop.noted_once")
    def noted_once(task_id: str, tag: str) -> None:
        counter.incr(effects_key(prefix, "shop.noted_once", tag))

    @app.task(base=IdempotentTask, bind=True, shared=False, name="shop.linked_brief", idempotency={"lease_seconds": 1})
    def linked_brief(self: Any, order_id: int) -> dict[str, Any]:
        counter.incr(effects_key(prefix, "shop.linked_brief", self.request.idempotency_key))
        return {"order": str(order_id), "charged": 1}

    return linked


if os.environ.get("SHOP_BROKER"):
    from shop import app

    _prefix = os.environ["SHOP_PREFIX"]
    _counter = redis.Redis.from_url(COUNTER_URL)
    add_linked(app, _prefix)

    @signals.before_task_publish.connect(weak=False)
    def _die_while_sending_an_armed_link(sender: Any = None, body: Any = None, **_: Any) -> None:
        if sender != "shop.noted" or not isinstance(body, (tuple, list)) or len(body[0]) < 2:
            return
        tag = str(body[0][1])
        if _counter.delete(held(_prefix, tag)):
            _counter.set(holding(_prefix, tag), 1)
            deadline = time.monotonic() + 60
            while not _counter.exists(go(_prefix, tag)) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        if _counter.delete(stalled(_prefix, tag)):
            _counter.set(holding(_prefix, tag), 1)
            deadline = time.monotonic() + 60
            while not _counter.exists(go(_prefix, tag)) and time.monotonic() < deadline:
                time.sleep(0.05)
        if _counter.delete(armed(_prefix, tag)):
            os.kill(os.getpid(), signal.SIGKILL)
