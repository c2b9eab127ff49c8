"""Outcomes as stored: results in the task's serializer, failures rebuilt as their own class.

Decoding is the one place store content becomes objects, so it trusts nothing the record says about
itself: a result is decoded only when its content type is one the app accepts
(:func:`accepted_content_types`), never because the record claims it. Pickle is accepted only with
``accept_pickle=True``: anyone who can write to the store could otherwise run code in every process
that reads it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterable
from typing import Any

from celery.exceptions import Retry
from celery.result import ResultBase
from kombu import serialization

from .errors import ReplayedFailureError, SerializationError
from .records import ErrorInfo, IdempotencyRecord

__all__ = [
    "serializer_of",
    "JSON_ONLY",
    "PICKLE_CONTENT_TYPE",
    "accepted_content_types",
    "decode_result",
    "encode_result",
    "prepare_value",
    "rebuild_exception",
    "replay",
]

# kombu ships no annotations: name the calls used here with their real shapes.
_dumps: Callable[..., tuple[str, str, Any]] = serialization.dumps
_loads: Callable[..., Any] = serialization.loads
_prepare_accept: Callable[[Iterable[str]], set[str]] = serialization.prepare_accept_content

PICKLE_CONTENT_TYPE = "application/x-python-serialize"
JSON_ONLY: frozenset[str] = frozenset({"application/json"})


def serializer_of(task: Any | None, conf: Any) -> str:
    """The serializer a task's outcomes are stored in: the task's own, else the app's
    ``task_serializer``, else json (as Celery picks the one its messages use)."""
    return (task.serializer if task is not None else None) or conf.task_serializer or "json"


def accepted_content_types(conf: Any, *, accept_pickle: bool) -> frozenset[str]:
    """The content types stored outcomes may be decoded from: what the app accepts for messages
    and results (``accept_content``, ``result_accept_content``) and its ``task_serializer``;
    pickle if and only if ``accept_pickle`` (whatever ``accept_content`` says)."""
    names = [*(conf.accept_content or ()), *(conf.result_accept_content or ()), conf.task_serializer or "json"]
    accepted = _prepare_accept(names) - {PICKLE_CONTENT_TYPE}
    return frozenset(accepted | {PICKLE_CONTENT_TYPE} if accept_pickle else accepted)


def prepare_value(value: Any, serializer: str) -> Any:
    """A task's return value as Celery's result backend stores it (``BaseBackend.prepare_value``):
    a result object (``return child.delay(x)``) as its ``(id, parent)`` tuple form, unless the
    serializer is pickle. So the record holds what the backend holds, and a duplicate gets what the
    original's ``AsyncResult.get()`` gets: the ``[[id, parent], children]`` lists (rebuild a result
    object from them with ``celery.result.result_from_tuple``). tests/api/test_celery_compat_breaks.py holds this copy
    of Celery's rule against the backend's own.
    """
    if serializer != "pickle" and isinstance(value, ResultBase):
        return value.as_tuple()
    return value


def encode_result(value: Any, serializer: str) -> tuple[bytes, str, str]:
    """Serialize a task's return value, prepared as the result backend prepares it
    (:func:`prepare_value`), as ``(payload, content_type, content_encoding)``.

    Raises:
        SerializationError: the serializer cannot encode ``value``.
    """
    try:
        content_type, encoding, payload = _dumps(prepare_value(value, serializer), serializer=serializer)
    except Exception as exc:
        raise SerializationError(
            f"the task's result cannot be encoded with the {serializer!r} serializer: {exc}; "
            "return JSON-serializable values (or an id the caller can look up)"
        ) from exc
    data = payload.encode(encoding if encoding != "binary" else "latin-1") if isinstance(payload, str) else payload
    return data, content_type, encoding


def decode_result(record: IdempotencyRecord, accept: Collection[str] = JSON_ONLY) -> Any:
    """The stored result of a COMPLETED record, as the task returned it (after serialization).

    Args:
        record: The record (or a ledger entry's outcome in a record's shape).
        accept: The content types that may be decoded (:func:`accepted_content_types`).

    Raises:
        SerializationError: the record's content type is not in ``accept`` (nothing is decoded),
            or its payload does not decode.
    """
    if record.result is None or record.content_type is None:
        return None
    context = {name: getattr(record, name, None) for name in ("key", "task_name", "task_id")}
    content_type = record.content_type
    if content_type not in accept:
        fix = (
            "set accept_pickle=True only if every writer of the store is trusted"
            if content_type == PICKLE_CONTENT_TYPE
            else "add its serializer to app.conf.accept_content if it is yours"
        )
        raise SerializationError(
            f"a stored result claims content type {content_type!r} ({len(record.result)} bytes), which this "
            f"app does not accept ({', '.join(sorted(accept))}); it was not decoded. Forget the record "
            f"(celery -A proj idem forget KEY --task NAME) to run the call again, or {fix}",
            **context,
        )
    try:
        return _loads(record.result, content_type, record.content_encoding or "utf-8", accept=set(accept))
    except Exception as exc:
        raise SerializationError(
            f"a stored result of content type {content_type!r} ({len(record.result)} bytes) does not decode: "
            f"{exc}; forget the record (celery -A proj idem forget KEY --task NAME) to run the call again",
            **context,
        ) from exc


def rebuild_exception(error: ErrorInfo) -> BaseException:
    """The stored failure as its own exception class, or :class:`ReplayedFailureError`.

    The class is looked up only in a module this process has already imported: a record names its
    module, and importing whatever module a store record names would run that module's code on the
    say-so of anyone who can write to the store. The task's own module (and what it imports) is
    loaded wherever the task is called or run, so its exception classes rebuild.
    """
    try:
        module = sys.modules.get(error.module)
        first, *rest = error.type.split(".")
        # The module's own namespace (no module __getattr__ hook runs), then nested classes.
        target: Any = vars(module).get(first) if module is not None else None
        for part in rest:
            target = getattr(target, part) if isinstance(target, type) else None
        # Only what an outcome can be: an Exception (never SystemExit, KeyboardInterrupt, Celery's
        # Retry: none of them is ever stored, so a record naming one was not written by us).
        if isinstance(target, type) and issubclass(target, Exception) and not issubclass(target, Retry):
            return _construct(target, error.args)
    except Exception:  # noqa: BLE001 - any failure to rebuild falls through to the generic error
        pass
    return ReplayedFailureError(f"{error.module}.{error.type}: {error.message}")


def _construct(cls: type[BaseException], args: list[Any]) -> BaseException:
    """``cls(*args)``; for a class whose ``__init__`` wants more than its stored args (it passed a
    built message up), the instance without ``__init__``, kept only if it still reads as text.
    Raises when neither works (SQLAlchemy's StatementError family builds its text from attributes)."""
    try:
        return cls(*args)
    except Exception:  # noqa: BLE001 - __init__ wants other arguments: try without it
        exc = cls.__new__(cls, *args)
        exc.args = tuple(args)
        str(exc), repr(exc)  # raises if the text needs what __init__ would have set
        return exc


def replay(record: IdempotencyRecord, accept: Collection[str] = JSON_ONLY) -> Any:
    """Return a COMPLETED record's result (decoded only from a type in ``accept``), or raise a
    FAILED record's error."""
    if record.error is not None:
        raise rebuild_exception(record.error)
    return decode_result(record, accept)
