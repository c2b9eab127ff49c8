"""The services the state machine, the result handles and the reconciler are given: the resolved
settings and per-task policies, the store, the heartbeat, the counters, and how a settled record is
read back (the ledger over the store).

:class:`Runtime` knows nothing of signals, the reconciler's beat task or the task class: the
extension (:class:`~celery_idem.extension.Idempotency`, the composition root) is a Runtime that
also wires those onto its app. Modules below the extension are given a Runtime, never the
extension.
"""

from __future__ import annotations

import difflib
import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection
from typing import Any

from pydantic import ValidationError

from . import telemetry
from .config import IdempotencyPolicy, IdempotencySettings, LeftBehind, invalid_settings
from .endings import MODES, Mode
from .errors import ConfigurationError
from .heartbeat import Heartbeat
from .keys import keyed_identity
from .once import computed_once
from .outcome import accepted_content_types, replay
from .records import IdempotencyRecord, Identity, State
from .stores import Store, store_from_url

__all__ = ["COUNTERS", "INSTALLED_ATTRIBUTE", "Runtime", "installed_on", "settings_of"]

logger = logging.getLogger("celery_idem")

INSTALLED_ATTRIBUTE = "_celery_idempotency"  # where an app keeps the runtime installed on it
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


def installed_on(app: Any) -> Runtime | None:
    """The runtime installed on ``app`` (its :class:`~celery_idem.Idempotency`), or None."""
    installed = app.__dict__.get(INSTALLED_ATTRIBUTE)
    return installed if isinstance(installed, Runtime) else None


class Runtime:
    """celery-idem's services on one Celery app; see the module docstring.

    Args:
        app: The Celery app.
        settings: :class:`IdempotencySettings` fields given in code; they win over
            ``app.conf.idempotency_<name>`` and the defaults.
    """

    def __init__(self, app: Any, settings: dict[str, Any]) -> None:
        self.app = app
        self._keywords = settings
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._policies: dict[str, IdempotencyPolicy] = {}
        self._next_traceback_at = 0.0  # proceed_unprotected's traceback, once a minute
        self.heartbeat = Heartbeat(
            on_error=functools.partial(self.count, "store_errors"), liveness_seconds=self._liveness_seconds
        )

    # ---- settings and policies -----------------------------------------------------------------

    @computed_once
    def settings(self) -> IdempotencySettings:
        """Resolved on first use, so ``app.conf`` may still change after tasks are defined."""
        return settings_of(self.app, self._keywords)

    def _liveness_seconds(self) -> float:
        return self.settings.liveness_seconds

    @computed_once
    def accepted_content_types(self) -> frozenset[str]:
        """The content types a stored outcome may be decoded from, everywhere this app reads the
        store (replays, ``get()``, the CLI, the ledger): the app's accepted serializers; pickle
        only with ``accept_pickle=True``."""
        return accepted_content_types(self.app.conf, accept_pickle=self.settings.accept_pickle)

    @functools.partial(computed_once, on_lost=lambda store: store.close())
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

    def mode_for(self, task: Any) -> Mode:
        """The task's deduplication mode, by its policy's ``mode`` (DESIGN §7)."""
        return MODES[self.policy_for(task).mode]

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
                merged.update(
                    option
                    if isinstance(option, dict)
                    else {name: getattr(option, name) for name in option.model_fields_set}
                )
            try:
                policy = self.settings.policy(merged)
            except ValidationError as exc:
                raise invalid_settings(f"idempotency policy of task {task.name!r}", exc) from None
            self._policies[task.name] = policy
        return policy

    # ---- records -------------------------------------------------------------------------------

    def _identity(self, task: Any, key: str, scope: str | None) -> Identity:
        return keyed_identity(task if isinstance(task, str) else task.name, key, scope)

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
            logger.warning(
                "could not read the ledger for %s: %s; the store's outcome stands",
                telemetry.shown(record.identity),
                exc,
            )
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
            logger.warning(
                "%s is FAILED in the store but committed in the ledger: the ledger wins",
                telemetry.shown(record.identity),
            )
        return entry

    def forget(self, task: Any, key: str, scope: str | None = None) -> bool:
        """Remove the record in any state; True if there was one. A running attempt is fenced out."""
        return self.store.forget(self._identity(task, key, scope))

    def proceed_unprotected(self, operation: str, identity: Identity, task_id: str) -> bool:
        """Count a store outage; True (and a warning) when the settings say run on without the store."""
        self.count("store_errors")
        if self.settings.on_store_error != "proceed":
            return False
        # One line per call; the chained traceback (70-odd lines) at most once a minute, at DEBUG.
        logger.warning(
            "store unavailable at %s of %s (task %s): proceeding unprotected (on_store_error='proceed'): %s",
            operation,
            telemetry.shown(identity),
            task_id,
            sys.exc_info()[1],
            extra=telemetry.fields(identity, outcome="PROCEED", task_id=task_id, operation=operation),
        )
        now = time.monotonic()
        if now >= self._next_traceback_at:
            self._next_traceback_at = now + 60.0
            logger.debug("the store error behind proceeding unprotected (shown once a minute)", exc_info=True)
        return True

    # ---- counters ------------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n
        telemetry.counted(name, n)

    def metrics(self) -> dict[str, int]:
        """Counters since this process started: claims, duplicates, replays, mismatches, ..."""
        with self._lock:
            return dict(self._counters)


