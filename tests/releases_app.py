"""One task, ``deploy.charge``, as each release of an app declares it: the deploys of
tests/worker/test_deploys.py publish with one release and run on a worker of another.

``make_app(release=...)`` builds the producer's app in the test; a ``celery -A releases_app worker``
subprocess builds ``app`` from the SHOP_* variables of tests/workers.py plus RELEASE. Every execution
of the body is an INCR on the counter Redis under the call's idempotency key, never read from the
library's records.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery
from shop import COUNTER_URL, effects_key

from celery_idem import Idempotency, IdempotentTask

NAME = "deploy.charge"


def _v1(self: Any, order_id: int, amount: int) -> dict[str, Any]:
    return _charged(self, order_id, amount)


def _optional_added(self: Any, order_id: int, amount: int, currency: str = "EUR") -> dict[str, Any]:
    return _charged(self, order_id, amount, currency)


def _default_changed(self: Any, order_id: int, amount: int, currency: str = "USD") -> dict[str, Any]:
    return _charged(self, order_id, amount, currency)


def _note_added(self: Any, order_id: int, amount: int, currency: str = "EUR", note: str = "") -> dict[str, Any]:
    return _charged(self, order_id, amount, currency)


def _renamed(self: Any, order_id: int, total: int) -> dict[str, Any]:
    return _charged(self, order_id, total)


def _removed(self: Any, order_id: int) -> dict[str, Any]:
    return _charged(self, order_id, 0)


def _required_added(self: Any, order_id: int, amount: int, currency: str) -> dict[str, Any]:
    return _charged(self, order_id, amount, currency)


#: Each release of ``deploy.charge``: v1, and what a later release may have made of it.
RELEASES = {
    "v1": _v1,
    "optional_added": _optional_added,
    "default_changed": _default_changed,
    "note_added": _note_added,
    "renamed": _renamed,
    "removed": _removed,
    "required_added": _required_added,
}


def _charged(task: Any, order_id: int, amount: int, currency: str = "EUR") -> dict[str, Any]:
    counter = redis.Redis.from_url(COUNTER_URL)
    counter.incr(effects_key(task.app.conf.deploy_prefix, NAME, task.request.idempotency_key))
    return {"order": order_id, "charged": amount, "currency": currency, "release": task.app.conf.deploy_release}


def make_app(*, release: str, broker: str, backend: str, store: str, prefix: str, **settings: Any) -> Celery:
    app = Celery("releases", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=prefix,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        deploy_prefix=prefix,
        deploy_release=release,
    )
    Idempotency(app, store=store, key_prefix=prefix, **settings)
    app.task(shared=False, base=IdempotentTask, bind=True, name=NAME)(RELEASES[release])
    return app


if os.environ.get("RELEASE"):
    app = make_app(
        release=os.environ["RELEASE"],
        broker=os.environ["SHOP_BROKER"],
        backend=os.environ["SHOP_BACKEND"],
        store=os.environ["SHOP_STORE"],
        prefix=os.environ["SHOP_PREFIX"],
        **json.loads(os.environ.get("SHOP_SETTINGS") or "{}"),
    )
