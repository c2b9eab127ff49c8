"""Where a ``pydantic=True`` task's arguments hold sets, so their fingerprint is one per call.

Celery sends a model argument as ``model_dump(mode="json")``, which writes a ``set`` or
``frozenset`` field as a list in the set's iteration order, and that order depends on the process's
hash seed (``PYTHONHASHSEED``). The same ``Order(tags={"gift", "fragile"})`` sent by two web
processes is then two different lists, though the worker's validation makes one set of both. A
fingerprint is a function of the call, never of the process that made it (DESIGN §3), so the lists
that the worker's validation reads as sets are taken unordered: :class:`Unordered`, whose
canonical JSON is the set's (its elements' canonical forms, sorted, each once).

Which lists those are comes from pydantic's own JSON schema of each parameter the worker validates
(annotated with a model, or an optional one, as Celery's wrapper validates them): an array with
``uniqueItems`` is a set. The shapes are built once per task; a task, or a parameter, whose models
hold no set has none, so its calls cost nothing more. Where the schema is ambiguous (a union whose
branches read one list both as a set and as an ordered list) the list is left as it is: a missed
merge only runs a call twice, a wrong one would drop a different call.
"""

from __future__ import annotations

import inspect
import logging
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

__all__ = ["Shape", "Unordered", "model_shape", "parameter_shapes", "unordered"]

logger = logging.getLogger("celery_idem.fingerprint")


class Unordered:
    """A list the worker reads as a set: its canonical JSON is that of the set (celery_idem.fingerprint)."""

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items


@dataclass(eq=False)
class Shape:
    """Where sets sit in a JSON value: ``set`` (a list read as a set, of ``item``s), ``list`` (each
    element an ``item``), ``tuple`` (``items`` by position, ``item`` past them), ``object`` (``props``
    by key, ``item`` for other keys), ``either`` (a list as ``items[0]``, an object as ``items[1]``),
    ``conflict`` (left as sent). ``None`` anywhere means "holds no set"."""

    kind: str = ""
    item: Shape | None = None
    items: tuple[Shape | None, ...] = ()
    props: dict[str, Shape | None] = field(default_factory=dict)


def unordered(value: Any, shape: Shape | None) -> Any:
    """``value`` with every list that ``shape`` says is a set wrapped as :class:`Unordered`."""
    if shape is None:
        return value
    kind = shape.kind
    if kind == "either":  # a union of a list and an object shape: the value says which
        return unordered(value, shape.items[1] if isinstance(value, dict) else shape.items[0])
    if kind == "object":
        if not isinstance(value, dict):
            return value
        props, other = shape.props, shape.item
        return {k: unordered(v, props[k] if k in props else other) for k, v in value.items()}
    if not isinstance(value, (list, tuple)):
        return value
    if kind == "set":
        return Unordered([unordered(v, shape.item) for v in value])
    if kind == "list":
        return [unordered(v, shape.item) for v in value]
    if kind == "tuple":
        head = shape.items
        return [unordered(v, head[i] if i < len(head) else shape.item) for i, v in enumerate(value)]
    return value


def parameter_shapes(task: Any) -> dict[str, Shape] | None:
    """The set shapes of the parameters a ``pydantic=True`` task's worker validates, by name; None
    when the task is no such task or none of its models holds a set."""
    if getattr(task, "_dump_pydantic_arguments", None) is None:
        return None
    func: Callable[..., Any] = inspect.unwrap(task.run)
    try:
        hints = typing.get_type_hints(func)
    except (NameError, AttributeError, TypeError):  # as Celery's wrapper falls back
        hints = {}
    shapes: dict[str, Shape] = {}
    for name, param in inspect.signature(func).parameters.items():
        annotation = hints.get(name, param.annotation)
        args = typing.get_args(annotation)
        if len(args) == 2 and type(None) in args:  # Optional[Model], as Celery reads it
            annotation = next(arg for arg in args if arg is not type(None))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            shape = model_shape(annotation)
            if shape is not None:
                shapes[name] = shape
    return shapes or None


_model_shapes: dict[type[BaseModel], Shape | None] = {}


def model_shape(model: type[BaseModel]) -> Shape | None:
    """The set shape of ``model``'s JSON form (cached per class); None when it holds no set."""
    if model in _model_shapes:
        return _model_shapes[model]
    shape: Shape | None = None
    try:
        with warnings.catch_warnings():  # once per class; a default with no JSON form only warns
            warnings.simplefilter("ignore")
            by_name = model.model_json_schema(by_alias=False, mode="validation")
            by_alias = model.model_json_schema(by_alias=True, mode="validation")
        # A dump writes field names; a message made by hand may use the aliases the worker reads.
        for schema in (by_name,) if by_alias == by_name else (by_name, by_alias):
            shape = _merge(shape, _Builder(schema.get("$defs", {})).build(schema))
    except Exception as exc:  # noqa: BLE001 - a model pydantic cannot describe: fingerprinted as sent
        logger.warning("no JSON schema for %s (%s): its set fields are fingerprinted in the order sent", model, exc)
        shape = None
    _model_shapes[model] = shape
    return shape