def settings_of(app: Any, keywords: dict[str, Any]) -> IdempotencySettings:
    """``app``'s settings: ``keywords`` (given to ``Idempotency(app, ...)``) over
    ``app.conf.idempotency_<name>`` over the defaults.

    Raises:
        ConfigurationError: a setting in ``app.conf`` that celery-idem does not know (with the
            closest known name), or an invalid value.
    """
    known = IdempotencySettings.model_fields
    misspelt = sorted(
        name
        for name in map(_setting_name(app), app.conf.keys())
        if name.startswith("idempotency_") and name[12:] not in known
    )
    if misspelt:
        guesses = {
            k: [name for name in known if name.startswith(k[12:])][:1]
            or difflib.get_close_matches(k[12:], known, n=1, cutoff=0.5)
            for k in misspelt
        }
        hints = ", ".join(f"{k}" + (f" (did you mean idempotency_{g[0]}?)" if g else "") for k, g in guesses.items())
        raise ConfigurationError(f"unknown celery-idem setting in app.conf: {hints}")
    unread = [found for key in app.conf.keys() if (found := _unread(app, str(key), known)) is not None]
    refused = sorted(text for text, certain in unread if certain)
    if refused:
        raise ConfigurationError(f"celery-idem settings in app.conf that it never reads: {'; '.join(refused)}")
    warned = _WARNED.setdefault(app, set())  # settings can be computed twice (computed_once)
    for text in sorted(text for text, certain in unread if not certain and text not in warned):
        warned.add(text)
        logger.warning("a setting in app.conf that celery-idem never reads: %s", text)
    values: dict[str, Any] = {}
    for name in known:
        conf_value = app.conf.get(f"idempotency_{name}")
        if conf_value is not None:
            values[name] = conf_value
    values.update(keywords)
    try:
        return IdempotencySettings(**values)
    except ValidationError as exc:
        raise invalid_settings(f"celery-idem settings of app {app.main!r}", exc) from None


_WARNED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _unread(app: Any, key: str, known: Collection[str]) -> tuple[str, bool] | None:
    """What is wrong with ``key``, when it looks like a celery-idem setting written in a way this app
    never reads (the case, or a prefix of a namespace the app does not have), and whether that is
    certain; None for any other key.

    Only a key that names (or nearly names) one of ours counts. Under a namespace a key without its
    prefix (``IDEMPOTENCY_STORE`` under ``CELERY``) is not certain: a Django project's own settings
    sit in the same ``app.conf``, and one of them may share a name with ours (a warning, then). So
    is, on an app without a namespace (a Django project configured the older way has its settings
    there too), an upper-case key that only resembles one of ours and lacks Celery's prefix.
    """
    raw = str(getattr(app, "namespace", None) or "").rstrip("_")
    case = _namespace_case(raw)
    parts = key.lower().split("_")
    if parts[0] in ("celery", raw.lower()):
        parts = parts[1:]
    if len(parts) < 2 or parts[0] != "idempotency":
        return None
    name = "_".join(parts[1:])
    if key == f"idempotency_{name}":
        return None  # as set in code, read under any namespace (a misspelt one is reported as unknown)
    if name not in known and not difflib.get_close_matches(name, known, n=1, cutoff=0.8):
        return None
    guess = name if name in known else difflib.get_close_matches(name, known, n=1, cutoff=0.8)[0]
    if raw:
        wanted = case(f"{raw}_IDEMPOTENCY_{guess}")
        if key == wanted or (key.startswith(case(f"{raw}_")) and key == case(key)):
            return None  # read (a misspelt one is reported as unknown)
        which = "upper" if case is str.upper else "lower"
        text = f"{key} (the app reads its settings under namespace {raw!r} in {which} case: {wanted})"
        return text, key.lower().startswith(f"{raw.lower()}_")
    text = f"{key} (celery-idem reads idempotency_{guess}, in lower case, from an app without a namespace)"
    return text, name in known or key.lower().startswith("celery_") or key != key.upper()


def _namespace_case(namespace: str) -> Callable[[str], str]:
    """How Celery spells the keys it reads under ``namespace`` (``celery.utils.text.match_case``):
    upper case under an upper-case namespace (``CELERY``), lower case under any other (``celery``)."""
    return str.upper if f"{namespace}_".isupper() else str.lower


def _setting_name(app: Any) -> Callable[[str], str]:
    """A key of ``app.conf`` as the setting it names: an app configured with a namespace (Django's
    ``config_from_object("django.conf:settings", namespace="CELERY")``) lists its keys as written,
    ``CELERY_IDEMPOTENCY_LEASE_SECONDS``, and reads them as ``idempotency_lease_seconds``. Any other
    key counts as written: a setting given in code (``app.conf.idempotency_ttl_seconds``) is lower
    case, while a project's own setting without the namespace (a Django setting
    ``IDEMPOTENCY_HEADER``) is upper case, none of Celery's, and names no setting of ours."""
    # Celery reads CELERY_X under namespace "CELERY" and "CELERY_" alike, in the namespace's case.
    raw = str(getattr(app, "namespace", None) or "").rstrip("_")
    case = _namespace_case(raw)
    prefix = case(f"{raw}_") if raw else ""

    def name(key: str) -> str:
        if prefix and str(key).startswith(prefix) and str(key) == case(str(key)):
            return str(key)[len(prefix) :].lower()
        return str(key)  # as set in code (app.conf.idempotency_ttl = ...): a lower-case name counts

    return name
