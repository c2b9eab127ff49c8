"""The callbacks ``self.replace()`` links to a replacement, so the replaced task's record follows it.

Celery's replace publishes the replacement under the replaced task's own id and ends the replaced
attempt with ``Ignore``. The handler keeps that attempt's record IN_PROGRESS under its owner token
(a claim is handed the id, whose result is the replacement's) and links these two tasks to the
replacement; they settle the record with its outcome, fenced by the token:

- ``celery_idem.replaced`` (link): the replacement returned -> COMPLETED with its value;
- ``celery_idem.replaced_failed`` (link_error, called in the failing worker): FAILED when the
  replaced task's policy classes the error permanent, else released.

Should neither ever run (the replacement revoked or lost), the record's lease runs out and the
reconciler settles it from the result backend under the same id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery import Task

from .protocol import REPLACED_FAILED_TASK, REPLACED_TASK
from .records import Identity

if TYPE_CHECKING:
    from .extension import Idempotency

__all__ = ["install", "replaced", "replaced_failed"]


def _settle(app: Any, task_name: str, scope: str, key: str, owner: str, value: Any = None, exc: Any = None) -> None:
    task = app.tasks.get(task_name)
    if task is None or not hasattr(task, "idempotency_handler"):
        return
    task.idempotency_handler.settle_replaced(Identity(scope, task_name, key), owner, value=value, exc=exc)


def replaced(self: Any, value: Any, *, task_name: str, scope: str, key: str, owner: str) -> None:
    """Link of the replacement: it returned, so the replaced task's record completes with its value."""
    _settle(self.app, task_name, scope, key, owner, value=value)


def replaced_failed(self: Any, request: Any, exc: Any, traceback: Any, *, task_name: str, scope: str, key: str,
                    owner: str) -> None:  # fmt: skip
    """Error link of the replacement: the replaced task's record takes its failure (classed as usual)."""
    if isinstance(exc, BaseException):  # else the reconciler settles it from the result backend
        _settle(self.app, task_name, scope, key, owner, exc=exc)


def install(idem: Idempotency) -> None:
    """Register the two callbacks on the app (every worker of the app then knows them).

    Module-level functions, so installing a second extension on the app registers the same callables
    again instead of new ones under the same names. Plain Tasks whatever the app's task_cls: an
    idempotent callback would be deduplicated by its arguments.
    """
    app = idem.app
    app.task(name=REPLACED_TASK, base=Task, bind=True, shared=False, ignore_result=True)(replaced)
    app.task(name=REPLACED_FAILED_TASK, base=Task, bind=True, shared=False, ignore_result=True)(replaced_failed)
