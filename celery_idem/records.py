"""The record a store keeps per identity, and what each atomic operation answers."""

from __future__ import annotations

import enum
import hashlib
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

__all__ = [
    "Decision",
    "ErrorInfo",
    "IdempotencyRecord",
    "Identity",
    "State",
    "Transition",
    "identity_id",
    "owner_digest",
]


class State(str, enum.Enum):
    """Where a record stands in the state machine (DESIGN §3)."""

    PENDING = "PENDING"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"

    @property
    def settled(self) -> bool:
        """True for the states that hold an outcome."""
        return self in (State.COMPLETED, State.FAILED)


class Decision(str, enum.Enum):
    """What an atomic store operation decided."""

    NEW = "NEW"  # claim: the caller owns the identity now and must publish
    DUPLICATE = "DUPLICATE"  # claim: a live attempt holds it; hand back its task id
    REPLAY = "REPLAY"  # claim/acquire: the outcome is stored; hand it back
    MISMATCH = "MISMATCH"  # claim/acquire: the identity is held by other arguments
    RUN = "RUN"  # acquire: the caller owns the attempt and runs the body
    BUSY = "BUSY"  # acquire: another attempt is running with a live lease
    OK = "OK"  # complete/fail/release/renew: written under the caller's token
    LOST = "LOST"  # complete/fail/release/renew: the token no longer owns the record


class Identity(NamedTuple):
    """Who a record belongs to: (scope, task name, key). ``scope`` is ``""`` when unscoped."""

    scope: str
    task_name: str
    key: str

    def __str__(self) -> str:
        return f"{self.scope}/{self.task_name}/{self.key}" if self.scope else f"{self.task_name}/{self.key}"


class ErrorInfo(BaseModel):
    """A final failure as stored: enough to rebuild the exception for every later duplicate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: str
    module: str
    message: str
    args: list[Any] = []

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorInfo:
        """Describe ``exc`` with its class, module, message and (JSON-safe) args."""
        return cls(
            type=type(exc).__qualname__,
            module=type(exc).__module__,
            message=str(exc),
            args=[a if isinstance(a, (str, int, float, bool, type(None))) else repr(a) for a in exc.args],
        )


class IdempotencyRecord(BaseModel):
    """One identity's record. Times are POSIX seconds (floats) on the store's clock."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    scope: str = ""
    task_name: str
    fingerprint: str
    state: State
    task_id: str
    owner: str
    attempt: int = 0
    lease_expires_at: float | None = None
    created_at: float
    updated_at: float
    expires_at: float
    ttl_seconds: float
    result: bytes | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    error: ErrorInfo | None = None
    call: bytes | None = None  # celery_idem.calls: kept only for stale_action="requeue"
    # The task id of an attempt this record took over past its lease (its body may have run: the
    # next attempt reads that id's evidence first), or the one its claim kept; None on a fresh record.
    previous_task_id: str | None = None

    @property
    def identity(self) -> Identity:
        return Identity(self.scope, self.task_name, self.key)

    def held_by(self, token: str) -> bool:
        """Whether ``token`` is this record's owner: the token itself, or, on a record that keeps
        only its digest once settled (the Redis store's packed record), that digest."""
        return self.owner == token or (self.owner.startswith("#") and self.owner == owner_digest(token))


def owner_digest(token: str) -> str:
    """What a compact settled record keeps of its owner token: ``#`` and the first 16 hex digits
    of its SHA-1 (the Redis store's scripts compute the same with ``redis.sha1hex``)."""
    return "#" + hashlib.sha1(token.encode("utf-8"), usedforsecurity=False).hexdigest()[:16]


@dataclass(frozen=True)
class Transition:
    """The answer of claim/acquire (with the record as it stands after the operation) and of the
    fenced writes (``record`` is None for those: they need no read back)."""

    decision: Decision
    record: IdempotencyRecord | None = None

    @property
    def ok(self) -> bool:
        return self.decision is Decision.OK


def identity_id(namespace: str, scope: str, task_name: str, key: str) -> uuid.UUID:
    """The row's key: 16 bytes of SHA-256 over the length-prefixed identity (prefixes keep
    ``("a:b", "c")`` and ``("a", "b:c")`` apart)."""
    digest = hashlib.sha256()
    for part in (namespace, scope, task_name, key):
        raw = part.encode("utf-8")
        digest.update(len(raw).to_bytes(4, "big"))
        digest.update(raw)
    return uuid.UUID(bytes=digest.digest()[:16])
