"""Idempotency: the per-app extension. Settings, the store, the signal hooks, the counters."""

from __future__ import annotations

import difflib
import functools
import logging
import pickle
import threading
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from .config import IdempotencyPolicy, IdempotencySettings
from .errors import ConfigurationError
from .fingerprint import validate_key, validate_scope
from .heartbeat import Heartbeat
from .outcome import accepted_content_types, replay
from .records import IdempotencyRecord, Identity, State

if TYPE_CHECKING:
    from .reconciler import ReconcileReport
from .stores import Store, store_from_url

__all__ = ["COUNTERS", "Idempotency"]

logger = logging.getLogger("celery_idem")

_ATTRIBUTE = "_celery_idempotency"
COUNTERS = (
    "claims",
    "duplicates",
    "replays",
    "mismatches",
    "busy_waits",
    "lost_locks",
    "store_errors",
    "reconciled_completed",
    "reconciled_failed",
    "reconciled_released",
)


class LeftBehind:
    """Stands in ``app.conf`` for a setting given in code that cannot travel with the app (a Store
    instance, an object that does not pickle). A process that rebuilds the app from its conf (a
    pool child started with ``spawn``) finds this instead, and using it is a clear error."""

    def __init__(self, name: str, description: str) -> None:
        self.name = name
        self.description = description

    def error(self) -> ConfigurationError:
        return ConfigurationError(
            f"celery-idem setting {self.name} was given in code as {self.description}, which cannot travel "
            "to this process (a pool child started with worker_pool_start_method='spawn' rebuilds the app "
            f"from app.conf): pass a value that pickles ({'its URL, ' if self.name == 'store' else ''}"
            f"e.g. Idempotency(app, {self.name}=...)) or set app.conf.idempotency_{self.name}"
        )

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise self.error()

    def __repr__(self) -> str:
        return f"<left behind: {self.description}>"


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
    logger.warning("celery-idem setting %s=%r does not pickle: pool children started with spawn will not see it",
                   name, value)  # fmt: skip
    return None


def _invalid(where: str, error: ValidationError) -> ConfigurationError:
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in error.errors())
    return ConfigurationError(f"invalid {where}: {problems}")


