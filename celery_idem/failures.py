"""The failure rules: which exceptions are retryable and which permanent (DESIGN §3), and which
say "the body may have run". One source, read by the handler and the reconciler alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from kombu.exceptions import OperationalError as KombuOperationalError

from .errors import LockLostError, PermanentError, RetryableError, SerializationError, StoreUnavailableError

if TYPE_CHECKING:
    from .config import IdempotencyPolicy

__all__ = ["BODY_MAY_HAVE_RUN", "FailureClass", "classify_failure"]

FailureClass = Literal["retryable", "permanent"]
# A task FAILURE with one of these says "the body may have run": never evidence to free the key.
BODY_MAY_HAVE_RUN: tuple[type[BaseException], ...] = (StoreUnavailableError, LockLostError)
# Failures that are transient by nature, whatever default_failure says.
_TRANSIENT: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    KombuOperationalError,
    TimeLimitExceeded,
    SoftTimeLimitExceeded,
    WorkerLostError,
    RetryableError,
    Retry,
)
_TRANSIENT_NAMES = frozenset({"ConnectionError", "TimeoutError", "Timeout"})


def classify_failure(
    exc: BaseException, policy: IdempotencyPolicy, autoretry_for: Sequence[type[BaseException]] = ()
) -> FailureClass:
    """``"permanent"`` (stored and replayed) or ``"retryable"`` (released) for an exception.

    Celery's control flow first: ``Reject`` without requeue and ``Ignore`` end the call on purpose,
    and a result that cannot be stored comes after the effect: all three are final (``Reject``
    with requeue is a retry). Then the policy's and the marker's permanent classes; then the
    retryable ones (the markers, Celery's Retry, the task's autoretry_for, the policy's list,
    connection and timeout errors, time limits, a lost worker); anything else follows
    ``policy.default_failure``.
    """
    if isinstance(exc, Reject):
        return "retryable" if exc.requeue else "permanent"
    if isinstance(exc, (Ignore, SerializationError, PermanentError, *policy.permanent)):
        return "permanent"
    if isinstance(exc, (*_TRANSIENT, *autoretry_for, *policy.retryable)):
        return "retryable"
    if any(c.__name__ in _TRANSIENT_NAMES for c in type(exc).__mro__):
        return "retryable"
    return policy.default_failure
