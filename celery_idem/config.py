"""Per-task policy and per-app settings (DESIGN §6). One time unit everywhere: seconds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .errors import ConfigurationError

__all__ = [
    "LeftBehind",
    "invalid_settings",
    "MAX_RESULT_BYTES",
    "MAX_SECONDS",
    "MAX_STORE_TIMEOUT_SECONDS",
    "MIN_STORE_TIMEOUT_SECONDS",
    "IdempotencyPolicy",
    "IdempotencySettings",
    "POLICY_FIELDS",
]

FailureClass = Literal["retryable", "permanent"]

# "Forever" is not a duration: every store needs a finite expiry (Redis PEXPIRE refuses inf, and a
# lease, a wait or a beat interval of inf breaks the arithmetic). 100 years is the longest any
# duration setting takes, and every store holds it (tests/outages/test_store_configuration.py).
MAX_SECONDS = 100 * 365 * 86400
# A store call waits at most an hour (PostgreSQL's statement_timeout tops out at 24.8 days) and at
# least a millisecond (the unit of statement_timeout and busy_timeout, where 0 means "no timeout").
MAX_STORE_TIMEOUT_SECONDS = 3600.0
MIN_STORE_TIMEOUT_SECONDS = 0.001
# The largest value Redis takes by default (proto-max-bulk-len): a larger limit would let a result
# through the check that no Redis store can then hold.
MAX_RESULT_BYTES = 512 * 1024 * 1024
_DURATIONS = ("ttl_seconds", "lease_seconds", "pending_timeout_seconds", "busy_wait_seconds")


def _finite(name: str, value: float | None, most: float = MAX_SECONDS) -> float | None:
    if value is not None and not value <= most:  # also refuses nan
        why = (
            "100 years: every store needs a finite expiry, 'forever' is not supported"
            if most == MAX_SECONDS
            else "an hour: a store call that needs longer is a store that is down"
        )
        raise ValueError(f"{name} must be a finite number of seconds, at most {most:.0f} ({why}); got {value!r}")
    return value


class IdempotencyPolicy(BaseModel):
    """How one task is made idempotent: the task option ``idempotency=`` (a dict or this model),
    or the keywords of ``@idempotent_task``."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    key_args: list[str] | None = Field(
        default=None,
        description="Only these parameters go into the fingerprint (None: all of them; []: none, one call of "
        "the task at a time whatever its arguments); needs the task's typing on.",
    )
    require_key: bool = Field(default=False, description="Refuse calls without an idempotency_key (InvalidKeyError).")
    ttl_seconds: float = Field(default=86400, gt=0, description="How long an outcome is kept and replayed.")
    lease_seconds: float = Field(
        default=30, gt=0, description="IN_PROGRESS lease; a heartbeat renews it every lease/3."
    )
    pending_timeout_seconds: float = Field(
        default=3600, gt=0, description="PENDING lease from claim to start (countdown/ETA is added)."
    )
    on_duplicate: Literal["return", "raise"] = Field(
        default="return", description="A duplicate call hands back the original, or raises DuplicateTaskError."
    )
    on_busy: Literal["wait", "retry"] = Field(
        default="wait", description="A message whose identity is running elsewhere waits for it, or retries later."
    )
    busy_wait_seconds: float = Field(default=60, ge=0, description="How long on_busy='wait' waits.")
    retryable: tuple[type[BaseException], ...] = Field(
        default=(), description="Exception classes that release the key for another try."
    )
    permanent: tuple[type[BaseException], ...] = Field(
        default=(), description="Exception classes stored as the final outcome."
    )
    default_failure: FailureClass = Field(
        default="retryable", description="How an exception in neither list is classed."
    )
    stale_action: Literal["release", "requeue"] = Field(
        default="release", description="What the reconciler does with a provably dead attempt."
    )
    results: Literal["both", "store"] = Field(
        default="both",
        description="Where an outcome is written: 'both' (Celery's result backend and the store, as plain "
        "Celery) or 'store' (the store only: one write per outcome; see docs/results.md).",
    )
    # DESIGN §7: until_started, throttle, debounce and replace are not built yet (docs/modes.md).
    mode: Literal["idempotent", "until_done"] = Field(
        default="idempotent",
        description="When the key is free again: 'idempotent' (its outcome is kept ttl_seconds and handed to "
        "every later call) or 'until_done' (celery-singleton's: one call per key from publish to the end of "
        "its run; the key is free once it ends, and nothing is replayed after; see docs/modes.md).",
    )

    @field_validator(*_DURATIONS)
    @classmethod
    def _durations_finite(cls, value: float, info: ValidationInfo) -> float | None:
        return _finite(str(info.field_name), value)

    @model_validator(mode="after")
    def _outcome_somewhere(self) -> IdempotencyPolicy:
        if self.mode == "until_done" and self.results == "store":
            raise ValueError(
                "results='store' keeps an outcome in the store only, and in mode 'until_done' the next call "
                "takes the key's record over: an earlier call's handle could no longer be answered; use "
                "results='both' (the default)"
            )
        return self

    @field_validator("key_args")
    @classmethod
    def _key_args_named(cls, value: list[str] | None) -> list[str] | None:
        # [] is a fingerprint of no argument: every call of the task is one call (celery-once's keys=[]).
        if value is not None and not all(isinstance(v, str) and v for v in value):
            raise ValueError("key_args must be a list of parameter names ([] for none), or None for all")
        return value


