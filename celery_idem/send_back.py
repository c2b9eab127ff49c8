"""How a worker sends a message back to the broker to run later: the one sender of every countdown
the library sets (a store outage's backoff, a BUSY duplicate's next look, a kept replacement).

DESIGN §3, "Nothing lost": fail closed never means fail lost, on every broker and queue type.

- **A countdown every broker takes.** It is sent as :func:`~celery_idem.timing.broker_countdown`
  gives it: whole seconds, rounded up, at least one. RabbitMQ's native delayed delivery (quorum
  queues behind a topic exchange, the production layout) refuses anything else, and a refused
  send was a lost message.
- **A refused send loses nothing.** Should the broker still refuse the message with its countdown,
  the worker waits the countdown itself (at most 30 s), then sends the message without one (a
  plain publish to its queue: no delayed route involved). The message is not let go meanwhile: under early ack the
  worker holds its only copy, and under ``acks_late`` a bare requeue would come straight back with
  no backoff, into a quorum queue's delivery limit (20 on RabbitMQ 4.0+), which drops it. While the
  broker refuses even that, the worker keeps trying (the wait doubling up to 30 s) for ``patience``
  seconds (the task's ``pending_timeout_seconds``: as long as the call's claim waits for a
  message), never more than :data:`LONGEST_HOLD_SECONDS`: a warm shutdown waits for the pool
  slot that holds it, and an orchestrator's grace (Kubernetes' 30 s) must outlast that; then,
  under ``acks_late``, it rejects the message with requeue (the broker still holds
  it), and under early ack it logs the message as lost and raises the broker's error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Task as CeleryTask
from celery.exceptions import Reject

from .timing import broker_countdown

__all__ = ["LONGEST_HOLD_SECONDS", "send_back"]

logger = logging.getLogger("celery_idem.send_back")

_LONGEST_PAUSE = 30.0  # seconds between two tries of a send the broker refuses
#: The longest a worker holds a message the broker refuses (a warm shutdown waits for it).
LONGEST_HOLD_SECONDS = 25.0


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
        Reject: with ``acks_late``, the broker refused the message for ``patience`` seconds; it is
            requeued (the broker keeps it).
        Exception: under early ack, the broker's own error after ``patience`` seconds of refusals.
    """
    request, delay = task.request, broker_countdown(countdown)
    # The worker's own wait, should the broker refuse the countdown: at most the longest outage trip
    # (a BUSY look or an outage try that comes back sooner than asked only looks again).
    pause = min(float(delay), _LONGEST_PAUSE)
    options = task.signature_from_request(request, args, kwargs, countdown=delay).options
    options["headers"] = {**(options.get("headers") or {}), **(headers or {})}
    options["retries"] = request.retries
    try:
        CeleryTask.apply_async(task, args, kwargs, **options)
        return
    except Exception as exc:
        logger.error(
            "could not send task %s (%s) back to the broker with a %ds countdown: %s; "
            "the worker waits %gs and sends it without one",
            task.name,
            request.id,
            delay,
            exc,
            pause,
        )
    options.pop("countdown", None)
    options.pop("eta", None)
    patience = min(patience, LONGEST_HOLD_SECONDS)
    pause = min(pause, patience)
    deadline = time.monotonic() + patience
    while True:
        time.sleep(pause)
        try:
            CeleryTask.apply_async(task, args, kwargs, **options)
        except Exception as exc:
            pause = min(2 * pause, _LONGEST_PAUSE)
            if time.monotonic() + pause < deadline:
                logger.error(
                    "could not send task %s (%s) back to the broker: %s; the worker keeps it and tries again in %gs",
                    task.name,
                    request.id,
                    exc,
                    pause,
                )
                continue
            if task.acks_late:
                logger.error(
                    "could not send task %s (%s) back to the broker for %gs: %s; rejected with requeue, "
                    "the broker keeps it",
                    task.name,
                    request.id,
                    patience,
                    exc,
                )
                raise Reject(exc, requeue=True) from exc
            logger.critical(
                "could not send task %s (%s) back to the broker for %gs: %s; it was acknowledged on "
                "receipt (early ack), so the call is LOST: make it again with its key",
                task.name,
                request.id,
                patience,
                exc,
            )
            raise
        logger.warning(
            "task %s (%s) sent back to the broker without a countdown, after the worker waited for it",
            task.name,
            request.id,
        )
        return
