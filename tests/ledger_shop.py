"""The ledger's test apps and database, shared by the tests/recovery/test_ledger_*.py modules (DESIGN §4,
§6): exactly one business effect per identity, on real PostgreSQL and SQLite.

Every execution runs through a real idempotent task (eager app, memory store), so the handler sets the
request's key, scope and fingerprint exactly as a worker does. Racers each get their OWN app and store:
each acquires RUN and reaches the ledger, as two workers do after a lost lease. That is the case the
ledger exists for; the store cannot stop it, only the database can.

Side effects are counted outside the library: rows of a business table with no unique constraint (a
second insert WOULD be a second row), and the calls of the effect function.

A module takes the fixtures by assignment (``db = ledger_shop.db``): an imported name shadowed by the
test's argument is a redefinition to ruff.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from conftest import POSTGRES_URL, require_server

from celery_idem import Idempotency, IdempotentTask
from celery_idem.ledger import Ledger

TASK = "ledger.pay"


class CardDeclined(Exception):
    """A business failure raised inside the transaction."""


def payments_table(metadata: sa.MetaData, name: str) -> sa.Table:
    # No unique constraint on order_id: only the ledger stands between a second execution and a second row.
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.Integer, nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
    )


def shop_app(
    ledger: Ledger,
    payments: sa.Table,
    calls: list[str],
    *,
    effect_seconds: float = 0.0,
    fail: bool = False,
    times: dict[str, list[float]] | None = None,
    holding: Callable[[], None] | None = None,
) -> Celery:
    """One worker's view: an eager app with its own memory store and the idempotent task ``ledger.pay``.

    ``times`` collects when bodies reach the ledger ("entered") and when an effect ends ("effect_done");
    ``holding`` is called inside the transaction, right after the business insert.
    """
    times = times if times is not None else {"entered": [], "effect_done": []}
    app = Celery("ledger-shop", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app)  # memory:// store, this app's alone

    @app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)
    def pay(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        def effect(session: Any) -> dict[str, Any]:
            calls.append(self.request.id)
            session.execute(sa.insert(payments).values(order_id=order_id, amount=amount, task_id=self.request.id))
            if holding is not None:
                holding()
            if effect_seconds:
                time.sleep(effect_seconds)
            times["effect_done"].append(time.time())
            if fail:
                raise CardDeclined(f"card declined for order {order_id}")
            return {"order": order_id, "paid": amount, "task_id": self.request.id}

        times["entered"].append(time.time())
        return ledger.run_once(self, effect)

    return app


def pay(app: Celery, order_id: int, amount: int, key: str, scope: str | None = None) -> tuple[str, Any]:
    """Run one call through the task; (its task id, what it returned)."""
    result = app.tasks[TASK].apply_async((order_id, amount), idempotency_key=key, idempotency_scope=scope)
    # Celery's eager apply() flags "inside a task" in a process-wide global, which racing threads see:
    # the call has already run, so get() cannot block.
    return result.id, result.get(disable_sync_subtasks=False)


@dataclass
class Db:
    url: str
    engine: sa.Engine
    ledger: Ledger
    payments: sa.Table

    def payment_rows(self) -> list[Any]:
        with self.engine.connect() as connection:
            return list(connection.execute(sa.select(self.payments).order_by(self.payments.c.id)))

    def ledger_rows(self) -> list[Any]:
        with self.engine.connect() as connection:
            return list(connection.execute(sa.select(self.ledger.table)))


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Db]:
    if request.param == "postgresql":
        require_server("postgresql")
        url = POSTGRES_URL
    else:
        url = f"sqlite:///{tmp_path}/ledger.db"
    engine = sa.create_engine(url)
    suffix = uuid.uuid4().hex[:12]
    ledger = Ledger(engine, table_name=f"ledger_{suffix}")
    payments = payments_table(sa.MetaData(), f"payments_{suffix}")
    try:
        ledger.create_schema()
        payments.create(engine)
        yield Db(url, engine, ledger, payments)
    finally:
        payments.drop(engine, checkfirst=True)
        ledger.table.drop(engine, checkfirst=True)
        engine.dispose()


@pytest.fixture
def key() -> str:
    return f"pay-{uuid.uuid4().hex}"


def body_app(body: Callable[..., Any]) -> Celery:
    """An eager app (its own memory store) whose idempotent task ``ledger.pay`` runs ``body``."""
    app = Celery("ledger-body", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app)
    app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)(body)
    return app
