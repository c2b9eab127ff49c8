"""The Django app config of ``celery_idem.contrib.django``."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks


class CeleryIdemConfig(AppConfig):
    """Registers celery-idem's system checks, and the ``django://`` store URL, when Django starts."""

    name = "celery_idem.contrib.django"
    label = "celery_idem"
    verbose_name = "celery-idem"
    default_auto_field = "django.db.models.BigAutoField"  # pinned: a project's own default never changes our tables

    def ready(self) -> None:
        from ...stores import register_scheme
        from . import checks as ours

        checks.register(ours.check_settings, "celery_idem")
        checks.register(ours.check_delivery, "celery_idem")
        register_scheme("django", _DjangoStoreURL)


class _DjangoStoreURL:
    """``django://`` for store_from_url: the store (and SQLAlchemy) is imported only when one is built."""

    @staticmethod
    def from_url(url: str, **options: Any) -> Any:
        from .store import DjangoStore

        return DjangoStore.from_url(url, **options)

    # How store_from_url tells a mistake from an outage: the SQL store's judgement
    @staticmethod
    def _misconfiguration(exc: Exception) -> str | None:
        from .store import DjangoStore

        return DjangoStore._misconfiguration(exc)

    @staticmethod
    def _is_mistake(exc: Exception) -> bool:
        from .store import DjangoStore

        return DjangoStore._is_mistake(exc)

    @staticmethod
    def _is_outage(exc: Exception) -> bool:
        from .store import DjangoStore

        return DjangoStore._is_outage(exc)
