"""celery-idem's Django system checks (``manage.py check``), run on the project's Celery app.

Each finds at deploy time what would otherwise surface at the first task, or never:

- ``celery_idem.E001``: a setting celery-idem does not know (a misspelt ``CELERY_IDEMPOTENCY_*``),
  or an invalid value. Celery itself ignores unknown names; celery-idem refuses them at first use.
- ``celery_idem.E002``: no store, outside eager mode.
- ``celery_idem.W003``: ``memory://`` outside eager mode: every process (each web process, each
  pool child) has a store of its own, so nothing is deduplicated between them.
- ``celery_idem.E004``: the pickle serializer without ``CELERY_IDEMPOTENCY_ACCEPT_PICKLE``: an
  idempotent task refuses it (a stored pickle runs code when replayed).
- ``celery_idem.W010``: ``task_acks_late`` without ``task_reject_on_worker_lost`` or
  ``task_retry_on_worker_lost``: a task whose worker process dies is acknowledged and never runs
  again; celery-idem then only frees its key (docs/concepts.md, the endings table).
- ``celery_idem.W011``: a Redis broker whose ``visibility_timeout`` is shorter than the lease: the
  broker delivers a running task again, and the copy waits on the lease.

The app is Celery's current app: the one a Django project's ``proj/celery.py`` creates and
``proj/__init__.py`` imports.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from django.core.checks import CheckMessage, Error, Warning

from ...config import IdempotencySettings
from ...errors import ConfigurationError
from ...runtime import installed_on, settings_of

__all__ = ["check_delivery", "check_settings"]

_NAMESPACE_HINT = (
    "Django settings CELERY_IDEMPOTENCY_<NAME> reach app.conf.idempotency_<name> through "
    'app.config_from_object("django.conf:settings", namespace="CELERY")'
)


def _settings(app: Any) -> IdempotencySettings:
    """The settings the app's celery-idem uses (the installed extension's, keywords included)."""
    installed = installed_on(app)
    return installed.settings if installed is not None else settings_of(app, {})


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001-E004: the settings, the store and the serializer."""
    app = current_app._get_current_object()
    try:
        settings = _settings(app)
    except ConfigurationError as exc:
        return [Error(str(exc), hint=_NAMESPACE_HINT, id="celery_idem.E001")]
    found: list[CheckMessage] = []
    eager = bool(app.conf.task_always_eager)
    store = settings.store
    if store is None and not eager:
        found.append(
            Error(
                f"no idempotency store for the Celery app {app.main!r}",
                hint="set CELERY_IDEMPOTENCY_STORE, e.g. 'redis://localhost:6379/2' or 'postgresql://user@host/db'",
                id="celery_idem.E002",
            )
        )
    elif isinstance(store, str) and store.startswith("memory://") and not eager:
        found.append(
            Warning(
                "the idempotency store is memory://: each process (web process, pool child) keeps its own "
                "records, so calls from different processes are not deduplicated",
                hint="use a shared store: CELERY_IDEMPOTENCY_STORE = 'redis://...' or 'postgresql://...'",
                id="celery_idem.W003",
            )
        )
    serializers = {str(app.conf.task_serializer)} | {str(name) for name in app.conf.accept_content or ()}
    if "pickle" in serializers and not settings.accept_pickle:
        found.append(
            Error(
                "the Celery app uses pickle, which idempotent tasks refuse: a stored pickle runs code when replayed",
                hint="use json (CELERY_TASK_SERIALIZER = 'json'), or set CELERY_IDEMPOTENCY_ACCEPT_PICKLE = True "
                "if only trusted code can write to the store",
                id="celery_idem.E004",
            )
        )
    return found


def check_delivery(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W010-W011: how the broker delivers a task whose worker died or that runs long."""
    app = current_app._get_current_object()
    conf = app.conf
    found: list[CheckMessage] = []
    if conf.task_acks_late and not conf.task_reject_on_worker_lost and not conf.get("task_retry_on_worker_lost"):
        found.append(
            Warning(
                "task_acks_late without task_reject_on_worker_lost: a task whose worker process dies is "
                "acknowledged and never runs again; celery-idem can only free its key",
                hint="set CELERY_TASK_REJECT_ON_WORKER_LOST = True (the broker delivers it again and celery-idem "
                "runs it once), or CELERY_TASK_RETRY_ON_WORKER_LOST = True on Celery 5.5+",
                id="celery_idem.W010",
            )
        )
    broker = str(conf.broker_url or "")
    if broker.startswith(("redis://", "rediss://", "redis+socket://", "sentinel://")):
        try:
            lease = _settings(app).lease_seconds
        except ConfigurationError:
            return found  # E001 says why
        try:
            visibility = float((conf.broker_transport_options or {}).get("visibility_timeout", 3600))
        except (TypeError, ValueError, AttributeError, OverflowError):
            return found  # not ours to judge: kombu says what it makes of it
        if visibility < lease:
            found.append(
                Warning(
                    f"the Redis broker's visibility_timeout ({visibility:g} s) is shorter than the lease "
                    f"({lease:g} s): the broker delivers a task still running again, and the copy waits on it",
                    hint="raise CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above the lease and the "
                    "longest countdown or ETA you use",
                    id="celery_idem.W011",
                )
            )
    return found
