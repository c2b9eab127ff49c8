"""The example project's own Celery app (``examples/django_shop``, ``django_shop.celery``) for a
``celery -A contrib_django.counted_shop worker`` subprocess, with each run of its charge's body
counted in Redis, outside the library: the body's call of ``ledger.run_once`` is counted (the
effect inside it is the ledger's to keep once; this counts the runs themselves).

The example reads its settings from the environment (``DJANGO_SHOP_*``: its database, broker,
queue, store and key prefix); the counter's keys are ``<key prefix>:body:<order id>``.
"""

from __future__ import annotations

import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_shop.settings")
django.setup()

import redis  # noqa: E402
from addresses import REDIS_COUNTER_URL  # noqa: E402
from django_shop.celery import app, ledger  # noqa: E402

__all__ = ["app"]

_counter = redis.Redis.from_url(REDIS_COUNTER_URL)
_prefix = os.environ.get("DJANGO_SHOP_KEY_PREFIX", "django-shop")
_run_once = ledger.run_once


def _counted(task: Any, fn: Any) -> Any:
    _counter.incr(f"{_prefix}:body:{task.request.args[0]}")
    return _run_once(task, fn)


ledger.run_once = _counted  # type: ignore[method-assign]
