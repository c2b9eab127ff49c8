"""Run the demo: check what it needs, start a real worker process, run the scenarios, stop the worker,
remove what it wrote, and print a summary with an exit code that says whether every guarantee held
(so the demo doubles as a smoke test): 0 held, 1 one did not, 2 the demo could not start."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import click

from .preflight import problem, shown

__all__ = ["main", "run_demo"]


@dataclass
class Check:
    scenario: str
    held: bool
    detail: str


#: Celery reads these before its configuration: the demo's wiring is the one it was given and checked.
CELERY_ENVIRONMENT = ("CELERY_BROKER_URL", "CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL", "CELERY_RESULT_BACKEND")


class Interrupted(BaseException):
    """SIGTERM or SIGHUP: the demo stops its worker and cleans up, as on Ctrl-C (and, like
    KeyboardInterrupt, no scenario takes it for its own failure)."""


def run_demo(
    *,
    broker: str | None = None,
    backend: str | None = None,
    store: str | None = None,
    workdir: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Run every scenario; 0 when every guarantee held, 1 otherwise, 2 when the demo cannot start
    (a missing extra, a server it cannot reach, a worker that does not start: said in one line on
    stderr), 130 when it was interrupted (after it stopped its worker and cleaned up)."""
    for name in CELERY_ENVIRONMENT:  # the worker process inherits the environment too
        os.environ.pop(name, None)
    try:
        why = problem(broker=broker, backend=backend, store=store)
        directory = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="celery-idem-demo-"))
        directory.mkdir(parents=True, exist_ok=True)
    except Exception as exc:  # noqa: BLE001 - a path it cannot create, a URL no check could read
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if why is not None:
        return refuse(why)
    # Imported once the check passed: the demo's app needs SQLAlchemy (the sql extra).
    from .harness import Demo, WorkerDidNotStart
    from .scenarios import SCENARIOS, play

    try:
        demo = Demo(directory.resolve(), broker, backend, store, out)
    except Exception as exc:  # noqa: BLE001 - its files or its shop database could not be made
        return refuse(f"cannot prepare the work directory {directory}: {type(exc).__name__}: {exc}")
    wiring = ", ".join(f"{k}={shown(v) if v else 'embedded'}" for k, v in demo.wiring.items())
    demo.say(f"celery-idem demo ({wiring}); work files in {directory}")
    checks: list[Check] = []
    refused = interrupted = False
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        demo.say("starting a worker process (prefork, 2 children) ...")
        demo.start_worker()
        demo.say("the worker is up\n")
        for name, scenario in SCENARIOS:
            demo.say(f"-> {name} ...")
            started = time.monotonic()
            shown_ = play(demo, scenario)
            for line in shown_.story:
                demo.say(f"   {line}")
            demo.say(f"   [{'ok' if shown_.held else 'FAILED'}] {shown_.detail} ({time.monotonic() - started:.1f}s)")
            checks.append(Check(name, shown_.held, shown_.detail))
    except WorkerDidNotStart as exc:
        refused = True
        why = str(exc)
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
    finally:
        # Cleanup is not cut short by a second Ctrl-C or a TERM: the signals wait until it is done.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if interrupted:
            demo.say("\ninterrupted: stopping the worker at once (a cold shutdown) ...")
        else:
            demo.say("\nstopping the worker: a warm shutdown, it lets running tasks finish (15 s at most) ...")
        demo.say(f"stopped ({demo.stop(cold=interrupted):.1f}s)")
        removed, failed = demo.clean_up()
        if removed:
            demo.say(f"removed what the demo wrote to your servers: {', '.join(removed)}")
        if failed:
            demo.say(f"could not remove: {'; '.join(failed)}")
        if not workdir:
            shutil.rmtree(directory, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if refused:
        return refuse(why or "the demo's worker did not start")
    if checks:
        summary(demo.say, checks)
    if interrupted:
        demo.say("interrupted: not every scenario ran")
        return 130
    return 0 if checks and all(c.held for c in checks) else 1


def refuse(why: str) -> int:
    """The demo cannot start: one line on stderr, exit 2."""
    print(f"celery-idem demo: {' '.join(why.split())}", file=sys.stderr)
    return 2


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


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
