"""The shop of tests/shop.py plus the tasks the chaos tests kill, freeze and cut off.

``make_chaos_app(conf=..., **make_app_arguments)`` builds it in the test process; a ``celery -A
chaos_shop worker`` subprocess gets ``app`` from the SHOP_* variables and CHAOS_CONF (JSON: Celery
settings such as broker_transport_options); CHAOS_REFUSE_DELAYED=1 refuses every delayed message
(:func:`refuse_delayed_delivery`), CHAOS_REFUSE_SENDS=1 every message while the test says so
(:func:`refuse_sends_while_flagged`). Effects are counted outside the library: business rows
in the ledger's database, INCRs on the counter Redis.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from shop import COUNTER_URL, effects_key, make_app, payments_table

from celery_idem import Idempotency, IdempotentTask

LEASE = 2.0  # seconds: every chaos task's lease, so a dead attempt's lease runs out quickly


def make_chaos_app(*, conf: dict[str, Any] | None = None, **arguments: Any) -> Celery:
    app = make_app(**arguments)
    app.conf.update(conf or {})
    _add_tasks(app, arguments["prefix"])
    return app


def _add_tasks(app: Celery, prefix: str) -> None:
    idem = Idempotency.of(app)
    counter = redis.Redis.from_url(COUNTER_URL)
    policy = {"key_args": ["order_id", "amount"], "lease_seconds": LEASE}

    @app.task(name="chaos.pay", shared=False, base=IdempotentTask, bind=True, acks_late=True, idempotency=policy)
    def pay(
        self: Any, order_id: int, amount: int, hold_first: float = 0.0, work: float = 0.0, inside: bool = False
    ) -> Any:
        """A payment through the ledger. Every execution records its pid and sleeps ``work``; the
        first one also sleeps ``hold_first`` (a window to kill or freeze it) before its transaction,
        or with ``inside`` after its insert, holding the transaction open (``:in_tx`` says when).
        The effects counter counts executions that got past run_once; business rows are the truth."""
        ledger = idem.settings.ledger
        assert ledger is not None, "chaos.pay needs the ledger (SHOP_LEDGER)"
        key = effects_key(prefix, self.name, self.request.idempotency_key)
        pipe = counter.pipeline()
        pipe.incr(f"{key}:entered")
        pipe.set(f"{key}:pid", os.getpid())
        first = pipe.execute()[0] == 1
        if first and not inside:
            time.sleep(hold_first)
        time.sleep(work)
        payments = payments_table(prefix)

        def charge_card(session: Any) -> dict[str, int]:
            session.execute(payments.insert().values(order_id=order_id, amount=amount))
            if first and inside:
                counter.incr(f"{key}:in_tx")
                time.sleep(hold_first)
            return {"paid": amount, "order": order_id}

        outcome = ledger.run_once(self, charge_card)
        counter.incr(key)
        return outcome

    @app.task(
        name="chaos.work",
        shared=False,
        base=IdempotentTask,
        bind=True,
        acks_late=True,
        idempotency={"lease_seconds": LEASE},
    )
    def work(self: Any, seconds: float, tag: str = "") -> str:
        """A long task with no ledger: its effect (an INCR, and the pid) comes first, then it works."""
        key = effects_key(prefix, self.name, self.request.idempotency_key)
        pipe = counter.pipeline()
        pipe.incr(key)
        pipe.set(f"{key}:pid", os.getpid())
        pipe.execute()
        time.sleep(seconds)
        return f"worked {seconds}"


def refuse_delayed_delivery() -> None:
    """Fault: RabbitMQ's native delayed delivery refuses every countdown in this process (kombu's
    routing of a delayed message raises, as it does for a countdown under one second), as a broker
    that refuses a delayed message would. A message sent without a countdown is not touched."""
    import celery.app.base

    def refuse(countdown: int, routing_key: str) -> str:
        raise ValueError(f"native delayed delivery refused a countdown of {countdown!r} (fault injected)")

    celery.app.base.calculate_routing_key = refuse  # type: ignore[attr-defined]


def refused_sends_flag(prefix: str) -> str:
    """The counter Redis key that, while it exists, makes the worker's broker refuse every send."""
    return f"effects:{prefix}:refuse-sends"


def refuse_sends_while_flagged(app: Celery, prefix: str) -> None:
    """Fault: while :func:`refused_sends_flag` exists (the test sets it with a TTL), every message
    this process sends is refused as by a broker that is down (kombu's OperationalError)."""
    from kombu.exceptions import OperationalError

    counter, send_task = redis.Redis.from_url(COUNTER_URL), app.send_task

    def refusing(*args: Any, **kwargs: Any) -> Any:
        if counter.exists(refused_sends_flag(prefix)):
            raise OperationalError("the broker refused the message (fault injected)")
        return send_task(*args, **kwargs)

    app.send_task = refusing  # type: ignore[method-assign]


if os.environ.get("CHAOS_REFUSE_DELAYED"):
    refuse_delayed_delivery()
if os.environ.get("SHOP_BROKER"):
    app = make_chaos_app(
        conf=json.loads(os.environ.get("CHAOS_CONF") or "{}"),
        broker=os.environ["SHOP_BROKER"],
        backend=os.environ.get("SHOP_BACKEND") or None,
        store=os.environ["SHOP_STORE"],
        prefix=os.environ["SHOP_PREFIX"],
        queue=os.environ["SHOP_QUEUE"],
        ledger_url=os.environ.get("SHOP_LEDGER") or None,
        **json.loads(os.environ.get("SHOP_SETTINGS") or "{}"),
    )
    if os.environ.get("CHAOS_REFUSE_SENDS"):
        refuse_sends_while_flagged(app, os.environ["SHOP_PREFIX"])
