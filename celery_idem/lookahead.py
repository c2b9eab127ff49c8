"""What a call deferred to a commit will be answered, as far as the store can tell now.

A call staged in an outbox or deferred with ``delay_on_commit`` is claimed after its transaction
commits, so that a transaction that rolls back never leaves a claim behind. An HTTP API must answer
its client before that: a key reused for other arguments is refused, and a retry of a request is
handed the task id of the call it repeats. :func:`prior_call` reads (never writes) the record under
the call's key, one read, and answers with the decision the claim would make on it:

- another fingerprint (in any state): MISMATCH, :class:`PayloadMismatchError`, now;
- the same fingerprint, settled (REPLAY) or unsettled under a live lease (DUPLICATE): the handle
  of the call it repeats (its task id, its outcome), and nothing is to be staged; with
  ``on_duplicate="raise"``, :class:`DuplicateTaskError`;
- no record, or one whose lease ran out (a claim would take it over): None, nothing is known, and
  the call is to be made; its claim after the commit decides.

A read writes nothing, so a transaction that rolls back after it leaves the key as it found it.
What a read cannot see: a call of the same key staged or deferred in a transaction that has not
committed yet, or committed with its publish not done (the relay's to do). Such a call is claimed
after this one's look: a retry of it is staged under a task id of its own (whose outcome is the
original's, replayed), and other arguments are refused at that claim (the outbox's dead letter,
the ``delay_on_commit`` handle's ``error``). docs/guides/django.md says what an API does with that.

:func:`claim_staged` closes that window where the store can join the caller's transaction (the
``django://`` store on the outbox's own database, PostgreSQL or SQLite): the claim of a staged call
is written at staging, in that transaction, so it commits or rolls back with the row, and a
concurrent call with the key waits for it and is then answered as above.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import timing
from .calling import log_decision
from .errors import StoreUnavailableError
from .protocol import BYPASS_HEADER, KEY_HEADER, OPTION_HEADERS, SCOPE_HEADER
from .records import Decision, IdempotencyRecord, Identity
from .releases import earlier_fingerprint
from .result import bind_handle
from .stores.rules import UNSETTLED, classify

if TYPE_CHECKING:
    from .calling import TaskCalls
    from .runtime import Runtime

__all__ = ["claim_staged", "prior_call"]


def prior_call(
    calls: TaskCalls,
    idem: Runtime,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any],
) -> Any:
    """The handle of the call that this one (``apply_async(args, kwargs, **options)`` of the task of
    ``calls``) repeats, or None when the store knows of none.

    Raises:
        PayloadMismatchError: the key was used for other arguments.
        DuplicateTaskError: the call repeats another and the policy says ``on_duplicate="raise"``.
        InvalidKeyError: the key or scope breaks the rule (or the policy requires a key).
    """
    call = _identified(calls, args, kwargs, options)
    if call is None:
        return None  # not deduplicated: nothing to repeat
    identity, fp, args, kwargs = call
    try:
        record = idem.store.get(identity)
        if (
            record is not None
            and record.fingerprint != fp
            and earlier_fingerprint(calls, args, kwargs) == (record.fingerprint)
        ):
            fp = record.fingerprint  # recorded by a celery-idem that kept defaults in the fingerprint
        if record is None or not _held(record, fp, idem.store.now, settled_is_free=not calls.mode.keeps_outcome):
            return None
    except StoreUnavailableError:
        return None  # nothing known now; the claim after the commit decides (fail closed there)
    decision = classify(record, fp, claiming=True, task_id=record.task_id)
    log_decision(decision, identity, record.task_id, record)
    return _repeated(calls, idem, identity, decision, record)


def claim_staged(
    calls: TaskCalls,
    idem: Runtime,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any],
    task_id: str,
    using: str,
) -> Any:
    """The claim of a call staged under ``task_id`` in the transaction open on the database
    ``using``, written in that transaction where the store can join it (``django://`` on that
    database: its ``claim_in_transaction``), so it commits or rolls back with the staged call, and
    the relay's claim after the commit finds it as its own. Elsewhere nothing is claimed now.

    Returns:
        The handle of the call this one repeats (nothing is to be staged), or None: stage it
        (claimed now under ``task_id``, or to be claimed by the relay).

    Raises:
        PayloadMismatchError: the key was used for other arguments.
        DuplicateTaskError: the call repeats another and the policy says ``on_duplicate="raise"``.
    """
    claim = getattr(idem.store, "claim_in_transaction", None)
    call = None if claim is None else _identified(calls, args, kwargs, options)
    if claim is None or call is None:
        return None
    identity, fp, args, kwargs = call
    policy = calls.policy
    claiming = functools.partial(
        claim,
        using,
        identity,
        task_id=task_id,
        pending_seconds=timing.pending_seconds(policy.pending_timeout_seconds, options, calls.task.expires),
        ttl_seconds=policy.ttl_seconds,
        call=calls.kept_call(args, kwargs, {k: v for k, v in options.items() if k not in OPTION_HEADERS}),
        settled_is_free=not calls.mode.keeps_outcome,
    )
    claimed = claiming(fp)
    if claimed is None:
        return None  # the store cannot join this transaction: the relay claims
    if claimed.decision is Decision.MISMATCH and claimed.record is not None:
        earlier = earlier_fingerprint(calls, args, kwargs)
        if earlier != fp and earlier == claimed.record.fingerprint:
            claimed = claiming(earlier)  # recorded by a celery-idem that kept defaults in the fingerprint
    idem.count("claims")
    record = claimed.record
    assert record is not None
    log_decision(claimed.decision, identity, task_id, record)
    if claimed.decision is Decision.NEW:
        return None
    return _repeated(calls, idem, identity, claimed.decision, record)


def _identified(
    calls: TaskCalls, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any]
) -> tuple[Identity, str, Any, Any] | None:
    """The identity and fingerprint of the call (and its arguments as sent), as apply_async decides
    them; None for a call that bypasses celery-idem."""
    headers = options.get("headers") or {}
    key = options.get(KEY_HEADER, headers.get(KEY_HEADER))
    scope = options.get(SCOPE_HEADER, headers.get(SCOPE_HEADER))
    if options.get(BYPASS_HEADER, headers.get(BYPASS_HEADER)) is False:
        return None
    args, kwargs = calls.as_sent(args, kwargs, options)
    fp = calls.fingerprint(args, kwargs)
    if key is None and scope is None:
        key, scope = calls.running_identity(fp)
    return calls.identify(key, scope, fp), fp, args, kwargs


def _repeated(
    calls: TaskCalls, idem: Runtime, identity: Identity, decision: Decision, record: IdempotencyRecord
) -> Any:
    """What a call that the record's call holds is answered: the refusal, or that call's handle."""
    if decision is Decision.MISMATCH:
        idem.count("mismatches")
        raise calls.mismatch(identity, record)
    idem.count("replays" if decision is Decision.REPLAY else "duplicates")
    if calls.policy.on_duplicate == "raise":
        raise calls.duplicate(identity, record)
    handle = calls.task.AsyncResult(record.task_id)
    return bind_handle(handle, identity, idem, deduplicated=True, record=record)


def _held(record: IdempotencyRecord, fp: str, now: Any, *, settled_is_free: bool) -> bool:
    """Whether a claim made now would not take ``record``: another fingerprint, a settled record
    (unless the task's mode keeps no outcome for new calls: its claim takes one), or an unsettled
    one under a live lease (the server's clock, asked only then)."""
    if record.state not in UNSETTLED:
        return not settled_is_free
    if record.fingerprint != fp:
        return True
    return record.lease_expires_at is None or record.lease_expires_at > now()
