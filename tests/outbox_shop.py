"""The outbox's test app: a shop whose orders stage their charge in a SQLAlchemy outbox.

A ``celery -A outbox_shop worker`` subprocess and ``python outbox_shop.py relay`` both build
``app`` and ``outbox`` from the SHOP_* environment (workers.Worker sets it; SHOP_OUTBOX_DB is the
database URL, SHOP_OUTBOX_TABLE the outbox table). The charge's side effect is an INCR on the
counter Redis (never our records), and every message published is counted there too, by
``before_task_publish`` in whichever process published it.

``relay`` runs one relay pass; ``SHOP_RELAY_DIES=after_publish`` SIGKILLs the relay after its
first publish returned (before the transaction that deletes the row commits), ``before_publish``
after its claim and before the message reaches the broker, ``before_claim`` before its first
claim; ``SHOP_RELAY_LEASE`` is how long the rows it took stay its own (seconds).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import redis
import sqlalchemy as sa
from addresses import REDIS_COUNTER_URL
from celery import Celery
from celery.signals import before_task_publish

from celery_idem import Idempotency, IdempotentTask
from celery_idem.outbox import SQLOutbox, staging

COUNTER_URL = os.environ.get("SHOP_COUNTER", REDIS_COUNTER_URL)


def make(
    *, broker: str, backend: str | None, store: str, prefix: str, queue: str, db: str, table: str, **settings: Any
) -> tuple[Celery, SQLOutbox]:
    app = Celery("outbox_shop", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    Idempotency(app, store=store, key_prefix=prefix, **settings)
    counter = redis.Redis.from_url(COUNTER_URL)

    @app.task(name="outbox.charge", base=IdempotentTask, bind=True, shared=False)
    def charge(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        counter.incr(f"effects:{prefix}:{order_id}")
        return {"order_id": order_id, "charged": amount}

    @app.task(name="outbox.plain", bind=True, shared=False)
    def plain(self: Any, order_id: int) -> int:
        counter.incr(f"effects:{prefix}:plain:{order_id}")
        return order_id

    def count_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if str(sender).startswith("outbox."):
            counter.incr(f"publishes:{prefix}:{headers.get('id')}")

    before_task_publish.connect(count_publish, weak=False)
    engine = sa.create_engine(db, poolclass=sa.pool.NullPool)
    return app, SQLOutbox(engine, table_name=table)


def effects(prefix: str, order_id: Any) -> int:
    return int(redis.Redis.from_url(COUNTER_URL).get(f"effects:{prefix}:{order_id}") or 0)


def publishes(prefix: str, task_id: str) -> int:
    return int(redis.Redis.from_url(COUNTER_URL).get(f"publishes:{prefix}:{task_id}") or 0)


if os.environ.get("SHOP_OUTBOX_DB"):
    app, outbox = make(
        broker=os.environ["SHOP_BROKER"],
        backend=os.environ.get("SHOP_BACKEND") or None,
        store=os.environ["SHOP_STORE"],
        prefix=os.environ["SHOP_PREFIX"],
        queue=os.environ["SHOP_QUEUE"],
        db=os.environ["SHOP_OUTBOX_DB"],
        table=os.environ["SHOP_OUTBOX_TABLE"],
        **json.loads(os.environ.get("SHOP_SETTINGS") or "{}"),
    )


def _relay_dying(when: str) -> None:
    """Make this process die at ``when`` in its first publish (no handler runs: SIGKILL)."""
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if when == "before_claim":
        staging.relay_call = lambda *args, **kwargs: die()  # type: ignore[assignment]
    elif when == "after_publish":
        relay_call = staging.relay_call

        def published_then_die(*args: Any, **kwargs: Any) -> Any:
            relay_call(*args, **kwargs)
            die()

        staging.relay_call = published_then_die  # type: ignore[assignment]
    elif when == "before_publish":
        charge = app.tasks["outbox.charge"]
        charge._send = lambda *args, **kwargs: die()  # type: ignore[method-assign]
    else:
        raise SystemExit(f"SHOP_RELAY_DIES={when!r}: before_claim, before_publish or after_publish")


if __name__ == "__main__" and sys.argv[1:] == ["relay"]:
    if os.environ.get("SHOP_RELAY_DIES"):
        _relay_dying(os.environ["SHOP_RELAY_DIES"])
    outbox.lease_seconds = float(os.environ.get("SHOP_RELAY_LEASE") or outbox.lease_seconds)
    print(outbox.relay(app))
