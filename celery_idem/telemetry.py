"""What the library reports as it works, for whoever listens: a process-wide list of sinks.

Three kinds of report, each a plain call that costs nothing when no sink listens:

- ``decision(task, side, decision)``: what a call (``side="publish"``) or a message
  (``side="worker"``) was answered (``NEW``, ``DUPLICATE``, ``REPLAY``, ``MISMATCH``, ``RUN``,
  ``BUSY``);
- ``store_call(operation, seconds, outcome)``: one store operation, how long it took, and whether
  it answered (``ok``), timed out or could not be reached (``outage``), or failed otherwise
  (``error``);
- ``counted(name, n)``: the extension's own counters (``Idempotency.metrics()``) as they move.

:mod:`celery_idem.metrics` is the Prometheus sink. Nothing here may carry a key, a task id or an
argument: a sink that labels by them would grow without bound and leak personal data.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["Sink", "add_sink", "counted", "decision", "remove_sink", "store_call"]


class Sink(Protocol):
    def decision(self, task: str, side: str, decision: str) -> None: ...

    def store_call(self, operation: str, seconds: float, outcome: str) -> None: ...

    def counted(self, name: str, n: int) -> None: ...


_SINKS: tuple[Sink, ...] = ()  # replaced whole under the lock: readers need none
_LOCK = threading.Lock()


def add_sink(sink: Sink) -> None:
    global _SINKS
    with _LOCK:
        if sink not in _SINKS:
            _SINKS = (*_SINKS, sink)


def remove_sink(sink: Sink) -> None:
    global _SINKS
    with _LOCK:
        _SINKS = tuple(s for s in _SINKS if s is not sink)


def decision(task: str, side: str, decision: str) -> None:
    for sink in _SINKS:
        sink.decision(task, side, decision)


def store_call(operation: str, seconds: float, outcome: str) -> None:
    for sink in _SINKS:
        sink.store_call(operation, seconds, outcome)


def counted(name: str, n: int = 1) -> None:
    for sink in _SINKS:
        sink.counted(name, n)
