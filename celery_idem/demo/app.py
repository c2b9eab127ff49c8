"""The demo's Celery app: a shop whose tasks write each execution to a file (the side effect).

The runner builds it with :func:`make_app`; the worker process it starts imports this module
(``celery -A celery_idem.demo.app worker``) and gets ``app`` from the CELERY_IDEM_DEMO_* variables.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery

from celery_idem import Idempotency, IdempotentTask, PermanentError

LEASE_SECONDS = 2.0


def effects_file(workdir: Path) -> Path:
    return workdir / "effects.log"


def make_app(*, workdir: Path, broker: str | None, backend: str | None, store: str | None, prefix: str) -> Celery:
    """The demo app; with no broker, backend or store it runs on files in ``workdir``, no server."""
    broker = broker or "filesystem://"
    if not backend:
        (workdir / "results").mkdir(parents=True, exist_ok=True)
    app = Celery("demo", broker=broker, backend=backend or f"file://{workdir / 'results'}", set_as_current=False)
    app.conf.update(
        task_default_queue=f"{prefix}-q",
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=3600,
    )
    if broker.startswith("filesystem://"):
        queue = workdir / "queue"
        queue.mkdir(parents=True, exist_ok=True)
        app.conf.broker_transport_options = {
            "data_folder_in": str(queue),
            "data_folder_out": str(queue),
            "control_folder": str(workdir / "control"),  # broadcasts (inspect); default: ./control
            "polling_interval": 0.05,
        }
    Idempotency(
        app,
        store=store or f"sqlite:///{workdir / 'idem.db'}",
        key_prefix=prefix,
        lease_seconds=LEASE_SECONDS,
        stale_grace_seconds=5,
        inspect_timeout_seconds=1,
    )
    effects = effects_file(workdir)

    def effect(task: Any) -> int:
        """The side effect: one line per execution of a body, appended outside the library.
        Returns how many executions this identity has had, this one included."""
        line = f"{task.name} {task.request.idempotency_key}"
        with effects.open("a") as log:
            log.write(f"{line} {os.getpid()}\n")
        return sum(1 for row in effects.read_text().splitlines() if row.rsplit(" ", 1)[0] == line)

    def task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
        decorate: Callable[[Callable[..., Any]], Any] = app.task(**options)  # Celery ships no annotations
        return decorate

    @task(
        base=IdempotentTask,
        bind=True,
        shared=False,
        name="demo.charge",
        idempotency={"key_args": ["order_id", "amount"]},
    )
    def charge(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        """Charge a card: the side effect that must happen once."""
        effect(self)
        time.sleep(0.2)
        return {"order_id": order_id, "charged": amount, "charge_id": f"ch_{self.request.id[:8]}"}

    @task(base=IdempotentTask, bind=True, shared=False, name="demo.declined")
    def declined(self: Any, order_id: int) -> None:
        """A card that is declined: a final answer, stored and replayed."""
        effect(self)
        raise PermanentError(f"card declined for order {order_id}")

    @task(
        base=IdempotentTask,
        bind=True,
        shared=False,
        name="demo.flaky",
        autoretry_for=(ConnectionError,),
        max_retries=3,
        default_retry_delay=0,
    )
    def flaky(self: Any, order_id: int) -> dict[str, Any]:
        """A provider that times out once: retried under the same task id, then stored."""
        effect(self)
        if self.request.retries == 0:
            raise ConnectionError("payment provider timed out")
        return {"order_id": order_id, "attempts": self.request.retries + 1}

    @task(
        base=IdempotentTask,
        bind=True,
        shared=False,
        name="demo.provision",
        acks_late=True,
        idempotency={"key_args": ["server"]},
    )
    def provision(self: Any, server: str, seconds: float) -> str:
        """A long job whose worker the demo kills: only its first attempt is slow."""
        if effect(self) == 1:
            time.sleep(seconds)
        return f"{server} is up"

    return app


if os.environ.get("CELERY_IDEM_DEMO_WORKDIR"):
    app = make_app(
        workdir=Path(os.environ["CELERY_IDEM_DEMO_WORKDIR"]),
        broker=os.environ.get("CELERY_IDEM_DEMO_BROKER") or None,
        backend=os.environ.get("CELERY_IDEM_DEMO_BACKEND") or None,
        store=os.environ.get("CELERY_IDEM_DEMO_STORE") or None,
        prefix=os.environ.get("CELERY_IDEM_DEMO_PREFIX", "demo"),
    )
