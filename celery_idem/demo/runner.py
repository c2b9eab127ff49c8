"""Run the demo: a real worker process, five scenarios, a summary, and an exit code that says
whether every guarantee held (so the demo doubles as a smoke test)."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import click

from ..errors import PayloadMismatchError, PermanentError
from ..extension import Idempotency
from ..records import State
from .app import effects_file, make_app

__all__ = ["main", "run_demo"]


@dataclass
class Check:
    scenario: str
    held: bool
    detail: str


class Demo:
    def __init__(self, workdir: Path, broker: str | None, backend: str | None, store: str | None, out: TextIO):
        self.workdir, self.out = workdir, out
        self.prefix = f"demo-{uuid.uuid4().hex[:6]}"  # fresh keys, even on a shared Redis
        self.wiring = {"broker": broker, "backend": backend, "store": store}
        self.app = make_app(workdir=workdir, prefix=self.prefix, **self.wiring)
        self.idem = Idempotency.of(self.app)
        self.workers: list[subprocess.Popen[bytes]] = []
        self.checks: list[Check] = []

    # ---- plumbing ------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def start_worker(self) -> None:
        log = self.workdir / f"worker-{len(self.workers)}.log"
        env = {**os.environ, "CELERY_IDEM_DEMO_WORKDIR": str(self.workdir), "CELERY_IDEM_DEMO_PREFIX": self.prefix}
        env.update({f"CELERY_IDEM_DEMO_{k.upper()}": v for k, v in self.wiring.items() if v})
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_idem.demo.app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "-l",
            "INFO",
            "-n",
            f"{self.prefix}-{len(self.workers)}@%h",
            "-Q",
            f"{self.prefix}-q",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with log.open("wb") as sink:
            worker = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        self.workers.append(worker)
        deadline = time.monotonic() + 60
        while "ready." not in log.read_text(errors="replace"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the demo worker did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)

    def kill_worker(self) -> None:
        worker = self.workers[-1]
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)

    def stop(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGTERM)
                try:
                    worker.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(worker.pid, signal.SIGKILL)

    def executions(self, task: str, key: str) -> int:
        path = effects_file(self.workdir)
        rows = path.read_text().splitlines() if path.exists() else []
        return collections.Counter(row.rsplit(" ", 1)[0] for row in rows)[f"{task} {key}"]

    def scenario(self, name: str, run: Callable[[], tuple[bool, str]]) -> None:
        self.say(f"-> {name} ...")
        started = time.monotonic()
        try:
            held, detail = run()
        except Exception as exc:  # noqa: BLE001 - a scenario that crashes did not hold
            held, detail = False, f"{type(exc).__name__}: {exc}"
        mark = "ok" if held else "FAILED"
        self.say(f"   [{mark}] {detail} ({time.monotonic() - started:.1f}s)")
        self.checks.append(Check(name, held, detail))

    # ---- the scenarios -------------------------------------------------------------------------

    def storm(self) -> tuple[bool, str]:
        charge, key = self.app.tasks["demo.charge"], f"order-1001-{self.prefix}"
        answers: list[tuple[str, Any]] = []
        lock = threading.Lock()

        def caller() -> None:
            for _ in range(25):
                result = charge.apply_async((1001, 4200), idempotency_key=key)
                value = result.get(timeout=60, interval=0.05)
                with lock:
                    answers.append((result.id, repr(value)))

        threads = [threading.Thread(target=caller) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        runs, ids, values = self.executions("demo.charge", key), {a[0] for a in answers}, {a[1] for a in answers}
        held = len(answers) == 200 and runs == 1 and len(ids) == 1 and len(values) == 1
        return held, f"200 calls from 8 threads: {runs} execution, {len(ids)} task id, {len(values)} distinct answer"

    def mismatch(self) -> tuple[bool, str]:
        key = f"order-1001-{self.prefix}"
        try:
            self.app.tasks["demo.charge"].apply_async((1001, 9900), idempotency_key=key)
        except PayloadMismatchError:
            runs = self.executions("demo.charge", key)
            return runs == 1, f"same key, amount 9900 instead of 4200: PayloadMismatchError, still {runs} execution"
        return False, "a different amount under a used key was accepted"

    def final_failure(self) -> tuple[bool, str]:
        declined, key = self.app.tasks["demo.declined"], f"order-77-{self.prefix}"
        outcomes = []
        for _ in range(2):
            result = declined.apply_async((77,), idempotency_key=key)
            try:
                result.get(timeout=60, interval=0.05)
                outcomes.append("no error")
            except PermanentError as exc:
                outcomes.append(f"{type(exc).__name__}({exc})")
        runs = self.executions("demo.declined", key)
        held = runs == 1 and outcomes[0] == outcomes[1] != "no error"
        return held, f"declined twice with {outcomes[0]}, body ran {runs} time: the second call was a replay"

    def retry(self) -> tuple[bool, str]:
        flaky, key = self.app.tasks["demo.flaky"], f"order-88-{self.prefix}"
        result = flaky.apply_async((88,), idempotency_key=key)
        value = result.get(timeout=60, interval=0.05)
        again = flaky.apply_async((88,), idempotency_key=key)
        runs = self.executions("demo.flaky", key)
        held = value["attempts"] == 2 and runs == 2 and again.deduplicated and again.get(timeout=60) == value
        return held, f"timed out once, retried under task id {result.id[:8]}: {runs} attempts, then replayed"

    def crash(self) -> tuple[bool, str]:
        provision, key = self.app.tasks["demo.provision"], f"db-1-{self.prefix}"
        provision.apply_async((key, 120), idempotency_key=key)
        deadline = time.monotonic() + 60
        while self.executions("demo.provision", key) < 1:
            if time.monotonic() > deadline:
                return False, "the job never started"
            time.sleep(0.05)
        self.kill_worker()
        stuck = self.idem.get("demo.provision", key)
        self.start_worker()
        if stuck is not None and stuck.lease_expires_at:
            time.sleep(max(0.0, stuck.lease_expires_at - time.time()) + 0.5)
        report = self.idem.reconcile()
        retried = provision.apply_async((key, 0.1), idempotency_key=key)
        answer = retried.get(timeout=60, interval=0.05)
        final = self.idem.get("demo.provision", key)
        runs = self.executions("demo.provision", key)
        settled = final is not None and final.state is State.COMPLETED and answer == f"{key} is up"
        held = stuck is not None and stuck.state is State.IN_PROGRESS and settled and runs == 2
        how = f"reconciler: scanned {report.scanned}, released {report.released}, left {report.left}"
        return held, f"worker SIGKILLed mid-job (record IN_PROGRESS); {how}; the job then ran once to completion"

    def summary(self) -> None:
        width = max(len(c.scenario) for c in self.checks)
        self.say("\n" + "scenario".ljust(width) + "  held  detail")
        self.say("-" * width + "  ----  " + "-" * 40)
        for check in self.checks:
            self.say(f"{check.scenario.ljust(width)}  {'yes' if check.held else 'NO':<4}  {check.detail}")
        failed = [c.scenario for c in self.checks if not c.held]
        self.say("\n" + ("every guarantee held" if not failed else f"NOT HELD: {', '.join(failed)}"))


def run_demo(
    *,
    broker: str | None = None,
    backend: str | None = None,
    store: str | None = None,
    workdir: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Run every scenario; 0 when every guarantee held, 1 otherwise."""
    directory = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="celery-idem-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    demo = Demo(directory.resolve(), broker, backend, store, out)
    wiring = ", ".join(f"{k}={v or 'embedded'}" for k, v in demo.wiring.items())
    demo.say(f"celery-idem demo ({wiring}); work files in {directory}")
    try:
        demo.start_worker()
        demo.say("a real worker process is up (prefork, 2 children)\n")
        demo.scenario("storm of duplicate calls", demo.storm)
        demo.scenario("payload mismatch refused", demo.mismatch)
        demo.scenario("final failure replayed", demo.final_failure)
        demo.scenario("retryable failure retried", demo.retry)
        demo.scenario("worker killed mid-task", demo.crash)
    finally:
        demo.stop()
        if not workdir:
            shutil.rmtree(directory, ignore_errors=True)
    demo.summary()
    return 0 if all(c.held for c in demo.checks) else 1


@click.group(name="celery-idem")
def main() -> None:
    """celery-idem: make Celery tasks safe to call twice."""


@main.command()
@click.option("--broker", default=None, help="A broker URL (default: an embedded file transport).")
@click.option("--backend", default=None, help="A result backend URL (default: files).")
@click.option("--store", default=None, help="An idempotency store URL (default: SQLite).")
@click.option("--workdir", default=None, help="Keep the demo's files here (default: a temporary directory).")
def demo(broker: str | None, backend: str | None, store: str | None, workdir: str | None) -> None:
    """Show the guarantees on a real worker; exits 1 if one did not hold."""
    raise SystemExit(run_demo(broker=broker, backend=backend, store=store, workdir=workdir))
