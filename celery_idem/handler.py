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
    BUSY   -> wait for the running attempt (on_busy="wait") or retry later (on_busy="retry")
    MISMATCH -> PayloadMismatchError, record untouched
"""

from __future__ import annotations

import datetime
import inspect
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from celery.exceptions import Retry, SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.utils import json as kombu_json

from .errors import (
    ConfigurationError,
    DuplicateTaskError,
    IdempotencyError,
    InvalidKeyError,
    LockLostError,
    PayloadMismatchError,
    PermanentError,
    RetryableError,
    SerializationError,
    StoreUnavailableError,
)
from .fingerprint import fingerprint, validate_key, validate_scope
from .outcome import encode_result, replay
from .records import Decision, ErrorInfo, IdempotencyRecord, Identity
from .stores.base import Fence

if TYPE_CHECKING:
    from .config import IdempotencyPolicy
    from .extension import Idempotency

__all__ = ["BYPASS_HEADER", "KEY_HEADER", "SCOPE_HEADER", "Handler", "classify_failure", "request_header"]

KEY_HEADER, SCOPE_HEADER, BYPASS_HEADER = "idempotency_key", "idempotency_scope", "idempotency"
_CONTINUATIONS = ("link", "link_error", "chain", "chord", "group_id")
# Failures that are transient by nature, whatever default_failure says.
_TRANSIENT: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    KombuOperationalError,
    TimeLimitExceeded,
    SoftTimeLimitExceeded,
    WorkerLostError,
    RetryableError,
    Retry,
)
_TRANSIENT_NAMES = frozenset({"ConnectionError", "TimeoutError", "Timeout"})

logger = logging.getLogger("celery_idem.handler")
FailureClass = Literal["retryable", "permanent"]


def request_header(request: Any, name: str) -> Any:
    """A message header as a task request holds it: in ``headers`` (eager mode, and on workers),
    or as an attribute (workers merge message headers into the request)."""
    return (request.headers or {}).get(name, getattr(request, name, None))


def classify_failure(
    exc: BaseException, policy: IdempotencyPolicy, autoretry_for: Sequence[type[BaseException]] = ()
) -> FailureClass:
    """``"permanent"`` (stored and replayed) or ``"retryable"`` (released) for an exception.

    The policy's and the marker's permanent classes win; then the retryable ones (the markers,
    Celery's Retry, the task's autoretry_for, the policy's list, connection and timeout errors,
    time limits, a lost worker); anything else follows ``policy.default_failure``.
    """
    if isinstance(exc, (PermanentError, *policy.permanent)):
        return "permanent"
    if isinstance(exc, (*_TRANSIENT, *autoretry_for, *policy.retryable)):
        return "retryable"
    if any(c.__name__ in _TRANSIENT_NAMES for c in type(exc).__mro__):
        return "retryable"
    return policy.default_failure


def _delay_seconds(options: Mapping[str, Any]) -> float:
    """How far in the future a countdown or ETA puts the message (its PENDING lease grows by it)."""
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown:
        return max(float(countdown), 0.0)
    if isinstance(eta, str):
        eta = datetime.datetime.fromisoformat(eta)
    if isinstance(eta, datetime.datetime):
        now = datetime.datetime.now(eta.tzinfo) if eta.tzinfo else datetime.datetime.now()
        return max((eta - now).total_seconds(), 0.0)
    return 0.0


class Handler:
    """Drives one task's calls and messages through the store. One per task, built on first use."""

    def __init__(self, idem: Idempotency, task: Any) -> None:
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
        if self.policy.key_args is not None:
            self._check_key_args(self.policy.key_args)

    # ---- identity ------------------------------------------------------------------------------

    def _check_key_args(self, key_args: Sequence[str]) -> None:
        """A key_args typo fails at the task's first call, naming the parameters it has."""
        params = inspect.signature(self._run_function).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        missing = [name for name in key_args if name not in params]
        if missing:
            raise ConfigurationError(
                f"key_args of task {self.task.name!r} names {', '.join(map(repr, missing))}, "
                f"not parameters of {self.task.name}{inspect.signature(self._run_function)}"
            )

    def fingerprint(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        return fingerprint(self._run_function, args, kwargs, key_args=self.policy.key_args, serializer=self.serializer)

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

        fp = self.fingerprint(args, kwargs)
        if key is None and scope is None:
            key, scope = self._running_identity(fp)
        identity = self.identify(key, scope, fp)
        # A caller that chose the task id (a frozen signature, a chain step, a group member) waits
        # on that id: a duplicate of it is published anyway, and the worker replays into it.
        awaited_id = bool(options.get("task_id"))
        task_id = options.get("task_id") or str(uuid.uuid4())
        options["task_id"] = task_id
        options["headers"] = {**headers, KEY_HEADER: identity.key, **({SCOPE_HEADER: scope} if scope else {})}
        policy = self.policy
        try:
            claimed = self.idem.store.claim(
                identity,
                fp,
                task_id,
                pending_seconds=policy.pending_timeout_seconds + _delay_seconds(options),
                ttl_seconds=policy.ttl_seconds,
                call=self._call(args, kwargs),
            )
        except StoreUnavailableError:
            if not self._proceed_unprotected("claim", identity, task_id):
                raise
            return self._result(send(args, kwargs, options), identity, deduplicated=False)
        self.idem.count("claims")
        record = claimed.record
        assert record is not None
        self._log(claimed.decision, identity, task_id, record)

        if claimed.decision is Decision.NEW:
            try:
                sent = send(args, kwargs, options)
            except BaseException:
                # The call is over: publishing failed, or (eager mode) the body ran inline and raised.
                # Free whatever is still unsettled under this call's task id; an outcome the body
                # already stored stays. The broker's own error propagates, unwrapped.
                self._give_back(identity, task_id, fence="task_id", settled_is_fine=True)
                raise
            return self._result(sent, identity, deduplicated=False)
        if claimed.decision is Decision.MISMATCH:
            self.idem.count("mismatches")
            raise self._mismatch(identity, record)
        self.idem.count("replays" if claimed.decision is Decision.REPLAY else "duplicates")
        if policy.on_duplicate == "raise":
            raise DuplicateTaskError(
                f"task {self.task.name!r} with idempotency key {identity.key!r} is a duplicate of task "
                f"{record.task_id} ({record.state.value}); on_duplicate='raise' refuses it",
                key=identity.key,
                task_name=self.task.name,
                task_id=record.task_id,
            )
        if awaited_id or any(options.get(name) for name in _CONTINUATIONS):
            # Published anyway: the worker replays the outcome into the chain (or under the id the
            # caller waits on) instead of running the body.
            return self._result(send(args, kwargs, options), identity, deduplicated=True)
        from .result import IdempotentResult

        return IdempotentResult(
            record.task_id,
            task_name=self.task.name,
            backend=self.task.backend,
            app=self.task.app,
            deduplicated=True,
            idempotency_key=identity.key,
            identity=identity,
            idempotency=self.idem,
            record=record if record.state.settled else None,
        )

    def _running_identity(self, fp: str) -> tuple[str | None, str | None]:
        """A key-less call of this task from inside its own body, with the same arguments, is the
        running call itself: it inherits that call's key and scope (and so gets its own id back)."""
        request = self.task.request
        if getattr(request, "idempotency_fingerprint", None) == fp:
            return request.idempotency_key, request.idempotency_scope
        return None, None

    def _call(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> bytes | None:
        """The call as the reconciler re-publishes it; kept only when the policy requeues."""
        if self.policy.stale_action != "requeue":
            return None
        text: str = kombu_json.dumps({"args": list(args or ()), "kwargs": dict(kwargs or {})})  # type: ignore[no-untyped-call]
        return text.encode("utf-8")

    def _result(self, result: Any, identity: Identity, *, deduplicated: bool) -> Any:
        result.deduplicated = deduplicated
        result.idempotency_key = identity.key
        result.identity = identity
        result.idempotency = self.idem
        return result

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
            return self._run_function(*args, **kwargs)
        fp = self.fingerprint(args, kwargs)
        identity = self.identify(request_header(request, KEY_HEADER), request_header(request, SCOPE_HEADER), fp)
        request.idempotency_key = identity.key
        request.idempotency_scope = identity.scope or None
        request.idempotency_fingerprint = fp
        task_id = request.id
        policy, store = self.policy, self.idem.store
        deadline: float | None = None
        pause = 0.02
        while True:
            try:
                taken = store.acquire(
                    identity,
                    fp,
                    task_id,
                    lease_seconds=policy.lease_seconds,
                    ttl_seconds=policy.ttl_seconds,
                    call=self._call(args, kwargs),
                )
            except StoreUnavailableError as exc:
                if self._proceed_unprotected("acquire", identity, task_id):
                    return self._run_function(*args, **kwargs)
                if isinstance(exc, self._autoretry_for):
                    # Fail closed, but keep the message: the user asked for retries on this error.
                    raise task.retry(exc=exc, **(getattr(task, "retry_kwargs", None) or {})) from exc
                raise
            record = taken.record
            assert record is not None
            self._log(taken.decision, identity, task_id, record)
            if taken.decision is Decision.RUN:
                return self._run_owned(record, args, kwargs)
            if taken.decision is Decision.REPLAY:
                self.idem.count("replays")
                return replay(record, self.idem.accepted_content_types)
            if taken.decision is Decision.MISMATCH:
                self.idem.count("mismatches")
                raise self._mismatch(identity, record)
            # BUSY: another attempt holds a live lease.
            if deadline is None:
                self.idem.count("busy_waits")
                deadline = time.monotonic() + (policy.busy_wait_seconds if policy.on_busy == "wait" else 0)
            if time.monotonic() >= deadline:
                raise task.retry(
                    countdown=policy.lease_seconds,
                    exc=DuplicateTaskError(
                        f"task {task.name!r} with idempotency key {identity.key!r} is still running as task "
                        f"{record.task_id}; retrying later",
                        key=identity.key,
                        task_name=task.name,
                        task_id=record.task_id,
                    ),
                )
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _run_owned(self, record: IdempotencyRecord, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        identity, owner, policy, store = record.identity, record.owner, self.policy, self.idem.store
        # The caller's call, which a retry with changed arguments still answers for (the ledger checks it).
        self.task.request.idempotency_fingerprint = record.fingerprint
        lease = self.idem.heartbeat.add(store, identity, owner, policy.lease_seconds)
        try:
            try:
                value = self._run_function(*args, **kwargs)
            except Retry as exc:
                # A retry is queued under this task id: keep the identity for it, past its countdown.
                when = exc.when if isinstance(exc.when, (int, float)) else _delay_seconds({"eta": exc.when})
                self._give_back(identity, owner, pending_seconds=policy.pending_timeout_seconds + (when or 0))
                raise
            except BaseException as exc:
                self._settle_failure(identity, owner, exc)
                raise
            try:
                payload, content_type, encoding = encode_result(value, self.serializer)
                answer = store.complete(identity, owner, payload, content_type=content_type, content_encoding=encoding)
            except SerializationError:
                self._give_back(identity, owner)  # nothing stays IN_PROGRESS
                raise
            except StoreUnavailableError:
                if not self._proceed_unprotected("complete", identity, record.task_id):
                    raise
                return value
            if not answer.ok:
                self.idem.count("lost_locks")
                raise LockLostError(
                    f"task {self.task.name!r} ({record.task_id}) lost its lease on idempotency key "
                    f"{identity.key!r} to another attempt; its outcome was not stored",
                    key=identity.key,
                    task_name=self.task.name,
                    task_id=record.task_id,
                )
            return value
        finally:
            self.idem.heartbeat.remove(lease)

    def classify(self, exc: BaseException) -> FailureClass:
        """``"permanent"`` (stored and replayed) or ``"retryable"`` (released) for an exception."""
        return classify_failure(exc, self.policy, self._autoretry_for)

    def _settle_failure(self, identity: Identity, owner: str, exc: BaseException) -> None:
        # SystemExit, KeyboardInterrupt...: never an outcome; and a retryable error never freezes a key.
        if not isinstance(exc, Exception) or self.classify(exc) == "retryable":
            self._give_back(identity, owner)
            return
        try:
            answer = self.idem.store.fail(identity, owner, ErrorInfo.from_exception(exc))
        except IdempotencyError as store_exc:
            logger.warning("could not store the failure of %s: %s", identity, store_exc)
            self.idem.count("store_errors")
            return
        if not answer.ok:
            self.idem.count("lost_locks")
            logger.warning("failure of %s was not stored: another attempt owns the record", identity)

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
