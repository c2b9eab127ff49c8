"""A payments app on the recommended configuration (celeryconfig.py beside this file): the settings
come from the config module; the ledger, which holds a database engine, joins in code."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.signals import worker_process_init

from celery_idem import Idempotency
from celery_idem.ledger import Ledger


def make_app(
    database_url: str | None = None,
    *,
    config: object = "examples.production.celeryconfig",
    ledger_table: str = "celery_idem_ledger",
) -> Celery:
    app = Celery("payments", set_as_current=False)
    app.config_from_object(config)
    url = database_url or os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@localhost:5432/payments")
    engine = sa.create_engine(url, pool_pre_ping=True)
    Idempotency(app, ledger=Ledger(engine, table_name=ledger_table))  # the reconciler asks it first

    @worker_process_init.connect(weak=False)
    def _fresh_pool(**_: Any) -> None:
        engine.dispose(close=False)  # a prefork child must not share the parent's connections

    return app
