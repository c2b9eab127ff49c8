"""The message protocol: the headers celery-idem adds to a task message, and the names of its
internal tasks. Small and import-free, so the signal hooks, the ledger and the reconciler read a
message without importing the state machine."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BYPASS_HEADER",
    "KEY_HEADER",
    "OUTAGE_HEADER",
    "REPLACED_FAILED_TASK",
    "REPLACED_TASK",
    "SCOPE_HEADER",
    "request_header",
]

KEY_HEADER, SCOPE_HEADER, BYPASS_HEADER = "idempotency_key", "idempotency_scope", "idempotency"
OUTAGE_HEADER = "idempotency_store_waits"  # how often this message went back for a store outage
# The callbacks self.replace() links to the replacement (registered by celery_idem.replacement).
REPLACED_TASK, REPLACED_FAILED_TASK = "celery_idem.replaced", "celery_idem.replaced_failed"


def request_header(request: Any, name: str) -> Any:
    """A message header as a task request holds it: in ``headers`` (eager mode, and on workers),
    or as an attribute (workers merge message headers into the request)."""
    return (request.headers or {}).get(name, getattr(request, name, None))
