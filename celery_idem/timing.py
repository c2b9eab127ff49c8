"""Message timing, read as Celery reads it: how far a countdown or ETA puts a message in the
future, how long a PENDING claim may wait for a message that has an expiry, and which countdowns
every broker takes."""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

from celery.utils.time import maybe_iso8601

__all__ = ["EXPIRY_GRACE_SECONDS", "NATIVE_DELAY_MAX_SECONDS", "broker_countdown", "delay_seconds", "pending_seconds"]

# How long a claim outlives the expiry of the message it waits for. A broker that drops an expired
# message (RabbitMQ turns ``expires`` into the message TTL) sends no task_revoked, so nothing else
# frees the key; the grace covers the publish after the claim and the worker's clock against ours.
EXPIRY_GRACE_SECONDS = 5.0
# RabbitMQ's native delayed delivery (Celery 5.5+, on as soon as a queue is a quorum queue, for every
# topic or fanout exchange) routes a countdown message by the 28 bits of ``int(countdown)``: it
# refuses a countdown under one second (``int(0.5) == 0``) and holds none longer than this.
NATIVE_DELAY_MAX_SECONDS = 2**28 - 1


def broker_countdown(seconds: float) -> int:
    """The countdown to send for a wait of ``seconds``: whole seconds, rounded up (never sooner than
    asked), at least 1 and at most :data:`NATIVE_DELAY_MAX_SECONDS` (a wait of "forever" included),
    so that native delayed delivery takes it and delivers it no earlier than asked."""
    if not seconds < NATIVE_DELAY_MAX_SECONDS:  # inf and NaN too
        return NATIVE_DELAY_MAX_SECONDS
    return max(1, math.ceil(seconds))


def _seconds_until(when: datetime.datetime | str) -> float:
    """Seconds from now until ``when``, read as Celery reads an ETA or expiry: a naive datetime is
    UTC (the worker's Request and send_task make it aware with ``naive_as_utc``), whatever the
    process's local zone or the app's ``timezone``."""
    moment: datetime.datetime = maybe_iso8601(when)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    # Both in UTC before subtracting: two datetimes of one zone subtract as wall clocks (wrong
    # across a DST change), which Celery 5.7's subtract_datetimes fixes and 5.3-5.6 lack.
    now = datetime.datetime.now(datetime.timezone.utc)
    return (moment.astimezone(datetime.timezone.utc) - now).total_seconds()


def delay_seconds(options: Mapping[str, Any]) -> float:
    """How far in the future a countdown or ETA puts the message (its PENDING lease grows by it)."""
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown:
        return max(float(countdown), 0.0)
    if isinstance(eta, (str, datetime.datetime)):
        return max(_seconds_until(eta), 0.0)
    return 0.0


def pending_seconds(pending_timeout: float, options: Mapping[str, Any], default_expires: Any) -> float:
    """A claim's PENDING lease: the pending timeout plus the message's countdown or ETA, and never
    past the message's own expiry plus :data:`EXPIRY_GRACE_SECONDS`.

    ``expires`` is read as Celery reads it: seconds from now, or a datetime (ISO string) where a
    naive one is UTC; the task's own ``expires`` applies when the call gives none.
    """
    lease = pending_timeout + delay_seconds(options)
    expires = options["expires"] if "expires" in options else default_expires
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        left = float(expires)
    elif isinstance(expires, (str, datetime.datetime)):
        left = _seconds_until(expires)
    else:
        return lease
    return min(lease, max(left, 0.0) + EXPIRY_GRACE_SECONDS)
