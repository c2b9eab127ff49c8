"""IdempotentTask: a thin Celery Task that hands both sides of every call to its Handler."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

from celery import Task

from . import attempts, lookahead, on_commit, replacement
from .config import IdempotencyPolicy
from .errors import ConfigurationError
from .extension import Idempotency
from .handler import HandledTask, Handler
from .on_commit import OnCommitResult
from .protocol import BYPASS_HEADER, KEY_HEADER, SCOPE_HEADER, headers_with_options, request_header
from .result import IdempotentResult

__all__ = ["IdempotentTask"]

logger = logging.getLogger("celery_idem.task")
# The attempts (task name, task id) in the handler on this thread now. A direct call from the body
# copies the running request (Celery's push_request), id included: that is how it is recognised.
_local = threading.local()


def _running_here() -> set[tuple[str, str]]:
    running: set[tuple[str, str]] | None = getattr(_local, "running", None)
    if running is None:
        running = _local.running = set()
    return running


def _replacing_inline() -> set[tuple[str, str]]:
    """The attempts on this thread whose eager ``replace`` is tracing its replacement inline now."""
    replacing: set[tuple[str, str]] | None = getattr(_local, "replacing", None)
    if replacing is None:
        replacing = _local.replacing = set()
    return replacing


class IdempotentTask(Task, HandledTask):  # type: ignore[misc]
    """Base class of idempotent tasks: ``@app.task(base=IdempotentTask, idempotency={...})``.

    The task option ``idempotency`` (a dict or :class:`IdempotencyPolicy`) is the task's policy;
    fields it leaves out come from the app's settings. apply_async takes ``idempotency_key``,
    ``idempotency_scope`` and ``idempotency=False`` (bypass for one call).
    """

    idempotency: ClassVar[dict[str, Any] | IdempotencyPolicy | None] = None
    _idempotency_handler: Handler | None = None
    _warned_without_id = False

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # Install the extension as soon as the task is bound, so the worker's parent process has
        # the signal hooks even if the user never calls Idempotency(app) themselves.
        Idempotency.of(app)

    @property
    def idempotency_handler(self) -> Handler:
        """The handler of this task on its app (built at first use, then cached)."""
        handler = self._idempotency_handler
        if handler is None or handler.idem is not Idempotency.of(self.app):
            handler = self._idempotency_handler = Handler(Idempotency.of(self.app), self)
        return handler

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        options.update(task_id=task_id, producer=producer, link=link, link_error=link_error, shadow=shadow)
        return self.idempotency_handler.publish(args, kwargs, options, self._send)

    def apply(
        self,
        args: Any = None,
        kwargs: Any = None,
        link: Any = None,
        link_error: Any = None,
        task_id: str | None = None,
        retries: int | None = None,
        throw: bool | None = None,
        logfile: Any = None,
        loglevel: Any = None,
        headers: Any = None,
        **options: Any,
    ) -> Any:
        """Run the call here, as a worker runs its message: ``idempotency_key``,
        ``idempotency_scope`` and ``idempotency=False`` are honoured as apply_async honours them
        (one run per identity, a stored outcome replayed, other arguments under a used key refused
        with PayloadMismatchError: in the EagerResult, or raised at once with ``throw=True``).
        A ``pydantic=True`` task's models are dumped as apply_async sends them.

        Raises:
            InvalidKeyError: the key or scope breaks the rule, or the policy requires a key and the
                call has none, before anything runs.
        """
        headers = headers_with_options(options, headers)
        found = headers if isinstance(headers, Mapping) else {}
        handler = self.idempotency_handler
        if found.get(BYPASS_HEADER) is not False:
            handler.identify(found.get(KEY_HEADER), found.get(SCOPE_HEADER), "")  # the key rules, require_key too
        args, kwargs = handler.as_sent(args, kwargs, options)
        return super().apply(
            args,
            kwargs,
            link=link,
            link_error=link_error,
            task_id=task_id,
            retries=retries,
            throw=throw,
            logfile=logfile,
            loglevel=loglevel,
            headers=headers,
            **options,
        )

    def _send(self, args: Any, kwargs: Any, options: dict[str, Any]) -> Any:
        return super().apply_async(args, kwargs, **options)

    # Celery's DjangoTask API, on every idempotent task (a Django project's `base=IdempotentTask`
    # replaces the DjangoTask the fixup would have given it). Publishing, and so the claim, happens
    # when the caller's transaction commits: a rolled-back transaction leaves no claim behind.

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> OnCommitResult:
        """``delay()`` once the caller's Django transaction commits (at once outside one). The
        key and scope are checked now; the claim is made at commit. Returns the call's handle
        (:class:`~celery_idem.on_commit.OnCommitResult`): its task id is known once the commit published
        the call (a duplicate is handed the original's), and a refusal at commit is kept there."""
        return self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(self, args: Any = None, kwargs: Any = None, **options: Any) -> OnCommitResult:
        """``apply_async()`` once the caller's Django transaction commits (see
        :meth:`delay_on_commit`). ``using`` names the database whose transaction decides (the
        default one otherwise, as in Celery's ``DjangoTask``). A call refused at commit
        (``PayloadMismatchError``, ``DuplicateTaskError``, ``StoreUnavailableError``, the broker's
        error) is that call's alone: the transaction's other on-commit calls still run, and the
        refusal is on the handle and in an ERROR line (:mod:`celery_idem.on_commit`).

        Raises:
            InvalidKeyError: the key or scope breaks the rule (now, inside the transaction).
            ConfigurationError: Django is not installed.
        """
        # What is checked now is what is claimed at commit: the options and their headers are the
        # call's own copies (a caller that reuses one headers dict changes nothing of this call).
        using = options.pop("using", None)
        options = dict(options)
        if isinstance(options.get("headers"), Mapping):
            options["headers"] = dict(options["headers"])
        found = headers_with_options(dict(options), options.get("headers"))
        found = found if isinstance(found, Mapping) else {}
        identity = None
        if found.get(BYPASS_HEADER) is not False:
            identity = self.idempotency_handler.identify(found.get(KEY_HEADER), found.get(SCOPE_HEADER), "")
        send = functools.partial(self.apply_async, args, kwargs, **options)
        return on_commit.defer(send, self.name, identity, using)

    def prior_call(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """The handle of the call that ``apply_async(args, kwargs, **options)`` would repeat (its
        task id, its outcome), or None when the store knows of none: one read, nothing written.
        For a call that is claimed later (``outbox.apply_async``, ``apply_async_on_commit``), so an
        API answers its client now (:mod:`celery_idem.lookahead` says what a read cannot see).

        Raises:
            PayloadMismatchError: the key was used for other arguments.
            DuplicateTaskError: the call repeats another, and the policy says ``on_duplicate="raise"``.
            InvalidKeyError: the key or scope breaks the rule.
        """
        handler = self.idempotency_handler
        return lookahead.prior_call(handler, handler.idem, args, kwargs, options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:  # a plain function call in user code: Celery's behaviour
            return super().__call__(*args, **kwargs)
        attempt = (self.name, request.id)
        if attempt in _running_here():
            replacing = _replacing_inline()
            if attempt in replacing:
                # Celery's eager replace traces the replacement here, frozen under this task id, with
                # a request of its own (eager, this id): its body runs as Celery's tracer runs a task,
                # under that request. Task.__call__ would push a blank one before Celery 5.5 (5.5
                # copies the current one), and the body's own replace would then publish and return
                # nothing. Its body's calls of the task are plain calls again.
                replacing.discard(attempt)
                return self.run(*args, **kwargs)
            # The body calls its own task as a function (``countdown(n - 1)``): Celery pushes that
            # call's request only inside Task.__call__, so until then it wears this attempt's; it
            # is a plain call, never a copy of the running message.
            return super().__call__(*args, **kwargs)
        if request.id is None:
            if request_header(request, KEY_HEADER) is not None:
                # A hand-built message that asks for deduplication but carries nothing to fence it by:
                # running it unprotected would run every copy of it.
                raise ConfigurationError(
                    f"a message of task {self.name!r} carries an idempotency_key but no task id: celery-idem "
                    "fences every attempt by its task id, so it cannot run once; send it with an id "
                    "(apply_async and send_task always give one)"
                )
            # A tracer built by hand with a request that has no id (Celery's own unit tests): no task
            # id, no attempt to fence. The body runs as plain Celery's tracer runs it (task.run).
            if not self._warned_without_id:
                self._warned_without_id = True
                logger.warning(
                    "task %r was traced with no task id (a tracer built by hand: a worker's message always "
                    "has one): its body runs without idempotency",
                    self.name,
                )
            return self.run(*args, **kwargs)
        running = _running_here()  # never a request attribute: message headers become those
        running.add(attempt)
        try:
            with attempts.running():  # what the handler keeps of this attempt lives and ends here
                return self.idempotency_handler.run(args, kwargs)
        finally:
            running.discard(attempt)

    def on_replace(self, sig: Any) -> Any:
        # The replacement inherits this task id: it takes this attempt's record, or callbacks settle it.
        request = self.request
        if not request.is_eager:
            return replacement.on_replace(self.idempotency_handler, sig, super().on_replace)
        attempt = (self.name, request.id)
        replacing = _replacing_inline()
        replacing.add(attempt)  # eager: Celery traces the replacement inline, on this thread (__call__)
        try:
            return replacement.on_replace(self.idempotency_handler, sig, super().on_replace)
        finally:
            replacing.discard(attempt)

    def AsyncResult(self, task_id: str, **kwargs: Any) -> IdempotentResult:  # noqa: N802 - Celery's name
        return IdempotentResult(task_id, backend=self.backend, task_name=self.name, app=self.app, **kwargs)
