"""celery-once's ``QueueOnce`` on celery-idem: change ``from celery_once import QueueOnce,
AlreadyQueued`` to ``from celery_idem.compat.once import QueueOnce, AlreadyQueued`` and nothing else.

celery-once 3.0.1's options, mapped onto a policy (docs/migration.md, "From celery-once"):

- the lock, held from publish until the task ends (its default ``unlock_before_run=False``), is the
  mode ``until_done``: a duplicate call while the call waits or runs is refused, and once its run
  ended (returned or failed) the next call runs;
- ``once={"keys": [...]}`` is ``key_args`` (``[]``: one call of the task at a time, whatever its
  arguments; no ``keys``: every argument);
- ``once={"graceful": False}`` (the default) raises :class:`AlreadyQueued` with ``.countdown``, the
  seconds left on the duplicate's lock; ``graceful=True`` returns celery-once's
  ``EagerResult(None, None, "REJECTED")``, per task or per call (``apply_async(once={...})``);
- ``timeout`` (``ONCE["settings"]["default_timeout"]``, 1 hour) is ``pending_timeout_seconds``: how
  long a queued call holds its key before a worker starts it, counted from its countdown or ETA.
  Once running, the key is held by the attempt's lease (renewed while it runs) until the run ends,
  never cut short by the timeout as celery-once's lock is;
- ``app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": ...}}`` installs
  ``Idempotency(app, store=url)`` when the app has none.

``unlock_before_run=True`` (the key freed when a worker starts the body) is the mode
``until_started``, not built yet: it is refused with :class:`~celery_idem.errors.ConfigurationError`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from celery import states
from celery.result import EagerResult

from ..errors import ConfigurationError, DuplicateTaskError
from ..extension import Idempotency
from ..runtime import installed_on
from ..task import IdempotentTask

__all__ = ["AlreadyQueued", "QueueOnce"]

logger = logging.getLogger("celery_idem.compat.once")

#: celery-once's Redis backend, by both of its import paths: the only one whose URL is a store's.
REDIS_BACKENDS = frozenset({"celery_once.backends.Redis", "celery_once.backends.redis.Redis"})
DEFAULT_TIMEOUT_SECONDS = 60 * 60  # celery-once's default_timeout


class AlreadyQueued(DuplicateTaskError):
    """celery-once's refusal of a duplicate call (``graceful=False``); also a ``DuplicateTaskError``.

    Args:
        countdown: Seconds left on the lock of the call it duplicates (the store's clock).
    """

    def __init__(
        self, countdown: float, *, key: str | None = None, task_name: str | None = None, task_id: str | None = None
    ) -> None:
        super().__init__(f"Expires in {countdown} seconds", key=key, task_name=task_name, task_id=task_id)
        self.args = (countdown,)  # celery-once's: rebuilt from its countdown alone, as Celery ships it
        self.countdown = countdown


def _once_settings(app: Any) -> Mapping[str, Any]:
    config = app.conf.get("ONCE")
    if config is None:
        return {}
    if not isinstance(config, Mapping) or not isinstance(config.get("settings", {}), Mapping):
        raise ConfigurationError(f"app.conf.ONCE must be a dict with a 'settings' dict, as celery-once's: {config!r}")
    settings: Mapping[str, Any] = config.get("settings", {})
    return settings


def _install(app: Any) -> None:
    """``Idempotency(app)`` from celery-once's configuration, unless the app has one already."""
    if installed_on(app) is not None:
        return
    config = app.conf.get("ONCE")
    if config is None:
        raise ConfigurationError(
            "QueueOnce needs celery-once's app.conf.ONCE = {'backend': 'celery_once.backends.Redis', "
            "'settings': {'url': 'redis://...'}} (its url becomes celery-idem's store), or an "
            "Idempotency(app, store=...) installed before the tasks are bound"
        )
    backend, url = config.get("backend"), _once_settings(app).get("url")
    if backend not in REDIS_BACKENDS or not url:
        raise ConfigurationError(
            f"celery_idem.compat.once takes its store from celery-once's Redis backend and its settings' url; "
            f"got backend {backend!r} with url {url!r}: use 'celery_once.backends.Redis' with a url, or install "
            "Idempotency(app, store=...) before the tasks are bound"
        )
    Idempotency(app, store=url)


class QueueOnce(IdempotentTask):
    """celery-once's task base class: ``@app.task(base=QueueOnce, once={...})``. A call while an
    earlier one with the same key arguments waits in the queue or runs raises :class:`AlreadyQueued`
    (or, ``graceful``, returns a REJECTED ``EagerResult``) and publishes nothing."""

    abstract = True
    once: ClassVar[dict[str, Any]] = {"graceful": False, "unlock_before_run": False}

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # Celery reads the app's configuration here too (Task.bind): the policy is settled before
        # the task's first call, so the worker's parent and the producer see the same one.
        once = dict(cls.once or {})
        if once.get("unlock_before_run"):
            raise ConfigurationError(
                f"task {cls.name!r}: once={{'unlock_before_run': True}} frees the key when a worker starts the "
                "body, which is celery-idem's mode 'until_started', not built yet (docs/modes.md); drop it to "
                "hold the key until the run ends (celery-once's default, mode 'until_done')"
            )
        unknown = sorted(set(once) - {"graceful", "keys", "timeout", "unlock_before_run"})
        if unknown:  # celery-once ignores them too: a typo must not stop an app that ran before
            logger.warning("task %s: once option(s) %s mean nothing to celery-once: ignored", cls.name, unknown)
        _install(app)
        policy: dict[str, Any] = {
            "mode": "until_done",
            "on_duplicate": "raise",  # caught below: AlreadyQueued, or graceful's REJECTED result
            "pending_timeout_seconds": once.get(
                "timeout", _once_settings(app).get("default_timeout", DEFAULT_TIMEOUT_SECONDS)
            ),
        }
        if once.get("keys") is not None:
            policy["key_args"] = list(once["keys"])
        cls.idempotency = policy
        super().on_bound(app)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Publish the call, unless an earlier one holds its key.

        Raises:
            AlreadyQueued: a duplicate, and the call's (else the task's) ``once`` says ``graceful=False``.
            ConfigurationError: a per-call ``once={"timeout": ...}`` other than the task's.
        """
        once = options.pop("once", None) or {}
        timeout = once.get("timeout")
        if timeout is not None and timeout != self.idempotency_handler.policy.pending_timeout_seconds:
            raise ConfigurationError(
                f"task {self.name!r}: a per-call once={{'timeout': {timeout!r}}} is not supported (celery-idem "
                "has no per-call policy); set it on the task, once={'timeout': ...}"
            )
        try:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        except DuplicateTaskError as exc:
            # (A call that ended holds no key in mode until_done: only a live one refuses this call.)
            if once.get("graceful", self.once.get("graceful", False)):
                return EagerResult(None, None, states.REJECTED)
            raise AlreadyQueued(
                self._lock_left(exc.key), key=exc.key, task_name=self.name, task_id=exc.task_id
            ) from None

    def _lock_left(self, key: str | None) -> float:
        """Seconds left on the lock of ``key`` (the holder's lease, or its claim's) by the store's clock."""
        idem = Idempotency.of(self.app)
        record = idem.get(self, key) if key is not None else None
        if record is None or record.lease_expires_at is None:
            return 0.0
        return max(0.0, round(record.lease_expires_at - idem.store.now(), 3))
