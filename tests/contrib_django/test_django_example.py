"""examples/django_shop, run as its README says: ``manage.py migrate`` and ``manage.py check`` on its
own settings module, then its checkout view through Django's test client (``Idempotency-Key``
header -> the charge staged in the outbox, published at commit -> the ORM ledger), on a SQLite file and a PostgreSQL
schema. A retried checkout pays once; a checkout whose transaction fails publishes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module (and its databases)
from conftest import REDIS_URL, require_server, wipe  # noqa: E402
from django_project import EXAMPLE, require_alias, shop_env  # noqa: E402

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
