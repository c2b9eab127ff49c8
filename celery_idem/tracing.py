"""OpenTelemetry (the ``opentelemetry`` extra): what celery-idem decided, on the spans that
opentelemetry-instrumentation-celery already opens, and a span of its own for a publish it
suppressed (a duplicate never reaches ``before_task_publish``, where that instrumentation opens its
publish span, so it would leave no trace).

With opentelemetry-api installed, ``Idempotency(app)`` installs it; nothing else is needed beyond
the instrumentation and an SDK the application sets up. Every decision sets, on the current span:

- ``idempotency.outcome``: ``NEW``, ``DUPLICATE``, ``REPLAY``, ``MISMATCH`` (a call), ``RUN``,
  ``BUSY``, ``REPLAY``, ``MISMATCH`` (a message);
- ``idempotency.side``: ``publish`` or ``worker``;
- ``idempotency.scope``, and ``idempotency.key_hash``: a hash of the key (with its scope and task),
  the one worker events carry;
- ``idempotency.key``: the key itself, only after :func:`celery_idem.telemetry.configure`
  ``(plain_keys=True)`` (keys can carry personal data; logs follow the same switch);
- ``idempotency.original_task_id``: the task id that holds the key, when it is another.

A call answered without publishing (``DUPLICATE``, ``REPLAY``, ``MISMATCH``) also gets a span of its
own, ``celery_idem.suppressed <task>``, child of the caller's, with the same attributes.
"""

from __future__ import annotations

import threading
from typing import Any

from . import telemetry
from .records import IdempotencyRecord, Identity

__all__ = ["configure", "install"]

SUPPRESSED = frozenset({"DUPLICATE", "REPLAY", "MISMATCH"})
_LOCK = threading.Lock()
_installed = False


def configure(*, plain_keys: bool = False) -> None:
    """Whether spans (and log lines) carry the plain key besides its hash: one switch for both,
    :func:`celery_idem.telemetry.configure`."""
    telemetry.configure(plain_keys=plain_keys)


def install() -> bool:
    """Put decisions on spans, once per process (``Idempotency(app)`` calls this); False without
    opentelemetry-api."""
    global _installed
    with _LOCK:
        if not _installed:
            try:
                from opentelemetry import trace  # noqa: F401
            except ImportError:
                return False
            telemetry.add_witness(_witness)
            _installed = True
        return True


def _attributes(identity: Identity, side: str, decision: str, task_id: str, record: IdempotencyRecord) -> Any:
    attributes: dict[str, str] = {
        "idempotency.outcome": decision,
        "idempotency.side": side,
        "idempotency.scope": identity.scope,
        "idempotency.key_hash": telemetry.key_hash(identity),
    }
    if telemetry.plain_keys():
        attributes["idempotency.key"] = identity.key
    if record.task_id != task_id:
        attributes["idempotency.original_task_id"] = record.task_id
    return attributes


def _witness(identity: Identity, side: str, decision: str, task_id: str, record: IdempotencyRecord) -> None:
    from opentelemetry import trace

    attributes = _attributes(identity, side, decision, task_id, record)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)
    if side == "publish" and decision in SUPPRESSED:
        tracer = trace.get_tracer("celery_idem")
        with tracer.start_as_current_span(
            f"celery_idem.suppressed {identity.task_name}",
            kind=trace.SpanKind.PRODUCER,
            attributes={**attributes, "celery.task_name": identity.task_name, "celery.task_id": task_id},
        ):
            pass
