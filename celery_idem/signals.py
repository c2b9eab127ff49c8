"""Signal hooks: protect messages sent by name, and settle records after a hard kill.

A message published by ``app.send_task`` (or beat, or another service) never passes through
IdempotentTask.apply_async, but it still runs through IdempotentTask.__call__ on the worker, where
the handler acquires with the key from the ``idempotency_key`` header. A key given as a
``send_task`` option (or a by-name signature's option) is sent by Celery as a message *property*,
which AMQP drops on the way: ``before_task_publish`` moves it into the headers in every process
that has celery-idem loaded (the worker also reads it from the properties, where they survive).

After a hard kill (SIGKILL, the hard time limit, a terminating revoke) the task's own code never
runs again: the worker's parent process sends ``task_failure`` (WorkerLostError, TimeLimitExceeded)
or ``task_revoked``. These hooks take the step the task's mode gives those endings
(``endings.Step.RELEASE_STALE``): they release what that delivery may still hold, and nothing else.
The parent has no owner token of an attempt, so the fence is what the message carries: a record
that ``replace()`` handed to this message and that no attempt has taken yet (still held under the
token the message carries, which the store compares: :mod:`celery_idem.replacement`), else, fenced
by the task id, a PENDING claim or an IN_PROGRESS record past its lease. A live attempt under the
same task id (a copy of the task running elsewhere, the task itself, or a replacement that took its
record: its token is spent) is left: its lease frees the key if it is really dead.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import TYPE_CHECKING, Any

from celery import signals

from . import continuations, telemetry
from .endings import HARD_KILLS, Ending, Step
from .errors import IdempotencyError
from .handler import HandledTask
from .protocol import HANDOVER_HEADER, KEY_HEADER, OPTION_HEADERS, SCOPE_HEADER, message_header, request_header

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["connect", "disconnect"]

logger = logging.getLogger("celery_idem.signals")
_REMEMBERED = 10_000  # headers of in-flight messages kept by the parent, newest first


class _Hooks:
    def __init__(self, idem: Runtime) -> None:
        self.idem = idem
        # task id -> message headers, kept by the process that receives messages: the hard time
        # limit's task_failure comes without the request, so the key is looked up here.
        self.headers: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.lock = threading.Lock()

    def _ours(self, task: Any) -> bool:
        return isinstance(task, HandledTask) and task.app is self.idem.app

    def ran(self, **kw: Any) -> None:
        continuations.settled(**kw)  # a duplicate's continuation was applied: its fence is settled

    def exiting(self, **_: Any) -> None:
        self.idem.heartbeat.flush()

    def received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        task = getattr(request, "task", None)
        if task is None or not self._ours(task):
            return
        found = {name: message_header(request.request_dict, name) for name in (KEY_HEADER, SCOPE_HEADER)}
        kept = {name: value for name, value in found.items() if value is not None}
        with self.lock:
            self.headers[request.id] = kept
            while len(self.headers) > _REMEMBERED:
                self.headers.popitem(last=False)

    def worker_ready(self, sender: Any = None, **_: Any) -> None:
        """Say at start when the store does not answer (in a thread: start is never held up)."""
        if getattr(sender, "app", None) is not self.idem.app:
            return
        threading.Thread(target=self._check_store, name="celery-idem-store-check", daemon=True).start()

    def _check_store(self) -> None:
        try:
            store = self.idem.store
            store.ping()
        except IdempotencyError as exc:
            logger.error(
                "celery-idem store does not answer at worker start: %s; tasks wait with the broker "
                "until it does (on_store_error=%r)",
                exc,
                self.idem.settings.on_store_error,
            )
            return
        logger.info("celery-idem store %r answers", store)

    def failed(self, sender: Any = None, task_id: str | None = None, exception: Any = None, **kw: Any) -> None:
        if task_id is None or not isinstance(exception, HARD_KILLS) or not self._ours(sender):
            return
        headers = self._request_headers(sender.request)
        self._settle(Ending.KILLED, sender, task_id, kw.get("args"), kw.get("kwargs"), headers)

    def revoked(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        # sender is the task; request is the revoked message's task Context.
        if request is None or not self._ours(sender):
            return
        headers = self._request_headers(request)
        self._settle(Ending.REVOKED, sender, request.id, request.args, request.kwargs, headers)

    @staticmethod
    def _request_headers(request: Any) -> dict[str, Any]:
        """The idempotency headers a task Context holds (with a replacement's handover token)."""
        found = {name: request_header(request, name) for name in (KEY_HEADER, SCOPE_HEADER, HANDOVER_HEADER)}
        return {name: value for name, value in found.items() if value is not None}

    def _settle(self, ending: Ending, task: Any, task_id: str, args: Any, kwargs: Any, headers: Any) -> None:
        """Take the step the task's mode gives an ending the parent sees (the attempt's own code is gone)."""
        with self.lock:
            remembered = self.headers.pop(task_id, None)
        headers = {**(headers or {}), **(remembered or {})}
        why = "failure" if ending is Ending.KILLED else "revoke"
        try:
            handler = task.idempotency_handler
            step = handler.mode.after[ending]
            if step is not Step.RELEASE_STALE:  # no mode has another step for a gone attempt yet
                raise AssertionError(f"the parent cannot take the {step.value} step ({ending.value})")
            key = headers.get(KEY_HEADER)
            fp = handler.fingerprint(args or (), kwargs or {}) if key is None else ""
            identity = handler.identify(key, headers.get(SCOPE_HEADER), fp)
            token = headers.get(HANDOVER_HEADER)
            store = self.idem.store
            # A replacement dropped before it ran holds its replaced attempt's record under its
            # token, leased for its whole wait (an hour): the record waits for this very message.
            handed = isinstance(token, str) and bool(token) and store.release(identity, token).ok
            released = handed or store.release(identity, task_id, fence="task_id").ok
        except (IdempotencyError, TypeError, ValueError) as exc:
            logger.warning("could not settle task %s after its %s: %s", task_id, why, exc)
            return
        logger.info(
            "%s of task %s: record %s %s", why, task_id, telemetry.shown(identity), "released" if released else "left"
        )


def options_to_headers(headers: Any = None, properties: Any = None, **_: Any) -> None:
    """``before_task_publish``: move idempotency options that Celery put in the message properties
    (``send_task(..., idempotency_key=...)``) into the headers, where every transport carries them
    and every retry of the message keeps them. An option wins over a header, as in apply_async."""
    if headers is None or not properties:
        return
    for name in OPTION_HEADERS:
        value = properties.pop(name, None)
        if value is not None:
            headers[name] = value


def connect(idem: Runtime) -> list[tuple[Any, Any]]:
    """Connect one extension's hooks; returns what :func:`disconnect` needs.

    The publish hook is process-wide (a message sent by name names no app) and connected once.
    """
    signals.before_task_publish.connect(options_to_headers, weak=False, dispatch_uid="celery_idem.options_to_headers")
    hooks = _Hooks(idem)
    receivers = [
        (signals.task_received, hooks.received),
        (signals.task_failure, hooks.failed),
        (signals.task_revoked, hooks.revoked),
        (signals.worker_ready, hooks.worker_ready),
        (signals.task_postrun, hooks.ran),
        # A process about to exit (a pool child recycled; a solo or threads pool's warm shutdown)
        # first stores the outcomes the store refused during an outage, within a bound.
        (signals.worker_process_shutdown, hooks.exiting),
        (signals.worker_shutdown, hooks.exiting),
    ]
    for signal, receiver in receivers:
        signal.connect(receiver, weak=False)
    return receivers


def disconnect(receivers: list[tuple[Any, Any]]) -> None:
    for signal, receiver in receivers:
        signal.disconnect(receiver)
