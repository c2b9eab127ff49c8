"""The transactional outbox on the Django ORM, on every database (SQLite, PostgreSQL, MariaDB),
migrated with ``migrate``, with real ``celery worker`` processes of the example project: a
rolled-back ``transaction.atomic()`` publishes and claims nothing; a committed one is published at
its commit, or by the relay (``manage.py celery_idem_relay``) when the process died before; a relay
SIGKILLed after publishing and before deleting its row is followed by one that publishes again, and
the payment is made once. Payments are counted in the database, outside the library."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module
from conftest import REDIS_URL, require_server, wipe  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import transaction  # noqa: E402
from django_project import require_alias, shop_env  # noqa: E402
from storefront.models import Payment  # noqa: E402
from workers import BACKEND, TESTS, Worker  # noqa: E402

from celery_idem import Idempotency, store_from_url  # noqa: E402
from celery_idem.contrib.django.ledger import DjangoLedger  # noqa: E402
from celery_idem.contrib.django.models import LedgerEntry, OutboxEntry  # noqa: E402
from celery_idem.contrib.django.outbox import DjangoOutbox  # noqa: E402

BROKER = REDIS_BROKER_URL
GET = 30
TASK = "djworker.pay"


class Boom(Exception):
    pass


@pytest.fixture(params=django_project.ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    require_alias(request.param)
    require_server("redis")
    return str(request.param)


@pytest.fixture
def prefix(alias: str) -> Iterator[str]:
    name = f"dj{uuid.uuid4().hex[:10]}"
    yield name
    wipe(store_from_url(REDIS_URL, key_prefix=name))
    LedgerEntry.objects.using(alias).filter(namespace=name).delete()
    OutboxEntry.objects.using(alias).all().delete()


@pytest.fixture
def producer(prefix: str, alias: str) -> Any:
    from contrib_django.django_worker import make_app

    return make_app(prefix, BROKER, BACKEND, REDIS_URL, DjangoLedger(alias, namespace=prefix))


def child_env(alias: str, prefix: str, **more: str) -> dict[str, str]:
    env = shop_env(alias)
    env["PYTHONPATH"] = os.pathsep.join([str(django_project.EXAMPLE), str(TESTS), env["PYTHONPATH"]])
    env.update(SHOP_BROKER=BROKER, SHOP_BACKEND=BACKEND, SHOP_STORE=REDIS_URL, SHOP_PREFIX=prefix, SHOP_QUEUE=prefix)
    return {**env, **more}


@pytest.fixture
def workers(tmp_path: Path, prefix: str, alias: str) -> Iterator[Callable[[], Worker]]:
    started: list[Worker] = []

    def start() -> Worker:
        env = child_env(alias, prefix)
        worker = Worker(tmp_path, BROKER, REDIS_URL, prefix, app="contrib_django.django_worker", env=env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def payments(alias: str, order: int) -> int:
    return Payment.objects.using(alias).filter(order_id=order).count()


def new_order() -> int:
    return uuid.uuid4().int % 2_000_000_000


def test_a_rolled_back_transaction_publishes_nothing_and_leaves_no_claim(producer: Any, alias: str) -> None:
    outbox = DjangoOutbox(alias)
    handle = None
    with pytest.raises(Boom), transaction.atomic(using=alias):
        handle = outbox.apply_async(producer.tasks[TASK], (new_order(), 100), idempotency_key="order-1")
        raise Boom
    assert handle is not None
    assert not OutboxEntry.objects.using(alias).exists()
    assert Idempotency.of(producer).store.get(handle.identity) is None
    assert outbox.relay(producer).published == []


def test_a_committed_call_is_published_at_its_commit_and_pays_once(
    producer: Any, alias: str, workers: Callable[[], Worker]
) -> None:
    workers()
    order = new_order()
    with transaction.atomic(using=alias):
        handle = DjangoOutbox(alias).apply_async(producer.tasks[TASK], (order, 100), idempotency_key=f"o-{order}")
        assert OutboxEntry.objects.using(alias).filter(task_id=handle.id).exists()  # not published yet
    assert handle.get(timeout=GET) == {"paid": 100, "order": order}
    assert payments(alias, order) == 1
    assert not OutboxEntry.objects.using(alias).exists()


def test_the_relay_command_publishes_what_a_dead_process_did_not(
    producer: Any, alias: str, workers: Callable[[], Worker]
) -> None:
    order = new_order()
    with transaction.atomic(using=alias):  # committed, and its process "died" before publishing
        handle = DjangoOutbox(alias, publish_on_commit=False).apply_async(
            producer.tasks[TASK], (order, 300), idempotency_key=f"o-{order}"
        )
    assert OutboxEntry.objects.using(alias).count() == 1
    out = io.StringIO()
    from celery import current_app

    previous = current_app._get_current_object()
    producer.set_current()
    try:
        call_command("celery_idem_relay", "--once", database=alias, stdout=out)
    finally:
        previous.set_current()
    assert "published 1, put off 0, dead 0" in out.getvalue()
    workers()
    assert handle.get(timeout=GET) == {"paid": 300, "order": order}
    assert payments(alias, order) == 1 and not OutboxEntry.objects.using(alias).exists()


def test_a_relay_killed_after_publishing_is_followed_by_a_resend_and_the_payment_is_made_once(
    producer: Any, alias: str, prefix: str, workers: Callable[[], Worker]
) -> None:
    order = new_order()
    with transaction.atomic(using=alias):
        handle = DjangoOutbox(alias, publish_on_commit=False).apply_async(
            producer.tasks[TASK], (order, 400), idempotency_key=f"o-{order}"
        )
    died = subprocess.run(
        [sys.executable, str(TESTS / "contrib_django" / "django_relay.py")],
        env=child_env(alias, prefix, SHOP_RELAY_DIES="after_publish", SHOP_RELAY_LEASE="300"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert died.returncode == -9, died.stderr
    assert OutboxEntry.objects.using(alias).count() == 1  # its DELETE never committed
    outbox = DjangoOutbox(alias)
    assert outbox.relay(producer).published == []  # leased by the dead relay
    OutboxEntry.objects.using(alias).update(available_at=datetime(2000, 1, 1, tzinfo=timezone.utc))  # lease ran out
    assert len(outbox.relay(producer).published) == 1  # a copy of the same task id
    workers()
    assert handle.get(timeout=GET) == {"paid": 400, "order": order}
    assert payments(alias, order) == 1 and not OutboxEntry.objects.using(alias).exists()


def test_a_call_that_can_never_be_published_goes_to_the_dead_letter_and_can_be_retried(
    producer: Any, alias: str
) -> None:
    outbox = DjangoOutbox(alias, publish_on_commit=False)
    order = new_order()
    producer.tasks[TASK].apply_async((order, 1), idempotency_key=f"o-{order}")  # another call took the key
    with transaction.atomic(using=alias):
        outbox.apply_async(producer.tasks[TASK], (order, 500), idempotency_key=f"o-{order}")
    assert len(outbox.relay(producer).dead) == 1
    (entry,) = OutboxEntry.objects.using(alias).all()
    assert entry.dead and entry.attempts == 1 and (entry.last_error or "").startswith("PayloadMismatchError")
    assert outbox.relay(producer).dead == []  # never tried again by itself
    assert outbox.retry_dead() == 1
    entry.refresh_from_db()
    assert not entry.dead and entry.attempts == 0
