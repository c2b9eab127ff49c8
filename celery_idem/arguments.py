"""How a call's arguments bind to its task's signature, and how ``key_args`` narrows them (DESIGN §2):
``charge(42, 100)``, ``charge(order_id=42, amount=100)`` and ``charge(42, amount=100)`` bind alike,
defaults applied, as Celery's own argument check binds them; :func:`at_defaults` says what a call
that leaves a parameter out holds in it (the fingerprint leaves those out)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .errors import ConfigurationError

__all__ = ["at_defaults", "bind_arguments", "check_key_args", "select_key_args"]


@functools.lru_cache(maxsize=2048)
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def bind_arguments(
    func: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    skip_first: bool = False,
    apply_defaults: bool = True,
) -> dict[str, Any]:
    """Bind a call to ``func``'s signature, as ``{parameter: value}``.

    Args:
        func: The task's run function.
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.
        skip_first: Drop the first parameter (``self`` of a bound task given as a plain function).
        apply_defaults: Give every parameter the call left out its default (and ``*args`` /
            ``**kwargs`` their empty values); False binds only what the call gave.

    Raises:
        TypeError: the arguments do not fit the signature (as Celery's own argument check says).
    """
    signature = _signature(func)
    if skip_first:
        params = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=params)
    try:
        bound = signature.bind(*(args or ()), **(kwargs or {}))
    except TypeError as exc:
        name = getattr(func, "__qualname__", repr(func))
        raise TypeError(f"{name}{signature}: {exc}") from None
    if apply_defaults:
        bound.apply_defaults()
    return dict(bound.arguments)


@functools.lru_cache(maxsize=2048)
def at_defaults(func: Callable[..., Any], skip_first: bool = False) -> dict[str, Any]:
    """What each parameter of ``func`` holds when a call leaves it out: its default, and an empty
    ``*args`` or ``**kwargs``; required parameters are not in it. Cached: the caller must not change it."""
    params = list(_signature(func).parameters.values())[1 if skip_first else 0 :]
    empty: dict[Any, Any] = {inspect.Parameter.VAR_POSITIONAL: (), inspect.Parameter.VAR_KEYWORD: {}}
    return {
        p.name: empty[p.kind] if p.kind in empty else p.default
        for p in params
        if p.kind in empty or p.default is not inspect.Parameter.empty
    }


def check_key_args(func: Callable[..., Any], key_args: Sequence[str], *, task_name: str, typed: bool) -> None:
    """Refuse, at a task's first call, ``key_args`` that name no parameter of ``func`` (unless it
    takes ``**kwargs``), or any ``key_args`` on a task whose typing is off (calls are not bound).

    Raises:
        ConfigurationError: saying which names are wrong, or that typing is off, and what to do.
    """
    if not typed:
        raise ConfigurationError(
            f"task {task_name!r} sets key_args, which picks arguments by parameter name, but its "
            "typing is off (typing=False, or Celery(strict_typing=False)), so its calls are not bound "
            "to its signature: remove key_args and pass an idempotency_key, or turn typing back on"
        )
    params = _signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [name for name in key_args if name not in params]
    if missing:
        raise ConfigurationError(
            f"key_args of task {task_name!r} names {', '.join(map(repr, missing))}, "
            f"not parameters of {task_name}{_signature(func)}"
        )


def select_key_args(arguments: dict[str, Any], key_args: Iterable[str], func: Callable[..., Any]) -> dict[str, Any]:
    """Narrow bound ``arguments`` to ``key_args`` (a name not a parameter is picked out of ``**kwargs``).

    Raises:
        ValueError: a name is neither a parameter nor can travel in ``**kwargs``.
    """
    params = _signature(func).parameters
    var_kw = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = arguments.get(var_kw, {}) if var_kw else {}
    selected: dict[str, Any] = {}
    for name in key_args:
        if name == var_kw:
            # Naming the **kwargs parameter itself keys the call on everything it holds.
            selected[name] = extra
        elif name in arguments:
            selected[name] = arguments[name]
        elif name in extra:
            selected[name] = extra[name]
        elif name in params:
            continue  # a parameter the call left out (bound without its default): absent, as at its default
        elif not var_kw:
            raise ValueError(
                f"key_args names {name!r}, which is not a parameter of "
                f"{getattr(func, '__qualname__', func)}{_signature(func)}"
            )
        # A key arg that would travel in **kwargs but was not passed is simply absent.
    return selected
