"""Prometheus metrics (the ``prometheus`` extra).

With prometheus-client installed, ``Idempotency(app)`` records these in prometheus-client's own
metric types, in its default registry, with no other code: under ``PROMETHEUS_MULTIPROC_DIR``
(prometheus-client's multiprocess mode, which every prefork deployment needs) each pool child
writes its own files and a ``MultiProcessCollector`` sums them at scrape time.

- ``celery_idem_decisions_total{task, side, decision}``: what each call (``side="publish"``:
  ``NEW``, ``DUPLICATE``, ``REPLAY``, ``MISMATCH``) and each message (``side="worker"``: ``RUN``,
  ``BUSY``, ``REPLAY``, ``MISMATCH``) was answered;
- ``celery_idem_store_request_duration_seconds{operation, outcome}``: a histogram of every store
  operation (``claim``, ``acquire``, ``complete``, ...), by outcome (``ok``, ``outage``, ``error``);
- ``celery_idem_events_total{event}``: the counters of ``Idempotency.metrics()`` (``lost_locks``,
  ``store_errors``, ``busy_waits``, ``reconciled_completed``, ...).

No label ever holds a key, a task id or an argument. ``register_prometheus`` is the older,
single-process collector (``celery_idem_<counter>_total{app}``), kept for code that uses it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import telemetry
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .runtime import Runtime as Idempotency

__all__ = ["HELP", "IdempotencyCollector", "PrometheusSink", "install", "register_prometheus"]

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


# Seconds: a Redis round trip is ~0.2 ms, a PostgreSQL statement ~1 ms, a timeout up to 30 s.
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PrometheusSink:
    """The telemetry sink that records into prometheus-client's metric types (see the module)."""

    def __init__(self, registry: Any = None) -> None:
        prometheus = _prometheus()
        registry = registry if registry is not None else prometheus.REGISTRY
        self.decisions = prometheus.Counter(
            "celery_idem_decisions",
            "Calls and messages, by task, side (publish, worker) and the decision they were answered.",
            ["task", "side", "decision"],
            registry=registry,
        )
        self.store = prometheus.Histogram(
            "celery_idem_store_request_duration_seconds",
            "Store operations, by operation and outcome (ok, outage, error).",
            ["operation", "outcome"],
            buckets=STORE_BUCKETS,
            registry=registry,
        )
        self.events = prometheus.Counter(
            "celery_idem_events",
            "The extension's counters (Idempotency.metrics()), by event.",
            ["event"],
            registry=registry,
        )
        # Every counter exists from the start at 0: a series born with its first increment has no
        # earlier sample, so rate() and increase() never see that increment (the first lost lock).
        for name in HELP:
            self.events.labels(name)

    def decision(self, task: str, side: str, decision: str) -> None:
        self.decisions.labels(task, side, decision).inc()

    def store_call(self, operation: str, seconds: float, outcome: str) -> None:
        self.store.labels(operation, outcome).observe(seconds)

    def counted(self, name: str, n: int) -> None:
        self.events.labels(name).inc(n)


_SINK: PrometheusSink | None = None


def install() -> PrometheusSink | None:
    """Record into prometheus-client's default registry, once per process (``Idempotency(app)``
    calls this); None without prometheus-client."""
    global _SINK
    with _LOCK:
        if _SINK is None:
            try:
                import prometheus_client  # noqa: F401
            except ImportError:
                return None
            _SINK = PrometheusSink()
            telemetry.add_sink(_SINK)
        return _SINK
