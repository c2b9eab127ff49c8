"""A ``celery -A shop worker`` subprocess for the tests that need real worker processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from addresses import REDIS_BACKEND_URL

TESTS = Path(__file__).parent
BACKEND = REDIS_BACKEND_URL


def execute_as_worker(app: Any, name: str, task_id: str, *, args: tuple[Any, ...] = (1,), **fields: Any) -> None:
    """Run one message of task ``name`` in this process as a worker's pool does (Celery's own Request),
    without a broker: ``fields`` are message headers (``idempotency_key``, ``expires``, ...)."""
    from celery.contrib.testing.mocks import TaskMessage
    from celery.worker.request import Request

    message = TaskMessage(name, args=args, id=task_id, **fields)
    message.properties = {}
    message.delivery_info = {"exchange": "", "routing_key": "celery"}
    Request(message, app=app).execute()


def wait_for(predicate: Callable[[], Any], what: str, seconds: float = 30) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {seconds}s")


class Worker:
    """A ``celery -A shop worker`` subprocess (``app=`` names another app module, ``env=`` adds to its
    environment)."""

    def __init__(
        self,
        tmp: Path,
        broker: str,
        store: str,
        prefix: str,
        ledger_url: str | None = None,
        *,
        pool: str = "prefork",
        queue: str | None = None,
        name: str | None = None,
        app: str = "shop",
        concurrency: int = 2,
        env: dict[str, str] | None = None,
        **settings: Any,
    ) -> None:
        self.name = name or f"{prefix}-{uuid.uuid4().hex[:4]}@{socket.gethostname()}"
        self.log = tmp / f"worker-{uuid.uuid4().hex[:6]}.log"
        env = {
            **os.environ,
            "SHOP_BROKER": broker,
            "SHOP_BACKEND": BACKEND,
            "SHOP_STORE": store,
            "SHOP_PREFIX": prefix,
            "SHOP_QUEUE": prefix,
            "SHOP_SETTINGS": json.dumps(settings),
            "SHOP_LEDGER": ledger_url or "",
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        if "DJANGO_SETTINGS_MODULE" not in (env or {}):
            env.pop("DJANGO_SETTINGS_MODULE", None)  # Celery's Django fixup would load it in a non-Django app
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            queue or prefix,
            "-n",
            self.name,
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=TESTS, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for(lambda: "ready." in self.output() or self.process.poll() is not None, "worker start", 60)
        assert self.process.poll() is None, f"worker exited:\n{self.output()}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole worker: parent and children, no handler runs anywhere."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
