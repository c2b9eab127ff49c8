"""``celery -A proj idem ...``: look at records, forget them, count them, run the reconciler.

Installed as a ``celery.commands`` entry point. Every command prints for people by default and
JSON with ``--json``; a missing record exits 1, a bad argument exits 2.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import sys
from collections.abc import Collection, Sequence
from typing import Any

import click

from .errors import IdempotencyError, SerializationError
from .extension import Idempotency
from .outcome import JSON_ONLY, decode_result
from .records import IdempotencyRecord, State
from .task import IdempotentTask

__all__ = ["idem", "record_view"]

_STATES = [state.value for state in State]


def record_view(record: IdempotencyRecord, accept: Collection[str] = JSON_ONLY) -> dict[str, Any]:
    """A record as JSON-safe data: the result decoded only from a content type in ``accept``;
    any other shows its content type and size, never decoded."""
    view = record.model_dump(exclude={"result", "call", "content_encoding"})
    view["state"] = record.state.value
    if record.result is not None:
        try:
            view["result"] = decode_result(record, accept)
            json.dumps(view["result"])
        except SerializationError as exc:
            view["result"] = {"content_type": record.content_type, "bytes": len(record.result), "not_decoded": str(exc)}
        except Exception:  # noqa: BLE001 - decoded but not JSON-representable: show the bytes
            view["result"] = {"base64": base64.b64encode(record.result).decode("ascii")}
    return view


def _extension(ctx: click.Context) -> Idempotency:
    return Idempotency.of(ctx.obj.app)


def _task_name(ctx: click.Context, name: str) -> str:
    app = ctx.obj.app
    app.loader.import_default_modules()
    if name not in app.tasks:
        known = sorted(n for n, t in app.tasks.items() if isinstance(t, IdempotentTask))
        raise click.BadParameter(
            f"{name!r} is not a task of app {app.main!r}; idempotent tasks: {', '.join(known) or 'none'}",
            param_hint="--task",
        )
    return name


def _wants_json(ctx: click.Context, as_json: bool) -> bool:
    """``--json`` after the subcommand, or before it (``celery idem --json list``)."""
    return as_json or bool(ctx.find_root().meta.get(_JSON_META))


def _emit(data: Any, as_json: bool, human: str) -> None:
    click.echo(json.dumps(data, indent=2, default=str) if as_json else human)


def _fail(message: str, as_json: bool, code: int = 1) -> None:
    if as_json:
        click.echo(json.dumps({"error": message}))
    else:
        click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def _view(ctx: click.Context, record: IdempotencyRecord) -> dict[str, Any]:
    return record_view(record, _extension(ctx).accepted_content_types)


# ---- for people: times as ISO-8601 UTC with how long ago or ahead, durations rounded -----------------

_TIMES = ("created_at", "updated_at", "lease_expires_at", "expires_at")


def span(seconds: float) -> str:
    """A duration for people, to two units at most: ``6 ms``, ``45 s``, ``3 min 20 s``, ``23 h``, ``2 d 4 h``."""
    seconds = abs(seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    for unit, size, smaller, smaller_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1)):
        if whole >= size:
            big, rest = divmod(whole, size)
            small = rest // smaller_size
            return f"{big} {unit}" + (f" {small} {smaller}" if small else "")
    return f"{whole} s"


def when(timestamp: float, now: float) -> str:
    """``2026-11-27T04:55:01Z (3 min ago)`` or ``(in 23 h)``, by the store server's ``now``."""
    iso = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    ahead = timestamp - now
    return f"{iso} ({'in ' + span(ahead) if ahead >= 0 else span(ahead) + ' ago'})"