POLICY_FIELDS: frozenset[str] = frozenset(IdempotencyPolicy.model_fields)


DEFAULT_LIVENESS_SECONDS = 10.0


class IdempotencySettings(IdempotencyPolicy):
    """App-wide settings: ``Idempotency(app, **settings)`` over ``app.conf.idempotency_<name>``.

    Holds the defaults of every policy field too, so ``ttl_seconds`` can be set once per app.
    """

    store: Any = Field(
        default=None, description="Store URL or Store instance; memory:// by default only in eager mode."
    )
    key_prefix: str = Field(default="idem", min_length=1, description="Prefix of every store key or table row.")
    store_timeout_seconds: float = Field(
        default=2.0, ge=MIN_STORE_TIMEOUT_SECONDS, description="Deadline of every store call (0.001 to 3600)."
    )
    on_store_error: Literal["raise", "proceed"] = Field(
        default="raise", description="Store down: fail closed (StoreUnavailableError) or run unprotected."
    )
    max_result_bytes: int = Field(
        default=1_048_576,
        gt=0,
        le=MAX_RESULT_BYTES,
        description="Largest serialized result stored (at most 512 MiB, the largest value Redis takes).",
    )
    accept_pickle: bool = Field(default=False, description="Allow tasks whose serializer is pickle.")
    reconcile_interval_seconds: float | None = Field(
        default=None, gt=0, description="Run the reconciler from beat this often (None: no beat entry)."
    )
    ledger: Any = Field(default=None, description="A celery_idem.ledger.Ledger the reconciler consults.")
    inspect_timeout_seconds: float = Field(
        default=1.0, gt=0, description="How long the reconciler waits for workers to answer inspect."
    )
    stale_grace_seconds: float = Field(
        default=3600, ge=0, description="Release a stale record with no evidence once this far past its lease."
    )
    liveness_seconds: float = Field(
        default=DEFAULT_LIVENESS_SECONDS,
        gt=0,
        allow_inf_nan=False,
        description="Lifetime of a worker process's liveness record (beaten every third of it); a dead "
        "holder is seen this long after its last beat (keep it at most lease_seconds: then at its lease's end). "
        "Unset: 10, or twice store_timeout_seconds when that is longer.",
    )

    @model_validator(mode="after")
    def _liveness_fits(self) -> IdempotencySettings:
        if "liveness_seconds" not in self.model_fields_set:
            # The default follows the store deadline, so a long store_timeout_seconds alone is valid.
            derived = max(DEFAULT_LIVENESS_SECONDS, 2 * self.store_timeout_seconds)
            object.__setattr__(self, "liveness_seconds", derived)
        elif self.liveness_seconds < self.store_timeout_seconds:
            raise ValueError(
                f"liveness_seconds ({self.liveness_seconds:g}) must be at least store_timeout_seconds "
                f"({self.store_timeout_seconds:g}): one slow beat would otherwise pass for a death"
            )
        return self

    @field_validator("store_timeout_seconds", "inspect_timeout_seconds")
    @classmethod
    def _waits_finite(cls, value: float, info: ValidationInfo) -> float | None:
        return _finite(str(info.field_name), value, MAX_STORE_TIMEOUT_SECONDS)

    @field_validator("reconcile_interval_seconds", "stale_grace_seconds", "liveness_seconds")
    @classmethod
    def _app_durations_finite(cls, value: float | None, info: ValidationInfo) -> float | None:
        return _finite(str(info.field_name), value)

    def policy(self, overrides: IdempotencyPolicy | dict[str, Any] | None = None) -> IdempotencyPolicy:
        """The effective policy of one task: these defaults under the task's own fields."""
        base = {name: getattr(self, name) for name in POLICY_FIELDS}
        if isinstance(overrides, IdempotencyPolicy):
            base.update({name: getattr(overrides, name) for name in overrides.model_fields_set})
        elif overrides:
            base.update(overrides)
        return IdempotencyPolicy(**base)


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


def invalid_settings(where: str, error: ValidationError) -> ConfigurationError:
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in error.errors())
    return ConfigurationError(f"invalid {where}: {problems}")
