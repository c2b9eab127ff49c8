"""The project's Celery app, with celery-idem and the ledger on Django's database."""

from __future__ import annotations

import os

from celery import Celery

from celery_idem import Idempotency
from celery_idem.contrib.django.ledger import DjangoLedger

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_shop.settings")

app = Celery("django_shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# The ledger records each task's outcome in the transaction of its ORM writes; the app's readers
# (a duplicate's result, the reconciler) ask it too.
# Its namespace is the store's key prefix: apps that share the database keep their rows apart.
ledger = DjangoLedger(namespace=app.conf.idempotency_key_prefix or "idem")
Idempotency(app, ledger=ledger)
