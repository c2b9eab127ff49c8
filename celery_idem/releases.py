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
claim made for it (proved by its token) is given back: its key is never held for a message that is
gone, and a message under another call's task id frees nothing and ends quietly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery.exceptions import Ignore

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
            that had another one); the claim made for this very message is given back.
        Ignore: such a message under a task id its record names, which it cannot prove to be the
            message the record was claimed for (a copy of a call that runs or ran elsewhere, a
            forged copy): the id's answer is its record's, so it ends quietly.
        SerializationError: the arguments, as received, have no canonical form.
    """
    try:
        return calls.fingerprint(args, kwargs)
    except SerializationError:
        raise
    except TypeError as exc:
        raise _unbound(calls, settle, exc) from None


def _unbound(calls: TaskCalls, settle: Settler, exc: TypeError) -> Exception:
    """What a message this release cannot bind ends with: see :func:`message_fingerprint`."""
    task, request = calls.task, calls.task.request
    said = (
        f"task {task.name!r} ({request.id}) cannot take the arguments of its message, sent by another "
        f"release of the task with another signature? {exc}; the body did not run"
    )
    key = request_header(request, KEY_HEADER)
    try:
        identity = calls.identify(key, request_header(request, SCOPE_HEADER), "") if key is not None else None
        record = settle.idem.store.get(identity) if identity is not None else None
    except IdempotencyError as error:  # a key that is not one, or the store down: nothing to give back
        logger.error("%s (its record could not be read: %s)", said, error)
        return TypeError(said)
    if identity is None or record is None or record.task_id != request.id:
        logger.error("%s", said if identity is None else f"{telemetry.shown(identity)}: {said}")
        return TypeError(said)
    token = request_header(request, CLAIM_HEADER)
    if isinstance(token, str) and record.state is State.PENDING and not record.attempt and record.held_by(token):
        # The claim made for this very message, fenced by its token: the key is free for the next call.
        settle.give_back(identity, token, settled_is_fine=True)
        said += "; its idempotency key is freed: call it again with arguments that fit"
        logger.error("%s: %s", telemetry.shown(identity), said)
        return TypeError(said)
    logger.error(
        "%s: %s; its task id's record is %s and not this message's to settle: ending quietly",
        telemetry.shown(identity),
        said,
        record.state.value,
    )
    quiet: Exception = Ignore(f"task {request.id} cannot be bound and is not its record's message: refused")
    return quiet
