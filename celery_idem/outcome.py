"""Outcomes as stored: results in the task's serializer, failures rebuilt as their own class."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kombu import serialization

from .errors import ReplayedFailureError, SerializationError
from .records import ErrorInfo, IdempotencyRecord

__all__ = ["decode_result", "encode_result", "rebuild_exception", "replay"]

# kombu ships no annotations: name the two calls used here with their real shapes.
_dumps: Callable[..., tuple[str, str, Any]] = serialization.dumps
_loads: Callable[..., Any] = serialization.loads


def encode_result(value: Any, serializer: str) -> tuple[bytes, str, str]:
    """Serialize a task's return value as ``(payload, content_type, content_encoding)``.

    Raises:
        SerializationError: the serializer cannot encode ``value``.
    """
    try:
        content_type, encoding, payload = _dumps(value, serializer=serializer)
    except Exception as exc:
        raise SerializationError(
            f"the task's result cannot be encoded with the {serializer!r} serializer: {exc}; "
            "return JSON-serializable values (or an id the caller can look up)"
        ) from exc
    data = payload.encode(encoding if encoding != "binary" else "latin-1") if isinstance(payload, str) else payload
    return data, content_type, encoding


def decode_result(record: IdempotencyRecord) -> Any:
    """The stored result of a COMPLETED record, as the task returned it (after serialization)."""
    if record.result is None or record.content_type is None:
        return None
    return _loads(record.result, record.content_type, record.content_encoding or "utf-8", accept={record.content_type})


def rebuild_exception(error: ErrorInfo) -> BaseException:
    """The stored failure as its own exception class, or :class:`ReplayedFailureError`."""
    try:
        target: Any = importlib.import_module(error.module)
        for part in error.type.split("."):
            target = getattr(target, part)
        if isinstance(target, type) and issubclass(target, BaseException):
            return target(*error.args)
    except Exception:  # noqa: BLE001 - any failure to rebuild falls through to the generic error
        pass
    return ReplayedFailureError(f"{error.module}.{error.type}: {error.message}")


def replay(record: IdempotencyRecord) -> Any:
    """Return a COMPLETED record's result, or raise a FAILED record's error."""
    if record.error is not None:
        raise rebuild_exception(record.error)
    return decode_result(record)
