"""celery-idem's Django system checks (``manage.py check``), run on the project's Celery app.

Each finds at deploy time what would otherwise surface at the first task, or never:

- ``celery_idem.E001``: a setting celery-idem does not know (a misspelt ``CELERY_IDEMPOTENCY_*``),
  or an invalid value. Celery itself ignores unknown names; celery-idem refuses them at first use.
- ``celery_idem.E002``: no store, outside eager mode.
- ``celery_idem.W003``: ``memory://`` outside eager mode: every process (each web process, each
  pool child) has a store of its own, so nothing is deduplicated between them.
- ``celery_idem.E004``: the pickle task serializer without ``CELERY_IDEMPOTENCY_ACCEPT_PICKLE``: an
  idempotent task refuses it (a stored pickle runs code when replayed).
- ``celery_idem.W005``: pickle only in ``accept_content``: workers run pickled messages a producer
  sends, which idempotent tasks refuse.
- ``celery_idem.W006``: a ``CELERY_IDEMPOTENCY_*`` setting that is not all upper case: Django
  loads only upper-case settings, so it never reaches Celery.
- ``celery_idem.W010``: ``task_acks_late`` without ``task_reject_on_worker_lost`` or
  ``task_retry_on_worker_lost``: a task whose worker process dies is acknowledged and never runs
  again; celery-idem then only frees its key (docs/concepts.md, the endings table).
- ``celery_idem.W011``: a Redis broker whose ``visibility_timeout`` is shorter than the lease: the
  broker delivers a running task again, and the copy waits on the lease.
- ``celery_idem.W012``: an idempotent task whose retries can outlast its record's TTL (its
  ``max_retries`` times its retry delay, or its backoff): a retry that arrives after the record
  expired runs as a new call beside any duplicate.

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
    """E001-W006 and W012: the settings, the store, the serializer and the TTL against retries."""
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
    elif _is_memory(store) and not eager:
        found.append(
            Warning(
                "the idempotency store is memory://: each process (web process, pool child) keeps its own "
                "records, so calls from different processes are not deduplicated",
                hint="use a shared store: CELERY_IDEMPOTENCY_STORE = 'redis://...' or 'postgresql://...'",
                id="celery_idem.W003",
            )
        )
    if not settings.accept_pickle:
        if _is_pickle(app.conf.task_serializer):
            found.append(
                Error(
                    "the Celery app's task serializer is pickle, which idempotent tasks refuse: a stored pickle "
                    "runs code when replayed",
                    hint="use json (CELERY_TASK_SERIALIZER = 'json'), or set CELERY_IDEMPOTENCY_ACCEPT_PICKLE = True "
                    "if only trusted code can write to the store",
                    id="celery_idem.E004",
                )
            )
        elif any(_is_pickle(name) for name in app.conf.accept_content or ()):
            found.append(
                Warning(
                    "CELERY_ACCEPT_CONTENT includes pickle: workers run pickled messages any producer sends, "
                    "and idempotent tasks refuse them",
                    hint="accept json only (CELERY_ACCEPT_CONTENT = ['json'])",
                    id="celery_idem.W005",
                )
            )
    found.extend(_lower_case_settings())
    found.extend(_retries_past_ttl(app))
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
    if any(url.startswith(_REDIS_BROKERS) for url in _broker_urls(conf.broker_url)):
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


_REDIS_BROKERS = ("redis://", "rediss://", "redis+socket://", "sentinel://")
_PICKLE = ("pickle", "application/x-python-serialize")


def _is_pickle(name: Any) -> bool:
    return str(name).strip().lower() in _PICKLE


def _is_memory(store: Any) -> bool:
    from ...stores.memory import MemoryStore

    return isinstance(store, MemoryStore) or (isinstance(store, str) and store.strip().lower().startswith("memory://"))


def _broker_urls(broker: Any) -> list[str]:
    """Every URL of ``broker_url``: one, a failover list, or ``;``-separated ones, lower-cased."""
    urls = broker if isinstance(broker, (list, tuple)) else str(broker or "").split(";")
    return [str(url).strip().lower() for url in urls if url]


def _lower_case_settings() -> list[CheckMessage]:
    """W006: ``CELERY_IDEMPOTENCY_*`` names in the settings module that Django never loads."""
    import importlib

    from django.conf import settings as django_settings

    module_name = getattr(django_settings, "SETTINGS_MODULE", None)
    if not module_name:
        return []  # settings.configure(): Django keeps upper-case names only, and has no module to read
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    return [
        Warning(
            f"{name} is not all upper case: Django loads only upper-case settings, so Celery never sees it",
            hint=f"rename it {name.upper()}",
            id="celery_idem.W006",
        )
        for name in sorted(vars(module))
        if name.upper().startswith("CELERY_IDEMPOTENCY_") and name != name.upper()
    ]


def _retries_past_ttl(app: Any) -> list[CheckMessage]:
    """W012: idempotent tasks whose retry horizon, when it can be known, outlasts the TTL."""
    from ...task import IdempotentTask

    installed = installed_on(app)
    if installed is None:
        return []
    found: list[CheckMessage] = []
    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, IdempotentTask):
            continue
        try:
            ttl = installed.policy_for(task).ttl_seconds
        except ConfigurationError:
            continue  # the task's own error says why, at its first call
        horizon = _retry_horizon(task)
        if horizon is not None and horizon > ttl:
            found.append(
                Warning(
                    f"task {name!r} can retry for {horizon:g} s, longer than its idempotency TTL ({ttl:g} s): "
                    "a retry that arrives after its record expired runs as a new call",
                    hint="raise its ttl_seconds (idempotency={'ttl_seconds': ...}) above the retry horizon, "
                    "or lower max_retries or the retry delay",
                    id="celery_idem.W012",
                )
            )
    return found


def _retry_horizon(task: Any) -> float | None:
    """How long a task's retries can go on, when its options say (None: unbounded or unknown)."""
    retries = getattr(task, "max_retries", None)
    if not isinstance(retries, int) or isinstance(retries, bool) or retries <= 0:
        return None
    backoff = getattr(task, "retry_backoff", False)
    if getattr(task, "autoretry_for", ()) and backoff:
        try:
            base = 1.0 if backoff is True else float(backoff)
            cap = float(getattr(task, "retry_backoff_max", 600) or 600)
        except (TypeError, ValueError):
            return None
        if not (base > 0 and cap > 0):
            return None
        total, step = 0.0, base
        for n in range(retries):  # doubling until the cap (a few dozen steps), then the cap for the rest
            if step >= cap:
                return total + cap * (retries - n)
            total, step = total + step, step * 2
        return total
    fixed = getattr(task, "default_retry_delay", None)
    if not isinstance(fixed, (int, float)) or isinstance(fixed, bool):
        return None
    return float(fixed) * retries
