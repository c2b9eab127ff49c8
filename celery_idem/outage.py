"""A worker facing a store outage keeps the message (DESIGN §3, "Nothing lost").

When the store cannot be reached before a body runs (``on_store_error="raise"``), the message goes
back to the broker under the same task id (:mod:`celery_idem.send_back`, which keeps it even when the
broker refuses it), with a countdown that doubles from :data:`FIRST_DELAY_SECONDS` up to
:data:`MAX_DELAY_SECONDS`, until the store answers. Each is a whole number of seconds: RabbitMQ's
native delayed delivery takes no other (``timing.broker_countdown``). Two headers
count the trips (:data:`~celery_idem.protocol.OUTAGE_HEADER`, and of those, the trips for an error no
outage mapping knows, :data:`~celery_idem.protocol.SURPRISES_HEADER`).

Both headers are ours, and bounded: they only ever change how long *their own* message waits before
its next try (at most :data:`MAX_DELAY_SECONDS`), or, for a store error no mapping knows, after how
many trips it fails with that error. A producer can set them, so they are read as input: any value
(missing, negative, huge, fractional, not a number) reads as a count between 0 and
:data:`MAX_TRIPS`, and the countdown is looked up, never computed by an exponent that could
overflow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery.exceptions import Retry

from .errors import StoreUnavailableError
from .protocol import OUTAGE_HEADER, SURPRISES_HEADER, request_header

__all__ = [
    "FIRST_DELAY_SECONDS",
    "MAX_DELAY_SECONDS",
    "MAX_TRIPS",
    "UNEXPECTED_MAX_TRIPS",
    "countdown",
    "gives_up",
    "keep_message",
    "trips",
]

FIRST_DELAY_SECONDS, MAX_DELAY_SECONDS = 1.0, 30.0  # the outage backoff doubles up to this
# Each delay of the backoff, by trip: 1, 2, 4, ... and MAX_DELAY_SECONDS from the first doubling
# that reaches it on. A table, so no trip count can make the arithmetic overflow.
_DELAYS: tuple[float, ...] = tuple(min(FIRST_DELAY_SECONDS * 2**n, MAX_DELAY_SECONDS) for n in range(8))
# A trip count is kept at most this (about a year of trips 30 s apart): it never grows without bound.
MAX_TRIPS = 1_000_000
# A store error no outage mapping knows may never pass (a task id the database refuses): after this
# many trips back to the broker for such errors (a real outage's trips do not count) the message
# fails with it instead of looping forever.
UNEXPECTED_MAX_TRIPS = 8

logger = logging.getLogger("celery_idem.outage")


def trips(request: Any, header: str) -> int:
    """The trip count a message carries in ``header``: a whole number in ``[0, MAX_TRIPS]``, whatever
    the header holds (absent, None, negative, fractional, huge, a numeric string, or garbage: 0)."""
    value = request_header(request, header)
    if isinstance(value, str) and value.strip().isdecimal() and len(value.strip()) <= 12:
        value = int(value.strip())  # isdecimal, not isdigit: int() refuses "²"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN
        return 0
    if value <= 0:
        return 0
    return MAX_TRIPS if value >= MAX_TRIPS else int(value)


def countdown(waits: int) -> float:
    """Seconds before the next try of a message that went back ``waits`` times already."""
    return _DELAYS[min(max(waits, 0), len(_DELAYS) - 1)]


def gives_up(request: Any, exc: StoreUnavailableError) -> bool:
    """Whether a store error no outage mapping knows has outlived every trip back it is given."""
    return exc.unexpected and trips(request, SURPRISES_HEADER) >= UNEXPECTED_MAX_TRIPS


def keep_message(
    task: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    exc: StoreUnavailableError,
    republish: Callable[..., None],
    headers: Mapping[str, Any] | None = None,
) -> Retry:
    """Fail closed, never lost: send this message back to the broker (through ``republish``, which
    takes ``args, kwargs, countdown=, headers=``) with the next countdown and ``headers`` added, and
    return the ``Retry`` the task raises. Neither bounded by nor counted in the task's own
    max_retries (the task did not fail), so Celery's retries count is kept as it is."""
    request = task.request
    waits = trips(request, OUTAGE_HEADER)
    surprises = min(trips(request, SURPRISES_HEADER) + exc.unexpected, MAX_TRIPS)
    delay = countdown(waits)
    logger.error(
        "store unavailable: task %s (%s) not run, back to the broker in %gs: %s",
        task.name,
        request.id,
        delay,
        exc,
    )
    counts = {OUTAGE_HEADER: min(waits + 1, MAX_TRIPS), **({SURPRISES_HEADER: surprises} if surprises else {})}
    republish(args, kwargs, countdown=delay, headers={**(headers or {}), **counts})
    return Retry(exc=StoreUnavailableError(f"the idempotency store is unavailable; retry in {delay:g}s"), when=delay)
