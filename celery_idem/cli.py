"""``celery -A proj idem ...``: look at records, forget them, count them, run the reconciler.

Installed as a ``celery.commands`` entry point. Every command prints for people by default and
JSON with ``--json``; a missing record exits 1, a bad argument exits 2.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Collection
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


def _human(view: dict[str, Any]) -> str:
    width = max(len(k) for k in view)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in view.items() if v is not None)


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
def idem() -> None:
    """The ``idem`` command group."""


@idem.command(name="show", help="Show the record of KEY.")
@click.argument("key")
@click.option("--task", "task", required=True, help="The task's name.")
@click.option("--scope", default=None, help="The idempotency scope.")
@json_option
@click.pass_context
def show(ctx: click.Context, key: str, task: str, scope: str | None, as_json: bool) -> None:
    name = _task_name(ctx, task)
    record = _extension(ctx).get(name, key, scope)
    if record is None:
        _fail(f"no record for key {key!r} of task {name!r}" + (f" in scope {scope!r}" if scope else ""), as_json)
        return
    view = _view(ctx, record)
    _emit(view, as_json, _human(view))


@idem.command(name="forget", help="Remove the record of KEY in any state (a running attempt is fenced out).")
@click.argument("key")
@click.option("--task", "task", required=True, help="The task's name.")
@click.option("--scope", default=None, help="The idempotency scope.")
@json_option
@click.pass_context
def forget(ctx: click.Context, key: str, task: str, scope: str | None, as_json: bool) -> None:
    name = _task_name(ctx, task)
    removed = _extension(ctx).forget(name, key, scope)
    if not removed:
        _fail(f"no record for key {key!r} of task {name!r}", as_json)
        return
    _emit({"forgotten": True, "key": key, "task": name, "scope": scope}, as_json, f"forgot {name} {key}")


@idem.command(name="list", help="List records in a state, newest first.")
@click.option("--state", type=click.Choice(_STATES, case_sensitive=False), required=True)
@click.option("--task", "task", default=None, help="Only this task.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@json_option
@click.pass_context
def list_(ctx: click.Context, state: str, task: str | None, limit: int, as_json: bool) -> None:
    name = _task_name(ctx, task) if task else None
    records = _extension(ctx).store.records(state=State(state.upper()), task_name=name, limit=limit)
    rows = [f"{r.task_name}  {r.scope or '-'}  {r.key}  {r.task_id}  attempt={r.attempt}" for r in records]
    _emit([_view(ctx, r) for r in records], as_json, "\n".join(rows) or "no records")


@idem.command(name="stats", help="Count the store's live records by state.")
@json_option
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    extension = _extension(ctx)
    counts = {state.value: n for state, n in extension.store.count_by_state().items()}
    data = {"store": repr(extension.store), "records": counts}
    human = f"store {data['store']}\n" + "\n".join(f"{state:<12} {n}" for state, n in counts.items())
    _emit(data, as_json, human)


@idem.command(name="reconcile", help="Settle records stuck past their lease.")
@click.option("--dry-run", is_flag=True, help="Count what would be done; change nothing.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many stale records.")
@json_option
@click.pass_context
def reconcile(ctx: click.Context, dry_run: bool, limit: int | None, as_json: bool) -> None:
    ctx.obj.app.loader.import_default_modules()
    report = _extension(ctx).reconcile(limit=limit, dry_run=dry_run)
    fields = report.model_dump()
    human = ("dry run: " if dry_run else "") + ", ".join(f"{k}={v}" for k, v in fields.items() if k != "dry_run")
    _emit(fields, as_json, human)
