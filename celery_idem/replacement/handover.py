"""The replaced attempt hands its record over before anything is published (:func:`on_replace`),
and its replacement by its own call takes it back under its own token (:func:`take_over`); the
package docstring (:mod:`celery_idem.replacement`) tells the whole story."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery.canvas import Signature, _chain, chord, group
from celery.exceptions import Ignore

from .. import attempts, outage, telemetry, timing
from ..errors import IdempotencyError, LockLostError, StoreUnavailableError
from ..owners import worker_token
from ..protocol import (
    BYPASS_HEADER,
    HANDOVER_HEADER,
    KEY_HEADER,
    REPLACED_FAILED_TASK,
    REPLACED_TASK,
    SCOPE_HEADER,
    request_header,
)
from ..records import Decision, Identity, Transition
from ..settle import Settler

if TYPE_CHECKING:
    from ..config import IdempotencyPolicy
    from ..runtime import Runtime

__all__ = ["Handler", "on_replace", "take_over"]

logger = logging.getLogger("celery_idem.replacement")


class Handler(Protocol):
    """What this module is given of the replaced task's handler (:class:`celery_idem.handler.Handler`,
    which calls it): the task, its runtime and policy, how its calls are identified, its writes
    (:class:`~celery_idem.settle.Settler`) and how its message goes back to the broker."""

    idem: Runtime
    task: Any
    policy: IdempotencyPolicy
    settle: Settler

    def fingerprint(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str: ...

    def identify(self, key: Any, scope: Any, fp: str) -> Identity: ...

    def as_sent(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any]
    ) -> tuple[Any, Any]: ...

    def republish(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        countdown: float,
        headers: Mapping[str, Any] | None = None,
    ) -> None: ...


# ---- the replaced attempt --------------------------------------------------------------------------


def on_replace(handler: Handler, sig: Any, publish: Callable[[Any], Any]) -> Any:
    """``Task.on_replace``: ``sig`` (final: frozen under this task id, the chain's rest appended) is
    about to be published by ``publish`` (Celery's own on_replace, which raises ``Ignore``)."""
    task = handler.task
    attempt = attempts.current(task)
    if attempt is None or attempt.owner is None or task.request.is_eager:
        return publish(sig)  # eager: the replacement runs inline; unprotected: no record to hand on
    attempt.replacement_wait = _longest_wait(handler, sig)
    store, policy, identity, owner = handler.idem.store, handler.policy, attempt.identity, attempt.owner
    # Whatever the replacement, the record is handed to a token of its own (naming no process: a
    # duplicate that meets it knows nothing runs it yet, and waits through the broker), leased for
    # as long as the replacement may take, before anything is published: the replacement (its own
    # call) takes it by that token, or the callbacks linked to it (any other) settle it under it.
    token = worker_token(getattr(task.request, "hostname", None))
    heartbeat = handler.idem.heartbeat
    if attempt.lease is not None:
        heartbeat.remove(attempt.lease)  # no beat under the old token after the handover
    same = _own_call(handler, attempt, sig)
    # The token is leased for the replacement's whole wait from the handover on, before the publish:
    # a process that dies right after the publish leaves a record nothing may take while the
    # replacement waits (a lease of one would free it then, and the call would run twice). The price:
    # a process that dies between the handover and the publish leaves the call waiting that long.
    try:
        handed = store.hand_over(identity, owner, token, lease_seconds=attempt.replacement_wait + policy.lease_seconds)
    except StoreUnavailableError as exc:
        # Not sent. The message is kept: back to the broker, it runs again once the store answers
        # (DESIGN: "Nothing lost"), carrying the token, so that a handover that landed with only its
        # reply lost is taken back at once by the copy (as the replacement would take it), not waited out.
        handler.idem.count("store_errors")
        request = task.request
        args, kwargs = request.args or (), request.kwargs or {}
        raise outage.keep_message(task, args, kwargs, exc, handler.republish, {HANDOVER_HEADER: token}) from None
    if not handed.ok:
        # Another attempt took the record past this one's lease (this process froze): it runs the call
        # and sends its own replacement. Sending this one too would run the replacement twice.
        raise LockLostError(
            f"task {task.name!r} ({attempt.task_id}) lost its lease on idempotency key {identity.key!r} to "
            "another attempt; its replacement was not sent",
            key=identity.key,
            task_name=task.name,
            task_id=attempt.task_id,
        )
    if same is not None:
        # The step carries its identity: a chain's last step is published by the worker of the step
        # before it, where no attempt of this call runs to lend a key-less step this call's key.
        scope = {SCOPE_HEADER: identity.scope} if identity.scope else {}
        keyed = {KEY_HEADER: identity.key, **scope, HANDOVER_HEADER: token}
        same.set(headers={**(same.options.get("headers") or {}), **keyed})
    else:
        fence = {"scope": identity.scope, "task_name": task.name, "key": identity.key, "owner": token}
        # Linked where the replacement ends: the step that carries this task id (Celery appends the
        # rest of an outer chain after it, whose outcome is not this call's). A chord (a group, as
        # Celery's replace makes it one) ends in its body, which a failing member fails too: both go
        # there (chord.link_error would warn, and may link the members as well).
        last = _end_of(sig, attempt.task_id)
        last.link(task.app.signature(REPLACED_TASK, kwargs=fence))
        errback = task.app.signature(REPLACED_FAILED_TASK, kwargs=fence)
        if type(last) is Signature:  # first: a user errback that raises stops the rest on Celery 5.3
            last.options["link_error"] = [errback, *(last.options.get("link_error") or [])]
        else:
            last.link_error(errback)
    attempt.replaced, attempt.handed_over = True, same is not None
    try:
        return publish(sig)
    except Ignore:  # Celery's on_replace raises it once the replacement is sent
        raise
    except BaseException as exc:
        # Not sent: the record comes back to this attempt, whose failure settles it as usual; a
        # replacement whose claim failed closed (another idempotent call) keeps this message.
        attempt.replaced = attempt.handed_over = False
        with contextlib.suppress(IdempotencyError):
            store.hand_over(identity, token, owner, lease_seconds=policy.lease_seconds)
        if isinstance(exc, StoreUnavailableError):
            request = task.request
            raise outage.keep_message(task, request.args or (), request.kwargs or {}, exc, handler.republish) from None
        raise


def _end_of(sig: Any, task_id: str) -> Any:
    """The step of ``sig`` that ends the replacement: the one Celery froze under the replaced task id
    (a chord's body), before any step of an outer chain appended after it; ``sig`` when none is."""
    if isinstance(sig, chord):
        return sig.body
    if isinstance(sig, _chain):
        for step in sig.tasks:
            if (step.body if isinstance(step, chord) else step).options.get("task_id") == task_id:
                return _end_of(step, task_id)
    return sig


def _own_call(handler: Handler, attempt: attempts.Attempt, sig: Any) -> Signature | None:
    """The step of ``sig`` that carries this task id, if it is this very call (task and identity)."""
    for step in sig.tasks if isinstance(sig, _chain) else (sig,):
        options = step.options
        if options.get("task_id") != attempt.task_id:
            continue
        if type(step) is not Signature or step.task != attempt.task_name:
            return None
        headers = options.get("headers") or {}
        if options.get(BYPASS_HEADER) is False or headers.get(BYPASS_HEADER) is False:
            return None
        key = options.get(KEY_HEADER, headers.get(KEY_HEADER))
        scope = options.get(SCOPE_HEADER, headers.get(SCOPE_HEADER))
        args, kwargs = handler.as_sent(step.args, step.kwargs, options)
        fp = handler.fingerprint(args, kwargs)
        if key is None and scope is None:  # a key-less call of the running call is the running call
            return step if fp == attempt.fingerprint else None
        return step if handler.identify(key, scope, fp) == attempt.identity else None
    return None


def _longest_wait(handler: Handler, sig: Any) -> float:
    """How long the replacement may take before its last step runs: each step's queue wait (the
    policy's pending timeout past its countdown or ETA, never past its message's expiry), added up
    along a chain with a lease for each earlier step's run (a step is published once the one before
    it ran), the longest of a group's members, a chord's header then its body."""
    policy, expires = handler.policy, handler.task.expires

    def wait(step: Any) -> float:
        if isinstance(step, chord):
            return wait(step.tasks) + policy.lease_seconds + wait(step.body)
        own = timing.pending_seconds(policy.pending_timeout_seconds, getattr(step, "options", None) or {}, expires)
        if isinstance(step, _chain):
            parts = [wait(part) for part in step.tasks]
            return sum(parts) + policy.lease_seconds * max(len(parts) - 1, 0) if parts else own
        if isinstance(step, (group, list, tuple)):  # members run side by side (a chord's header may be a list)
            return max((wait(part) for part in (step.tasks if isinstance(step, group) else step)), default=own)
        return own

    return wait(sig)


# ---- the replacement -------------------------------------------------------------------------------


def take_over(handler: Handler, identity: Identity, owner: str) -> Transition | None:
    """Before its acquire: a message that carries a handover token takes the record held under it
    (``hand_over``, fenced by the token: a forged or spent one is LOST) under ``owner`` and RUNs,
    whatever its arguments (a replacement may carry other ones, as a Celery retry may). None when
    there is no token or the store holds nothing under it: the message acquires as any other.

    A store error here is the acquire's to meet (it asks the same store next): the take is tried
    again on the message's next look.
    """
    request = handler.task.request
    token = request_header(request, HANDOVER_HEADER)
    if not isinstance(token, str) or not token:
        return None
    store = handler.idem.store
    try:
        if not store.hand_over(identity, token, owner, lease_seconds=handler.policy.lease_seconds).ok:
            return None  # forged, spent (another copy took it), or never handed over (an outage then)
        record = store.get(identity)
    except StoreUnavailableError as exc:
        handler.idem.count("store_errors")
        logger.warning("replacement %s could not take %s over: %s", request.id, telemetry.shown(identity), exc)
        return None
    if record is None or record.owner != owner:
        return None  # forgotten or taken since, by an operator: acquire as any message
    logger.info("replacement %s took %s over from the attempt it replaced", request.id, telemetry.shown(identity))
    return Transition(Decision.RUN, record)
