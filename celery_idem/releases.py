"""A call across releases (DESIGN §2, "Across releases"): what a message is when the worker's code
is not the code that sent it.

A rolling deploy puts producers and workers of two releases on one queue. The fingerprint is taken
of the call as bound to each side's own signature, so the two sides agree only on what both see:
the fingerprint leaves out every parameter that holds its default (celery_idem.fingerprint), so a
parameter added with a default changes no call. For the rest, a worker whose binding of a message
gives another fingerprint than its record holds asks whether the record was made for this very
call anyway (:func:`same_call`):

- the message carries the token of the PENDING claim its producer made for it (``CLAIM_HEADER``),
  and the store still holds the record under that token and that task id: proof, since only that
  producer and the store know the token. Once an attempt of it ran, the message is its attempt
  chain's, as a Celery retry is (the store grants that under the record's task id only);
- or the record was written by a celery-idem that kept defaults in the fingerprint (before 0.2),
  and the call, fingerprinted that way here, is the record's.

Then it acquires under the record's own fingerprint (the caller's call), and the store's compare
holds as for any message. A message that cannot be bound at all (a parameter removed, renamed, a
required one added) is failed by :func:`message_fingerprint` with an error that says so, and the
claim made for it is given back: its key is never held for a message that is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from . import telemetry
from .calling import TaskCalls
from .errors import IdempotencyError, SerializationError
from .protocol import CLAIM_HEADER, HANDOVER_HEADER, KEY_HEADER, SCOPE_HEADER, request_header
from .records import IdempotencyRecord, State
from .settle import Settler

__all__ = ["continues_its_chain", "earlier_fingerprint", "message_fingerprint", "same_call"]

logger = logging.getLogger("celery_idem.handler")


def continues_its_chain(request: Any) -> bool:
    """Whether the running message says it continues its task id's attempt chain, which may carry
    other arguments than the record's: Celery's retry (``retries > 0``), a replacement (or a copy of
    one) that a replaced attempt handed its record to, or the message its record was claimed for,
    bound by another release. All are fields a producer could set, so the store grants it only
    under the record's own task id (a random id: whoever knows it can publish under it anyway) and
    once an attempt has run."""
    if request.retries:
        return True
    return any(isinstance(request_header(request, name), str) for name in (HANDOVER_HEADER, CLAIM_HEADER))


def same_call(calls: TaskCalls, record: IdempotencyRecord, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``record``, which holds another fingerprint than the running message's arguments
    bound to this release's signature, was made for this very call (see the module's docstring)."""
    request = calls.task.request
    token = request_header(request, CLAIM_HEADER)
    if (
        isinstance(token, str)
        and record.task_id == request.id
        and record.state is State.PENDING
        and not record.attempt
        and record.held_by(token)
    ):
        return True
    return earlier_fingerprint(calls, args, kwargs) == record.fingerprint


def earlier_fingerprint(calls: TaskCalls, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str | None:
    """The fingerprint celery-idem before 0.2 gave this call (its defaults kept in), or None."""
    try:
        return calls.fingerprint(args, kwargs, keep_defaults=True)
    except (TypeError, ValueError, SerializationError):
        return None


def message_fingerprint(calls: TaskCalls, settle: Settler, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The running message's fingerprint on this release.

    Raises:
        TypeError: the message's arguments do not fit this release's signature (sent by a release
            that had another one): its claim is given back, so the key is free for the next call.
    """
    try:
        return calls.fingerprint(args, kwargs)
    except TypeError as exc:
        task, request = calls.task, calls.task.request
        error = TypeError(
            f"task {task.name!r} ({request.id}) cannot take the arguments of its message, sent by another "
            f"release of the task with another signature? {exc}; the body did not run and the call's "
            "idempotency key is freed: call it again with arguments that fit"
        )
        key = request_header(request, KEY_HEADER)
        if key is not None:
            try:
                identity = calls.identify(key, request_header(request, SCOPE_HEADER), "")
            except IdempotencyError:
                raise error from None
            # Only the claim made for this very message: PENDING under its task id (a fence).
            settle.give_back(identity, request.id, fence="task_id", settled_is_fine=True)
            logger.error("%s: %s", telemetry.shown(identity), error)
        else:
            logger.error("%s", error)
        raise error from None
