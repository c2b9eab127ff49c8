"""Worker events for what celery-idem decided about a message (Flower and ``celery events`` show
them): ``task-replayed`` when a message was answered with its key's stored outcome instead of
running, ``task-deduplicated`` when it found its key's attempt running (it waits for that outcome,
or goes back to the broker), ``task-mismatched`` when its key belongs to other arguments.

Sent only when the worker sends task events (``celery worker -E``, ``worker_send_task_events``),
best effort: an event that cannot be sent never fails the task. The fields name the task id that
holds the key (``original``), its state, the scope, and a hash of the key (``key_hash``), never
the key itself.
"""

from __future__ import annotations

import logging
from typing import Any

from .records import Decision, IdempotencyRecord, Identity
from .telemetry import key_hash

__all__ = ["EVENT_TYPES", "key_hash", "send_decision_event"]

logger = logging.getLogger("celery_idem.events")

EVENT_TYPES = {
    Decision.REPLAY: "task-replayed",
    Decision.BUSY: "task-deduplicated",
    Decision.MISMATCH: "task-mismatched",
}


def send_decision_event(task: Any, decision: Decision, identity: Identity, record: IdempotencyRecord) -> None:
    """The event of a message's ``decision``, if it has one and the worker sends task events."""
    event = EVENT_TYPES.get(decision)
    request = task.request
    if event is None or request.is_eager or not task.app.conf.worker_send_task_events:
        return
    try:
        task.send_event(
            event,
            retry=False,
            original=record.task_id,
            state=record.state.value,
            scope=identity.scope,
            key_hash=key_hash(identity),
        )
    except Exception:  # noqa: BLE001 - an event is never worth a task
        logger.debug("could not send %s for task %s", event, request.id, exc_info=True)
