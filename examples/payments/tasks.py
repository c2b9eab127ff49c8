"""The payments worker side: a Celery app with celery-idem, and the ``payments.charge`` task.

``charge`` records the payment with :meth:`Ledger.run_once`: the ledger row (unique per
idempotency key) and the ``payments`` row are written in ONE transaction, so even when the
idempotency store loses track of an attempt (a worker killed after its commit, an expired lease),
a second execution of the same key finds the committed ledger row, rolls back, and returns the
first outcome. The key is also what the task would send to the card processor as *its*
idempotency key, so the processor de-duplicates on its side too.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.signals import worker_process_init
from sqlalchemy.orm import Session

from celery_idem import Idempotency, IdempotentTask
from celery_idem.ledger import Ledger

from .config import Config

CHARGE = "payments.charge"


def payments_table(name: str = "payments", metadata: sa.MetaData | None = None) -> sa.Table:
    """The business table. Deliberately no UNIQUE on the key: a double charge would show up here as
    a second row (in production, add one as a last line of defence)."""
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(64), nullable=False, index=True),
        sa.Column("amount", sa.Integer, nullable=False),  # minor units (cents)
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("provider_idempotency_key", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )


def make_celery(config: Config | None = None) -> Celery:
    """The payments Celery app. One per process in production (``celery_app.py``); tests build one
    per test with their own queue, key prefix and tables."""
    config = config or Config.from_env()
    app = Celery("payments", broker=config.broker_url, backend=config.result_backend, set_as_current=False)
    app.conf.update(
        task_default_queue=config.queue,
        task_acks_late=True,  # a worker that dies mid-charge gets its message redelivered...
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=86400,
    )
    engine = sa.create_engine(config.database_url, pool_pre_ping=True)
    ledger = Ledger(engine, table_name=config.ledger_table)
    # ...and the store (plus the ledger, in the database) makes sure it charges once.
    Idempotency(
        app,
        store=config.idempotency_store,
        key_prefix=config.key_prefix,
        ledger=ledger,  # the reconciler settles stuck records from the ledger first
        reconcile_interval_seconds=config.reconcile_interval_seconds,  # beat entry celery-idem-reconcile
    )
    payments = payments_table(config.payments_table)

    @worker_process_init.connect(weak=False)
    def _fresh_pool(**_: Any) -> None:
        # A prefork child must not share the parent's pooled connections (SQLAlchemy's fork recipe).
        engine.dispose(close=False)

    @app.task(
        base=IdempotentTask,
        bind=True,
        shared=False,  # bound to this app only: a process may hold several (tests do)
        name=CHARGE,
        idempotency={"require_key": True, "key_args": ["order_id", "amount"]},
    )
    def charge(self: Any, order_id: str, amount: int) -> dict[str, Any]:
        provider_key = self.request.idempotency_key  # the caller's Idempotency-Key

        def record_payment(session: Session) -> dict[str, Any]:
            # A real service calls its card processor here, with the header
            # ``Idempotency-Key: <provider_key>``: a retry of this task is then also a no-op there.
            payment_id = session.execute(
                payments.insert()
                .values(
                    order_id=order_id,
                    amount=amount,
                    status="captured",
                    provider_idempotency_key=provider_key,
                    task_id=self.request.id,
                    created_at=time.time(),
                )
                .returning(payments.c.id)
            ).scalar_one()
            return {"payment_id": payment_id, "order_id": order_id, "amount": amount, "status": "captured"}

        return ledger.run_once(self, record_payment)

    return app


def init_db(config: Config | None = None) -> None:
    """Create the payments and ledger tables if they are missing (``python -m examples.payments initdb``)."""
    config = config or Config.from_env()
    engine = sa.create_engine(config.database_url)
    try:
        Ledger(engine, table_name=config.ledger_table).create_schema()
        payments_table(config.payments_table).metadata.create_all(engine, checkfirst=True)
    finally:
        engine.dispose()


def dispose(app: Celery) -> None:
    """Close what the app holds open: the database pool and the idempotency store."""
    idem = Idempotency.of(app)
    idem.settings.ledger.engine.dispose()
    if "store" in idem.__dict__:  # opened on first use only
        idem.store.close()
