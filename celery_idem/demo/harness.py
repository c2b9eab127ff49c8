"""The demo's world: its app, its worker processes, the side effects counted outside the library,
and the cleanup of what it wrote to a user's servers."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ..extension import Idempotency
from .app import create_shop_database, effects_file, make_app, payments

__all__ = ["Demo", "WorkerDidNotStart"]

WORKER_START_SECONDS = 60.0


#: How long one cleanup step may take: a server that stopped answering does not hold the demo.
STEP_SECONDS = 20.0


class WorkerDidNotStart(RuntimeError):
    """The demo's worker process exited, or was not ready in time (the message: its log's last line)."""


class Demo:
    def __init__(
        self, workdir: Path, prefix: str, broker: str | None, backend: str | None, store: str | None, out: TextIO
    ):
        """``workdir``: a new directory, the demo's alone (its workers run there, and nothing of the
        caller's directory shadows a module of theirs); ``prefix``: of its keys, tables and queue."""
        self.workdir, self.out, self.prefix = workdir, out, prefix
        self.wiring = {"broker": broker, "backend": backend, "store": store}
        self.app = make_app(workdir=workdir, prefix=self.prefix, **self.wiring)
        self.idem = Idempotency.of(self.app)
        create_shop_database(workdir, self.prefix)
        self.workers: list[subprocess.Popen[bytes]] = []
        self.task_ids: set[str] = set()  # every result the demo's calls may have written
        self.muted = False

    def say(self, text: str) -> None:
        """Print a line; a reader that went away (``| head``) silences the demo, and it goes on to
        stop its worker and clean up."""
        if self.muted:
            return
        try:
            self.out.write(text + "\n")
            self.out.flush()
        except (BrokenPipeError, ValueError):
            self.muted = True
            with contextlib.suppress(OSError, ValueError):  # no error at exit for the lost reader
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.out.fileno())

    # ---- calls and their effects ---------------------------------------------------------------

    def call(self, name: str, *args: Any, **options: Any) -> Any:
        result = self.app.tasks[name].apply_async(args, **options)
        self.task_ids.add(result.id)
        return result

    def executions(self, task: str, key: str) -> int:
        """How many times a body ran for this key: lines of the effects file, written by the bodies."""
        return sum(1 for row in self._effects() if row.rsplit(" ", 1)[0] == f"{task} {key}")

    def executions_of(self, task: str) -> int:
        """How many times a body of ``task`` ran, whatever its key."""
        return sum(1 for row in self._effects() if row.split(" ", 1)[0] == task)

    def _effects(self) -> list[str]:
        path = effects_file(self.workdir)
        return path.read_text().splitlines() if path.exists() else []

    def payments(self, order_id: int) -> list[int]:
        return payments(self.workdir, order_id)

    # ---- worker processes ----------------------------------------------------------------------

    def log(self, n: int = -1) -> Path:
        return self.workdir / f"worker-{n % len(self.workers)}.log"

    def start_worker(self) -> None:
        """A ``celery worker`` process (prefork, 2 children) in the work directory (where no module of
        the caller's directory shadows Celery's), killed with the demo if the demo dies."""
        log = self.workdir / f"worker-{len(self.workers)}.log"
        env = {**os.environ, "CELERY_IDEM_DEMO_WORKDIR": str(self.workdir), "CELERY_IDEM_DEMO_PREFIX": self.prefix}
        env.update({f"CELERY_IDEM_DEMO_{k.upper()}": v for k, v in self.wiring.items() if v})
        command = [
            *(sys.executable, "-m", "celery", "-A", "celery_idem.demo.app", "worker", "-P", "prefork", "-c", "2"),
            *("-l", "INFO", "-n", f"{self.prefix}-{len(self.workers)}@%h", "-Q", f"{self.prefix}-q"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        ]
        with log.open("wb") as sink:
            worker = subprocess.Popen(
                command,
                env=env,
                cwd=self.workdir,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_dying_with(os.getpid()),
            )
        self.workers.append(worker)
        deadline = time.monotonic() + WORKER_START_SECONDS
        while "ready." not in log.read_text(errors="replace"):
            if worker.poll() is not None or time.monotonic() > deadline:
                lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
                last = lines[-1].strip() if lines else "its log is empty"
                raise WorkerDidNotStart(f"the demo's worker did not start ({last})")
            time.sleep(0.05)

    def dead(self) -> str | None:
        """Why the running worker is gone (its log's last line), or None while it runs."""
        worker = self.workers[-1]
        if worker.poll() is None:
            return None
        lines = self.log().read_text(errors="replace").splitlines() or ["(empty log)"]
        return f"the worker exited ({worker.returncode}); its log ends: {lines[-1]}"

    def kill_worker(self) -> None:
        """SIGKILL the worker and its children at once: nothing of it runs another line."""
        worker = self.workers[-1]
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)

    def stop(self, *, cold: bool = False) -> float:
        """Stop every worker still running; how long it took. A warm shutdown (SIGTERM to the main
        process: it lets running tasks finish, 15 s at most), or a cold one (SIGKILL to the group)."""
        started = time.monotonic()
        for worker in self.workers:
            if worker.poll() is None:
                if cold:
                    os.killpg(worker.pid, signal.SIGKILL)
                else:
                    os.kill(worker.pid, signal.SIGTERM)
                try:
                    worker.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(worker.pid, signal.SIGKILL)
                    worker.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)  # a child its main process left behind
        return time.monotonic() - started

    # ---- what it leaves behind -----------------------------------------------------------------

    def clean_up(self) -> tuple[list[str], list[str]]:
        """Remove what the demo wrote to servers it was pointed at: its records (its own tables, on
        SQL), its results, its queue and exchange. Files in the work directory are the runner's to
        keep or remove. Each step on its own: what it removed, and what it could not (and why)."""
        removed: list[str] = []
        failed: list[str] = []

        def step(what: str, remove: Callable[[], str | None]) -> None:
            """One step on a thread of its own, waited for STEP_SECONDS at most (a server that
            stopped answering); its failure said, the other steps run."""
            outcome: list[str | None] = []

            def run() -> None:
                try:
                    outcome.append(remove())
                except Exception as exc:  # noqa: BLE001 - said, and the other steps still run
                    failed.append(f"{what} ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")

            thread = threading.Thread(target=run, name="celery-idem-demo-cleanup", daemon=True)
            thread.start()
            thread.join(STEP_SECONDS)
            if thread.is_alive():
                failed.append(f"{what} (no answer within {STEP_SECONDS:g} s)")
            elif outcome and outcome[0]:
                removed.append(outcome[0])

        if self.wiring["store"]:
            step("its records", self._remove_records)
        if self.wiring["backend"]:
            step("its results", self._remove_results)
        if self.wiring["broker"]:
            step(f"the queue {self.prefix}-q", self._remove_queue)
        step("its connections", self._close)
        return removed, failed

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            self.idem.store.close()
        with contextlib.suppress(Exception):
            self.idem.settings.ledger.engine.dispose()
        with contextlib.suppress(Exception):
            self.app.close()

    def _remove_records(self) -> str:
        store: Any = self.idem.store
        if hasattr(store, "liveness"):  # SQL: the demo's own tables (app.demo_store), dropped whole
            store.table.drop(store.engine, checkfirst=True)
            store.liveness.drop(store.engine, checkfirst=True)
            return f"its tables {store.table.name} and {store.liveness.name}"
        records = list(store.records(limit=100_000))  # the store's records under the demo's prefix
        for record in records:
            store.forget(record.identity)
        return f"{len(records)} records (store prefix {self.prefix})"

    def _remove_results(self) -> str | None:
        backend = self.app.backend
        if not getattr(backend, "persistent", True) or type(backend).__name__ == "RPCBackend":
            return None  # rpc:// keeps no results: its replies went to the caller's queue
        for task_id in self.task_ids:
            backend.forget(task_id)
        return f"{len(self.task_ids)} results"

    def _remove_queue(self) -> str:
        name = f"{self.prefix}-q"
        with self.app.connection_for_write() as connection:
            channel = connection.default_channel
            queue = self.app.amqp.queues[name].bind(channel)
            queue.declare()  # a virtual transport (Redis) deletes only the bindings its channel knows
            queue.delete()
            if queue.exchange is not None and queue.exchange.name:
                queue.exchange.bind(channel).delete()  # AMQP keeps the exchange Celery declared for it
            if hasattr(channel, "unacked_key"):
                _forget_unacked(channel, name)
                _forget_pidboxes(channel, self.prefix)
        return f"the queue {name}"


