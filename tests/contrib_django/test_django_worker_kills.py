"""The Django ledger with real worker processes SIGKILLed before and after their commit (the
example project's database: a SQLite file or a PostgreSQL schema, migrated with ``migrate``), as
tests/recovery/test_reconciler.py does for the SQLAlchemy ledger. Payments are counted in the
database and each step of the body in Redis: outside the library."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL, REDIS_COUNTER_URL

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module
import redis  # noqa: E402
from conftest import REDIS_URL, require_server, wipe  # noqa: E402
from django_project import require_alias, shop_env  # noqa: E402
from storefront.models import Payment  # noqa: E402
from workers import BACKEND, Worker, wait_for  # noqa: E402

from celery_idem import Idempotency, State, store_from_url  # noqa: E402
from celery_idem.contrib.django.ledger import DjangoLedger  # noqa: E402
from celery_idem.contrib.django.models import LedgerEntry  # noqa: E402

BROKER = REDIS_BROKER_URL
COUNTER_URL = REDIS_COUNTER_URL
GET = 30
TASK = "djworker.pay"


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


@pytest.fixture
def producer(prefix: str, alias: str) -> Any:
    """The worker's app in this process, as a producer; its ledger reads ``alias``, the database the
    worker's project calls "default"."""
    from contrib_django.django_worker import make_app

    return make_app(prefix, BROKER, BACKEND, REDIS_URL, DjangoLedger(alias, namespace=prefix))


@pytest.fixture
def workers(tmp_path: Path, prefix: str, alias: str) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []
    env = shop_env(alias)
    env["PYTHONPATH"] = os.pathsep.join([str(django_project.EXAMPLE), env["PYTHONPATH"]])

    def start(**settings: Any) -> Worker:
        worker = Worker(tmp_path, BROKER, REDIS_URL, prefix, app="contrib_django.django_worker", env=env, **settings)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def steps(prefix: str, name: str, key: str) -> int:
    return int(redis.Redis.from_url(COUNTER_URL).get(f"djworker:{prefix}:{name}:{key}") or 0)


def payments(alias: str, order: int) -> int:
    return Payment.objects.using(alias).filter(order_id=order).count()


@pytest.mark.slow
def test_killed_after_commit_is_completed_from_the_django_ledger_and_never_runs_again(
    producer: Any, workers: Callable[..., Worker], prefix: str, alias: str
) -> None:
    idem = Idempotency.of(producer)
    key = f"k-{uuid.uuid4().hex}"
    order = uuid.uuid4().int % 2_000_000_000
    worker = workers()
    # Given a payment whose transaction committed, and whose worker dies before the store write
    result = producer.tasks[TASK].apply_async((order, 100), {"hold_after_commit": 60}, idempotency_key=key)
    wait_for(lambda: steps(prefix, "committed", key), "commit")
    worker.kill()
    assert payments(alias, order) == 1
    record = idem.get(TASK, key)
    assert record is not None and record.state is State.IN_PROGRESS
    # When its lease has run out and the reconciler runs
    time.sleep(max(0.0, record.lease_expires_at - time.time()) + 0.2)
    report = idem.reconcile()
    # Then the record is COMPLETED from the ledger, a duplicate replays it, and nothing ran twice
    assert (report.scanned, report.completed) == (1, 1)
    again = producer.tasks[TASK].apply_async((order, 100), idempotency_key=key)
    assert again.deduplicated and again.id == result.id
    assert again.get(timeout=GET) == {"paid": 100, "order": order}
    assert payments(alias, order) == 1 and steps(prefix, "fn", key) == 1


@pytest.mark.slow
def test_killed_before_commit_rolls_back_and_the_retried_call_pays_once(
    producer: Any, workers: Callable[..., Worker], prefix: str, alias: str
) -> None:
    idem = Idempotency.of(producer)
    key = f"k-{uuid.uuid4().hex}"
    order = uuid.uuid4().int % 2_000_000_000
    doomed = workers()
    # Given a payment killed inside its transaction, before the commit
    producer.tasks[TASK].apply_async((order, 200), {"hold_before_commit": 60}, idempotency_key=key)
    wait_for(lambda: steps(prefix, "fn", key), "the business write")
    doomed.kill()
    stale = idem.get(TASK, key)
    assert stale is not None and stale.state is State.IN_PROGRESS
    # and its worker back under the same node name, answering without the task
    workers(name=doomed.name)
    time.sleep(max(0.0, stale.lease_expires_at - time.time()) + 0.2)
    report = idem.reconcile()
    # Then the dead attempt is released (the ledger holds nothing), and the retried call pays once
    assert (report.scanned, report.released) == (1, 1) and idem.get(TASK, key) is None
    assert payments(alias, order) == 0
    retried = producer.tasks[TASK].apply_async((order, 200), idempotency_key=key)
    assert not retried.deduplicated and retried.get(timeout=GET) == {"paid": 200, "order": order}
    assert payments(alias, order) == 1 and steps(prefix, "body", key) == 1
