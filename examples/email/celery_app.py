"""The app ``celery -A examples.email.celery_app worker`` loads, configured from ``EMAIL_*`` variables."""

from __future__ import annotations

from .tasks import make_celery

app = make_celery()