class Idempotency:
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
        self.app = app
        self._keywords = settings
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._policies: dict[str, IdempotencyPolicy] = {}
        self.heartbeat = Heartbeat(
            on_error=functools.partial(self.count, "store_errors"), liveness_seconds=self._liveness_seconds
        )
        previous = app.__dict__.get(_ATTRIBUTE)
        if previous is not None:
            previous.disconnect()
        setattr(app, _ATTRIBUTE, self)
        from .reconciler import install
        from .replacement import install as install_replacement_callbacks
        from .signals import connect

        self._receivers = connect(self)
        install(self)
        install_replacement_callbacks(self)
        if settings:
            # Explicit settings are validated at construction, on their own: reading app.conf here
            # would configure the app now, and an on_after_configure handler connected after this
            # line (Celery's documented way to add periodic tasks) would never run.
            try:
                IdempotencySettings(**settings)
            except ValidationError as exc:
                raise _invalid(f"celery-idem settings of app {app.main!r}", exc) from None
        # Settings given in code travel with the app's conf, which is all a pool child started with
        # spawn gets (the pickled app rebuilds from it); here the keywords still win.
        for name, value in settings.items():
            travelling = _travelling(name, value)
            if travelling is not None:
                app.conf[f"idempotency_{name}"] = travelling

    @classmethod
    def of(cls, app: Any) -> Idempotency:
        """The extension installed on ``app``; installs one with the app's settings if there is none."""
        installed = app.__dict__.get(_ATTRIBUTE)
        return installed if installed is not None else cls(app)

    def disconnect(self) -> None:
        """Disconnect this instance's signal hooks and stop its heartbeat thread (once no attempt
        of it is running); a replaced instance does this."""
        from .signals import disconnect

        disconnect(self._receivers)
        self.heartbeat.stop()

    def __repr__(self) -> str:
        return f"<Idempotency app={self.app.main!r}>"

    # ---- settings and policies -----------------------------------------------------------------

    @functools.cached_property
    def settings(self) -> IdempotencySettings:
        """Resolved on first use, so ``app.conf`` may still change after tasks are defined."""
        known = IdempotencySettings.model_fields
        misspelt = sorted(
            key for key in self.app.conf.keys() if key.startswith("idempotency_") and key[12:] not in known
        )
        if misspelt:
            guesses = {
                k: [name for name in known if name.startswith(k[12:])][:1]
                or difflib.get_close_matches(k[12:], known, n=1, cutoff=0.5)
                for k in misspelt
            }
            hints = ", ".join(
                f"{k}" + (f" (did you mean idempotency_{g[0]}?)" if g else "") for k, g in guesses.items()
            )
            raise ConfigurationError(f"unknown celery-idem setting in app.conf: {hints}")
        values: dict[str, Any] = {}
        for name in known:
            conf_value = self.app.conf.get(f"idempotency_{name}")
            if conf_value is not None:
                values[name] = conf_value
        values.update(self._keywords)
        try:
            return IdempotencySettings(**values)
        except ValidationError as exc:
            raise _invalid(f"celery-idem settings of app {self.app.main!r}", exc) from None

    def _liveness_seconds(self) -> float:
        return self.settings.liveness_seconds

    @functools.cached_property
    def accepted_content_types(self) -> frozenset[str]:
        """The content types a stored outcome may be decoded from, everywhere this app reads the
        store (replays, ``get()``, the CLI, the ledger): the app's accepted serializers; pickle
        only with ``accept_pickle=True``."""
        return accepted_content_types(self.app.conf, accept_pickle=self.settings.accept_pickle)

    @functools.cached_property
    def store(self) -> Store:
        """The store, built once from the ``store`` setting."""
        settings = self.settings
        store = settings.store
        if isinstance(store, LeftBehind):
            raise store.error()
        if store is None:
            if not self.app.conf.task_always_eager:
                raise ConfigurationError(
                    f"no idempotency store for app {self.app.main!r}: pass Idempotency(app, "
                    "store='redis://...') or set app.conf.idempotency_store (memory:// is the default "
                    "only with task_always_eager)"
                )
            store = "memory://"
        if isinstance(store, Store):
            return store
        # A store that cannot be opened raises StoreUnavailableError (an outage, or a surprise)
        # or ConfigurationError (a mistake in the URL); nothing is cached, so the next use retries.
        return store_from_url(
            str(store),
            key_prefix=settings.key_prefix,
            timeout_seconds=settings.store_timeout_seconds,
            max_result_bytes=settings.max_result_bytes,
        )

    def policy_for(self, task: Any) -> IdempotencyPolicy:
        """The task's effective policy: its ``idempotency`` option over the app-wide defaults."""
        policy = self._policies.get(task.name)
        if policy is None:
            # A task class's policy refines its base classes' (a task option refines its base=).
            merged: dict[str, Any] = {}
            for klass in reversed(task.__class__.__mro__):  # __class__: Celery may hand us a Proxy
                option = klass.__dict__.get("idempotency")
                if option is None:
                    continue
                if not isinstance(option, (dict, IdempotencyPolicy)):
                    raise ConfigurationError(
                        f"the idempotency option of task {task.name!r} must be a dict or IdempotencyPolicy; "
                        f"got {type(option).__name__}"
                    )
                merged.update(option if isinstance(option, dict) else {
                    name: getattr(option, name) for name in option.model_fields_set
                })  # fmt: skip
            try:
                policy = self.settings.policy(merged)
            except ValidationError as exc:
                raise _invalid(f"idempotency policy of task {task.name!r}", exc) from None
            self._policies[task.name] = policy
        return policy

    # ---- records -------------------------------------------------------------------------------

    def _identity(self, task: Any, key: str, scope: str | None) -> Identity:
        name = task if isinstance(task, str) else task.name
        return Identity(validate_scope(scope), name, validate_key(key))

    def get(self, task: Any, key: str, scope: str | None = None) -> IdempotencyRecord | None:
        """The record of ``(scope, task, key)``; ``task`` is the task or its name."""
        return self.store.get(self._identity(task, key, scope))

    def committed(self, identity: Identity, fingerprint: str | None, ledger: Any = None) -> Any:
        """The committed entry of this call (a :class:`~celery_idem.ledger.LedgerEntry`) in
        ``ledger`` (default: the app's), or None: no ledger, no committed row, or other arguments.

        Raises:
            LedgerUnavailableError: the ledger's database could not be asked in time.
            sqlalchemy.exc.SQLAlchemyError: any other database error.
        """
        ledger = ledger if ledger is not None else self.settings.ledger
        return None if ledger is None else ledger.completed(identity, fingerprint)

    def replay(self, record: IdempotencyRecord) -> Any:
        """A settled record's outcome as every reader answers it (a worker's duplicate, ``get()``):
        the stored value or failure, except that a stored failure of a call the ledger holds
        committed answers with the ledger's value. The business database wins over the store."""
        try:
            entry = self.overruled(record)
        except Exception as exc:  # noqa: BLE001 - the ledger cannot be asked: the store's outcome stands
            logger.warning("could not read the ledger for %s: %s; the store's outcome stands", record.identity, exc)
            entry = None
        if entry is not None:
            return entry.value(self.accepted_content_types)
        return replay(record, self.accepted_content_types)

    def overruled(self, record: IdempotencyRecord) -> Any:
        """The app's ledger entry that overrules a FAILED record, or None.

        Raises:
            LedgerUnavailableError: the ledger's database could not be asked in time.
        """
        if record.state is not State.FAILED or self.settings.ledger is None:
            return None
        entry = self.committed(record.identity, record.fingerprint)
        if entry is not None:
            logger.warning("%s is FAILED in the store but committed in the ledger: the ledger wins", record.identity)
        return entry

    def forget(self, task: Any, key: str, scope: str | None = None) -> bool:
        """Remove the record in any state; True if there was one. A running attempt is fenced out."""
        return self.store.forget(self._identity(task, key, scope))

    def reconcile(self, limit: int | None = None, dry_run: bool = False) -> ReconcileReport:
        """Settle records stuck past their lease against the ledger, the result backend and worker
        liveness (see :mod:`celery_idem.reconciler`). Safe to run twice at once.

        Args:
            limit: At most this many stale records per run (default 1000).
            dry_run: Count what would be done; change nothing.
        """
        from .reconciler import Reconciler

        return Reconciler(self, dry_run=dry_run).run(limit)

    # ---- counters ------------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def metrics(self) -> dict[str, int]:
        """Counters since this process started: claims, duplicates, replays, mismatches, ..."""
        with self._lock:
            return dict(self._counters)