def _human_record(view: dict[str, Any], record: IdempotencyRecord, now: float) -> str:
    shown = {k: v for k, v in view.items() if v is not None}
    for name in _TIMES:
        value = getattr(record, name)
        if value is not None:
            shown[name] = when(value, now)
    if record.lease_expires_at is not None and not record.state.settled:
        left = record.lease_expires_at - now
        what = "lease" if record.state is State.IN_PROGRESS else "claim"  # a PENDING claim waits for its worker
        shown[what] = f"{span(left)} left" if left > 0 else f"ran out {span(left)} ago"
    shown["ttl_seconds"] = f"{record.ttl_seconds:g} ({span(record.ttl_seconds)})"
    width = max(len(k) for k in shown)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in shown.items())


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns under a header, two spaces apart."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def _age(text: str) -> float:
    """``90s``, ``10m``, ``2h``, ``1d`` (or plain seconds) as seconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*", text)
    if found is None:
        raise click.BadParameter(f"{text!r} is not an age; write it as 90s, 10m, 2h or 1d", param_hint="--older-than")
    return float(found[1]) * {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}[found[2] or "s"]


class _States(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.2 only
    """States, case-insensitive, comma-separated; ``all`` for every one."""

    name = "states"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[State]:
        if isinstance(value, list):
            return value
        names = [part.strip().upper() for part in str(value).split(",") if part.strip()]
        if names == ["ALL"]:
            return list(State)
        unknown = [name for name in names if name not in _STATES]
        if unknown or not names:
            self.fail(f"{str(value)!r} is not a state; states: {', '.join(_STATES)} (or all)", param, ctx)
        return [State(name) for name in names]


_JSON_META = "celery_idem.json"
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


class _Group(click.Group):
    """Turns celery-idem's own errors (a store that is down, a bad setting) into one clear line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except IdempotencyError as exc:
            as_json = "--json" in sys.argv[1:]
            _fail(str(exc), as_json, 2 if isinstance(exc, ValueError) else 1)


@click.group(name="idem", cls=_Group, help="Inspect and repair celery-idem records.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (also accepted after the command).")
@click.pass_context
def idem(ctx: click.Context, as_json: bool) -> None:
    """The ``idem`` command group."""
    ctx.meta[_JSON_META] = as_json


@idem.command(name="show", help="Show the record of KEY.")
@click.argument("key")
@click.option("--task", "task", required=True, help="The task's name.")
@click.option("--scope", default=None, help="The idempotency scope.")
@json_option
@click.pass_context
def show(ctx: click.Context, key: str, task: str, scope: str | None, as_json: bool) -> None:
    as_json = _wants_json(ctx, as_json)
    name = _task_name(ctx, task)
    extension = _extension(ctx)
    record = extension.get(name, key, scope)
    if record is None:
        _fail(f"no record for key {key!r} of task {name!r}" + (f" in scope {scope!r}" if scope else ""), as_json)
        return
    view = _view(ctx, record)
    _emit(view, as_json, _human_record(view, record, extension.store.now()))


@idem.command(name="forget", help="Remove the record of KEY in any state (a running attempt is fenced out).")
@click.argument("key")
@click.option("--task", "task", required=True, help="The task's name.")
@click.option("--scope", default=None, help="The idempotency scope.")
@json_option
@click.pass_context
def forget(ctx: click.Context, key: str, task: str, scope: str | None, as_json: bool) -> None:
    as_json = _wants_json(ctx, as_json)
    name = _task_name(ctx, task)
    removed = _extension(ctx).forget(name, key, scope)
    if not removed:
        _fail(f"no record for key {key!r} of task {name!r}", as_json)
        return
    _emit({"forgotten": True, "key": key, "task": name, "scope": scope}, as_json, f"forgot {name} {key}")


