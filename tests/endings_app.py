"""The tasks of the endings matrix (tests/worker/test_endings.py): one per way a task body can end.

Each task is registered twice, ``end.<kind>.late`` (``acks_late=True``) and ``end.<kind>.early``
(``acks_late=False``), so one worker runs both halves of the matrix. Every execution of a body is an
INCR on the counter Redis under the call's idempotency key (``executions``), never read from the
library's records; a body that must hang to be killed, revoked or timed out hangs only the first
time it starts (a second counter), so a duplicate that runs again ends at once.

A ``celery -A endings_app worker`` subprocess builds ``app`` from the SHOP_* variables of
tests/workers.py, plus ENDINGS_QUEUES (every queue of the run, declared alike in producer and
workers), ENDINGS_QUORUM (declare them as RabbitMQ quorum queues) and ENDINGS_SPAWN (pool children
started by ``spawn``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject
from kombu import Queue
from shop import COUNTER_URL, effects_key

from celery_idem import Idempotency, IdempotentTask, PermanentError

LEASE_SECONDS = 3
HOLD_SECONDS = 30  # a first execution that hangs: it is killed, revoked or timed out long before


def executions_key(prefix: str, key: str) -> str:
    return effects_key(prefix, "end", key)


def make_app(
    *,
    broker: str,
    backend: str,
    store: str,
    prefix: str,
    queues: list[str],
    quorum: bool = False,
    spawn: bool = False,
    **settings: Any,
) -> Celery:
    app = Celery("endings", broker=broker, backend=backend, set_as_current=False)
    arguments = {"x-queue-type": "quorum"} if quorum else None
    app.conf.update(
        task_queues=[Queue(name, routing_key=name, durable=True, queue_arguments=arguments) for name in queues],
        task_default_queue=queues[0],
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    if spawn:
        app.conf.worker_pool_start_method = "spawn"
    Idempotency(app, store=store, key_prefix=prefix, **settings)
    counter = redis.Redis.from_url(COUNTER_URL)

    def effect(task: Any) -> int:
        """One execution of a body: counted, and the pid of the process that runs it."""
        key = executions_key(prefix, task.request.idempotency_key)
        pipe = counter.pipeline()
        pipe.incr(key)
        pipe.set(f"{key}:pid", os.getpid())
        return int(pipe.execute()[0])

    def first_start(task: Any) -> bool:
        return counter.incr(executions_key(prefix, task.request.idempotency_key) + ":started") == 1

    @app.task(shared=False, name="end.replacement")
    def replacement(key: str) -> str:
        counter.incr(executions_key(prefix, key) + ":replacement")
        return "done"

    def returns(self: Any) -> str:
        effect(self)
        return "done"

    def permanent(self: Any) -> str:
        effect(self)
        raise PermanentError("card declined")

    def retryable(self: Any) -> str:
        if effect(self) == 1:
            raise ConnectionError("payment provider unreachable")
        return "done"

    def retries(self: Any) -> str:
        effect(self)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return "done"

    def autoretried(self: Any, fail_times: int) -> str:
        if effect(self) <= fail_times:
            raise ConnectionError("payment provider unreachable")
        return "done"

    def replaced(self: Any) -> Any:
        effect(self)
        raise self.replace(replacement.si(self.request.idempotency_key))

    def rejects(self: Any, requeue: bool) -> str:
        if effect(self) == 1:
            raise Reject("not now", requeue=requeue)
        return "done"

    def ignores(self: Any) -> str:
        effect(self)
        raise Ignore()

    def hangs(self: Any, seconds: float = HOLD_SECONDS) -> str:
        """Hangs the first time it starts (to be killed, revoked, timed out or shut down)."""
        first = first_start(self)
        effect(self)
        if first:
            time.sleep(seconds)
        return "done"

    kinds: dict[str, tuple[Any, dict[str, Any]]] = {
        "returns": (returns, {}),
        "permanent": (permanent, {}),
        "retryable": (retryable, {}),
        "retries": (retries, {"max_retries": 1}),
        "autoretried": (autoretried, {"autoretry_for": (ConnectionError,), "max_retries": 1, "default_retry_delay": 0}),
        "replaced": (replaced, {}),
        "rejects": (rejects, {}),
        "ignores": (ignores, {}),
        "hangs": (hangs, {}),
        "hangs_reject_lost": (hangs, {"reject_on_worker_lost": True}),
        "hangs_retry_lost": (hangs, {"retry_on_worker_lost": True, "max_retries": 1, "default_retry_delay": 0}),
    }
    for kind, (body, options) in kinds.items():
        for variant, late in (("late", True), ("early", False)):
            app.task(
                shared=False,
                base=IdempotentTask,
                bind=True,
                name=f"end.{kind}.{variant}",
                acks_late=late,
                idempotency={"lease_seconds": LEASE_SECONDS},
                **options,
            )(body)
    return app


if os.environ.get("SHOP_BROKER"):
    app = make_app(
        broker=os.environ["SHOP_BROKER"],
        backend=os.environ["SHOP_BACKEND"],
        store=os.environ["SHOP_STORE"],
        prefix=os.environ["SHOP_PREFIX"],
        queues=json.loads(os.environ["ENDINGS_QUEUES"]),
        quorum=bool(os.environ.get("ENDINGS_QUORUM")),
        spawn=bool(os.environ.get("ENDINGS_SPAWN")),
    )
