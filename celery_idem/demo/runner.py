"""Run the demo: check what it needs, start a real worker process, run the scenarios, stop the worker,
remove what it wrote, and print a summary with an exit code that says whether every guarantee held
(so the demo doubles as a smoke test): 0 held, 1 one did not, 2 the demo could not start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
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
    """Ctrl-C, SIGTERM or SIGHUP: the demo stops its worker and cleans up (and, like
    KeyboardInterrupt, no scenario takes it for its own failure)."""


class Signals:
    """The demo's handler of SIGINT, SIGTERM and SIGHUP, installed before anything else: the first
    signal raises :class:`Interrupted`; later ones, and any once the cleanup began, wait for it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.closed = False
        self.previous = {sig: signal.signal(sig, self) for sig in self.SIGNALS}

    def __call__(self, signum: int, frame: object) -> None:
        if not self.closed:
            self.closed = True
            raise Interrupted(signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def run_demo(
    *,
    broker: str | None = None,
    backend: str | None = None,
    store: str | None = None,
    workdir: str | None = None,
    out: TextIO | None = None,
) -> int:
    """Run every scenario; 0 when every guarantee held, 1 otherwise, 2 when the demo cannot start
    (a missing extra, a server it cannot reach, a worker that does not start: said in one line on
    stderr), 130 when it was interrupted (after it stopped its worker and cleaned up).

    Its files go to a directory of their own: a new temporary one, removed at the end, or with
    ``workdir`` a new ``run-<prefix>`` directory inside it, kept."""
    signals = Signals()
    try:
        return _run(broker, backend, store, workdir, out, signals)
    except Interrupted:  # before the worker started: nothing to stop, nothing written yet
        return 130
    finally:
        signals.restore()


def _run(
    broker: str | None,
    backend: str | None,
    store: str | None,
    workdir: str | None,
    out: TextIO | None,
    signals: Signals,
) -> int:
    for name in CELERY_ENVIRONMENT:  # the worker process inherits the environment too
        os.environ.pop(name, None)
    out = out or sys.stdout or open(os.devnull, "w")  # noqa: SIM115 - stdout closed (`>&-`): say nothing
    prefix = f"demo-{uuid.uuid4().hex[:6]}"  # fresh keys and tables, even on a shared server
    try:
        why = problem(broker=broker, backend=backend, store=store)
        if workdir:
            directory = Path(workdir).resolve() / f"run-{prefix}"
            directory.mkdir(parents=True)
        else:
            directory = Path(tempfile.mkdtemp(prefix="celery-idem-demo-")).resolve()
    except Exception as exc:  # noqa: BLE001 - a path it cannot create, a URL no check could read
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if why is not None:
        return refuse(why)
    # Imported once the check passed: the demo's app needs SQLAlchemy (the sql extra).
    from .harness import Demo, WorkerDidNotStart
    from .scenarios import SCENARIOS, play

    try:
        demo = Demo(directory, prefix, broker, backend, store, out)
    except BaseException as exc:  # its app, store or shop database could not be made, or a signal
        shutil.rmtree(directory, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        return refuse(f"cannot start: {type(exc).__name__}: {exc}")
    checks: list[Check] = []
    refused = interrupted = False
    why = None
    try:
        wiring = ", ".join(f"{k}={shown(v) if v else 'embedded'}" for k, v in demo.wiring.items())
        demo.say(f"celery-idem demo ({wiring}); work files in {directory}")
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
        refused, why = True, str(exc)
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
    finally:
        signals.closed = True  # from here on a signal waits: the cleanup is bounded (harness.STEP_SECONDS)
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
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr closed too: the code says it
        print(f"celery-idem demo: {' '.join(why.split())}", file=sys.stderr)
    return 2


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
@click.option(
    "--workdir",
    default=None,
    help="Keep the demo's files in a new run-demo-<hex> directory inside this one (default: a temporary "
    "directory, removed at the end).",
)
def demo(broker: str | None, backend: str | None, store: str | None, workdir: str | None) -> None:
    """Show the guarantees on a real worker; exits 1 if one did not hold, 2 if it cannot start, 130 if
    interrupted (it stops its worker and removes what it wrote to your servers first)."""
    raise SystemExit(run_demo(broker=broker, backend=backend, store=store, workdir=workdir))
