"""Deliver a task message again, as a broker does after a lost ack: the same task id, the same
headers, run here as a worker's pool runs it (Celery's own ``Request``), with no broker.

:class:`Messages` keeps the first message of each task id seen while it listens: as published
(``before_task_publish``: its headers and body exactly), or, for a call run inline (eager mode
publishes nothing), as its request held it when it started (``task_prerun``: its arguments and
celery-idem's headers). :func:`deliver` runs one :class:`Message`.
"""

from __future__ import annotations

import inspect
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import signals, states
from celery.result import EagerResult

from ..protocol import BYPASS_HEADER, HANDOVER_HEADER, KEY_HEADER, SCOPE_HEADER, request_header

__all__ = ["Message", "Messages", "deliver", "message_for"]

# EagerResult takes the task's name only in later 5.3 patch releases (5.3.6 does, 5.3.0 does not): on
# those before, its ``name`` is None, as Celery's own eager results are there.
_EAGER_RESULT_TAKES_NAME = "name" in inspect.signature(EagerResult.__init__).parameters

# What a call run inline keeps of its message: celery-idem's own headers (the pacing headers of a
# trip back to the broker are not the original message's).
_KEPT_HEADERS = (KEY_HEADER, SCOPE_HEADER, BYPASS_HEADER, HANDOVER_HEADER)


@dataclass(frozen=True)
class Message:
    """One task message: what a worker receives."""

    task_name: str
    task_id: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, Any] = field(default_factory=dict)  # besides "id" and "task"
    embed: Mapping[str, Any] = field(default_factory=dict)  # callbacks, errbacks, chain, chord


class Messages:
    """The first message of each task id published or started in this process while listening."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[str, Message] = {}

    def start(self) -> None:
        signals.before_task_publish.connect(self._published, weak=False)
        signals.task_prerun.connect(self._started, weak=False)

    def stop(self) -> None:
        signals.before_task_publish.disconnect(self._published)
        signals.task_prerun.disconnect(self._started)

    def get(self, task_id: str) -> Message | None:
        with self._lock:
            return self._first.get(task_id)

    def _keep(self, message: Message) -> None:
        with self._lock:
            self._first.setdefault(message.task_id, message)  # a retry or a trip back is not the original

    def _published(self, body: Any = None, headers: Mapping[str, Any] | None = None, **_: Any) -> None:
        if not headers or not isinstance(body, (tuple, list)) or len(body) != 3:
            return  # not a protocol 2 task message
        args, kwargs, embed = body
        rest = {name: value for name, value in headers.items() if name not in ("id", "task")}
        self._keep(
            Message(str(headers["task"]), str(headers["id"]), tuple(args), dict(kwargs), rest, dict(embed or {}))
        )

    def _started(self, task_id: str = "", task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
        if task is None or not task_id:
            return
        kept = {name: value for name in _KEPT_HEADERS if (value := request_header(task.request, name)) is not None}
        self._keep(Message(task.name, task_id, tuple(args or ()), dict(kwargs or {}), kept))


def deliver(app: Any, message: Message) -> EagerResult:
    """Run ``message`` once, here, as a worker's pool runs it: Celery's ``Request`` and tracer,
    with ``is_eager`` False, so celery-idem's worker side runs as it does on a worker (it takes
    the key, replays, waits or refuses; a trip back to the broker is published through the app).

    Returns:
        An ``EagerResult`` of this delivery: ``state`` SUCCESS with the value, FAILURE with the
        exception (``get()`` raises it), RETRY or IGNORED; REVOKED if the message had expired.
    """
    from celery.contrib.testing.mocks import TaskMessage  # Celery's own message double
    from celery.worker.request import Request

    sent = TaskMessage(message.task_name, id=message.task_id, **dict(message.headers))
    sent.payload = (list(message.args), dict(message.kwargs), dict(message.embed) or None)
    sent.properties = {}
    sent.delivery_info = {"exchange": "", "routing_key": "celery", "redelivered": True}
    ended: dict[str, Any] = {}

    def postrun(task_id: str = "", retval: Any = None, state: str = "", **_: Any) -> None:
        if task_id == message.task_id and threading.current_thread() is here:
            ended.update(retval=retval, state=state)

    here = threading.current_thread()  # a worker thread may run another copy of this id meanwhile
    receiver_id = f"celery_idem.deliver.{uuid.uuid4()}"
    signals.task_postrun.connect(postrun, weak=False, dispatch_uid=receiver_id)
    try:
        Request(sent, app=app).execute()
    finally:
        signals.task_postrun.disconnect(dispatch_uid=receiver_id)
    state = ended.get("state") or states.REVOKED
    if not _EAGER_RESULT_TAKES_NAME:
        return EagerResult(message.task_id, ended.get("retval"), state)
    return EagerResult(message.task_id, ended.get("retval"), state, name=message.task_name)


def message_for(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    task_id: str | None = None,
    key: str | None = None,
    scope: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> Message:
    """A message of ``task`` (the task or its name) as a producer would send it, by hand."""
    sent = dict(headers or {})
    if key is not None:
        sent[KEY_HEADER] = key
    if scope is not None:
        sent[SCOPE_HEADER] = scope
    name = task if isinstance(task, str) else str(task.name)
    return Message(name, task_id or str(uuid.uuid4()), tuple(args), dict(kwargs or {}), sent)
