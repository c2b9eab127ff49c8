"""The state machine driver: what happens to a call (producer side) and to a message (worker side).

Everything celery-idem decides about one task lives here; IdempotentTask only hands its calls over.

Producer (``publish``): validate key and scope, fingerprint, claim, then
    NEW       -> publish (and give the claim back if publishing fails)
    DUPLICATE -> hand back the original task id, publish nothing
    REPLAY    -> hand back the stored outcome, publish nothing
    MISMATCH  -> PayloadMismatchError
A duplicate that carries a continuation (link, chain, chord, group) is published anyway: the worker
replays the stored outcome into it instead of running the body.

Worker (``run``): acquire, then
    RUN    -> run the body under a heartbeat; complete, fail or release by the owner token
    REPLAY -> return or raise the stored outcome without running
    BUSY   -> look again until the running attempt settles, then replay it (celery_idem.busy)
    MISMATCH -> PayloadMismatchError, record untouched
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import Task as CeleryTask
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from . import attempts, evidence, outage, replacement, timing
from .busy import BusyWait
from .calls import encode_call, published_options
from .errors import (
    ConfigurationError,
    DuplicateTaskError,
    IdempotencyError,
    InvalidKeyError,
    LedgerUnavailableError,
    LockLostError,
    PayloadMismatchError,
    SerializationError,
    StoreUnavailableError,
)
from .failures import FailureClass, classify_failure
from .fingerprint import check_key_args, fingerprint, validate_key, validate_scope
from .outcome import encode_result
from .owners import worker_token
from .protocol import (
    BYPASS_HEADER,
    HANDOVER_HEADER,
    KEY_HEADER,
    SCOPE_HEADER,
    request_header,
)
from .pydantic_sets import parameter_shapes
from .records import Decision, ErrorInfo, IdempotencyRecord, Identity, Transition
from .result import bind_handle
from .stores.base import Fence, new_token

if TYPE_CHECKING:
    from .config import IdempotencyPolicy
    from .heartbeat import Lease
    from .runtime import Runtime

__all__ = ["HandledTask", "Handler"]

_CONTINUATIONS = ("link", "link_error", "chain", "chord", "group_id")

logger = logging.getLogger("celery_idem.handler")


class HandledTask:
    """The mark of a task class whose calls go through a :class:`Handler` (``IdempotentTask``, which
    gives its handler as ``idempotency_handler``): the signal hooks tell celery-idem's tasks by it."""

    app: Any