@idem.command(name="list", help="List live records, newest first: every state unless --state says which.")
@click.option(
    "--state",
    "states",
    type=_States(),
    default="all",
    show_default=True,
    help="PENDING, IN_PROGRESS, COMPLETED, FAILED, several with commas, or all (any case).",
)
@click.option("--task", "task", default=None, help="Only this task.")
@click.option(
    "--older-than", "older_than", default=None, help="Only records last changed this long ago (90s, 10m, 2h, 1d)."
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@json_option
@click.pass_context
def list_(
    ctx: click.Context, states: list[State], task: str | None, older_than: str | None, limit: int, as_json: bool
) -> None:
    as_json = _wants_json(ctx, as_json)
    name = _task_name(ctx, task) if task else None
    age = _age(older_than) if older_than is not None else None
    store = _extension(ctx).store
    now = store.now()
    one = states[0] if len(states) == 1 else None
    # An age filter or several states are applied here, on every live record of the one state (or all).
    fetch = limit if age is None and (one is not None or len(states) == len(State)) else 1_000_000
    records = [
        r
        for r in store.records(state=one, task_name=name, limit=fetch)
        if r.state in states and (age is None or now - r.updated_at >= age)
    ][:limit]
    rows = [
        (
            r.state.value,
            r.task_name,
            r.scope or "-",
            r.key,
            r.task_id,
            str(r.attempt),
            span(now - r.updated_at),
            (f"{span(r.lease_expires_at - now)}" if (r.lease_expires_at or 0) > now else "ran out")
            if not r.state.settled and r.lease_expires_at is not None
            else "-",
            span(r.expires_at - now),
        )
        for r in records
    ]
    header = ("STATE", "TASK", "SCOPE", "KEY", "TASK ID", "ATTEMPT", "CHANGED", "LEASE LEFT", "EXPIRES IN")
    _emit([_view(ctx, r) for r in records], as_json, table(header, rows) if rows else "no records")


@idem.command(name="stats", help="Count the store's live records by state and by task.")
@json_option
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    as_json = _wants_json(ctx, as_json)
    extension = _extension(ctx)
    store = extension.store
    counts = {state.value: n for state, n in store.count_by_state().items()}
    try:
        by_task = {task: {s.value: n for s, n in c.items()} for task, c in store.count_by_task().items()}
    except NotImplementedError:
        by_task = None
    where = store.url or repr(store)  # its password redacted
    counters = (
        "the extension's counters (Idempotency.metrics()) are each process's own: a prefork worker's are in "
        "its children, summed by the Prometheus metrics (celery_idem_events_total; docs/operations.md, Metrics)"
    )
    prefix = getattr(store, "key_prefix", None)
    data = {"store": where, "prefix": prefix, "records": counts, "by_task": by_task, "counters": counters}
    lines = [
        f"store    {where}",
        f"prefix   {prefix}",
        "",
        table(("STATE", "RECORDS"), [(s, str(n)) for s, n in counts.items()]),
    ]
    if by_task:
        header = ("TASK", *(s.value for s in State))
        lines += ["", table(header, [(task, *(str(c[s.value]) for s in State)) for task, c in by_task.items()])]
    lines += ["", f"counters: {counters}"]
    _emit(data, as_json, "\n".join(lines))


@idem.command(name="reconcile", help="Settle records stuck past their lease.")
@click.option("--dry-run", is_flag=True, help="Count what would be done; change nothing.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many stale records.")
@json_option
@click.pass_context
def reconcile(ctx: click.Context, dry_run: bool, limit: int | None, as_json: bool) -> None:
    as_json = _wants_json(ctx, as_json)
    ctx.obj.app.loader.import_default_modules()
    report = _extension(ctx).reconcile(limit=limit, dry_run=dry_run)
    fields = report.model_dump()
    counts = ", ".join(f"{k}={v}" for k, v in fields.items() if k not in ("dry_run", "seconds", "left_records"))
    lines = [f"{'dry run' if dry_run else 'reconciled'} in {span(report.seconds)}: {counts}"]
    if report.left_records:
        lines += ["", "left as they were:"]
        header = ("TASK", "SCOPE", "KEY", "TASK ID", "STATE", "WHY")
        lines.append(
            table(
                header, [(r.task_name, r.scope or "-", r.key, r.task_id, r.state, r.why) for r in report.left_records]
            )
        )
    _emit(fields, as_json, "\n".join(lines))
