"""Durable evidence of an attempt's outcome, for when the store cannot take it: left, and read back.

An attempt whose body returned but whose outcome the store refused (an outage) hands the write to
its heartbeat thread, which flushes it before the process exits (within a bound). What still does
not land must not be lost with the process, so the attempt leaves evidence that outlives it: the
result backend holds its value under its task id (an ``ignore_result`` task writes it there in this
one case), and a ledger holds a committed effect.

The next attempt that takes the record over past its lease (``record.previous_task_id``, kept by
the store on every takeover) reads that evidence before it runs anything: a committed ledger entry
or a SUCCESS for the earlier task id settles the record COMPLETED with it (under the new attempt's
token), and the call is answered from it instead of running the body again.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from celery import states
from celery.backends.base import DisabledBackend

from . import telemetry
from .errors import LockLostError, StoreUnavailableError
from .outcome import encode_result
from .records import IdempotencyRecord, Identity, Transition

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Found", "earlier_outcome", "leave"]

logger = logging.getLogger("celery_idem.evidence")


class Found(NamedTuple):
    """The outcome of an earlier attempt, now stored on the record."""

    value: Any


def leave(task: Any, value: Any) -> None:
    """The record could not be settled: the task returns its value, so the result backend holds
    SUCCESS, which the reconciler and the next takeover settle COMPLETED from. An ignore_result task
    writes it there anyway in this one case (no other evidence would survive the outage)."""
    request = task.request
    if task.ignore_result or getattr(request, "ignore_result", False):
        if not isinstance(task.backend, DisabledBackend):
            task.backend.store_result(request.id, value, states.SUCCESS, request=request)


def earlier_outcome(idem: Runtime, task: Any, record: IdempotencyRecord) -> Found | None:
    """For a record this attempt just took over: the earlier attempt's outcome, stored on the record
    now, or None (no earlier attempt, or no evidence that its body completed: run the body).

    Raises:
        LockLostError: another attempt took the record while the evidence was read.
    """
    earlier = record.previous_task_id
    if earlier is None:
        return None
    payload = content_type = encoding = None
    try:
        entry = idem.committed(record.identity, record.fingerprint)
        if entry is not None and entry.result is not None:
            value = entry.value(idem.accepted_content_types)
            payload, content_type, encoding, why = entry.result, entry.content_type, entry.content_encoding, "ledger"
        else:
            meta = task.backend.get_task_meta(earlier) if not isinstance(task.backend, DisabledBackend) else {}
            if meta.get("status") != states.SUCCESS:
                return None
            value, why = meta.get("result"), "result backend"
            payload, content_type, encoding = encode_result(value, task.serializer or "json")
    except Exception as exc:  # noqa: BLE001 - no evidence could be read: the body runs, as without any
        logger.warning(
            "could not read the evidence of %s's earlier attempt %s: %r", telemetry.shown(record.identity), earlier, exc
        )
        return None
    identity, owner = record.identity, record.owner

    def write() -> Transition:
        return idem.store.complete(
            identity,
            owner,
            payload,
            content_type=content_type or "application/json",
            content_encoding=encoding or "utf-8",
        )

    try:
        answer = write()
    except StoreUnavailableError as exc:
        # The earlier attempt's outcome is known: never run the body for it. The heartbeat stores it
        # once the store answers (this attempt holds the record), as for an outcome of its own.
        logger.warning(
            "%s: storing the earlier attempt's outcome failed (%s); the heartbeat goes on",
            telemetry.shown(identity),
            exc,
        )
        idem.heartbeat.defer(
            identity, write, functools.partial(_settled_by, idem, identity, owner), seconds=record.ttl_seconds
        )
        idem.count("replays")
        return Found(value)
    if not answer.ok:
        raise LockLostError(
            f"{record.identity} was taken by another attempt while its earlier attempt's outcome was read",
            key=record.key,
            task_name=record.task_name,
            task_id=record.task_id,
        )
    logger.warning(
        "%s: the earlier attempt %s completed (%s); settled with its outcome instead of running again",
        telemetry.shown(record.identity),
        earlier,
        why,
    )
    idem.count("replays")
    return Found(value)


def _settled_by(idem: Runtime, identity: Identity, owner: str) -> bool:
    try:
        record = idem.store.get(identity)
    except StoreUnavailableError:
        return False
    return record is not None and record.state.settled and record.held_by(owner)
