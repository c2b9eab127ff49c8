"""Settings of the payments example, from ``PAYMENTS_<FIELD>`` environment variables.

The defaults are the services on localhost; docker-compose.yml sets the variables to its own
service names (``rabbitmq``, ``redis``, ``postgres``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "PAYMENTS_"


@dataclasses.dataclass(frozen=True)
class Config:
    broker_url: str = "amqp://guest:guest@127.0.0.1:5672//"
    result_backend: str = "redis://127.0.0.1:6379/1"
    idempotency_store: str = "redis://127.0.0.1:6379/2"
    database_url: str = "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/payments"
    queue: str = "payments"
    key_prefix: str = "idem"  # prefix of the idempotency records in the store
    payments_table: str = "payments"
    ledger_table: str = "celery_idem_ledger"
    reconcile_interval_seconds: float = 60.0  # beat runs celery_idem.reconcile this often

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """``PAYMENTS_BROKER_URL``, ``PAYMENTS_DATABASE_URL``, ...: one variable per field."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw:
                values[field.name] = float(raw) if isinstance(field.default, float) else raw
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce this config in another process."""
        return {ENV_PREFIX + name.upper(): str(value) for name, value in dataclasses.asdict(self).items()}