def _forget_unacked(channel: Any, queue: str) -> None:
    """Drop the Redis transport's copies of the queue's unacked messages (the killed workers'): kombu
    would restore them to the deleted queue once its visibility timeout (1 h) passed."""
    client = channel.client
    for tag, raw in client.hgetall(channel.unacked_key).items():
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue  # not the transport's format: not ours to judge
        if routing_key == queue:
            client.hdel(channel.unacked_key, tag)
            client.zrem(channel.unacked_index_key, tag)


def _forget_pidboxes(channel: Any, prefix: str) -> None:
    """Drop the demo's workers from the Redis transport's table of remote-control queues (one member
    per worker node, ``<node>.celery.pidbox``), which kombu sweeps only hours later."""
    client = channel.client
    table = channel.keyprefix_queue % ("celery.pidbox",)
    mine = [m for m in client.smembers(table) if f"{prefix}-".encode() in m]
    if mine:
        client.srem(table, *mine)


def _dying_with(parent: int) -> Callable[[], None]:
    """What the worker's process runs before Celery: on Linux, a SIGQUIT (Celery's cold shutdown,
    which stops the pool's children too) when the demo's process dies, however it dies, so no worker
    outlives the demo (and none starts if it died while the worker was being forked)."""

    def die_with_parent() -> None:
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGQUIT)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(1)

    return die_with_parent
