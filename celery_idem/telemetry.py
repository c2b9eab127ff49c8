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

What log lines, spans and events say about a key is decided here too: its hash (``key_hash``), the
same everywhere, so one key's story is a grep; ``shown(identity)`` for a log line's text, and
``fields(identity)`` for its ``extra`` (JSON formatters print them). The key itself only after
``configure(plain_keys=True)``: keys are often personal data (an e-mail address, an order of one
customer), and logs travel further than the store.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
from typing import Protocol

from .records import IdempotencyRecord, Identity

__all__ = [
    "Sink",
    "Witness",
    "add_sink",
    "add_witness",
    "configure",
    "counted",
    "decision",
    "described",
    "fields",
    "key_hash",
    "last_store_seconds",
    "plain_keys",
    "remove_sink",
    "remove_witness",
    "shown",
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
    _last_store_seconds.set(seconds)
    for sink in _SINKS:
        sink.store_call(operation, seconds, outcome)


# How long this thread's (or task's) last store operation took: the decision a log line reports was
# made by the claim or acquire just before it.
_last_store_seconds: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "celery_idem_last_store_seconds", default=None
)


def last_store_seconds() -> float | None:
    """How long the last store operation of this context took, in seconds (None before any)."""
    return _last_store_seconds.get()


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


_plain_keys = False


def configure(*, plain_keys: bool = False) -> None:
    """Whether log lines and spans carry the plain key besides its hash (``False``: only the hash).

    Events never do. Set it once at start-up (in the worker, e.g. in ``worker_process_init``, and in
    the producer) where keys are known to hold no personal data and a readable log is worth more.
    """
    global _plain_keys
    _plain_keys = plain_keys


def plain_keys() -> bool:
    """Whether :func:`configure` allowed plain keys."""
    return _plain_keys


def key_hash(identity: Identity) -> str:
    """A short, stable hash of an identity's key (its scope and task name included): enough to
    follow one key through logs, spans and events without writing the key, which may be personal
    data. The same in every process and version: ``key_hash(Identity(scope, task_name, key))``
    finds a key's lines."""
    text = "\x1f".join(identity)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class _Shown:
    """An identity as a log line's text shows it, formatted only if the line is emitted."""

    __slots__ = ("identity",)

    def __init__(self, identity: Identity) -> None:
        self.identity = identity

    def __str__(self) -> str:
        scope, task_name, key = self.identity
        where = f"{scope}/{task_name}" if scope else task_name
        if _plain_keys:
            return f"{where}/{key} (key_hash={key_hash(self.identity)})"
        return f"{where} (key_hash={key_hash(self.identity)})"

    __repr__ = __str__


def shown(identity: Identity) -> object:
    """``identity`` for the text of a log line or an operational error: the task, the scope and the
    key's hash (the key too, after ``configure(plain_keys=True)``)."""
    return _Shown(identity)


def fields(identity: Identity, **more: object) -> dict[str, object]:
    """The ``extra`` of a log line about ``identity``: ``idempotency_task``, ``idempotency_scope``,
    ``idempotency_key_hash`` (``idempotency_key`` only after ``configure(plain_keys=True)``), and
    ``more``, each name prefixed with ``idempotency_``."""
    extra: dict[str, object] = {
        "idempotency_task": identity.task_name,
        "idempotency_scope": identity.scope,
        "idempotency_key_hash": key_hash(identity),
    }
    if _plain_keys:
        extra["idempotency_key"] = identity.key
    for name, value in more.items():
        extra[f"idempotency_{name}"] = value
    return extra


def described(exc: BaseException) -> str:
    """``exc`` for a log line or an operational error's text: its type and message; for a database
    error wrapped by SQLAlchemy, the driver's own (SQLAlchemy's adds the statement and its parameters,
    which hold keys, arguments and results, on any engine made without ``hide_parameters``)."""
    orig = getattr(exc, "orig", None)
    if orig is not None and hasattr(exc, "statement"):
        return f"{type(orig).__name__}: {orig}"
    return f"{type(exc).__name__}: {exc}"
