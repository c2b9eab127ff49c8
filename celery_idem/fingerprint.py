"""Identity rules: what makes two calls the same call (DESIGN §2); what makes a key valid is
:mod:`celery_idem.keys`.

The fingerprint is the SHA-256 of the canonical JSON of the call's arguments *as the worker will
receive them*: positional and keyword arguments bound to the task's signature, optionally narrowed
to ``key_args``, round-tripped through the task's serializer, every parameter that holds its default
(and an empty ``*args`` or ``**kwargs``) left out, dumped with sorted keys and no whitespace.
``charge(42, 100)``, ``charge(order_id=42, amount=100)``, ``charge(42, amount=100)`` and, where
``currency`` defaults to ``"EUR"``, ``charge(42, 100, currency="EUR")`` are one call; so are a tuple
and a list, and a UUID and its string.

A default the caller never gave is not the caller's argument: leaving defaults out is what keeps a
call the same call across a release that adds a parameter with a default (DESIGN §2, "Across
releases"). celery-idem before 0.2 kept them in (``keep_defaults=True`` computes that form, which
records written then still hold).

A task whose user turned Celery's argument check off (``typing=False``, ``Celery(strict_typing=
False)``) is fingerprinted unbound: the call as given, ``{"args": [...], "kwargs": {...}}``, through
the same serializer round trip. Celery publishes such a call without looking at the signature, so
binding it here would refuse what Celery sends; spellings and defaults then count, and ``key_args``,
which picks arguments by parameter name, cannot apply.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import enum
import functools
import hashlib
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kombu import serialization
from kombu.utils import json as kombu_json
from pydantic import BaseModel

from .arguments import at_defaults, bind_arguments, select_key_args
from .errors import SerializationError
from .pydantic_sets import Shape, Unordered, model_shape, unordered

# kombu ships no annotations: name the two calls used here with their real shapes.
kombu_dumps: Callable[..., tuple[str, str, Any]] = serialization.dumps
kombu_loads: Callable[..., Any] = serialization.loads

__all__ = ["canonical_json", "fingerprint"]


_TAG = "\x00"  # opens the key of a tagged value; a real dict key that starts with it is escaped


def _normalize(value: Any) -> Any:
    """Map a received value onto plain JSON, injectively except where equality is intended.

    A UUID, datetime, date, time or Decimal equals its string form on purpose (the caller may pass
    either). bytes and sets become one-key dicts under a NUL-tagged key, and real dict keys that
    start with NUL are escaped, so no argument can spell the tag of another.
    """
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, dict):
        return {_key(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {f"{_TAG}bytes": bytes(value).hex()}
    if isinstance(value, (set, frozenset)):
        return {f"{_TAG}set": sorted(canonical_json(v) for v in value)}
    if isinstance(value, Unordered):  # a list the worker reads as a set: the set's form
        return {f"{_TAG}set": sorted({canonical_json(v) for v in value.items})}
    if isinstance(value, BaseModel):  # pickled as itself: its JSON form, as Celery sends it otherwise
        return _normalize(unordered(value.model_dump(mode="json"), model_shape(type(value))))
    if isinstance(value, enum.Enum):
        return {f"{_TAG}enum": [f"{type(value).__module__}.{type(value).__qualname__}", _normalize(value.value)]}
    raise TypeError(f"{type(value).__module__}.{type(value).__qualname__} has no canonical JSON form")


def _key(key: Any) -> str:
    if isinstance(key, str):
        return _TAG + key if key.startswith(_TAG) else key
    # Non-str keys survive only a pickle round trip; tag them so 1 and "1" stay apart.
    return f"{_TAG}key:{canonical_json(key)}"


_SCALARS = frozenset({str, int, float, bool, type(None)})
_PLAIN_ITEMS = 10_000  # past this many values a call takes the long way (a cycle among them too)


def _plain(value: Any) -> bool:
    """Whether ``value`` reaches the worker as this very JSON, so that its fingerprint needs neither
    the serializer round trip nor :func:`_normalize`: kombu's own json codec (an app may register
    another under the name), exact scalars, lists, tuples (dumped as lists either way) and dicts whose
    keys are ASCII str (a surrogate pair in a key is one character once decoded, which may reorder
    or merge keys), open no tag here and are not ``__type__`` (kombu decodes such a dict into an object)."""
    if not _kombus_own_json():
        return False
    stack, budget = [value], _PLAIN_ITEMS
    while stack:
        budget -= 1
        if budget < 0:
            return False
        item = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if kind is dict:
            for key, inner in item.items():
                if type(key) is not str or not key.isascii() or key.startswith(_TAG) or key == "__type__":
                    return False
                stack.append(inner)
        elif kind is list or kind is tuple:
            stack.extend(item)
        else:
            return False
    return True


def _kombus_own_json() -> bool:
    codec = serialization.registry._encoders.get("json")
    return (
        codec is not None
        and codec.encoder is kombu_json.dumps
        and serialization.registry._decoders.get(codec.content_type) is kombu_json.loads
    )


def canonical_json(value: Any) -> str:
    """Dump ``value`` as JSON with sorted keys and no whitespace (the fingerprint's input)."""
    return json.dumps(_normalize(value), sort_keys=True, separators=(",", ":"))


def _round_trip(value: Any, serializer: str) -> Any:
    try:
        content_type, encoding, payload = kombu_dumps(value, serializer=serializer)
        return kombu_loads(payload, content_type, encoding, accept={content_type})
    except Exception as exc:
        raise SerializationError(
            f"the task's arguments cannot be encoded with the {serializer!r} serializer: {exc}; "
            "pass JSON-serializable values (or configure a serializer that can encode them)"
        ) from exc


def fingerprint(
    func: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    key_args: Iterable[str] | None = None,
    serializer: str = "json",
    skip_first: bool = False,
    bind: bool = True,
    sets: Mapping[str, Shape] | None = None,
    keep_defaults: bool = False,
) -> str:
    """SHA-256 hex digest of the call's canonical arguments (DESIGN §2).

    Args:
        func: The task's run function; the call is bound to its signature.
        args: Positional arguments.
        kwargs: Keyword arguments.
        key_args: Keep only these parameters (None keeps all). A name that is not a parameter is
            picked out of ``**kwargs``; the name of the ``**kwargs`` parameter keeps all of it.
        serializer: The task's serializer name; arguments are round-tripped through it.
        skip_first: Drop the first parameter (``self`` of a bound task).
        bind: Bind the call to ``func``'s signature; False takes it as given (the task's
            ``typing`` is off), and then ``key_args`` must be None.
        sets: Where a ``pydantic=True`` task's parameters hold sets that arrive as lists
            (celery_idem.pydantic_sets.parameter_shapes): those lists count unordered.
        keep_defaults: Keep the parameters that hold their defaults, as celery-idem before 0.2
            fingerprinted a call (the form its records hold).

    Raises:
        TypeError: the arguments do not fit the signature, or ``key_args`` is given with
            ``bind=False``.
        ValueError: ``key_args`` names a parameter the signature does not have.
        SerializationError: the serializer, or canonical JSON, cannot encode the arguments.
    """
    if isinstance(key_args, str):
        raise TypeError(f"key_args must be a list of parameter names, not a str; got {key_args!r}")
    if not bind:
        if key_args is not None:
            raise TypeError("key_args needs the call bound to the task's signature; got bind=False")
        arguments: dict[str, Any] = {"args": list(args or ()), "kwargs": dict(kwargs or {})}
    else:
        # A parameter the call leaves out is absent (a sentinel default no serializer encodes too);
        # one it gives at its default's value is left out once compared as the worker receives it.
        arguments = bind_arguments(func, args, kwargs, skip_first=skip_first, apply_defaults=keep_defaults)
        if key_args is not None:
            arguments = select_key_args(arguments, key_args, func)
    defaults = _default_forms(func, skip_first, serializer) if bind and not keep_defaults else {}
    if serializer == "json" and not sets and _plain(arguments):
        # What the worker receives is this very JSON: the round trip and the normalisation change
        # nothing (tests/api/test_fingerprint.py holds this against the long way for any plain value).
        # What json cannot dump (an int of over 4,300 digits, a depth past the recursion limit) takes
        # the long way, which says what is wrong.
        with contextlib.suppress(ValueError, RecursionError):
            if defaults:
                arguments = _without_defaults(arguments, defaults, _dumps)
            text = _dumps(arguments)
            return hashlib.sha256(text.encode()).hexdigest()
    received = _round_trip(arguments, serializer)
    if sets and bind:
        for name, shape in sets.items():
            if name in received:
                received[name] = unordered(received[name], shape)
    try:
        if defaults:
            received = _without_defaults(received, defaults, canonical_json)
        text = canonical_json(received)
    except (TypeError, ValueError) as exc:
        raise SerializationError(
            f"the task's arguments, as the {serializer!r} serializer delivers them, have no canonical form "
            f"for the fingerprint: {exc}; "
            "pass JSON-like values (str, numbers, lists, dicts, UUID, datetime, Decimal, bytes, enums, models)"
        ) from exc
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _dumps(value: Any) -> str:
    """:func:`canonical_json` of a value that is already plain JSON (:func:`_plain`)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _without_defaults(received: dict[str, Any], forms: Mapping[str, str], dump: Callable[[Any], str]) -> dict[str, Any]:
    """``received`` (the bound call as the worker receives it) without the parameters that hold their
    default, compared in the form the worker would receive the default in: ``1`` and ``True`` stay
    apart, ``(1, 2)`` and ``[1, 2]`` do not."""
    kept = dict(received)
    for name, form in forms.items():
        if name in kept and dump(kept[name]) == form:
            del kept[name]
    return kept


@functools.lru_cache(maxsize=2048)
def _default_forms(func: Callable[..., Any], skip_first: bool, serializer: str) -> dict[str, str]:
    """Each defaulted parameter's default of ``func`` (an empty ``*args`` and ``**kwargs`` too) in its
    canonical form as the worker would receive it passed; a default no call can pass (a sentinel the
    serializer cannot encode), which no argument equals, is left out."""
    forms: dict[str, str] = {}
    for name, default in at_defaults(func, skip_first).items():
        if isinstance(default, BaseModel) and serializer != "pickle":
            default = default.model_dump(mode="json")  # as Celery sends a pydantic=True task's model
        try:
            forms[name] = canonical_json(_round_trip(default, serializer))
        except (SerializationError, TypeError, ValueError, RecursionError):
            continue
    return forms
