"""The django_shop example project: its Celery app loads with Django (the pattern of Celery's
"First steps with Django")."""

from .celery import app as celery_app

__all__ = ["celery_app"]
