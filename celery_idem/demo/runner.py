"""Run the demo: check what it needs, start a real worker process, run the scenarios, stop the worker,
remove what it wrote, and print a summary with an exit code that says whether every guarantee held
(so the demo doubles as a smoke test): 0 held, 1 one did not, 2 the demo could not start."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import click

from .preflight import problem

__all__ = ["main", "run_demo"]


@dataclass
class Check:
    scenario: str
    held: bool
    detail: str


def run_demo(
    *,
    broker: str | None = None,
    backend: str | None = None,
    store: str | None = None,
    workdir: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Run every scenario; 0 when every guarantee held, 1 otherwise, 2 when the demo cannot start
    (a missing extra, a server it cannot reach: said in one line on stderr)."""
    if (why := problem(broker=broker, backend=backend, store=store)) is not None:
        print(f"celery-idem demo: {why}", file=sys.stderr)
        return 2
    # Imported once the check passed: the demo's app needs SQLAlchemy (the sql extra).
    from .harness import Demo
    from .scenarios import SCENARIOS, play

    directory = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="celery-idem-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    demo = Demo(directory.resolve(), broker, backend, store, out)
    wiring = ", ".join(f"{k}={v or 'embedded'}" for k, v in demo.wiring.items())
    demo.say(f"celery-idem demo ({wiring}); work files in {directory}")
    checks: list[Check] = []
    try:
        demo.say("starting a worker process (prefork, 2 children) ...")
        demo.start_worker()
        demo.say("the worker is up\n")
        for name, scenario in SCENARIOS:
            demo.say(f"-> {name} ...")
            started = time.monotonic()
            shown = play(demo, scenario)
            for line in shown.story:
                demo.say(f"   {line}")
            demo.say(f"   [{'ok' if shown.held else 'FAILED'}] {shown.detail} ({time.monotonic() - started:.1f}s)")
            checks.append(Check(name, shown.held, shown.detail))
    finally:
        demo.say("\nstopping the worker: a warm shutdown, it finishes the tasks it runs ...")
        demo.say(f"stopped ({demo.stop():.1f}s)")
        removed = demo.clean_up()
        if removed:
            demo.say(f"removed what the demo wrote to your servers: {', '.join(removed)}")
        if not workdir:
            shutil.rmtree(directory, ignore_errors=True)
    summary(demo.say, checks)
    return 0 if checks and all(c.held for c in checks) else 1


def summary(say: Callable[[str], None], checks: list[Check]) -> None:
    width = max(len(c.scenario) for c in checks)
    say("\n" + "scenario".ljust(width) + "  held  detail")
    say("-" * width + "  ----  " + "-" * 40)
    for check in checks:
        say(f"{check.scenario.ljust(width)}  {'yes' if check.held else 'NO':<4}  {check.detail}")
    failed = [c.scenario for c in checks if not c.held]
    say("\n" + ("every guarantee held" if not failed else f"NOT HELD: {', '.join(failed)}"))


@click.group(name="celery-idem")
def main() -> None:
    """celery-idem: make Celery tasks safe to call twice."""


@main.command()
@click.option("--broker", default=None, help="A broker URL (default: an embedded file transport).")
@click.option("--backend", default=None, help="A result backend URL (default: files).")
@click.option("--store", default=None, help="An idempotency store URL (default: SQLite).")
@click.option("--workdir", default=None, help="Keep the demo's files here (default: a temporary directory).")
def demo(broker: str | None, backend: str | None, store: str | None, workdir: str | None) -> None:
    """Show the guarantees on a real worker; exits 1 if one did not hold, 2 if it cannot start."""
    raise SystemExit(run_demo(broker=broker, backend=backend, store=store, workdir=workdir))
