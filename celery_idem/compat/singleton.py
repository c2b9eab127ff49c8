"""celery-singleton 0.3.1 on celery-idem: change ``from celery_singleton import Singleton`` to
``from celery_idem.compat.singleton import Singleton`` and nothing else.

Its options map onto a policy in mode ``until_done`` (docs/modes.md): ``unique_on`` is ``key_args``,
``raise_on_duplicate`` is ``on_duplicate="raise"`` (raising this module's :class:`DuplicateTaskError`,
a :class:`celery_idem.DuplicateTaskError`), ``lock_expiry`` is ``pending_timeout_seconds`` (how long
a call that has not started holds its key; a running call holds it by its lease, which the heartbeat
renews). App settings: ``singleton_raise_on_duplicate``, ``singleton_lock_expiry``,
``singleton_backend_url`` and ``singleton_key_prefix`` (the store this module builds when the app
configures none: the Redis result backend, else the Redis broker, as celery-singleton picks; an eager
app with neither gets celery-idem's eager default, ``memory://``);
``singleton_backend_class`` only as celery-singleton's own Redis backend, ``singleton_backend_kwargs``
not at all (a :class:`~celery_idem.errors.ConfigurationError` at the task's first call says so).
What behaves differently, on purpose, is listed in docs/migration.md ("From celery-singleton").
"""

from __future__ import annotations

from typing import Any, ClassVar

from .. import errors
from ..config import IdempotencySettings
from ..errors import ConfigurationError
from ..extension import Idempotency
from ..handler import Handler
from ..runtime import installed_on
from ..task import IdempotentTask

__all__ = ["DuplicateTaskError", "Singleton", "clear_locks"]

# celery-singleton's only backend, as its settings name it (by path, or the class itself).
_PEER_BACKEND = "celery_singleton.backends.redis.RedisBackend"
_REDIS_SCHEMES = ("redis", "rediss")
_BATCH = 500  # records forgotten per read by clear_locks


class DuplicateTaskError(errors.DuplicateTaskError):
    """celery-singleton's refusal of a duplicate (``raise_on_duplicate``); ``.task_id`` is the id of the
    call that holds the key. Also a :class:`celery_idem.DuplicateTaskError`: either ``except`` catches it."""

    def __init__(self, message: str = "", task_id: str | None = None, **context: Any) -> None:
        super().__init__(message, task_id=task_id, **context)


class Singleton(IdempotentTask):
    """celery-singleton's task base: ``@app.task(base=Singleton, unique_on=..., raise_on_duplicate=...,
    lock_expiry=...)``. One call per key (its arguments, or those ``unique_on`` names) from its publish
    to the end of its run; a duplicate meanwhile is handed that call's ``AsyncResult`` (or raises)."""

    unique_on: ClassVar[list[str] | str | None] = None
    raise_on_duplicate: ClassVar[bool | None] = None
    lock_expiry: ClassVar[float | None] = None
    _singleton_refusal: ClassVar[ConfigurationError | None] = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # celery-singleton needs no setup call: the store and the policy come from the app's conf,
        # read when the task is bound to its app (as Celery reads its own task defaults).
        conf = app.conf
        try:
            _install_store(app)
            cls._singleton_refusal = None
        except ConfigurationError as exc:
            cls._singleton_refusal = exc  # told at the task's first call, never at import
        raise_ = cls.raise_on_duplicate
        if raise_ is None:
            raise_ = bool(conf.get("singleton_raise_on_duplicate"))
        expiry = cls.lock_expiry if cls.lock_expiry is not None else conf.get("singleton_lock_expiry")
        policy: dict[str, Any] = {"mode": "until_done", "on_duplicate": "raise" if raise_ else "return"}
        if cls.unique_on:
            policy["key_args"] = [cls.unique_on] if isinstance(cls.unique_on, str) else list(cls.unique_on)
        if expiry is not None:
            policy["pending_timeout_seconds"] = expiry
        cls.idempotency = policy
        super().on_bound(app)

    @property
    def idempotency_handler(self) -> Handler:
        if self._singleton_refusal is not None:
            raise self._singleton_refusal
        return super().idempotency_handler

    def apply_async(self, *args: Any, **options: Any) -> Any:
        try:
            return super().apply_async(*args, **options)
        except errors.DuplicateTaskError as exc:
            if isinstance(exc, DuplicateTaskError):
                raise
            raise DuplicateTaskError(
                f"Attempted to queue a duplicate of task ID {exc.task_id}",
                exc.task_id,
                key=exc.key,
                task_name=exc.task_name,
            ) from None


