"""The outbox's claim written in the caller's transaction (``django://`` on PostgreSQL) reads the
server's clock as it is when the claim is written, not the transaction's start (PostgreSQL's
``now()``): a lease that ran out meanwhile has run out, and a claim written late in a long
transaction holds its key for its whole lease. Found by an attack round (issue 27); both failed
before: the dead claim's task id handed back (the call lost), and a lease already past at commit.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402,F401 - configures Django for this module
from conftest import REDIS_URL, require_server, wipe  # noqa: E402
from django.db import transaction  # noqa: E402
from django_project import require_alias  # noqa: E402
from storefront.models import Payment  # noqa: E402
from workers import BACKEND  # noqa: E402

from celery_idem import Idempotency, store_from_url  # noqa: E402
from celery_idem.contrib.django.ledger import DjangoLedger  # noqa: E402
from celery_idem.contrib.django.models import LedgerEntry, OutboxEntry  # noqa: E402
from celery_idem.contrib.django.outbox import DjangoOutbox  # noqa: E402
from celery_idem.lookahead import _identified  # noqa: E402

TASK = "djworker.pay"
ALIAS = "postgresql"


@pytest.fixture
def producer() -> Iterator[Any]:
    require_alias(ALIAS)
    require_server("redis")
    from contrib_django.django_worker import make_app

    prefix = f"ct{uuid.uuid4().hex[:10]}"
    app = make_app(prefix, REDIS_BROKER_URL, BACKEND, f"django://{ALIAS}", DjangoLedger(ALIAS, namespace=prefix))
    yield app
    wipe(Idempotency.of(app).store)
    wipe(store_from_url(REDIS_URL, key_prefix=prefix))
    LedgerEntry.objects.using(ALIAS).filter(namespace=prefix).delete()
    OutboxEntry.objects.using(ALIAS).all().delete()


def test_a_claim_whose_lease_ran_out_during_the_transaction_is_taken_over_not_handed_back(producer: Any) -> None:
    pay, idem, outbox = producer.tasks[TASK], Idempotency.of(producer), DjangoOutbox(ALIAS, publish_on_commit=False)
    handler = pay.idempotency_handler
    order = uuid.uuid4().int % 2_000_000_000
    args, key = (order, 100), f"o-{order}"
    identity, fp, _, _ = _identified(handler, args, {}, {"idempotency_key": key})
    with transaction.atomic(using=ALIAS):
        Payment.objects.using(ALIAS).filter(order_id=order).count()  # the request's transaction has begun
        # Meanwhile a producer claimed the same call and died before publishing: its claim lasts 1 s
        dead = idem.store.claim(identity, fp, "dead-" + uuid.uuid4().hex, pending_seconds=1.0, ttl_seconds=3600)
        assert dead.record is not None and dead.record.task_id.startswith("dead-")
        time.sleep(2.5)  # the dead claim's lease ran out (by the server's clock)
        assert dead.record.lease_expires_at is not None and dead.record.lease_expires_at < idem.store.now()
        # The request stages the call: a claim made now takes the expired claim over
        handle = outbox.apply_async(pay, args, idempotency_key=key)
        staged = OutboxEntry.objects.using(ALIAS).filter(task_id=handle.id).exists()
    # Then the call is staged (under its own task id) and will be published; it is not handed the
    # handle of a call whose message never existed
    assert not handle.id.startswith("dead-"), "handed the dead claim's task id: the call is lost"
    assert staged, "nothing was staged: the call will never be published"


def test_a_claim_written_late_in_a_long_transaction_holds_its_key_for_its_whole_lease(producer: Any) -> None:
    pay, idem, outbox = producer.tasks[TASK], Idempotency.of(producer), DjangoOutbox(ALIAS, publish_on_commit=False)
    order = uuid.uuid4().int % 2_000_000_000
    args, key = (order, 100), f"o-{order}"
    with transaction.atomic(using=ALIAS):
        Payment.objects.using(ALIAS).filter(order_id=order).count()  # the request's transaction has begun
        time.sleep(7)  # the checkout's other work (a provider's API) inside the transaction
        first = outbox.apply_async(pay, args, idempotency_key=key, expires=1)
    record = idem.get(TASK, key)
    assert record is not None and record.task_id == first.id
    lease_left = (record.lease_expires_at or 0.0) - idem.store.now()
    # A retry of the request, at once: handed the original call
    with transaction.atomic(using=ALIAS):
        again = outbox.apply_async(pay, args, idempotency_key=key, expires=1)
    assert again.id == first.id, (
        f"a retry was not handed the original task id (the claim's lease had {lease_left:.1f}s left at its commit)"
    )
