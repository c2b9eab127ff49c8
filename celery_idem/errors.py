"""Every error celery-idem raises, in one tree.

::

    IdempotencyError
    ├── ConfigurationError         a setting, policy, store URL or missing extra is wrong
    ├── InvalidKeyError            a key or scope breaks the shape rule
    ├── PayloadMismatchError       same identity, other arguments
    ├── DuplicateTaskError         a duplicate call, with on_duplicate="raise"
    ├── StoreUnavailableError      the store did not answer in time, or refused
    ├── LedgerUnavailableError     the ledger's database did not answer in time, or refused
    ├── LockLostError              another attempt took over this one's lease
    ├── ReplayedFailureError       a stored failure whose class cannot be rebuilt
    ├── RecordGoneError            get() waits on a record that is gone, with no result backend to ask
    └── SerializationError         arguments or a result the serializer cannot encode
        └── ResultTooLargeError    a result over max_result_bytes   (both also kombu's EncodeError)

    RetryableError, PermanentError  markers users raise (or subclass) to classify failures

Every class is rebuildable from its positional ``args`` alone: Celery ships an exception as its
type and args through JSON, so a producer that only has plain Celery still sees the right class.
Context attributes (``key``, ``task_name``, ``task_id``) are keyword-only and optional for that
reason.
"""

from __future__ import annotations

from typing import Any

from kombu.exceptions import EncodeError

__all__ = [
    "ConfigurationError",
    "DuplicateTaskError",
    "IdempotencyError",
    "InvalidKeyError",
    "LedgerUnavailableError",
    "LockLostError",
    "PayloadMismatchError",
    "PermanentError",
    "RecordGoneError",
    "ReplayedFailureError",
    "ResultTooLargeError",
    "RetryableError",
    "SerializationError",
    "StoreUnavailableError",
]


class IdempotencyError(Exception):
    """Base class of every error celery-idem raises."""

    def __init__(
        self,
        message: str = "",
        *,
        key: str | None = None,
        task_name: str | None = None,
        task_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.task_name = task_name
        self.task_id = task_id

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the context attributes across pickling (prefork result pipes, pickle serializer).
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[IdempotencyError], args: tuple[Any, ...], state: dict[str, Any]) -> IdempotencyError:
    error = cls(*args)
    error.__dict__.update(state)
    return error


class ConfigurationError(IdempotencyError, ValueError):
    """A setting, policy or store URL is invalid, or an optional extra is not installed."""


class InvalidKeyError(IdempotencyError, ValueError):
    """An idempotency key or scope breaks the shape rule (1-255 printable chars, no whitespace)."""


class PayloadMismatchError(IdempotencyError):
    """The identity is already held by a call with other arguments."""


class DuplicateTaskError(IdempotencyError):
    """A duplicate call was refused because the policy says ``on_duplicate="raise"``."""


class StoreUnavailableError(IdempotencyError):
    """The idempotency store could not be reached, or did not answer within the timeout."""

    #: True when the store answered with an error no outage mapping knows (a driver's surprise, a
    #: value the database refuses): it may never pass, so a worker stops sending its message back.
    unexpected: bool = False


class LedgerUnavailableError(IdempotencyError):
    """The ledger's database could not be reached, or did not answer within its read timeout."""


class LockLostError(IdempotencyError):
    """This attempt's lease was taken over by another attempt; its outcome is not stored."""


class ReplayedFailureError(IdempotencyError):
    """A stored failure is replayed but its exception class cannot be rebuilt."""


class RecordGoneError(IdempotencyError):
    """get() waits on a record that is gone, and no result backend keeps the task's outcome."""


# Also kombu's EncodeError, which plain Celery raises for the same call: `except EncodeError`
# written for plain Celery still catches it.
class SerializationError(IdempotencyError, TypeError, EncodeError):
    """Arguments or a result cannot be encoded by the task's serializer."""


class ResultTooLargeError(SerializationError):
    """A serialized result is larger than ``max_result_bytes``."""


class RetryableError(Exception):
    """Raise (or subclass) to mark a failure as transient: the key is released, never frozen."""


class PermanentError(Exception):
    """Raise (or subclass) to mark a failure as final: it is stored and replayed to duplicates."""
