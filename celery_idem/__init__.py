"""celery-idem: make Celery tasks safe to call twice.

at-least-once delivery + idempotent handler = exactly-once effect
"""

from __future__ import annotations

from .config import IdempotencyPolicy, IdempotencySettings
from .decorators import idempotent_task
from .errors import (
    ConfigurationError,
    DuplicateTaskError,
    IdempotencyError,
    InvalidKeyError,
    LedgerUnavailableError,
    LockLostError,
    PayloadMismatchError,
    PermanentError,
    RecordGoneError,
    ReplayedFailureError,
    ResultTooLargeError,
    RetryableError,
    SerializationError,
    StoreUnavailableError,
)
from .extension import Idempotency
from .reconciler import ReconcileReport
from .records import IdempotencyRecord, State
from .result import IdempotentResult
from .stores import MemoryStore, Store, store_from_url
from .task import IdempotentTask

__version__ = "0.2.0.dev0"

__all__ = [
    "ConfigurationError",
    "DuplicateTaskError",
    "Idempotency",
    "IdempotencyError",
    "IdempotencyPolicy",
    "IdempotencyRecord",
    "IdempotencySettings",
    "IdempotentResult",
    "IdempotentTask",
    "InvalidKeyError",
    "LedgerUnavailableError",
    "LockLostError",
    "MemoryStore",
    "PayloadMismatchError",
    "PermanentError",
    "ReconcileReport",
    "RecordGoneError",
    "ReplayedFailureError",
    "ResultTooLargeError",
    "RetryableError",
    "SerializationError",
    "State",
    "Store",
    "StoreUnavailableError",
    "idempotent_task",
    "store_from_url",
]
