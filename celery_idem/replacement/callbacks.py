"""The two callbacks a replacement by another call is linked to: they settle the replaced task's
record with the replacement's outcome, fenced by the handover token (:mod:`celery_idem.replacement`)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from celery import Task, current_task

from .. import telemetry
from ..errors import SerializationError
from ..protocol import REPLACED_FAILED_TASK, REPLACED_TASK
from ..records import Identity

if TYPE_CHECKING:
    from ..runtime import Runtime

__all__ = ["install", "replaced", "replaced_failed"]

logger = logging.getLogger("celery_idem.replacement")


def _settle(app: Any, task_name: str, scope: str, key: str, owner: str, value: Any = None, exc: Any = None) -> None:
    task = app.tasks.get(task_name)
    if task is None or not hasattr(task, "idempotency_handler"):
        return
    handler, identity = task.idempotency_handler, Identity(scope, task_name, key)
    if exc is not None:
        handler.settle.settle_failure(identity, owner, exc, step=handler.settle.failure_step(exc))
        return
    with contextlib.suppress(SerializationError):  # stored as the record's permanent failure
        handler.settle.store_value(identity, owner, "(replacement)", value)


def replaced(self: Any, value: Any, *, task_name: str, scope: str, key: str, owner: str) -> None:
    """Link of the replacement: it returned, so the replaced task's record completes with its value."""
    _settle(self.app, task_name, scope, key, owner, value=value)


def replaced_failed(
    request: Any, exc: Any, traceback: Any, *, task_name: str, scope: str, key: str, owner: str
) -> None:
    """Error link of the replacement: the replaced task's record takes its failure (classed as usual).

    Not bound: Celery calls an errback whose signature it reads as ``(request, exc, traceback)`` in
    the failing worker, and sends any other (a bound task's) as a new message with the task id only.
    Never raises: an errback's error would run the failing task's error handling again.
    """
    if not isinstance(exc, BaseException):  # else the reconciler settles it from the result backend
        return
    try:
        _settle(current_task.app, task_name, scope, key, owner, exc=exc)
    except Exception:  # noqa: BLE001 - the lease runs out and the reconciler settles it
        logger.exception(
            "could not settle the record of %s after its replacement failed",
            telemetry.shown(Identity(scope, task_name, key)),
        )


def install(idem: Runtime) -> None:
    """Register the two callbacks on the app (every worker of the app then knows them).

    Module-level functions, so installing a second extension on the app registers the same callables
    again instead of new ones under the same names. Plain Tasks whatever the app's task_cls: an
    idempotent callback would be deduplicated by its arguments.
    """
    app = idem.app
    app.task(name=REPLACED_TASK, base=Task, bind=True, shared=False, ignore_result=True)(replaced)
    app.task(name=REPLACED_FAILED_TASK, base=Task, shared=False, ignore_result=True)(replaced_failed)
