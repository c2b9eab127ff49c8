"""The app of tests/worker/test_production_config.py: examples/production's app and configuration,
unchanged but for the durations the test shortens (``PROD_OVERRIDES``), plus one payment task.

``prod.pay`` charges through the ledger: its effect is a row of a payments table written in the
ledger's transaction (counted there, never in the library's records). Every start of the body is
an INCR on the counter Redis, with the pid that runs it and the exchange the message came through
(RabbitMQ's native delayed delivery hands countdown and ETA messages over from
``celery_delayed_delivery``). ``hold`` seconds are spent, on the first start only, ``before`` the
ledger's transaction (a body still running) or ``after`` its commit (the effect happened, the
outcome is not stored yet): where the test kills or shuts the worker down.

A ``celery -A production_app worker`` subprocess builds ``app`` from the environment the test
gives it: the configuration's own variables (CELERY_BROKER_URL, CELERY_RESULT_BACKEND,
IDEMPOTENCY_STORE, IDEMPOTENCY_KEY_PREFIX, CELERY_QUEUES, DATABASE_URL) and PROD_OVERRIDES.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery
from shop import COUNTER_URL

from celery_idem import Idempotency, IdempotentTask
from celery_idem.ledger import Ledger
from examples.production.app import make_app

PAY = "prod.pay"


def payments_table(prefix: str) -> sa.Table:
    """The business table; no unique constraint, so a second charge would show as a second row."""
    return sa.Table(
        f"payments_{prefix}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
    )


def ledger_table(prefix: str) -> str:
    return f"ledger_{prefix}"


def runs_key(prefix: str, key: str) -> str:
    return f"prod:{prefix}:{key}"


def build(database_url: str, prefix: str, overrides: dict[str, Any], config: object | None = None) -> Celery:
    """The app as production builds it (``make_app``), shortened by ``overrides``, with ``prod.pay``."""
    app = make_app(database_url, ledger_table=ledger_table(prefix), **({"config": config} if config else {}))
    app.conf.update(overrides)
    ledger: Ledger = Idempotency.of(app).settings.ledger
    payments = payments_table(prefix)
    counter = redis.Redis.from_url(COUNTER_URL)

    @app.task(base=IdempotentTask, bind=True, shared=False, name=PAY)
    def pay(self: Any, order_id: int, amount: int, hold: float = 0.0, hold_at: str = "") -> dict[str, Any]:
        key = runs_key(prefix, self.request.idempotency_key)
        pipe = counter.pipeline()
        pipe.incr(key)
        pipe.set(f"{key}:pid", os.getpid())
        pipe.rpush(f"{key}:exchange", (self.request.delivery_info or {}).get("exchange") or "")
        pipe.rpush(f"{key}:at", repr(time.time()))
        first = pipe.execute()[0] == 1
        if first and hold_at == "before":
            time.sleep(hold)

        def charge(session: Any) -> dict[str, Any]:
            row = session.execute(
                payments.insert().values(key=self.request.idempotency_key, amount=amount).returning(payments.c.id)
            ).scalar_one()
            return {"order_id": order_id, "amount": amount, "payment_id": row}

        outcome = ledger.run_once(self, charge)
        if first and hold_at == "after":
            counter.set(f"{key}:committed", 1)
            time.sleep(hold)
        return outcome

    return app


if os.environ.get("PROD_PREFIX"):
    app = build(os.environ["DATABASE_URL"], os.environ["PROD_PREFIX"], json.loads(os.environ["PROD_OVERRIDES"]))
