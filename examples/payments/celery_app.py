"""The app ``celery -A examples.payments.celery_app worker`` (and ``beat``) loads, configured from
the ``PAYMENTS_*`` environment variables (see config.py)."""

from __future__ import annotations

from .tasks import make_celery

app = make_celery()
