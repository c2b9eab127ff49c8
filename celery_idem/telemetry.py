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

Witnesses are the one exception, and stay in the process: ``witnessed(...)`` hands each decision,
with its identity (the key), task id and record, to the callables added with ``add_witness``. The
pytest plugin's recorder (:mod:`celery_idem.contrib.pytest`) is one; an exporter must never be.
"""

from __future__ import annotations

import threading
from typing import Protocol

from .records import IdempotencyRecord, Identity

__all__ = [
    "Sink",
    "Witness",
    "add_sink",
    "add_witness",
    "counted",
    "decision",
    "remove_sink",
    "remove_witness",
    "store_call",
    "witnessed",
]


class Sink(Protocol):
    def decision(self, task: str, side: str, decision: str) -> None: ...

    def store_call(self, operation: str, seconds: float, outcome: str) -> None: ...

    def counted(self, name: str, n: int) -> None: ...


class Witness(Protocol):
    def __call__(
        self, identity: Identity, side: str, decision: str, task_id: str, record: IdempotencyRecord
    ) -> None: ...


_SINKS: tuple[Sink, ...] = ()  # replaced whole under the lock: readers need none
_WITNESSES: tuple[Witness, ...] = ()
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


def add_witness(witness: Witness) -> None:
    global _WITNESSES
    with _LOCK:
        if witness not in _WITNESSES:
            _WITNESSES = (*_WITNESSES, witness)


def remove_witness(witness: Witness) -> None:
    global _WITNESSES
    with _LOCK:
        _WITNESSES = tuple(w for w in _WITNESSES if w != witness)  # a bound method is a new object each time


def witnessed(identity: Identity, side: str, decision: str, task_id: str, record: IdempotencyRecord) -> None:
    """``decision`` about the call or message ``task_id`` of ``identity``, as the store's ``record``
    stood then: for the witnesses only (see the module)."""
    for witness in _WITNESSES:
        witness(identity, side, decision, task_id, record)
