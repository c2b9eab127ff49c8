"""celery-idem: make Celery tasks safe to call twice.

at-least-once delivery + idempotent handler = exactly-once effect
"""

from __future__ import annotations

from .config import IdempotencyPolicy, IdempotencySettings
from .errors import (
    ConfigurationError,
    DuplicateTaskError,
    IdempotencyError,
    InvalidKeyError,
    LockLostError,
    PayloadMismatchError,
    PermanentError,
    ReplayedFailureError,
    ResultTooLargeError,
    RetryableError,
    SerializationError,
    StoreUnavailableError,
)
from .records import IdempotencyRecord, State
from .stores import MemoryStore, Store, store_from_url

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "DuplicateTaskError",
    "IdempotencyError",
    "IdempotencyPolicy",
    "IdempotencyRecord",
    "IdempotencySettings",
    "InvalidKeyError",
    "LockLostError",
    "MemoryStore",
    "PayloadMismatchError",
    "PermanentError",
    "ReplayedFailureError",
    "ResultTooLargeError",
    "RetryableError",
    "SerializationError",
    "State",
    "Store",
    "StoreUnavailableError",
    "store_from_url",
]
