"""``IdempotentDjangoTask``: an idempotent task that is also Celery's ``DjangoTask``.

Every :class:`~celery_idem.IdempotentTask` already has ``delay_on_commit`` and
``apply_async_on_commit`` (the claim is made when the caller's transaction commits), so
``@shared_task(base=IdempotentTask)`` is all a Django project needs. This class is for code that
asks ``isinstance(task, DjangoTask)``: on Celery 5.4+ it is one (on 5.3, which has no
``DjangoTask``, it is an ``IdempotentTask``). Our methods come first in its MRO.
"""

from __future__ import annotations

from typing import Any

from ...task import IdempotentTask

try:
    from celery.contrib.django.task import DjangoTask as _DjangoTask

    _BASES: tuple[type[Any], ...] = (IdempotentTask, _DjangoTask)
except ImportError:  # Celery 5.3
    _BASES = (IdempotentTask,)

__all__ = ["IdempotentDjangoTask"]

IdempotentDjangoTask: type[IdempotentTask] = type("IdempotentDjangoTask", _BASES, {"__module__": __name__})
