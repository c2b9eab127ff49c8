"""How a worker sends a message back to the broker to run later: the one sender of every countdown
the library sets (a store outage's backoff, a BUSY duplicate's next look, a kept replacement).

DESIGN §3, "Nothing lost": fail closed never means fail lost, on every broker and queue type.

- **A countdown every broker takes.** It is sent as :func:`~celery_idem.timing.broker_countdown`
  gives it: whole seconds, rounded up, at least one. RabbitMQ's native delayed delivery (quorum
  queues behind a topic exchange, the production layout) refuses anything else, and a refused
  send was a lost message.
- A send the broker refuses raises ``Reject(requeue=True)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Task as CeleryTask
from celery.exceptions import Reject

from .timing import broker_countdown

__all__ = ["send_back"]

logger = logging.getLogger("celery_idem.send_back")


def send_back(
    task: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    countdown: float,
    headers: Mapping[str, Any] | None = None,
    patience: float,
) -> None:
    """Send the message ``task`` runs again (same id, options and retries count), ``countdown``
    seconds from now (whole seconds, rounded up), with ``headers`` added, through Celery's own
    apply_async: a re-publish is never claimed again.

    Raises:
        Reject: the broker refused the re-publish too; with ``acks_late`` the message is requeued.
    """
    request, delay = task.request, broker_countdown(countdown)
    options = task.signature_from_request(request, args, kwargs, countdown=delay).options
    options["headers"] = {**(options.get("headers") or {}), **(headers or {})}
    options["retries"] = request.retries
    try:
        CeleryTask.apply_async(task, args, kwargs, **options)
    except Exception as exc:
        logger.error("could not send task %s (%s) back to the broker: %s; rejecting it", task.name, request.id, exc)
        raise Reject(exc, requeue=True) from exc
