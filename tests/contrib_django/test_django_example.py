"""examples/django_shop, run as its README says: ``manage.py migrate`` and ``manage.py check`` on its
own settings module, then its checkout view through Django's test client (``Idempotency-Key``
header -> the charge staged in the outbox, published at commit -> the ORM ledger), on a SQLite file and a PostgreSQL
schema. A retried checkout pays once; a checkout whose transaction fails publishes nothing."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module (and its databases)
import redis  # noqa: E402
from addresses import REDIS_BROKER_URL, REDIS_COUNTER_URL  # noqa: E402
from conftest import REDIS_URL, require_server, wipe  # noqa: E402
from django_project import EXAMPLE, require_alias, shop_env  # noqa: E402
from storefront.models import Payment  # noqa: E402
from workers import Worker, wait_for  # noqa: E402

from celery_idem import store_from_url  # noqa: E402

CHECKOUT = """
import json, django
django.setup()
from django.test import Client
from django_shop.celery import app
from storefront.models import Order, Payment
from celery_idem.contrib.django.models import OutboxEntry
app.conf.task_always_eager = True  # the charge runs here, at commit: no worker needed to count it
app.conf.task_eager_propagates = True  # and its error, if any, fails the run
order = Order.objects.create(amount=500)
client = Client()
statuses = [client.post(f"/checkout/{order.pk}/", headers={"Idempotency-Key": "pay-1"}).status_code for _ in range(3)]
statuses.append(client.post(f"/checkout/{order.pk}/").status_code)
statuses.append(client.post("/checkout/0/", headers={"Idempotency-Key": "pay-2"}).status_code)
order.refresh_from_db()
print(json.dumps({"statuses": statuses, "payments": Payment.objects.filter(order_id=order.pk).count(),
                  "status": order.status, "outbox": OutboxEntry.objects.count()}))
"""


@pytest.mark.parametrize(
    ("alias", "store"),
    [(alias, "redis") for alias in django_project.ALIASES]
    + [("sqlite", "django"), ("postgresql", "django"), ("mariadb", "django")],
)
def test_the_example_project_migrates_checks_and_charges_a_retried_checkout_once(alias: str, store: str) -> None:
    # With store "django", the project runs on its one database: no Redis for idempotency
    require_alias(alias)
    require_server("redis")
    prefix = f"djx{uuid.uuid4().hex[:10]}"
    url = REDIS_URL if store == "redis" else "django://"
    env = dict(shop_env(alias), DJANGO_SHOP_STORE=url, DJANGO_SHOP_KEY_PREFIX=prefix)

    logged: list[str] = []  # each child's stderr: what the project logged, shown when a check fails

    def run(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, *argv], cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        logged.append(done.stderr)
        return done.stdout

    try:
        run("manage.py", "migrate", "--noinput")
        assert "System check identified no issues" in run("manage.py", "check")
        answer = json.loads(run("-c", CHECKOUT).strip().splitlines()[-1])
    finally:
        wipe(store_from_url(REDIS_URL, key_prefix=prefix))
    # Three posts of one key: accepted each time, one payment, the outbox drained; no key: 400; no
    # such order: 404
    expected = {"statuses": [202, 202, 202, 400, 404], "payments": 1, "status": "paid", "outbox": 0}
    assert answer == expected, logged[-1]


# ---- a reused key, answered at request time -------------------------------------------------------

REQUESTS = """
import json, sys, django
django.setup()
from django.test import Client
from storefront.models import Order
client = Client()
answers = {}
for view in ("", "on-commit/"):  # the outbox's checkout, then the one with apply_async_on_commit
    a, b, c = (Order.objects.create(amount=500 + n).pk for n in range(3))
    def post(order, key):
        response = client.post(f"/checkout/{order}/{view}", headers={"Idempotency-Key": key})
        json_body = response.get("Content-Type") == "application/json"
        return [response.status_code, response.json().get("task_id") if json_body else None]
    key, other = f"pay-{a}", f"pay-{c}"
    answers[view or "outbox"] = {
        "orders": [a, b, c],
        "first": post(a, key),
        "retried": post(a, key),       # the same request again
        "reused": post(b, key),        # the same key for another order
        "rolled_back": post(0, other), # no such order: its transaction rolls back
        "free": post(c, other),        # so that key is still free
    }
print(json.dumps(answers))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("alias", "store"), [("sqlite", "redis"), ("postgresql", "redis"), ("postgresql", "django")])
def test_the_example_answers_a_reused_key_at_request_time_and_a_retry_with_the_original_task_id(
    alias: str, store: str, tmp_path: Path
) -> None:
    # The example's real views (Django's test client, in a process of the project's own settings),
    # a real worker of the project's Celery app on a queue of this test, the charge's body counted
    # in Redis outside the library; with the outbox and with apply_async_on_commit.
    require_alias(alias)
    require_server("redis")
    prefix = f"djr{uuid.uuid4().hex[:10]}"
    url = REDIS_URL if store == "redis" else "django://"
    env = dict(
        shop_env(alias),
        DJANGO_SHOP_STORE=url,
        DJANGO_SHOP_KEY_PREFIX=prefix,
        DJANGO_SHOP_QUEUE=prefix,
        DJANGO_SHOP_BROKER=REDIS_BROKER_URL,
    )
    counter = redis.Redis.from_url(REDIS_COUNTER_URL)
    worker = Worker(tmp_path, REDIS_BROKER_URL, url, prefix, app="contrib_django.counted_shop", env=env)
    try:
        done = subprocess.run(
            [sys.executable, "-c", REQUESTS], cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        answers = json.loads(done.stdout.strip().splitlines()[-1])
        for view, seen in answers.items():
            a, b, c = seen["orders"]
            # Then: the retry is handed the original call's task id, the key of another order is
            # refused with 422, and a rolled-back transaction left its key free
            (status, task_id), retried = seen["first"], seen["retried"]
            assert status == 202 and retried == [202, task_id], (view, seen)
            assert seen["reused"] == [422, None], (view, seen)
            assert seen["rolled_back"] == [404, None] and seen["free"][0] == 202, (view, seen)
            # And each accepted order's body ran once, the refused one's never
            wait_for(functools.partial(body_runs, counter, prefix, [a, c], [1, 1]), f"the charges of {view}")
            time.sleep(0.5)
            assert body_runs(counter, prefix, [a, b, c], [1, 0, 1]), view
            assert [Payment.objects.using(alias).filter(order_id=o).count() for o in (a, b, c)] == [1, 0, 1], view
    finally:
        worker.stop()
        keys = list(counter.scan_iter(match=f"{prefix}:*"))
        if keys:
            counter.delete(*keys)
        wipe(store_from_url(REDIS_URL, key_prefix=prefix))  # a django:// store's rows go with the schema


def body_runs(counter: redis.Redis, prefix: str, orders: list[int], expected: list[int]) -> bool:
    """Whether the charge's body ran ``expected`` times for each of ``orders`` (counted in Redis by
    ``contrib_django/counted_shop.py``)."""
    return [int(counter.get(f"{prefix}:body:{order}") or 0) for order in orders] == expected
