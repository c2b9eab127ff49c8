"""Idempotency: celery-idem on one Celery app, and the composition root.

:class:`Idempotency` is the :class:`~celery_idem.runtime.Runtime` (settings, store, heartbeat,
counters) that also wires celery-idem onto its app: the signal hooks, the reconciler's beat task,
the replacement callbacks. Nothing below this module imports it: each part is given the runtime.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Collection
from typing import Any

from celery import Task
from pydantic import ValidationError

from . import metrics, replacement, signals, tracing
from .config import IdempotencySettings, LeftBehind, invalid_settings
from .errors import ConfigurationError
from .reconciler import BEAT_ENTRY, TASK_NAME, Reconciler, ReconcileReport
from .records import Identity
from .runtime import COUNTERS, INSTALLED_ATTRIBUTE, Runtime, installed_on
from .stores import Store

__all__ = ["COUNTERS", "Idempotency"]

logger = logging.getLogger("celery_idem")


def _travelling(name: str, value: Any) -> Any:
    """``value`` as it can travel with the app's conf: itself if it pickles, else a :class:`LeftBehind`
    (for the settings typed Any) or None (not written: the child uses the conf or the default)."""
    if not isinstance(value, Store):
        try:
            pickle.dumps(value)
            return value
        except Exception:  # noqa: BLE001 - whatever pickle refuses stays behind
            pass
    if IdempotencySettings.model_fields[name].annotation is Any:
        return LeftBehind(name, f"{type(value).__name__} {value!r}")
    logger.warning(
        "celery-idem setting %s=%r does not pickle: pool children started with spawn will not see it", name, value
    )
    return None


class Idempotency(Runtime):
    """celery-idem on one Celery app.

    ``Idempotency(app, store="redis://...", ttl_seconds=3600)``: settings come from these keywords,
    then ``app.conf.idempotency_<name>``, then the defaults (:class:`IdempotencySettings`). Nothing
    is connected at construction; the store is opened on first use. Installing a second instance
    on the same app replaces the first.

    Args:
        app: The Celery app.
        store: A store URL or :class:`~celery_idem.stores.Store` (same as ``store=`` in settings).
        **settings: Any :class:`IdempotencySettings` field.

    Raises:
        ConfigurationError: an unknown or invalid setting.
    """

    def __init__(self, app: Any, store: str | Store | None = None, **settings: Any) -> None:
        if store is not None:
            settings["store"] = store
        unknown = sorted(set(settings) - set(IdempotencySettings.model_fields))
        if unknown:
            known = ", ".join(sorted(IdempotencySettings.model_fields))
            raise ConfigurationError(f"unknown setting {', '.join(unknown)}; settings are: {known}")
        super().__init__(app, settings)
        previous = installed_on(app)
        if isinstance(previous, Idempotency):
            previous.disconnect()
        setattr(app, INSTALLED_ATTRIBUTE, self)
        self._receivers = signals.connect(self)
        metrics.install()  # Prometheus, when prometheus-client is installed
        tracing.install()  # OpenTelemetry, when opentelemetry-api is installed
        _install_reconciler(self)
        replacement.install(self)
        if settings:
            # Explicit settings are validated at construction, on their own: reading app.conf here
            # would configure the app now, and an on_after_configure handler connected after this
            # line (Celery's documented way to add periodic tasks) would never run.
            try:
                IdempotencySettings(**settings)
            except ValidationError as exc:
                raise invalid_settings(f"celery-idem settings of app {app.main!r}", exc) from None
        # Settings given in code travel with the app's conf, which is all a pool child started with
        # spawn gets (the pickled app rebuilds from it); here the keywords still win.
        for name, value in settings.items():
            travelling = _travelling(name, value)
            if travelling is not None:
                app.conf[f"idempotency_{name}"] = travelling

    @classmethod
    def of(cls, app: Any) -> Idempotency:
        """The extension installed on ``app``; installs one with the app's settings if there is none."""
        installed = installed_on(app)
        return installed if isinstance(installed, Idempotency) else cls(app)

    def disconnect(self) -> None:
        """Disconnect this instance's signal hooks and stop its heartbeat thread (once no attempt
        of it is running); a replaced instance does this."""
        signals.disconnect(self._receivers)
        self.heartbeat.stop()

    def reinstall(self) -> None:
        """Put this instance back on its app, replacing (and disconnecting) the one installed since:
        what a test fixture that installed its own calls when the test ends."""
        installed = installed_on(self.app)
        if installed is self:
            return
        if isinstance(installed, Idempotency):
            installed.disconnect()
        setattr(self.app, INSTALLED_ATTRIBUTE, self)
        self._receivers = signals.connect(self)  # the heartbeat thread starts again when next needed

    def __repr__(self) -> str:
        return f"<Idempotency app={self.app.main!r}>"

    def reconcile(
        self, limit: int | None = None, dry_run: bool = False, *, identities: Collection[Identity] | None = None
    ) -> ReconcileReport:
        """Settle records stuck past their lease against the ledger, the result backend and worker
        liveness (see :mod:`celery_idem.reconciler`). Safe to run twice at once.

        Args:
            limit: At most this many stale records per run (default 1000).
            dry_run: Count what would be done; change nothing.
            identities: Only these records (an operator's selection, as the Django admin sends it);
                those whose lease still runs are left alone, and nothing is purged.
        """
        return Reconciler(self, dry_run=dry_run).run(limit, identities)


def reconcile_task(self: Any, limit: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """The body of the ``celery_idem.reconcile`` task that beat runs: a run of the extension
    installed on the task's app (the one that registered the task, or the instance that replaced it)."""
    # Without the left records' keys: the worker logs a task's return value, and the backend keeps it.
    return Idempotency.of(self.app).reconcile(limit=limit, dry_run=dry_run).model_dump(exclude={"left_records"})


def _install_reconciler(idem: Idempotency) -> None:
    """Register ``celery_idem.reconcile`` on the app, and its beat entry once the app is configured."""
    app = idem.app
    # A plain Task whatever the app's task_cls: under task_cls=IdempotentTask the reconciler would
    # otherwise be deduplicated by its (empty) arguments and beat's next runs handed the first one.
    app.task(name=TASK_NAME, base=Task, bind=True, shared=False, ignore_result=False)(reconcile_task)

    def add_beat_entry(**_: Any) -> None:
        if installed_on(app) is not idem:
            return  # replaced by a newer instance
        interval = idem.settings.reconcile_interval_seconds
        if interval:
            app.conf.beat_schedule = {
                **(app.conf.beat_schedule or {}),
                BEAT_ENTRY: {"task": TASK_NAME, "schedule": interval},
            }

    if app.configured:
        add_beat_entry()
    else:
        app.on_after_configure.connect(add_beat_entry, weak=False)
