"""Prometheus export of the extension's counters (the ``prometheus`` extra).

``Idempotency.metrics()`` is the plain dict; this module exposes the same counters as Prometheus
counters named ``celery_idem_<counter>_total``, read from the extension at scrape time::

    from prometheus_client import start_http_server
    from celery_idem.metrics import register_prometheus

    register_prometheus(Idempotency.of(app))
    start_http_server(9808)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError

if TYPE_CHECKING:
    from .extension import Idempotency

__all__ = ["HELP", "IdempotencyCollector", "register_prometheus"]

HELP = {
    "claims": "Claims the store answered at publish.",
    "duplicates": "Calls handed back the original task id of a running or queued call.",
    "replays": "Calls and messages answered with a stored outcome.",
    "mismatches": "Calls refused because the key belongs to other arguments.",
    "busy_waits": "Messages that waited for (or retried after) a running attempt of their identity.",
    "lost_locks": "Writes refused because another attempt owned the record.",
    "store_errors": "Store calls that failed or timed out.",
    "reconciled_completed": "Stale records the reconciler completed from the ledger or result backend.",
    "reconciled_failed": "Stale records the reconciler marked failed.",
    "reconciled_released": "Stale records the reconciler released.",
}


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "Prometheus metrics need prometheus-client: pip install 'celery-idem[prometheus]'"
        ) from exc
    return prometheus_client


class IdempotencyCollector:
    """A Prometheus collector over one extension's counters."""

    def __init__(self, idem: Idempotency, namespace: str = "celery_idem") -> None:
        self.idem = idem
        self.namespace = namespace

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        labels = {"app": str(self.idem.app.main)}
        for name, value in self.idem.metrics().items():
            family = CounterMetricFamily(f"{self.namespace}_{name}", HELP.get(name, name), labels=list(labels))
            family.add_metric(list(labels.values()), value)
            yield family


def register_prometheus(idem: Idempotency, registry: Any = None) -> IdempotencyCollector:
    """Register the extension's counters with ``registry`` (default: prometheus_client's)."""
    prometheus = _prometheus()
    collector = IdempotencyCollector(idem)
    (registry or prometheus.REGISTRY).register(collector)
    return collector
