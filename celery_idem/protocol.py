"""The message protocol: the headers celery-idem adds to a task message, and the names of its
internal tasks. Small and import-free, so the signal hooks, the ledger and the reconciler read a
message without importing the state machine. What the library keeps about a running attempt is
never a header or a request attribute (celery_idem.attempts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "BUSY_TRIPS_HEADER",
    "BYPASS_HEADER",
    "CLAIM_HEADER",
    "HANDOVER_HEADER",
    "KEY_HEADER",
    "OPTION_HEADERS",
    "OUTAGE_HEADER",
    "REPLACED_FAILED_TASK",
    "REPLACED_TASK",
    "SCOPE_HEADER",
    "SURPRISES_HEADER",
    "headers_with_options",
    "message_header",
    "request_header",
]

KEY_HEADER, SCOPE_HEADER, BYPASS_HEADER = "idempotency_key", "idempotency_scope", "idempotency"
# The headers a caller may also pass as send_task / signature options (which Celery sends as
# message properties): the producer moves them into the headers (celery_idem.signals).
OPTION_HEADERS = (KEY_HEADER, SCOPE_HEADER, BYPASS_HEADER)
OUTAGE_HEADER = "idempotency_store_waits"  # how often this message went back for a store outage
SURPRISES_HEADER = "idempotency_store_surprises"  # ...of those, for an error no outage mapping knows
# How often this message went back to the broker to wait for a record that a queued message (a
# replacement) holds: its next countdown doubles with it. Input: it only paces its own message.
BUSY_TRIPS_HEADER = "idempotency_busy_trips"
# The callbacks self.replace() links to the replacement (registered by celery_idem.replacement).
REPLACED_TASK, REPLACED_FAILED_TASK = "celery_idem.replaced", "celery_idem.replaced_failed"
# The token a self.replace() hands its record over to, carried by the replacement's message. Input
# like any header: it is worth something only while the store holds the record under that token.
HANDOVER_HEADER = "idempotency_handover"
# The owner token of the PENDING claim its producer made for this message (celery_idem.releases):
# worth something only while the store holds the record under that token, as the handover's is.
CLAIM_HEADER = "idempotency_claim"


def request_header(request: Any, name: str) -> Any:
    """A message header as a task request holds it: in ``headers`` (eager mode, and on workers),
    as an attribute (workers merge message headers into the request), or as a message property
    (a key given as a ``send_task`` option by a producer without celery-idem; only transports that
    keep unknown properties deliver it, Redis does, AMQP drops it)."""
    headers = request.headers if isinstance(request.headers, Mapping) else {}  # Celery never checks its type
    value = headers.get(name, getattr(request, name, None))
    if value is None:
        value = (getattr(request, "properties", None) or {}).get(name)
    return value


def message_header(message: Mapping[str, Any], name: str) -> Any:
    """A message header as a worker's request dict holds it: a header, else a message property."""
    value = message.get(name)
    if value is None:
        value = (message.get("properties") or {}).get(name)
    return value


def headers_with_options(options: dict[str, Any], headers: Any) -> Any:
    """The headers of a call run inline (``Task.apply``) with the idempotency options given to it
    moved in, as a worker finds them in a message (an option wins over a header, as in
    apply_async); ``headers`` as given when no option is set. The options are taken out of
    ``options``."""
    moved = {name: value for name in OPTION_HEADERS if (value := options.pop(name, None)) is not None}
    if not moved:
        return headers
    return {**(headers if isinstance(headers, Mapping) else {}), **moved}
