"""@idempotent_task: a thin wrapper over app.task / shared_task with base=IdempotentTask."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

from celery import shared_task

from .config import POLICY_FIELDS
from .errors import ConfigurationError
from .task import IdempotentTask

__all__ = ["idempotent_task"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def idempotent_task(fn: F, /) -> Any: ...


@overload
def idempotent_task(*, app: Any = None, **options: Any) -> Callable[[F], Any]: ...


def idempotent_task(fn: Callable[..., Any] | None = None, /, *, app: Any = None, **options: Any) -> Any:
    """Make a function an idempotent Celery task.

    ``@idempotent_task``, ``@idempotent_task(ttl_seconds=600)``, ``@idempotent_task(app=app, queue="q")``.
    Keywords that are :class:`IdempotencyPolicy` fields form the task's policy; every other keyword
    goes to ``app.task`` (or ``shared_task`` when no ``app`` is given).

    Raises:
        ConfigurationError: a ``base`` that is not an IdempotentTask, or a policy given twice.
    """
    policy = {name: options.pop(name) for name in list(options) if name in POLICY_FIELDS}
    if policy and "idempotency" in options:
        raise ConfigurationError("give the policy as keywords or as idempotency=..., not both")
    if policy:
        options["idempotency"] = policy
    base = options.setdefault("base", IdempotentTask)
    if not (isinstance(base, type) and issubclass(base, IdempotentTask)):
        raise ConfigurationError(f"base must be IdempotentTask or a subclass of it; got {base!r}")

    def decorate(function: Callable[..., Any]) -> Any:
        if app is None:
            return shared_task(**options)(function)
        return app.task(**options)(function)

    return decorate(fn) if fn is not None else decorate
