"""Prometheus export of the extension's counters (the ``prometheus`` extra).

``Idempotency.metrics()`` is the plain dict; this module exposes the same counters as Prometheus
counters named ``celery_idem_<counter>_total``, one sample per app (label ``app``), read at scrape
time. Several apps in one process share one collector per registry, so each metric family appears
once::

    from prometheus_client import start_http_server
    from celery_idem.metrics import register_prometheus

    register_prometheus(Idempotency.of(app))
    start_http_server(9808)
"""

from __future__ import annotations

import threading
import weakref
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

# One collector per registry (prometheus_client refuses two collectors of the same names).
_COLLECTORS: weakref.WeakKeyDictionary[Any, IdempotencyCollector] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "Prometheus metrics need prometheus-client: pip install 'celery-idem[prometheus]'"
        ) from exc
    return prometheus_client


class IdempotencyCollector:
    """A Prometheus collector over the counters of every extension registered with it."""

    def __init__(self, namespace: str = "celery_idem") -> None:
        self.namespace = namespace
        self._extensions: weakref.WeakSet[Idempotency] = weakref.WeakSet()

    def add(self, idem: Idempotency) -> None:
        self._extensions.add(idem)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        snapshots = [(str(idem.app.main), idem.metrics()) for idem in list(self._extensions)]
        for name, help_text in HELP.items():
            family = CounterMetricFamily(f"{self.namespace}_{name}", help_text, labels=["app"])
            for app_name, counters in snapshots:
                family.add_metric([app_name], counters.get(name, 0))
            yield family


def register_prometheus(idem: Idempotency, registry: Any = None) -> IdempotencyCollector:
    """Expose the extension's counters in ``registry`` (default: prometheus_client's own)."""
    prometheus = _prometheus()  # the extra is needed either way: name it before anything else
    registry = registry or prometheus.REGISTRY
    with _LOCK:
        collector = _COLLECTORS.get(registry)
        if collector is None:
            collector = _COLLECTORS[registry] = IdempotencyCollector()
            collector.add(idem)
            registry.register(collector)
        else:
            collector.add(idem)
    return collector
