"""The producer side: what happens to a call (``apply_async``, ``apply``, a signature's ``delay``).

Validate key and scope, fingerprint, claim, then
    NEW       -> publish (and give the claim back if publishing fails)
    DUPLICATE -> hand back the original task id, publish nothing
    REPLAY    -> hand back the stored outcome, publish nothing
    MISMATCH  -> PayloadMismatchError
A duplicate that carries a continuation (link, chain, chord, group) is published anyway: the worker
replays the stored outcome into it instead of running the body.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from . import attempts, timing
from .calling import TaskCalls, log_decision
from .errors import StoreUnavailableError
from .protocol import BYPASS_HEADER, CLAIM_HEADER, HANDOVER_HEADER, KEY_HEADER, OPTION_HEADERS, SCOPE_HEADER
from .records import Decision, Identity, State, Transition
from .releases import earlier_fingerprint
from .result import bind_handle
from .settle import Settler
from .stores.base import new_token

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["publish", "resending", "stages_messages"]

_CONTINUATIONS = ("link", "link_error", "chain", "chord", "group_id")
# The task id the outbox's relay is publishing again on this thread (outbox/staging.py): known from
# the relay itself, never from an option or a header a producer could set.
_RESENDING: ContextVar[str | None] = ContextVar("celery_idem_resending", default=None)


@contextmanager
def resending(task_id: str) -> Iterator[None]:
    """Within the block, a claim that finds ``task_id``'s own record is the outbox's relay publishing
    that staged call again: no duplicate of it. While no attempt took the claim, its message may
    never have reached the broker, so a copy of the same task id is sent (a worker takes it for a
    redelivery); otherwise nothing is."""
    token = _RESENDING.set(task_id)
    try:
        yield
    finally:
        _RESENDING.reset(token)


def publish(
    calls: TaskCalls,
    idem: Runtime,
    settle: Settler,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    options: dict[str, Any],
    send: Callable[[Any, Any, dict[str, Any]], Any],
) -> Any:
    """Claim, then publish through ``send`` (Celery's own apply_async) or hand back the original."""
    task = calls.task
    staged = stages_messages(task.app)
    if staged:
        send = _carrying_identity(send)
    key = options.pop(KEY_HEADER, None)
    scope = options.pop(SCOPE_HEADER, None)
    enabled = options.pop(BYPASS_HEADER, True)
    headers = dict(options.get("headers") or {})
    key = headers.get(KEY_HEADER) if key is None else key
    scope = headers.get(SCOPE_HEADER) if scope is None else scope
    if enabled is False or headers.get(BYPASS_HEADER) is False:
        options["headers"] = {**headers, BYPASS_HEADER: False}
        return send(args, kwargs, options)
    if options.get("retries"):
        # Celery's retry re-publishes the same attempt chain under the same task id: never claimed again.
        return send(args, kwargs, options)

    args, kwargs = calls.as_sent(args, kwargs, options)
    fp = calls.fingerprint(args, kwargs)
    calls.called(keyed=key is not None)
    if key is None and scope is None:
        key, scope = calls.running_identity(fp)
    identity = calls.identify(key, scope, fp)
    if _handing_over(task, options.get("task_id"), identity):
        # replace() with this very call: the record is handed to this message (replacement.py),
        # so there is nothing to claim, and a store outage must not stop it from being sent.
        options["headers"] = {**headers, KEY_HEADER: identity.key, **({SCOPE_HEADER: scope} if scope else {})}
        return bind_handle(send(args, kwargs, options), identity, idem, deduplicated=False)
    # A caller that chose the task id (a frozen signature, a chain step, a group member) waits
    # on that id: a duplicate of it is published anyway, and the worker replays into it.
    awaited_id = bool(options.get("task_id"))
    task_id = options.get("task_id") or str(uuid.uuid4())
    options["task_id"] = task_id
    options["headers"] = {**headers, KEY_HEADER: identity.key, **({SCOPE_HEADER: scope} if scope else {})}
    if staged:
        # The app writes the message to an outbox in the caller's transaction, which may roll
        # back: a claim made now would outlive it (and hand every later call a task id no message
        # carries). The worker claims the key, as for a message sent by name.
        return bind_handle(send(args, kwargs, options), identity, idem, deduplicated=False)
    policy = calls.policy
    claim_token = new_token()
    # The message carries its claim's token: a worker of another release, binding its arguments to
    # another fingerprint, still knows it for the call its record was claimed for (celery_idem.releases).
    options["headers"][CLAIM_HEADER] = claim_token

    def claim(fingerprint: str) -> Transition:
        return idem.store.claim(
            identity,
            fingerprint,
            task_id,
            pending_seconds=timing.pending_seconds(policy.pending_timeout_seconds, options, task.expires),
            ttl_seconds=policy.ttl_seconds,
            owner=claim_token,
            call=calls.kept_call(args, kwargs, options),
            # A mode that keeps no outcome for new calls: its ended run's record is this call's to take.
            settled_is_free=not calls.mode.keeps_outcome,
        )

    try:
        claimed = claim(fp)
        if claimed.decision is Decision.MISMATCH and claimed.record is not None:
            earlier = earlier_fingerprint(calls, args, kwargs)
            if earlier != fp and earlier == claimed.record.fingerprint:
                # Recorded by a celery-idem that kept defaults in the fingerprint: this very call.
                claimed = claim(earlier)
    except StoreUnavailableError:
        if not idem.proceed_unprotected("claim", identity, task_id):
            # The claim may have landed with only its reply lost: a PENDING record under a task
            # id no message will carry would hand every retry of the key that id. Give it back.
            settle.give_back(identity, claim_token, settled_is_fine=True, may_not_have_landed=True)
            raise
        return bind_handle(send(args, kwargs, options), identity, idem, deduplicated=False)
    idem.count("claims")
    record = claimed.record
    assert record is not None
    log_decision(claimed.decision, identity, task_id, record)

    if claimed.decision is Decision.NEW:
        if policy.results == "store" and not awaited_id and not _canvas(options) and not _child(task, options):
            # One write per outcome: the store holds it, and the handle returned here is the only
            # one this call has, and it reads the store. (A caller that chose the task id, a canvas,
            # or a running task whose children Celery records wait on that id through handles that
            # know no key: Celery writes those.)
            options.setdefault("ignore_result", True)
        try:
            sent = send(args, kwargs, options)
        except BaseException:
            if task.app.conf.task_always_eager:
                # The body ran inline in this call, its retries too, and nothing was queued: the
                # call is over, so free what it left unsettled under its task id (a Celery
                # retry's PENDING); an outcome the body stored stays.
                settle.give_back(identity, task_id, fence="task_id", settled_is_fine=True)
            else:
                # Publishing failed. The producer gives back only its own PENDING claim, fenced
                # by the token the claim minted: the broker's error can come after the message
                # got through (a publisher-confirm timeout, kombu's retried publish), and a
                # worker that took the record holds it under its own token, so it stays.
                settle.give_back(identity, record.owner, settled_is_fine=True)
            raise  # the broker's own error, unwrapped
        return bind_handle(sent, identity, idem, deduplicated=False, record=record)
    # A chain step that replace() handed the record to, published later by the step before it: the
    # store holds the record under exactly the token it carries (a forged one matches nothing). It
    # may carry other arguments than the record's (a poll one try later): the same attempt chain.
    token = headers.get(HANDOVER_HEADER)
    handed = isinstance(token, str) and record.held_by(token) and task_id == record.task_id
    if claimed.decision is Decision.MISMATCH and not handed:
        idem.count("mismatches")
        raise calls.mismatch(identity, record)
    if _RESENDING.get() == task_id == record.task_id and not handed:
        # The outbox's relay again, for the call it claimed before (see resending).
        if record.state is State.PENDING and not record.attempt:
            options["headers"][CLAIM_HEADER] = record.owner  # the token its record is held under
            return bind_handle(send(args, kwargs, options), identity, idem, deduplicated=False, record=record)
        return bind_handle(task.AsyncResult(task_id), identity, idem, deduplicated=False, record=record)
    idem.count("replays" if claimed.decision is Decision.REPLAY else "duplicates")
    if policy.on_duplicate == "raise" and not handed:
        raise calls.duplicate(identity, record)
    copy = task_id == record.task_id and not handed  # the original's own id again
    if not copy and (awaited_id or any(options.get(name) for name in _CONTINUATIONS)):
        # Published anyway: the worker replays the outcome into the chain (or under the id the
        # caller waits on) instead of running the body.
        return bind_handle(send(args, kwargs, options), identity, idem, deduplicated=True, record=record)
    return bind_handle(task.AsyncResult(record.task_id), identity, idem, deduplicated=True, record=record)


def stages_messages(app: Any) -> bool:
    """Whether ``app.send_task`` writes messages to a transactional outbox in the caller's database
    transaction instead of publishing them: django-celery-outbox's ``OutboxCelery`` (and its
    subclasses). Its relay publishes them after the commit, with the options a call was given but
    not its headers."""
    return _stages(type(app))  # type: ignore[arg-type]  # a class is hashable


@functools.lru_cache(maxsize=64)
def _stages(app_class: type) -> bool:
    """:func:`stages_messages` of an app class, judged once per class (every publish asks)."""
    return any(klass.__module__.partition(".")[0] == "django_celery_outbox" for klass in app_class.__mro__)


def _carrying_identity(send: Callable[[Any, Any, dict[str, Any]], Any]) -> Callable[[Any, Any, dict[str, Any]], Any]:
    """``send`` with the call's idempotency headers given as options too: an outbox that keeps a
    call's options but drops its headers (django-celery-outbox) still relays them, as message
    properties, which ``before_task_publish`` moves back into the headers (celery_idem.signals)."""

    def carrying(args: Any, kwargs: Any, options: dict[str, Any]) -> Any:
        headers = options.get("headers") or {}
        for name in OPTION_HEADERS:
            if headers.get(name) is not None:
                options.setdefault(name, headers[name])
        return send(args, kwargs, options)

    return carrying


def _canvas(options: Mapping[str, Any]) -> bool:
    """Whether Celery's canvas publishes this call (a chain step, a group or chord member, a link
    the worker applies): its result is read through the backend by a handle that knows no key."""
    # A chain's last step carries chain=[]: present, not None.
    return any(options.get(name) is not None for name in (*_CONTINUATIONS, "parent_id", "root_id", "group_index"))


def _child(task: Any, options: Mapping[str, Any]) -> bool:
    """Whether Celery records this call in the running task's children (``parent.children``,
    ``collect()``): a call made inside a task body on a worker, unless ``add_to_parent=False``."""
    return options.get("add_to_parent", True) is not False and task.app.current_worker_task is not None


def _handing_over(task: Any, task_id: str | None, identity: Identity) -> bool:
    """Whether this publish is the replacement a running attempt of this task hands its record to:
    known from the attempt on this thread, never from a header (headers are input)."""
    attempt = attempts.current(task)
    return attempt is not None and attempt.handed_over and task_id == attempt.task_id and (identity == attempt.identity)
