"""A Celery app on the example Django project (``examples/django_shop``), for real worker processes
in tests/contrib_django: ``celery -A contrib_django.django_worker worker`` with the project's
settings (``DJANGO_SETTINGS_MODULE=django_shop.settings``, its database from ``DJANGO_SHOP_DB``) and
the ``SHOP_*`` variables of tests/workers.py. Its ``djworker.pay`` writes a ``storefront.Payment`` through
``DjangoLedger.run_once`` and can be held inside its transaction or after its commit, so a test can
SIGKILL it at either point; its ``djworker.decline`` is a payment the provider declines inside
``run_once``'s ``fn``. Each step is counted in Redis, outside the library.
"""

from __future__ import annotations

import os
import time
from typing import Any

import django
from addresses import REDIS_COUNTER_URL
from django.conf import settings  # noqa: E402

if not settings.configured:  # a worker process: the example project's settings (a test process has its own,
    # and must not leave DJANGO_SETTINGS_MODULE in its environment: every worker it starts would inherit it)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_shop.settings")
    django.setup()

import redis  # noqa: E402
from celery import Celery  # noqa: E402
from django.db import transaction  # noqa: E402
from storefront.models import Payment  # noqa: E402

from celery_idem import Idempotency, IdempotentTask, PermanentError, RetryableError  # noqa: E402
from celery_idem.contrib.django.ledger import DjangoLedger  # noqa: E402

COUNTER_URL = os.environ.get("SHOP_COUNTER", REDIS_COUNTER_URL)


def make_app(prefix: str, broker: str, backend: str, store: str, ledger: DjangoLedger) -> Celery:
    """The app, as the worker runs it and as a test's producer sends to it (its own ledger alias)."""
    app = Celery("djworker", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        task_default_queue=prefix,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
    Idempotency(app, store=store, key_prefix=prefix, ledger=ledger, inspect_timeout_seconds=1.0)
    counter = redis.Redis.from_url(COUNTER_URL)

    def step(name: str, key: str) -> int:
        return int(counter.incr(f"djworker:{prefix}:{name}:{key}"))

    @app.task(
        base=IdempotentTask,
        bind=True,
        shared=False,
        name="djworker.pay",
        idempotency={"key_args": ["order_id", "amount"], "lease_seconds": 3},
    )
    def pay(self: Any, order_id: int, amount: int, hold_before_commit: float = 0, hold_after_commit: float = 0) -> Any:
        key = self.request.idempotency_key

        def charge_card() -> dict[str, int]:
            Payment.objects.using(ledger.using).create(order_id=order_id, amount=amount, task_id=self.request.id)
            if step("fn", key) == 1:
                time.sleep(hold_before_commit)  # only the first attempt gets stuck
            return {"paid": amount, "order": order_id}

        outcome = ledger.run_once(self, charge_card)
        step("committed", key)
        time.sleep(hold_after_commit)
        step("body", key)
        return outcome

    @app.task(
        base=IdempotentTask, bind=True, shared=False, name="djworker.decline", idempotency={"key_args": ["order_id"]}
    )
    def decline(self: Any, order_id: int, error: str = "permanent", caller: str = "") -> Any:
        """The provider declines inside fn (the ledger's transaction): its call is counted in Redis,
        then ``error`` ("permanent" or "retryable") is raised. ``caller`` runs run_once in the body's
        own transaction, which wrote a payment of its own (order ``-order_id``) first and then
        "commits" or "rolls back" whatever run_once raised: ``"atomic ..."`` in an ``atomic()``
        block, ``"manual ..."`` under manual transactions (``set_autocommit(False)``)."""
        using = ledger.using
        failure = {"permanent": PermanentError, "retryable": RetryableError}[error]

        def charge_card() -> None:
            Payment.objects.using(using).create(order_id=order_id, amount=100, task_id=self.request.id)
            step("provider", self.request.idempotency_key)  # the provider's charge: it answers with a decline
            raise failure(f"card declined for order {order_id}")

        if not caller:
            return ledger.run_once(self, charge_card)
        how, _, ending = caller.partition(" ")
        if how == "atomic":
            with transaction.atomic(using=using):
                Payment.objects.using(using).create(order_id=-order_id, amount=0, task_id=self.request.id)
                try:
                    return ledger.run_once(self, charge_card)
                except Exception as exc:
                    if ending != "commits":
                        raise
                    raised = exc  # the block commits the caller's payment; the error goes on after it
            raise raised
        transaction.set_autocommit(False, using=using)
        try:
            Payment.objects.using(using).create(order_id=-order_id, amount=0, task_id=self.request.id)
            try:
                return ledger.run_once(self, charge_card)
            finally:
                (transaction.commit if ending == "commits" else transaction.rollback)(using=using)
        finally:
            transaction.set_autocommit(True, using=using)

    return app


if "SHOP_PREFIX" in os.environ:  # a worker process
    app = make_app(
        os.environ["SHOP_PREFIX"],
        os.environ["SHOP_BROKER"],
        os.environ["SHOP_BACKEND"],
        os.environ["SHOP_STORE"],
        DjangoLedger(namespace=os.environ["SHOP_PREFIX"]),
    )
