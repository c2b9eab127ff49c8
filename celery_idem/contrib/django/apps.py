"""The Django app config of ``celery_idem.contrib.django``."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class CeleryIdemConfig(AppConfig):
    """Registers celery-idem's system checks when Django starts."""

    name = "celery_idem.contrib.django"
    label = "celery_idem"
    verbose_name = "celery-idem"
    default_auto_field = "django.db.models.BigAutoField"  # pinned: a project's own default never changes our tables

    def ready(self) -> None:
        from . import checks as ours

        checks.register(ours.check_settings, "celery_idem")
        checks.register(ours.check_delivery, "celery_idem")
