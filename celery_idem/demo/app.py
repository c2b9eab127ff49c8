"""The demo's Celery app: a shop whose tasks write each execution to a file, and its payments to a
table, outside the library (the side effects the demo counts).

The runner builds it with :func:`make_app`; the worker process it starts imports this module
(``celery -A celery_idem.demo.app worker``) and gets ``app`` from the CELERY_IDEM_DEMO_* variables.
It imports SQLAlchemy (the ledger's payments live in a SQLite file): the runner checks that the
``sql`` extra is installed before it imports this module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.signals import worker_process_init
from sqlalchemy.orm import Session

from ..errors import PermanentError
from ..extension import Idempotency
from ..ledger import Ledger
from ..stores import Store, store_from_url
from ..task import IdempotentTask
from .transport import Transport

LEASE_SECONDS = 2.0
#: The worker processes' liveness records live this long unrenewed: a killed worker is provably dead
#: (and its records released by the reconciler) seconds after its lease ran out.
LIVENESS_SECONDS = 2.0
#: The body of both charge tasks, plain and idempotent: what a card charge costs the worker.
CHARGE_SECONDS = 0.05


def effects_file(workdir: Path) -> Path:
    return workdir / "effects.log"


def shop_database(workdir: Path) -> str:
    """The shop's business database: its payments and the ledger, one SQLite file."""
    return f"sqlite:///{workdir / 'shop.db'}"


def payments_table(metadata: sa.MetaData) -> sa.Table:
    """The business table, with no UNIQUE on the order: a double charge shows as a second row."""
    return sa.Table(
        "payments",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.Integer, nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
    )


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
        # A Redis that stops answering fails the demo's calls instead of hanging them.
        redis_socket_connect_timeout=5,
        redis_socket_timeout=30,
    )
    if broker.startswith("filesystem://"):
        queue = workdir / "queue"
        queue.mkdir(parents=True, exist_ok=True)
        app.conf.broker_transport = Transport  # kombu's, writing each message atomically
        app.conf.broker_transport_options = {
            "data_folder_in": str(queue),
            "data_folder_out": str(queue),
            "control_folder": str(workdir / "control"),  # broadcasts (inspect); default: ./control
            "polling_interval": 0.05,
        }
    engine = sa.create_engine(shop_database(workdir))
    ledger = Ledger(engine, namespace=prefix)
    payments = payments_table(sa.MetaData())
    Idempotency(
        app,
        store=demo_store(store or f"sqlite:///{workdir / 'idem.db'}", prefix),
        key_prefix=prefix,
        ledger=ledger,  # the reconciler settles a record stuck after a payment from it
        lease_seconds=LEASE_SECONDS,
        liveness_seconds=LIVENESS_SECONDS,
        stale_grace_seconds=5,
        inspect_timeout_seconds=1,
    )
    effects = effects_file(workdir)

    def fresh_pool(**_: Any) -> None:
        engine.dispose(close=False)  # a prefork child must not share its parent's connections

    worker_process_init.connect(fresh_pool, weak=False)

    def effect(task: Any) -> int:
        """One line per execution of a body, appended outside the library. Returns how many
        executions this identity has had, this one included."""
        key = getattr(task.request, "idempotency_key", None)  # a plain task's request has none
        line = f"{task.name} {key or task.request.id}"
        with effects.open("a") as log:
            log.write(f"{line} {os.getpid()}\n")
        return sum(1 for row in effects.read_text().splitlines() if row.rsplit(" ", 1)[0] == line)

    def task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
        decorate: Callable[[Callable[..., Any]], Any] = app.task(shared=False, bind=True, **options)
        return decorate  # Celery ships no annotations

    def charge_card(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        effect(self)
        time.sleep(CHARGE_SECONDS)
        return {"order_id": order_id, "charged": amount, "charge_id": f"ch_{self.request.id[:8]}"}

    # The same body twice: once as plain Celery runs it, once under celery-idem.
    task(name="demo.plain_charge")(charge_card)
    task(base=IdempotentTask, name="demo.charge", idempotency={"key_args": ["order_id", "amount"]})(charge_card)

    @task(base=IdempotentTask, name="demo.declined")
    def declined(self: Any, order_id: int) -> None:
        """A card that is declined: a final answer, stored and replayed."""
        effect(self)
        raise PermanentError(f"card declined for order {order_id}")

    @task(
        base=IdempotentTask,
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

    @task(base=IdempotentTask, name="demo.provision", acks_late=True, idempotency={"key_args": ["server"]})
    def provision(self: Any, server: str, seconds: float) -> str:
        """A long job whose worker the demo kills before it has done anything: its first attempt is slow."""
        if effect(self) == 1:
            time.sleep(seconds)
        return f"{server} is up"

    @task(base=IdempotentTask, name="demo.pay", acks_late=True, idempotency={"key_args": ["order_id", "amount"]})
    def pay(self: Any, order_id: int, amount: int, linger: float) -> dict[str, Any]:
        """A payment recorded through the ledger; its first attempt lingers after the commit, where
        the demo kills its worker (between the payment and the outcome's write and the ack)."""
        first = effect(self) == 1

        def record(session: Session) -> dict[str, Any]:
            row = payments.insert().values(order_id=order_id, amount=amount, task_id=self.request.id)
            payment_id = session.execute(row.returning(payments.c.id)).scalar_one()
            return {"payment_id": payment_id, "order_id": order_id, "amount": amount}

        outcome = ledger.run_once(self, record)
        if first:
            time.sleep(linger)
        return outcome

    return app


SQL_SCHEMES = ("postgresql", "postgres", "sqlite", "mysql", "mariadb")


def demo_store(url: str, prefix: str) -> str | Store:
    """The demo's store. On SQL, in tables of its own, named by its prefix: it never writes to (nor
    upgrades the layout of) the tables a user's deployment keeps in that database, and drops its own
    when it ends."""
    if url.partition("://")[0].lower().split("+")[0] not in SQL_SCHEMES:
        return url
    name = prefix.replace("-", "_")
    return store_from_url(url, key_prefix=prefix, table_name=f"{name}_records", liveness_table_name=f"{name}_liveness")


def create_shop_database(workdir: Path, prefix: str) -> None:
    """The payments table and the ledger's, before any worker writes."""
    engine = sa.create_engine(shop_database(workdir))
    try:
        payments_table(sa.MetaData()).create(engine, checkfirst=True)
        Ledger(engine, namespace=prefix).create_schema()
    finally:
        engine.dispose()


def payments(workdir: Path, order_id: int) -> list[int]:
    """The ids of the payment rows of an order: what the card was charged, counted outside the library."""
    engine = sa.create_engine(shop_database(workdir))
    try:
        with engine.connect() as connection:
            table = payments_table(sa.MetaData())
            query = sa.select(table.c.id).where(table.c.order_id == order_id).order_by(table.c.id)
            return list(connection.execute(query).scalars())
    finally:
        engine.dispose()


if os.environ.get("CELERY_IDEM_DEMO_WORKDIR"):
    app = make_app(
        workdir=Path(os.environ["CELERY_IDEM_DEMO_WORKDIR"]),
        broker=os.environ.get("CELERY_IDEM_DEMO_BROKER") or None,
        backend=os.environ.get("CELERY_IDEM_DEMO_BACKEND") or None,
        store=os.environ.get("CELERY_IDEM_DEMO_STORE") or None,
        prefix=os.environ.get("CELERY_IDEM_DEMO_PREFIX", "demo"),
    )
