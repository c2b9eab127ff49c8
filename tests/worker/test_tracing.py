"""OpenTelemetry through a real (in-process) worker, with opentelemetry-instrumentation-celery and
the SDK's in-memory exporter: the instrumentation's spans carry what celery-idem decided, with a
hash of the key and the plain key only when asked; a publish celery-idem suppressed has a span."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL
from celery import Celery
from celery.contrib.testing.worker import start_worker
from conftest import REDIS_URL, require_server, wipe
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_idem import Idempotency, IdempotentTask, store_from_url, tracing
from celery_idem.events import key_hash
from celery_idem.records import Identity

BROKER, BACKEND = REDIS_BROKER_URL, REDIS_BACKEND_URL


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the process's global provider is set once
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    yield exporter
    instrumentor.uninstrument()


@pytest.fixture
def app(exporter: InMemorySpanExporter) -> Iterator[Celery]:
    require_server("redis")
    prefix = f"otel{uuid.uuid4().hex[:8]}"
    app = Celery("otel", broker=BROKER, backend=BACKEND, set_as_current=False)
    app.conf.update(task_default_queue=prefix, broker_connection_retry_on_startup=True)
    Idempotency(app, store=REDIS_URL, key_prefix=prefix)

    @app.task(base=IdempotentTask, shared=False, name="otel.charge")
    def charge(order_id: int) -> int:
        return order_id

    app.loader.import_module("celery.contrib.testing.tasks")  # start_worker's ping
    exporter.clear()
    yield app
    tracing.configure(plain_keys=False)
    wipe(store_from_url(REDIS_URL, key_prefix=prefix))


def spans(exporter: InMemorySpanExporter, outcome: str) -> list[Any]:
    return [
        span for span in exporter.get_finished_spans() if (span.attributes or {}).get("idempotency.outcome") == outcome
    ]


def test_the_workers_spans_carry_the_decision_and_a_hashed_key_and_a_suppressed_publish_has_a_span(
    app: Celery, exporter: InMemorySpanExporter
) -> None:
    key = f"order-{uuid.uuid4().hex}"
    charge = app.tasks["otel.charge"]
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        first = charge.apply_async((1,), idempotency_key=key)
        assert first.get(timeout=20) == 1
        again = charge.apply_async((1,), idempotency_key=key)  # answered at publish: not sent
        assert again.deduplicated
        sent = app.send_task("otel.charge", (1,), idempotency_key=key)  # sent by name: the worker replays
        assert sent.get(timeout=20) == 1
    hashed = key_hash(Identity("", "otel.charge", key))
    (ran,) = spans(exporter, "RUN")
    assert ran.name.startswith("run/") and ran.attributes["idempotency.key_hash"] == hashed
    assert ran.attributes["idempotency.side"] == "worker" and "idempotency.key" not in ran.attributes
    suppressed = [span for span in spans(exporter, "REPLAY") if span.name == "celery_idem.suppressed otel.charge"]
    assert len(suppressed) == 1 and suppressed[0].attributes["idempotency.original_task_id"] == first.id
    (replayed,) = [span for span in spans(exporter, "REPLAY") if span.name.startswith("run/")]
    assert replayed.attributes["idempotency.original_task_id"] == first.id
    assert not any(key in repr(dict(span.attributes or {})) for span in exporter.get_finished_spans())


def test_the_plain_key_only_when_asked(app: Celery, exporter: InMemorySpanExporter) -> None:
    tracing.configure(plain_keys=True)
    key = f"order-{uuid.uuid4().hex}"
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert app.tasks["otel.charge"].apply_async((2,), idempotency_key=key).get(timeout=20) == 2
    (ran,) = spans(exporter, "RUN")
    assert ran.attributes["idempotency.key"] == key