_CONFLICT = Shape(kind="conflict")  # one list read two ways: left as it is


class _Builder:
    def __init__(self, defs: Mapping[str, Any]) -> None:
        self.defs = defs
        self.reaches = _reaching_sets(defs)
        self.built: dict[str, Shape] = {}

    def build(self, schema: Any) -> Shape | None:
        if not isinstance(schema, dict):
            return None
        ref = schema.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[-1]
            if not self.reaches.get(name):
                return None
            if name not in self.built:  # recursive models point back at the shape being built
                self.built[name] = node = Shape()
                found = self.build(self.defs[name])
                node.kind, node.item, node.items, node.props = (
                    (found.kind, found.item, found.items, found.props) if found else ("", None, (), {})
                )
            return self.built[name]
        branches = schema.get("anyOf") or schema.get("oneOf") or schema.get("allOf")
        if isinstance(branches, list):
            # Branches of one JSON type are merged (two arrays, one a set and one not, conflict);
            # branches of other types never meet the same value.
            by_type: dict[str, list[Shape | None]] = {}
            for branch in branches:
                by_type.setdefault(self.json_type(branch), []).append(self.build(branch))
            joined: dict[str, Shape | None] = {}
            for kind, shapes in by_type.items():
                one = shapes[0]
                for other in shapes[1:]:
                    one = _merge_part(one, other, {}) if kind == "array" else _merge(one, other)
                joined[kind] = one
            array, obj = joined.get("array"), joined.get("object")
            return Shape("either", items=(array, obj)) if array and obj else array or obj
        if self.json_type(schema) == "array":
            if schema.get("uniqueItems"):
                return Shape("set", item=self.build(schema.get("items")))
            if isinstance(schema.get("prefixItems"), list):
                head = tuple(self.build(s) for s in schema["prefixItems"])
                rest = self.build(schema.get("items"))
                return Shape("tuple", item=rest, items=head) if rest or any(head) else None
            item = self.build(schema.get("items"))
            return Shape("list", item=item) if item else None
        if self.json_type(schema) == "object":
            props = {k: self.build(v) for k, v in (schema.get("properties") or {}).items()}
            other = self.build(schema.get("additionalProperties"))
            return Shape("object", item=other, props=props) if other or any(props.values()) else None
        return None

    def json_type(self, schema: Any) -> str:
        """``"array"``, ``"object"`` or ``"other"``: the JSON type a (referenced) schema reads."""
        if not isinstance(schema, dict):
            return "other"
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.json_type(self.defs.get(ref.rsplit("/", 1)[-1]))
        if schema.get("type") == "array" or "prefixItems" in schema:
            return "array"
        if schema.get("type") == "object" or "properties" in schema or "additionalProperties" in schema:
            return "object"
        return "other"


def _reaching_sets(defs: Mapping[str, Any]) -> dict[str, bool]:
    """Which definitions hold a set somewhere below them (a fixpoint: models may be recursive)."""
    direct = {name: _mentions(schema, "uniqueItems") for name, schema in defs.items()}
    refs = {name: {r.rsplit("/", 1)[-1] for r in _refs(schema)} for name, schema in defs.items()}
    reaches = dict(direct)
    changed = True
    while changed:
        changed = False
        for name in defs:
            if not reaches[name] and any(reaches.get(r) for r in refs[name]):
                reaches[name] = changed = True
    return reaches


def _mentions(schema: Any, word: str) -> bool:
    if isinstance(schema, dict):
        return bool(schema.get(word)) or any(_mentions(v, word) for v in schema.values())
    return isinstance(schema, list) and any(_mentions(v, word) for v in schema)


def _refs(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        own = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return own + [r for v in schema.values() for r in _refs(v)]
    return [r for v in schema for r in _refs(v)] if isinstance(schema, list) else []


def _merge(a: Shape | None, b: Shape | None, memo: dict[tuple[int, int], Shape] | None = None) -> Shape | None:
    """One shape for a value that may be read by either (two branches of a union, a model's field
    names and aliases): objects merge by key, alike shapes merge their parts, and a list read as a
    set by one and in order by the other is a conflict, left as sent. ``memo`` ends recursion."""
    if a is None or b is None:
        return a or b
    if a is b:
        return a
    if a.kind != b.kind or a.kind == _CONFLICT.kind or len(a.items) != len(b.items):
        return _CONFLICT
    memo = {} if memo is None else memo
    if (id(a), id(b)) in memo:
        return memo[id(a), id(b)]
    memo[id(a), id(b)] = merged = Shape(a.kind)
    merged.item = _merge_part(a.item, b.item, memo)
    merged.items = tuple(_merge_part(x, y, memo) for x, y in zip(a.items, b.items, strict=True))
    merged.props = dict(a.props)
    for key, shape in b.props.items():
        merged.props[key] = _merge_part(merged.props[key], shape, memo) if key in merged.props else shape
    return merged


def _merge_part(a: Shape | None, b: Shape | None, memo: dict[tuple[int, int], Shape]) -> Shape | None:
    # A part both read, one as holding a set and the other as not: ambiguous.
    if (a is None) != (b is None):
        return _CONFLICT
    return _merge(a, b, memo)
