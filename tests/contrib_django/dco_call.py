"""A producer of the django-celery-outbox interop project, in a process of its own: each call of
``argv[1]`` (JSON: ``[{"key": ..., "order": ..., "rollback": bool, "by_name": bool}, ...]``) is made
as a view makes it, ``dco.ship.apply_async((order,), idempotency_key=key)`` (with ``by_name``:
``app.send_task("dco.ship", (order,), idempotency_key=key)``) inside ``transaction.atomic()``, which
raises at its end when ``rollback`` is set. Prints, per call, JSON of what the caller got back, what
the outbox held inside and after the transaction, and celery-idem's record of the key afterwards.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from contrib_django.dco_app import app, ship  # sets Django up first
from django.db import transaction
from django_celery_outbox.models import CeleryOutbox

from celery_idem import Idempotency


class RolledBack(Exception):
    pass


def call(key: str, order: int, rollback: bool, by_name: bool) -> dict[str, Any]:
    staged = None
    try:
        with transaction.atomic():
            if by_name:  # sent by name, the key an option: no claim at the call, none of the task's code
                handle = app.send_task("dco.ship", (order,), idempotency_key=key)
            else:
                handle = ship.apply_async((order,), idempotency_key=key)
            staged = CeleryOutbox.objects.filter(task_id=handle.id).count()
            if rollback:
                raise RolledBack
    except RolledBack:
        pass
    record = Idempotency.of(app).get(ship, key)
    return {
        "task_id": handle.id,
        "deduplicated": getattr(handle, "deduplicated", None),
        "staged": staged,
        "outbox": list(CeleryOutbox.objects.values_list("task_id", flat=True)),
        "record": None if record is None else {"state": record.state.value, "task_id": record.task_id},
    }


calls = json.loads(sys.argv[1])
print(json.dumps([call(c["key"], c["order"], c.get("rollback", False), c.get("by_name", False)) for c in calls]))