def clear_locks(app: Any) -> None:
    """Forget every record of the app's :class:`Singleton` tasks, in any state (celery-singleton's
    ``clear_locks``, usually run from ``worker_ready``): their next calls run. An attempt still
    running is fenced out (it stores nothing). Tasks this process has not registered are left."""
    names = [task.name for task in list(app.tasks.values()) if isinstance(task, Singleton)]
    store = Idempotency.of(app).store
    for name in names:
        while True:
            batch = store.records(task_name=name, limit=_BATCH)
            for record in batch:
                store.forget(record.identity)
            if len(batch) < _BATCH:
                break


def _install_store(app: Any) -> None:
    """Give ``app`` celery-idem with a store, unless it configures one: ``singleton_backend_url``, else
    the result backend if it is Redis, else the broker if it is Redis (celery-singleton's choice).

    Raises:
        ConfigurationError: a setting celery-singleton has that cannot map, or no Redis to use.
    """
    conf = app.conf
    backend_class = conf.get("singleton_backend_class")
    if backend_class is not None and _PEER_BACKEND != (
        backend_class
        if isinstance(backend_class, str)
        else f"{getattr(backend_class, '__module__', '')}.{getattr(backend_class, '__qualname__', '')}"
    ):
        raise ConfigurationError(
            f"singleton_backend_class={backend_class!r}: celery_idem.compat.singleton keeps its records in a "
            "celery-idem store, not a celery-singleton backend; remove the setting and set "
            "app.conf.idempotency_store (a URL, or a celery_idem.stores.Store of your own)"
        )
    if conf.get("singleton_backend_kwargs"):
        raise ConfigurationError(
            f"singleton_backend_kwargs ({', '.join(sorted(conf.get('singleton_backend_kwargs')))}) are not "
            "supported: put Redis connection options in the store URL's query (redis://host/0?socket_timeout=5) "
            "and the store's deadline in idempotency_store_timeout_seconds"
        )
    installed = installed_on(app)
    settings = installed.settings if installed is not None else None
    prefix = conf.get("singleton_key_prefix")
    own_store = conf.get("idempotency_store") if settings is None else settings.store
    if own_store is not None:
        key_prefix = conf.get("idempotency_key_prefix") if settings is None else settings.key_prefix
        if prefix is not None and prefix != (key_prefix or IdempotencySettings().key_prefix):
            raise ConfigurationError(
                f"singleton_key_prefix={prefix!r} names the prefix of the store celery_idem.compat.singleton "
                f"builds, but app {app.main!r} configures its own idempotency store: set "
                "idempotency_key_prefix instead (or remove one of the two)"
            )
        return
    url = conf.get("singleton_backend_url") or _zero_configuration_url(app)
    if url is None:
        return  # eager, with no Redis: celery-idem's own default, memory://
    keywords: dict[str, Any] = {}
    if settings is not None:  # an Idempotency(app, ...) without a store: keep what it was given
        keywords = {name: getattr(settings, name) for name in settings.model_fields_set}
    if prefix is not None:
        keywords["key_prefix"] = prefix
    Idempotency(app, **{**keywords, "store": url})


def _zero_configuration_url(app: Any) -> str | None:
    conf = app.conf
    for setting in ("result_backend", "broker_url"):
        url = conf.get(setting)
        if isinstance(url, str) and url.partition("://")[0].lower() in _REDIS_SCHEMES:
            return url
    if conf.get("task_always_eager"):
        return None
    schemes = {s: str(conf.get(s) or "none").partition("://")[0] for s in ("result_backend", "broker_url")}
    raise ConfigurationError(
        f"celery_idem.compat.singleton needs a store for app {app.main!r}, and neither its result backend "
        f"({schemes['result_backend']}) nor its broker ({schemes['broker_url']}) is Redis: set "
        "app.conf.singleton_backend_url (or idempotency_store) to a store URL, e.g. redis://localhost:6379/2"
    )
