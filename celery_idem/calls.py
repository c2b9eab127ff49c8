"""The call a record keeps, for the reconciler to deliver it again (``stale_action="requeue"``).

A small versioned JSON document (kombu's json, never pickle: a stored pickle would run code)::

    {"v": 1, "args": [...], "kwargs": {...}, "options": {...}}

``options`` are the message's own, as Celery itself re-publishes a message (``Task.retry`` through
``Task.signature_from_request``): its routing (queue, exchange, routing key), priority, link and
link_error, chain, chord and group membership, time limits, expiry, other headers, the retries
count, and the task's serializer. The worker writes the call its attempt runs with (so after a
retry changed the arguments, those); the producer's claim writes the publish-time options, for a
message lost before any worker took it.

A call that cannot be kept (not JSON, or over :data:`MAX_CALL_BYTES`) is kept as a refusal, which
the reconciler answers with a release: a store keeps the claim's call when an acquire gives none,
so keeping nothing would leave the first call's arguments behind.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from celery.utils.time import maybe_iso8601
from kombu.utils import json as kombu_json

from .protocol import OUTAGE_HEADER, SURPRISES_HEADER

__all__ = ["MAX_CALL_BYTES", "Call", "CallRefused", "decode_call", "encode_call", "published_options"]

logger = logging.getLogger("celery_idem.calls")
VERSION = 1
MAX_CALL_BYTES = 64 * 1024
# The apply_async options that are part of the call; the others (a connection, a producer, a
# countdown or ETA already spent by the time a dead attempt is requeued) are not.
_PUBLISH_OPTIONS = (
    "queue",
    "exchange",
    "exchange_type",
    "routing_key",
    "priority",
    "serializer",
    "compression",
    "link",
    "link_error",
    "chain",
    "chord",
    "group_id",
    "group_index",
    "root_id",
    "parent_id",
    "shadow",
    "expires",
    "time_limit",
    "soft_time_limit",
    "headers",
    "reply_to",
    "ignore_result",
    "replaced_task_nesting",
    "stamped_headers",
)
# Never kept: the task id is the record's, and these belong to one delivery, not to the call.
_DELIVERY_ONLY = ("task_id", "countdown", "eta", "redelivered", "is_eager")


class CallRefused(ValueError):
    """The record keeps no call that can be delivered again (the reason is the message)."""


class Call(NamedTuple):
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]

    def expires_at(self) -> float | None:
        """When the message expires (epoch seconds; a naive time is UTC, as Celery reads it)."""
        expires = self.options.get("expires")
        if not isinstance(expires, (str, datetime.datetime)):
            return None
        moment: datetime.datetime = maybe_iso8601(expires)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.timezone.utc)
        return moment.timestamp()


def published_options(options: Mapping[str, Any], *, stamped: Sequence[str] = ()) -> dict[str, Any]:
    """The part of ``apply_async`` options that is the call: a kombu Queue or Exchange by its name,
    a relative expiry as the absolute time Celery puts in the message."""
    kept = {name: options[name] for name in (*_PUBLISH_OPTIONS, *stamped) if options.get(name) is not None}
    for name in ("queue", "exchange"):
        if name in kept:
            kept[name] = getattr(kept[name], "name", kept[name])
    expires = kept.get("expires")
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        now = datetime.datetime.now(datetime.timezone.utc)
        kept["expires"] = (now + datetime.timedelta(seconds=expires)).isoformat()
    return kept


def encode_call(
    task_name: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any],
    *,
    serializer: str,
) -> bytes:
    """The call as the record keeps it, or a refusal (logged) when it cannot be kept."""
    kept = {name: value for name, value in options.items() if name not in _DELIVERY_ONLY and value is not None}
    headers = {k: v for k, v in (kept.get("headers") or {}).items() if k not in (OUTAGE_HEADER, SURPRISES_HEADER)}
    kept.update(headers=headers, serializer=serializer)
    document = {"v": VERSION, "args": list(args or ()), "kwargs": dict(kwargs or {}), "options": kept}
    try:
        data = str(kombu_json.dumps(document)).encode("utf-8")  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        return _refuse(task_name, f"its call is not JSON ({exc})")
    if len(data) > MAX_CALL_BYTES:
        return _refuse(task_name, f"its call is {len(data)} bytes, over {MAX_CALL_BYTES}")
    return data


def _refuse(task_name: str, why: str) -> bytes:
    logger.warning("task %s: %s; a dead attempt of it is released, not requeued", task_name, why)
    return str(kombu_json.dumps({"v": VERSION, "refused": why})).encode("utf-8")  # type: ignore[no-untyped-call]


def decode_call(data: bytes) -> Call:
    """The kept call (a record written before options were kept gives none).

    Raises:
        CallRefused: the call was refused when kept, or cannot be read.
    """
    try:
        document = kombu_json.loads(data)  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        raise CallRefused(f"its call cannot be read ({exc})") from exc
    if not isinstance(document, dict) or document.get("v", VERSION) != VERSION:
        raise CallRefused("its call is in an unknown format")
    if "refused" in document:
        raise CallRefused(str(document["refused"]))
    return Call(
        list(document.get("args") or ()), dict(document.get("kwargs") or {}), dict(document.get("options") or {})
    )
