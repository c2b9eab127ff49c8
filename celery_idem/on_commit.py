"""Calls deferred to a Django transaction's commit (``delay_on_commit``, ``apply_async_on_commit``),
and the handle the caller keeps of each.

Django runs a transaction's on_commit callbacks in order and stops at the first that raises: every
later one is dropped (another task's call, a plain Celery task's, a cache purge). So a call refused
at commit (``PayloadMismatchError``, ``DuplicateTaskError``, ``StoreUnavailableError``, the
broker's error) never raises from its callback: the refusal is that call's alone. The caller learns
of it from the call's handle (``error``; ``get()`` raises it) and from an ERROR line of the logger
``celery_idem.on_commit`` naming the task and the key's hash. Outside a transaction the call is
published at once and raises as ``apply_async`` does: nothing else waits behind it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from . import telemetry
from .errors import ConfigurationError, IdempotencyError
from .records import Identity

__all__ = ["OnCommitResult", "defer"]

logger = logging.getLogger("celery_idem.on_commit")


class OnCommitResult:
    """The handle ``delay_on_commit`` / ``apply_async_on_commit`` return: the call, published when
    its transaction commits.

    Until then (and for good, when the transaction rolls back) ``result``, ``id`` and ``error`` are
    None. Once published, ``result`` is the call's :class:`~celery_idem.result.IdempotentResult`
    (a duplicate's: the original's id) and ``get()`` is its ``get()``. A call refused at commit keeps
    the refusal in ``error``, and ``get()`` raises it.
    """

    def __init__(self, task_name: str, identity: Identity | None) -> None:
        self.task_name = task_name
        self.identity = identity  # None for a call that bypasses celery-idem (idempotency=False)
        self.result: Any = None
        self.error: Exception | None = None

    def __repr__(self) -> str:
        state = "refused" if self.error is not None else "published" if self.result is not None else "not published"
        return f"<OnCommitResult {self.task_name} {state}{f' {self.id}' if self.id else ''}>"

    @property
    def id(self) -> str | None:
        """The task id once the call is published (a duplicate's: the original's), else None."""
        return None if self.result is None else str(self.result.id)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        """The call's outcome (the arguments of ``AsyncResult.get``).

        Raises:
            IdempotencyError: the refusal the call met at commit (its own class), or, when the call
                was not published (its transaction has not committed, or rolled back), the base class.
        """
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise IdempotencyError(
                f"the call of task {self.task_name!r} was not published: its transaction has not committed "
                "yet, or it rolled back",
                task_name=self.task_name,
            )
        return self.result.get(*args, **kwargs)

    def _publish(self, send: Callable[[], Any], *, contained: bool) -> None:
        try:
            self.result = send()
        except SoftTimeLimitExceeded:
            raise  # the running task's own time limit, struck during the publish: never a refusal
        except Exception as exc:
            if not contained:
                raise  # published at once, outside a transaction: the caller's own call raises
            self.error = exc
            identity, key = self.identity, getattr(exc, "key", None)
            if identity is not None and not identity.key and isinstance(key, str):
                identity = identity._replace(key=key)  # a key-less call: its key is its fingerprint
            logger.error(
                "%s: the call deferred to its transaction's commit was refused at commit with %s; the "
                "transaction committed and its other on-commit work goes on (the call's handle holds the error)",
                telemetry.shown(identity) if identity is not None else self.task_name,
                type(exc).__name__,
                extra=telemetry.fields(identity, error=type(exc).__name__) if identity is not None else {},
            )


def defer(send: Callable[[], Any], task_name: str, identity: Identity | None, using: str | None) -> OnCommitResult:
    """Run ``send`` (the call's ``apply_async``) when the transaction open on the database ``using``
    commits (at once outside one), and return the call's handle.

    Raises:
        ConfigurationError: Django is not installed.
    """
    try:
        from django.db import transaction
    except ImportError as exc:  # an optional dependency: the `django` extra
        raise ConfigurationError("delay_on_commit needs Django: pip install 'celery-idem[django]'") from exc
    handle = OnCommitResult(task_name, identity)
    contained = transaction.get_connection(using).in_atomic_block
    transaction.on_commit(functools.partial(handle._publish, send, contained=contained), using=using)
    return handle
