"""The demo's world: its app, its worker processes, the side effects counted outside the library,
and the cleanup of what it wrote to a user's servers."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from ..extension import Idempotency
from .app import create_shop_database, effects_file, make_app, payments

__all__ = ["Demo"]

WORKER_START_SECONDS = 60.0


class Demo:
    def __init__(self, workdir: Path, broker: str | None, backend: str | None, store: str | None, out: TextIO):
        self.workdir, self.out = workdir, out
        self.prefix = f"demo-{uuid.uuid4().hex[:6]}"  # fresh keys, even on a shared Redis
        self.wiring = {"broker": broker, "backend": backend, "store": store}
        self.app = make_app(workdir=workdir, prefix=self.prefix, **self.wiring)
        self.idem = Idempotency.of(self.app)
        create_shop_database(workdir, self.prefix)
        self.workers: list[subprocess.Popen[bytes]] = []
        self.task_ids: set[str] = set()  # every result the demo's calls may have written

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # ---- calls and their effects ---------------------------------------------------------------

    def call(self, name: str, *args: Any, **options: Any) -> Any:
        result = self.app.tasks[name].apply_async(args, **options)
        self.task_ids.add(result.id)
        return result

    def executions(self, task: str, key: str) -> int:
        """How many times a body ran for this key: lines of the effects file, written by the bodies."""
        path = effects_file(self.workdir)
        rows = path.read_text().splitlines() if path.exists() else []
        return collections.Counter(row.rsplit(" ", 1)[0] for row in rows)[f"{task} {key}"]

    def executions_of(self, task: str) -> int:
        path = effects_file(self.workdir)
        rows = path.read_text().splitlines() if path.exists() else []
        return sum(1 for row in rows if row.split(" ", 1)[0] == task)

    def payments(self, order_id: int) -> list[int]:
        return payments(self.workdir, order_id)

    # ---- worker processes ----------------------------------------------------------------------

    def log(self, n: int = -1) -> Path:
        return self.workdir / f"worker-{n % len(self.workers)}.log"

    def start_worker(self) -> None:
        log = self.workdir / f"worker-{len(self.workers)}.log"
        env = {**os.environ, "CELERY_IDEM_DEMO_WORKDIR": str(self.workdir), "CELERY_IDEM_DEMO_PREFIX": self.prefix}
        env.update({f"CELERY_IDEM_DEMO_{k.upper()}": v for k, v in self.wiring.items() if v})
        command = [
            *(sys.executable, "-m", "celery", "-A", "celery_idem.demo.app", "worker", "-P", "prefork", "-c", "2"),
            *("-l", "INFO", "-n", f"{self.prefix}-{len(self.workers)}@%h", "-Q", f"{self.prefix}-q"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        ]
        with log.open("wb") as sink:
            worker = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        self.workers.append(worker)
        deadline = time.monotonic() + WORKER_START_SECONDS
        while "ready." not in log.read_text(errors="replace"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the demo worker did not start; its log:\n{log.read_text(errors='replace')}")
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

    def stop(self) -> float:
        """A warm shutdown of every worker still running (SIGTERM: each finishes the tasks it runs);
        how long it took."""
        started = time.monotonic()
        for worker in self.workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGTERM)
                try:
                    worker.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(worker.pid, signal.SIGKILL)
                    worker.wait(timeout=10)
        return time.monotonic() - started

    # ---- what it leaves behind -----------------------------------------------------------------

    def clean_up(self) -> list[str]:
        """Remove what the demo wrote to servers it was pointed at: its records, its results and its
        queue. Files in the work directory are the runner's to keep or remove. Says what it removed."""
        removed = []
        if self.wiring["store"]:
            store = self.idem.store
            records = list(store.records(limit=100_000))  # the store's records under the demo's prefix
            for record in records:
                store.forget(record.identity)
            removed.append(f"{len(records)} records (store prefix {self.prefix})")
        if self.wiring["backend"]:
            for task_id in self.task_ids:
                self.app.backend.forget(task_id)
            removed.append(f"{len(self.task_ids)} results")
        if self.wiring["broker"]:
            name = f"{self.prefix}-q"
            with self.app.connection_for_write() as connection:
                channel = connection.default_channel
                queue = self.app.amqp.queues[name].bind(channel)
                queue.declare()  # a virtual transport (Redis) deletes only the bindings its channel knows
                queue.delete()
                if hasattr(channel, "unacked_key"):
                    _forget_unacked(channel, name)
            removed.append(f"the queue {name}")
        self.idem.store.close()
        self.idem.settings.ledger.engine.dispose()
        self.app.close()
        return removed


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