class Handler:
    """Drives one task's calls and messages through the store. One per task, built on first use."""

    def __init__(self, idem: Runtime, task: Any) -> None:
        self.idem = idem
        self.task = task
        self.policy: IdempotencyPolicy = idem.policy_for(task)
        self.serializer: str = task.serializer or task.app.conf.task_serializer or "json"
        if self.serializer == "pickle" and not idem.settings.accept_pickle:
            raise ConfigurationError(
                f"task {task.name!r} uses the pickle serializer, which celery-idem refuses by default: "
                "a stored pickle runs code when replayed; use json, or set accept_pickle=True"
            )
        self._run_function: Callable[..., Any] = task.run
        self._autoretry_for: tuple[type[BaseException], ...] = tuple(getattr(task, "autoretry_for", ()) or ())
        # Celery checks a call against the signature only while the task's typing is on (it
        # defaults to app.strict_typing): with it off, the call is fingerprinted as given.
        self._typed = bool(task.app.strict_typing if task.typing is None else task.typing)
        self._sets = parameter_shapes(task)  # a pydantic=True task's set fields, sent as lists
        if self.policy.key_args is not None:
            check_key_args(self._run_function, self.policy.key_args, task_name=task.name, typed=self._typed)

    # ---- identity ------------------------------------------------------------------------------

    def fingerprint(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        return fingerprint(self._run_function, args, kwargs, key_args=self.policy.key_args,
                           serializer=self.serializer, bind=self._typed, sets=self._sets)  # fmt: skip

    def identify(self, key: Any, scope: Any, fp: str) -> Identity:
        """Validate the caller's key and scope; a call without a key is keyed by its fingerprint."""
        scope_value = validate_scope(scope)
        if key is None:
            if self.policy.require_key:
                raise InvalidKeyError(
                    f"task {self.task.name!r} requires an idempotency key (require_key=True); "
                    "call it with apply_async(..., idempotency_key='...')",
                    task_name=self.task.name,
                )
            return Identity(scope_value, self.task.name, fp)
        return Identity(scope_value, self.task.name, validate_key(key))

    # ---- producer side -------------------------------------------------------------------------

    def publish(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: dict[str, Any],
        send: Callable[[Any, Any, dict[str, Any]], Any],
    ) -> Any:
        """Claim, then publish through ``send`` (Celery's own apply_async) or hand back the original."""
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

        args, kwargs = self.as_sent(args, kwargs, options)
        fp = self.fingerprint(args, kwargs)
        if key is None and scope is None:
            key, scope = self._running_identity(fp)
        identity = self.identify(key, scope, fp)
        if self._handing_over(options.get("task_id"), identity):
            # replace() with this very call: the record is handed to this message (replacement.py),
            # so there is nothing to claim, and a store outage must not stop it from being sent.
            options["headers"] = {**headers, KEY_HEADER: identity.key, **({SCOPE_HEADER: scope} if scope else {})}
            return bind_handle(send(args, kwargs, options), identity, self.idem, deduplicated=False)
        # A caller that chose the task id (a frozen signature, a chain step, a group member) waits
        # on that id: a duplicate of it is published anyway, and the worker replays into it.
        awaited_id = bool(options.get("task_id"))
        task_id = options.get("task_id") or str(uuid.uuid4())
        options["task_id"] = task_id
        options["headers"] = {**headers, KEY_HEADER: identity.key, **({SCOPE_HEADER: scope} if scope else {})}
        policy = self.policy
        claim_token = new_token()
        try:
            claimed = self.idem.store.claim(
                identity,
                fp,
                task_id,
                pending_seconds=timing.pending_seconds(policy.pending_timeout_seconds, options, self.task.expires),
                ttl_seconds=policy.ttl_seconds,
                owner=claim_token,
                call=self._call(args, kwargs, options),
            )
        except StoreUnavailableError:
            if not self._proceed_unprotected("claim", identity, task_id):
                # The claim may have landed with only its reply lost: a PENDING record under a task
                # id no message will carry would hand every retry of the key that id. Give it back.
                self._give_back(identity, claim_token, settled_is_fine=True)
                raise
            return bind_handle(send(args, kwargs, options), identity, self.idem, deduplicated=False)
        self.idem.count("claims")
        record = claimed.record
        assert record is not None
        self._log(claimed.decision, identity, task_id, record)

        if claimed.decision is Decision.NEW:
            try:
                sent = send(args, kwargs, options)
            except BaseException:
                if self.task.app.conf.task_always_eager:
                    # The body ran inline in this call, its retries too, and nothing was queued: the
                    # call is over, so free what it left unsettled under its task id (a Celery
                    # retry's PENDING); an outcome the body stored stays.
                    self._give_back(identity, task_id, fence="task_id", settled_is_fine=True)
                else:
                    # Publishing failed. The producer gives back only its own PENDING claim, fenced
                    # by the token the claim minted: the broker's error can come after the message
                    # got through (a publisher-confirm timeout, kombu's retried publish), and a
                    # worker that took the record holds it under its own token, so it stays.
                    self._give_back(identity, record.owner, settled_is_fine=True)
                raise  # the broker's own error, unwrapped
            return bind_handle(sent, identity, self.idem, deduplicated=False, record=record)
        # A chain step that replace() handed the record to, published later by the step before it: the
        # store holds the record under exactly the token it carries (a forged one matches nothing). It
        # may carry other arguments than the record's (a poll one try later): the same attempt chain.
        token = headers.get(HANDOVER_HEADER)
        handed = isinstance(token, str) and token == record.owner and task_id == record.task_id
        if claimed.decision is Decision.MISMATCH and not handed:
            self.idem.count("mismatches")
            raise self._mismatch(identity, record)
        self.idem.count("replays" if claimed.decision is Decision.REPLAY else "duplicates")
        if policy.on_duplicate == "raise" and not handed:
            raise DuplicateTaskError(
                f"task {self.task.name!r} with idempotency key {identity.key!r} is a duplicate of task "
                f"{record.task_id} ({record.state.value}); on_duplicate='raise' refuses it",
                key=identity.key,
                task_name=self.task.name,
                task_id=record.task_id,
            )
        copy = task_id == record.task_id and not handed  # the original's own id again
        if not copy and (awaited_id or any(options.get(name) for name in _CONTINUATIONS)):
            # Published anyway: the worker replays the outcome into the chain (or under the id the
            # caller waits on) instead of running the body.
            return bind_handle(send(args, kwargs, options), identity, self.idem, deduplicated=True, record=record)
        return bind_handle(self.task.AsyncResult(record.task_id), identity, self.idem, deduplicated=True, record=record)

    def _continues_its_chain(self) -> bool:
        """Whether the running message says it continues its task id's attempt chain, which may carry
        other arguments than the record's: Celery's retry (``retries > 0``), or a replacement (or a
        copy of one: a redelivery, a requeue) that a replaced attempt handed its record to. Both are
        fields a producer could set, so the store grants it only under the record's own task id (a
        random id: whoever knows it can publish under it anyway) and once an attempt has run."""
        request = self.task.request
        return bool(request.retries) or isinstance(request_header(request, HANDOVER_HEADER), str)

    def _handing_over(self, task_id: str | None, identity: Identity) -> bool:
        """Whether this publish is the replacement a running attempt of this task hands its record to:
        known from the attempt on this thread, never from a header (headers are input)."""
        attempt = attempts.current(self.task)
        return (
            attempt is not None
            and attempt.handed_over
            and task_id == attempt.task_id
            and (identity == attempt.identity)
        )

    def as_sent(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any]
    ) -> tuple[Any, Any]:
        """The arguments as Celery sends them: a ``pydantic=True`` task's models dumped, as Celery's
        apply_async does (5.5+, for every serializer but pickle). The fingerprint and the kept call
        are taken of what the worker will receive, never of the models."""
        dump = getattr(self.task, "_dump_pydantic_arguments", None)
        if dump is None or (options.get("serializer") or self.serializer) == "pickle":
            return args, kwargs
        dumped: tuple[Any, Any] = dump(args, kwargs)
        return dumped

    def _running_identity(self, fp: str) -> tuple[str | None, str | None]:
        """A key-less call of this task from inside its own body, with the same arguments, is the
        running call itself: it inherits that call's key and scope (and so gets its own id back)."""
        attempt = attempts.current(self.task)
        if attempt is not None and attempt.fingerprint == fp:
            return attempt.identity.key, attempt.identity.scope or None
        return None, None

    def _call(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any] | None = None
    ) -> bytes | None:
        """The call as the reconciler delivers it again (celery_idem.calls); kept only when the policy
        requeues. ``options`` are the publish-time ones; without them, the running message's own,
        as Celery re-publishes it (Task.retry): the arguments, routing and retries of this attempt."""
        if self.policy.stale_action != "requeue":
            return None
        if options is None:
            options = self.task.signature_from_request(self.task.request, args, kwargs).options
        else:
            options = published_options(options, stamped=options.get("stamped_headers") or ())
        return encode_call(self.task.name, args, kwargs, options, serializer=self.serializer)

    def _give_back(
        self,
        identity: Identity,
        token: str,
        pending_seconds: float | None = None,
        *,
        fence: Fence = "owner",
        settled_is_fine: bool = False,
    ) -> None:
        """Release under ``token``; a store error here is logged, never raised over the real error."""
        try:
            answer = self.idem.store.release(identity, token, pending_seconds=pending_seconds, fence=fence)
        except IdempotencyError as exc:
            logger.warning("could not release %s: %s; it frees itself when its lease runs out", identity, exc)
            self.idem.count("store_errors")
            return
        if not answer.ok and not settled_is_fine:
            self.idem.count("lost_locks")
            logger.warning("release of %s was LOST: another attempt owns it now", identity)

    # ---- worker side ---------------------------------------------------------------------------

    def run(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Acquire and run the body once per identity, or replay/wait/refuse."""
        task, request = self.task, self.task.request
        if request_header(request, BYPASS_HEADER) is False:
            request.idempotency_key = request.idempotency_scope = None  # bypassed: the body holds no identity
            return self._run_function(*args, **kwargs)
        fp = self.fingerprint(args, kwargs)
        key, scope = request_header(request, KEY_HEADER), request_header(request, SCOPE_HEADER)
        identity = self.identify(key, scope, fp)
        if key is not None and KEY_HEADER not in (request.headers or {}):
            # Delivered as a message property: a retry or a re-publish copies the headers only.
            request.headers = {**(request.headers or {}), KEY_HEADER: key, **({SCOPE_HEADER: scope} if scope else {})}
        request.idempotency_key = identity.key
        request.idempotency_scope = identity.scope or None
        attempts.begin(task, identity, fp)  # what the library keeps of this attempt: never on the request
        task_id = request.id
        policy = self.policy
        # The store is opened by the first look, inside the outage handling below.
        wait = BusyWait(task, identity, policy, lambda: self.idem.store, self.republish, self.idem.count)
        call = self._call(args, kwargs)
        while True:
            owner = worker_token(getattr(request, "hostname", None), self.idem.heartbeat.process_id)
            try:
                # A replacement takes the record its replaced attempt handed it, by its token, first.
                taken = replacement.take_over(self, identity, owner) or self.idem.store.acquire(
                    identity,
                    fp,
                    task_id,
                    lease_seconds=policy.lease_seconds,
                    ttl_seconds=policy.ttl_seconds,
                    owner=owner,
                    call=call,
                    next_look_seconds=wait.next_look_seconds(),
                    retry=self._continues_its_chain(),
                )
            except StoreUnavailableError as exc:
                if self._proceed_unprotected("acquire", identity, task_id):
                    return self._run_function(*args, **kwargs)
                if request.is_eager or outage.gives_up(request, exc):
                    # No broker keeps an eager call (and a store error no outage mapping knows that
                    # outlived every trip back may never pass): the caller is told. The acquire that
                    # may have landed (reply lost) is given back whole, and so is the claim waiting
                    # under this task id, which no message will carry now.
                    self._give_back(identity, owner, settled_is_fine=True)
                    self._give_back(identity, task_id, fence="task_id", settled_is_fine=True)
                    raise
                # The acquire may have landed with only its reply lost: hand the record back to
                # PENDING for the message kept below, or its copy would wait out a lease nobody holds.
                pending = timing.pending_seconds(policy.pending_timeout_seconds, {}, request.expires)
                self._give_back(identity, owner, pending, settled_is_fine=True)
                raise outage.keep_message(task, args, kwargs, exc, self.republish) from None
            record = taken.record
            assert record is not None
            self._log(taken.decision, identity, task_id, record)
            if taken.decision is Decision.RUN:
                return self._run_owned(record, args, kwargs)
            if taken.decision is Decision.REPLAY:
                if (quiet := wait.replayed(record)) is not None:
                    raise quiet
                self.idem.count("replays")
                return self.idem.replay(record)
            if taken.decision is Decision.MISMATCH:
                self.idem.count("mismatches")
                raise wait.mismatched(record) or self._mismatch(identity, record)
            wait.busy(record, args, kwargs)  # BUSY: another attempt holds a live lease (celery_idem.busy)

    def republish(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        countdown: float,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """Send this very message again (same id, options and retries count) ``countdown`` seconds
        from now, through Celery's own apply_async: a re-publish is never claimed again.

        Raises:
            Reject: the broker refused the re-publish too; with ``acks_late`` the message is requeued.
        """
        task, request = self.task, self.task.request
        options = task.signature_from_request(request, args, kwargs, countdown=countdown).options
        options["headers"] = {**(options.get("headers") or {}), **(headers or {})}
        try:
            CeleryTask.apply_async(task, args, kwargs, **{**options, "retries": request.retries})
        except Exception as exc:
            logger.error("could not send task %s (%s) back to the broker: %s; rejecting it", task.name, request.id, exc)
            raise Reject(exc, requeue=True) from exc

    def _run_owned(self, record: IdempotencyRecord, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        identity, owner, policy, store = record.identity, record.owner, self.policy, self.idem.store
        attempt = attempts.current(self.task)
        assert attempt is not None  # begun by run()
        # The caller's call, which a retry with changed arguments still answers for (the ledger checks it).
        attempt.fingerprint, attempt.owner = record.fingerprint, owner
        # The lease is kept from the moment it is taken: reading an earlier attempt's evidence may take
        # longer than the lease, and a record left unrenewed meanwhile would be taken by a copy.
        lease = attempt.lease = self.idem.heartbeat.add(store, identity, owner, policy.lease_seconds)
        try:
            found = evidence.earlier_outcome(self.idem, self.task, record)  # its body may have run
            if found is not None:
                return found.value
            if lease.lost:
                raise self._lost(record, "before its body ran")
            try:
                value = self._run_function(*args, **kwargs)
            except BaseException as exc:
                self._settle_exception(record, exc, lease)
                raise
            if isinstance(value, Retry):
                # ``return self.retry(throw=False)``: the retry is sent, so it settles as a raised one.
                # Eager, Celery's apply runs a returned Retry's retry inline, so it is returned; on a
                # worker it is raised (state RETRY), where Celery would try to store it as the result.
                self._settle_exception(record, value, lease)
                if self.task.request.is_eager:
                    return value
                raise value
            try:
                self._settle_value(record, value)
            except SoftTimeLimitExceeded:
                # The body returned: a time limit that strikes while its value is stored must not
                # turn the effect into a failure the reconciler would free the key on.
                self._defer_value(record, value)
            return value
        finally:
            self.idem.heartbeat.remove(lease)

    def _defer_value(self, record: IdempotencyRecord, value: Any) -> None:
        """Hand the value's write to the heartbeat thread, and leave it in the result backend."""
        identity, owner, store = record.identity, record.owner, self.idem.store
        logger.warning("the soft time limit struck while %s stored its outcome: the heartbeat stores it", identity)
        payload, content_type, encoding = encode_result(value, self.serializer)
        self._defer(identity, owner, lambda: store.complete(
            identity, owner, payload, content_type=content_type, content_encoding=encoding
        ))  # fmt: skip
        evidence.leave(self.task, value)

    def _settle_exception(self, record: IdempotencyRecord, exc: BaseException, lease: Lease) -> None:
        """What an attempt that ended by raising leaves behind (DESIGN §3, "Not failures"):

        Retry                 -> PENDING past its countdown (the retry message is this attempt chain)
        Ignore from replace() -> the replacement's (handed over, or settled by callbacks: replacement.py)
        Reject(requeue=True)  -> PENDING when the message really goes back (acks_late), else freed
        anything else         -> stored (permanent: Reject, Ignore, PermanentError...) or freed,
                                 unless the ledger holds the call committed (then COMPLETED)
        """
        identity, owner, policy = record.identity, record.owner, self.policy
        if isinstance(exc, Retry):
            # The retry message inherits this message's expiry: the claim never outlives it.
            delay = {"countdown": exc.when} if isinstance(exc.when, (int, float)) else {"eta": exc.when}
            pending = timing.pending_seconds(policy.pending_timeout_seconds, delay, self.task.request.expires)
            self._give_back(identity, owner, pending_seconds=pending)
        elif isinstance(exc, Ignore) and (attempt := attempts.current(self.task)) and attempt.replaced:
            replacement.await_replacement(self, attempt, lease)
        elif isinstance(exc, Reject) and exc.requeue:
            requeued = bool(self.task.acks_late)  # an early-acked message is gone: Celery drops it
            pending = timing.pending_seconds(policy.pending_timeout_seconds, {}, self.task.request.expires)
            self._give_back(identity, owner, pending_seconds=pending if requeued else None)
        else:
            self.settle_failure(identity, owner, exc, record.fingerprint, earlier_attempts=record.attempt > 1)

    def _settle_value(self, record: IdempotencyRecord, value: Any) -> None:
        """The body returned: the effect happened. Store the value (an unstorable one is stored as a
        permanent failure about it); a store outage is retried while the lease lasts, then left as
        evidence for the reconciler."""
        written = self.store_value(record.identity, record.owner, record.task_id, value)
        if written is None:
            evidence.leave(self.task, value)
        elif not written:
            raise self._lost(record, "its outcome was not stored")

    def _lost(self, record: IdempotencyRecord, consequence: str) -> LockLostError:
        return LockLostError(
            f"task {self.task.name!r} ({record.task_id}) lost its lease on idempotency key "
            f"{record.key!r} to another attempt; {consequence}",
            key=record.key,
            task_name=self.task.name,
            task_id=record.task_id,
        )

    def store_value(self, identity: Identity, owner: str, task_id: str, value: Any) -> bool | None:
        """Complete with ``value``, as :meth:`_write` answers.

        Raises:
            SerializationError: ``value`` cannot be encoded, or is over max_result_bytes; the record
                is FAILED with this error (the effect happened: the key is never freed).
        """
        store = self.idem.store
        try:
            payload, content_type, encoding = encode_result(value, self.serializer)
            return self._write(identity, owner, task_id, lambda: store.complete(
                identity, owner, payload, content_type=content_type, content_encoding=encoding
            ))  # fmt: skip
        except SerializationError as exc:
            error = ErrorInfo.from_exception(exc)
            self._write(identity, owner, task_id, lambda: store.fail(identity, owner, error))
            raise

    def _write(self, identity: Identity, owner: str, task_id: str, write: Callable[[], Transition]) -> bool | None:
        """Settle the record through ``write``: True (written), False (LOST: another attempt owns it),
        None (the store did not answer while the lease lasted, or the soft time limit struck: the
        heartbeat thread goes on trying, so the outcome lands as soon as the store is back, before a
        duplicate can take the lease that ran out meanwhile)."""
        try:
            return self._write_while_the_lease_lasts(identity, owner, task_id, write)
        except SoftTimeLimitExceeded:
            # Struck anywhere in the write or its retries: whether it landed is unknown, and this
            # thread must stop. The heartbeat finishes it; the task keeps its own ending.
            logger.warning("the soft time limit struck while %s (task %s) was settled: the heartbeat "
                           "finishes the write", identity, task_id)  # fmt: skip
            self._defer(identity, owner, write)
            return None

    def _write_while_the_lease_lasts(
        self, identity: Identity, owner: str, task_id: str, write: Callable[[], Transition]
    ) -> bool | None:
        deadline = time.monotonic() + self.policy.lease_seconds
        pause = 0.05
        retried = False
        while True:
            try:
                answer = write()
                if not answer.ok and retried and self._settled_by(identity, owner):
                    return True  # an earlier try was written and only its reply was lost
            except StoreUnavailableError as exc:
                retried = True
                self.idem.count("store_errors")
                if time.monotonic() + pause >= deadline:
                    logger.error("could not settle %s (task %s) while its lease lasted: %s; the heartbeat "
                                 "goes on trying", identity, task_id, exc)  # fmt: skip
                    self._defer(identity, owner, write)
                    return None
                logger.warning("settling %s (task %s) failed, retrying in %gs: %s", identity, task_id, pause, exc)
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            if not answer.ok:
                self.idem.count("lost_locks")
                logger.warning("outcome of %s (task %s) was LOST: another attempt owns the record", identity, task_id)
            return answer.ok

    def _defer(self, identity: Identity, owner: str, write: Callable[[], Transition]) -> None:
        """Hand ``write`` to the heartbeat thread, which tries it until it lands or the record expires."""
        landed = functools.partial(self._settled_by, identity, owner)
        self.idem.heartbeat.defer(identity, write, landed, seconds=self.policy.ttl_seconds)

    def _settled_by(self, identity: Identity, owner: str) -> bool:
        """Whether the record stands settled under ``owner``'s token (its own write landed)."""
        try:
            record = self.idem.store.get(identity)
        except StoreUnavailableError:
            return False
        return record is not None and record.state.settled and record.owner == owner

    def classify(self, exc: BaseException) -> FailureClass:
        """``"permanent"`` (stored and replayed) or ``"retryable"`` (released) for an exception."""
        return classify_failure(exc, self.policy, self._autoretry_for)

    def settle_failure(
        self,
        identity: Identity,
        owner: str,
        exc: BaseException,
        fingerprint: str | None = None,
        *,
        earlier_attempts: bool = False,
    ) -> None:
        """Store a permanent failure, or free the key after a retryable one (``SystemExit`` and
        any other non-``Exception`` too). Where the ledger holds the call committed, the record is
        completed with the ledger's value instead, whatever was raised: the ledger wins. The
        exception still propagates (the task did raise); results read through celery-idem answer
        with the record.
        """
        retryable = not isinstance(exc, Exception) or self.classify(exc) == "retryable"
        attempt = attempts.current(self.task)  # None: a callback settles a replaced attempt's record
        # Whether an effect of this identity may stand committed: this attempt called run_once, or
        # an earlier attempt (a retry, a redelivery, a takeover) ran and may have.
        touched = (attempt is not None and attempt.ledger_nonce is not None) or (
            earlier_attempts and self.idem.settings.ledger is not None
        )
        if retryable and not touched:
            self._give_back(identity, owner)
            return
        try:
            entry = self.idem.committed(identity, fingerprint, attempt.ledger if attempt else None)
        except LedgerUnavailableError as down:
            if touched:
                # Unknown is not failed: no outcome is stored and the key is not freed. The lease runs
                # out and the reconciler settles the record from the ledger once it answers.
                logger.warning("%s raised %r and the ledger cannot say whether its effect committed (%s): "
                               "left to the reconciler", identity, exc, down)  # fmt: skip
                return
            logger.warning("%s; the failure is stored", down)
            entry = None
        except Exception as broken:  # noqa: BLE001 - a misconfigured ledger never hides the task's error
            logger.error("could not read the ledger for %s: %r; the failure stands", identity, broken)
            entry = None
        store = self.idem.store
        if entry is not None:
            logger.warning("%s raised %r after its effect committed: completed from the ledger", identity, exc)
            self._write(identity, owner, "-", lambda: store.complete(
                identity, owner, entry.result or b"null", content_type=entry.content_type or "application/json",
                content_encoding=entry.content_encoding or "utf-8",
            ))  # fmt: skip
            return
        if retryable:
            self._give_back(identity, owner)
        else:
            self._write(identity, owner, "-", lambda: store.fail(identity, owner, ErrorInfo.from_exception(exc)))

    # ---- shared --------------------------------------------------------------------------------

    def _mismatch(self, identity: Identity, record: IdempotencyRecord) -> PayloadMismatchError:
        return PayloadMismatchError(
            f"idempotency key {identity.key!r} of task {self.task.name!r} was first used with other arguments "
            f"(task {record.task_id}, {record.state.value}); a new call needs a new key",
            key=identity.key,
            task_name=self.task.name,
            task_id=record.task_id,
        )

    def _proceed_unprotected(self, operation: str, identity: Identity, task_id: str) -> bool:
        """Count a store outage; True (and a warning) when the settings say run on without the store."""
        self.idem.count("store_errors")
        if self.idem.settings.on_store_error != "proceed":
            return False
        logger.warning(
            "store unavailable at %s of %s (task %s): proceeding unprotected (on_store_error='proceed')",
            operation,
            identity,
            task_id,
            exc_info=True,
        )
        return True

    def _log(self, decision: Decision, identity: Identity, task_id: str, record: IdempotencyRecord) -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "%s key=%s scope=%s task=%s task_id=%s record_task_id=%s state=%s",
                decision.value,
                identity.key,
                identity.scope or "-",
                identity.task_name,
                task_id,
                record.task_id,
                record.state.value,
            )
