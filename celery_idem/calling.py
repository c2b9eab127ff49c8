"""How one task's calls are told apart: the fingerprint of a call, its identity, the arguments as
Celery sends them, and the call a record keeps for the reconciler to deliver again.

:class:`TaskCalls` is built once per task from its policy; the handler is one (it extends it), and
the producer side, the worker side, the signal hooks and replace() all identify a call through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import attempts, telemetry
from .arguments import check_key_args
from .calls import encode_call, published_options
from .config import IdempotencyPolicy
from .endings import IDEMPOTENT, Mode
from .errors import ConfigurationError, DuplicateTaskError, InvalidKeyError, PayloadMismatchError
from .fingerprint import fingerprint
from .keys import keyed_identity, validate_scope
from .outcome import serializer_of
from .pydantic_sets import parameter_shapes
from .records import Decision, IdempotencyRecord, Identity

__all__ = ["TaskCalls", "log_decision", "log_ending"]

logger = logging.getLogger("celery_idem.handler")  # the decision log users filter on (operations.md)


class TaskCalls:
    """The identity rules of one task under its policy and deduplication mode.

    Raises:
        ConfigurationError: the task uses pickle without ``accept_pickle``, or its ``key_args`` name
            parameters its function does not have.
    """

    def __init__(self, task: Any, policy: IdempotencyPolicy, *, accept_pickle: bool, mode: Mode = IDEMPOTENT) -> None:
        self.task = task
        self.policy = policy
        self.mode = mode  # when its records are released and what a duplicate gets (celery_idem.endings)
        self.serializer = serializer_of(task, task.app.conf)
        if self.serializer == "pickle" and not accept_pickle:
            raise ConfigurationError(
                f"task {task.name!r} uses the pickle serializer, which celery-idem refuses by default: "
                "a stored pickle runs code when replayed; use json, or set accept_pickle=True"
            )
        self._run_function: Callable[..., Any] = task.run
        # Celery checks a call against the signature only while the task's typing is on (it
        # defaults to app.strict_typing): with it off, the call is fingerprinted as given.
        self._typed = bool(task.app.strict_typing if task.typing is None else task.typing)
        self._sets = parameter_shapes(task)  # a pydantic=True task's set fields, sent as lists
        if policy.key_args is not None:
            check_key_args(self._run_function, policy.key_args, task_name=task.name, typed=self._typed)
        self._seen_keyed = self._seen_keyless = False  # called()

    def fingerprint(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, *, keep_defaults: bool = False
    ) -> str:
        return fingerprint(
            self._run_function,
            args,
            kwargs,
            key_args=self.policy.key_args,
            serializer=self.serializer,
            bind=self._typed,
            sets=self._sets,
            keep_defaults=keep_defaults,
        )

    def identify(self, key: Any, scope: Any, fp: str) -> Identity:
        """Validate the caller's key and scope; a call without a key is keyed by its fingerprint."""
        if key is not None:
            return keyed_identity(self.task.name, key, scope)
        scope_value = validate_scope(scope)
        if self.policy.require_key:
            raise InvalidKeyError(
                f"task {self.task.name!r} requires an idempotency key (require_key=True); "
                "call it with apply_async(..., idempotency_key='...')",
                task_name=self.task.name,
            )
        return Identity(scope_value, self.task.name, fp)

    def called(self, keyed: bool) -> None:
        """A producer's call, with a key of its caller's or without one (the worker side cannot
        tell: a key-less call's fingerprint travels as its key). Warned of once per task and process
        when both are seen: the two are two identities even for the same arguments (DESIGN, identity
        rules), so a retry that lost its key runs again."""
        if keyed:
            if self._seen_keyed:
                return
            self._seen_keyed = True
        else:
            if self._seen_keyless:
                return
            self._seen_keyless = True
        if self._seen_keyed and self._seen_keyless:
            logger.warning(
                "task %s is called both with an idempotency key and without one: a keyed call and a "
                "key-less call of the same arguments are two calls, and both run; give every call a key "
                "(require_key=True makes a call without one an error)",
                self.task.name,
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

    def running_identity(self, fp: str) -> tuple[str | None, str | None]:
        """A key-less call of this task from inside its own body, with the same arguments, is the
        running call itself: it inherits that call's key and scope (and so gets its own id back)."""
        attempt = attempts.current(self.task)
        if attempt is not None and attempt.fingerprint == fp:
            return attempt.identity.key, attempt.identity.scope or None
        return None, None

    def kept_call(
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

    def duplicate(self, identity: Identity, record: IdempotencyRecord) -> DuplicateTaskError:
        """The refusal of a duplicate call under ``on_duplicate="raise"``."""
        return DuplicateTaskError(
            f"task {self.task.name!r} with idempotency key {identity.key!r} is a duplicate of task "
            f"{record.task_id} ({record.state.value}); on_duplicate='raise' refuses it",
            key=identity.key,
            task_name=self.task.name,
            task_id=record.task_id,
        )

    def mismatch(self, identity: Identity, record: IdempotencyRecord) -> PayloadMismatchError:
        return PayloadMismatchError(
            f"idempotency key {identity.key!r} of task {self.task.name!r} was first used with other arguments "
            f"(task {record.task_id}, {record.state.value}); a new call needs a new key",
            key=identity.key,
            task_name=self.task.name,
            task_id=record.task_id,
        )


def log_decision(
    decision: Decision, identity: Identity, task_id: str, record: IdempotencyRecord, *, side: str = "publish"
) -> None:
    """One INFO line per decision of a call (``side="publish"``) or a message (``"worker"``), with
    its fields in ``extra`` (:func:`celery_idem.telemetry.fields`): the key only as its hash."""
    telemetry.decision(identity.task_name, side, decision.value)
    telemetry.witnessed(identity, side, decision.value, task_id, record)
    if logger.isEnabledFor(logging.INFO):
        seconds = telemetry.last_store_seconds()
        logger.info(
            "%s %s task_id=%s record_task_id=%s state=%s store_ms=%s",
            decision.value,
            telemetry.shown(identity),
            task_id,
            record.task_id,
            record.state.value,
            "-" if seconds is None else f"{seconds * 1000:.1f}",
            extra=telemetry.fields(
                identity,
                outcome=decision.value,
                side=side,
                task_id=task_id,
                record_task_id=record.task_id,
                state=record.state.value,
                store_seconds=seconds,
            ),
        )


def log_ending(identity: Identity, task_id: str, ending: str, step: str) -> None:
    """One INFO line when an attempt that ran ends: how (``returned``, ``permanent``, ``retryable``,
    ``retried``, ...) and what its record was given (``complete``, ``fail``, ``release``, ...), so a
    key's lines tell its story from the call to the outcome."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "ENDED %s %s task_id=%s step=%s",
            ending,
            telemetry.shown(identity),
            task_id,
            step,
            extra=telemetry.fields(identity, outcome="ENDED", ending=ending, step=step, task_id=task_id, side="worker"),
        )
