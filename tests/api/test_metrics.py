"""The counters as Prometheus metrics (the ``prometheus`` extra), after real calls on eager apps.

Each test builds its own apps and its own ``CollectorRegistry``; what a scrape would read is taken from
``generate_latest`` and compared with ``Idempotency.metrics()`` and with the calls the test made.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celery_idem import ConfigurationError, Idempotency, IdempotentTask, PayloadMismatchError
from celery_idem.metrics import register_prometheus

# The counters DESIGN §6 promises at least.
PROMISED = {
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
}


def shop(name: str) -> tuple[Celery, Idempotency]:
    """An eager app (memory store) with ``m.charge`` and ``m.again``, a task that calls itself with its
    own arguments from its body: that inner call is a duplicate of the running one."""
    app = Celery(name, set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    idem = Idempotency(app)

    @app.task(base=IdempotentTask, bind=True, shared=False, name="m.charge")
    def charge(self: Any, order_id: int, amount: int) -> dict[str, int]:
        return {"order": order_id, "charged": amount}

    @app.task(base=IdempotentTask, bind=True, shared=False, name="m.again")
    def again(self: Any, order_id: int) -> dict[str, Any]:
        inner = again.delay(order_id)
        return {"own": self.request.id, "inner": inner.id, "deduplicated": inner.deduplicated}

    return app, idem


def traffic(app: Celery) -> None:
    """One NEW call, its replay, a mismatch on its key, and a duplicate (5 claims in all)."""
    charge, again = app.tasks["m.charge"], app.tasks["m.again"]
    key = f"order-{uuid.uuid4().hex}"
    first = charge.apply_async((1, 100), idempotency_key=key)  # NEW
    replayed = charge.apply_async((1, 100), idempotency_key=key)  # REPLAY
    assert replayed.deduplicated and replayed.id == first.id
    with pytest.raises(PayloadMismatchError):
        charge.apply_async((1, 999), idempotency_key=key)  # MISMATCH
    outer = again.delay(uuid.uuid4().int % 10**9).get()  # NEW, and from its body a DUPLICATE of itself
    assert outer["inner"] == outer["own"] and outer["deduplicated"] is True


def scraped(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """{(sample name, app label): value} as a Prometheus scrape of ``registry`` reads it."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels["app"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_counters_match_the_extension_after_real_calls() -> None:
    app, idem = shop("metrics-shop")
    registry = CollectorRegistry()
    register_prometheus(idem, registry)
    traffic(app)

    counters = idem.metrics()
    assert (counters["claims"], counters["replays"], counters["mismatches"], counters["duplicates"]) == (5, 1, 1, 1)
    assert set(counters) >= PROMISED
    text = generate_latest(registry).decode()
    assert 'celery_idem_claims_total{app="metrics-shop"} 5.0' in text
    assert "# TYPE celery_idem_claims_total counter" in text
    assert scraped(registry) == {
        (f"celery_idem_{name}_total", "metrics-shop"): float(n) for name, n in counters.items()
    }


def test_a_scrape_reads_the_counters_at_scrape_time() -> None:
    app, idem = shop("metrics-live")
    registry = CollectorRegistry()
    register_prometheus(idem, registry)
    assert scraped(registry)[("celery_idem_claims_total", "metrics-live")] == 0.0
    traffic(app)
    assert scraped(registry)[("celery_idem_claims_total", "metrics-live")] == 5.0


def test_two_apps_in_one_registry_are_told_apart_by_the_app_label() -> None:
    eu, eu_idem = shop("shop-eu")
    us, us_idem = shop("shop-us")
    registry = CollectorRegistry()
    register_prometheus(eu_idem, registry)
    register_prometheus(us_idem, registry)
    # Given traffic twice on one app and once on the other
    traffic(eu)
    traffic(eu)
    traffic(us)
    samples = scraped(registry)
    assert samples[("celery_idem_claims_total", "shop-eu")] == 10.0
    assert samples[("celery_idem_claims_total", "shop-us")] == 5.0
    for app_name, idem in (("shop-eu", eu_idem), ("shop-us", us_idem)):
        assert {name: value for (name, label), value in samples.items() if label == app_name} == {
            f"celery_idem_{name}_total": float(n) for name, n in idem.metrics().items()
        }


# Regression: each registration used to add a collector of the same families.
def test_two_apps_share_each_metric_family_in_the_default_kind_of_registry() -> None:
    _, eu_idem = shop("shop-eu")
    _, us_idem = shop("shop-us")
    # prometheus_client.REGISTRY is a CollectorRegistry(auto_describe=True): it refuses duplicated series.
    registry = CollectorRegistry(auto_describe=True)
    register_prometheus(eu_idem, registry)
    register_prometheus(us_idem, registry)
    text = generate_latest(registry).decode()
    # The exposition format allows one TYPE line per metric name, its samples grouped under it.
    assert text.count("# TYPE celery_idem_claims_total counter") == 1
    [claims] = [f for f in text_string_to_metric_families(text) if f.name == "celery_idem_claims"]
    assert {s.labels["app"] for s in claims.samples} == {"shop-eu", "shop-us"}


def test_register_prometheus_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _, idem = shop("metrics-no-extra")
    # A None entry in sys.modules makes `import prometheus_client` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'celery-idem\[prometheus\]'"):
        register_prometheus(idem, CollectorRegistry())


# ---- prometheus-client's own metric types: a prefork worker's children reach one scrape ------------


@pytest.mark.slow
def test_a_prefork_workers_children_reach_one_aggregated_scrape_with_no_code_beyond_the_extension(
    tmp_path: Any,
) -> None:
    from conftest import REDIS_URL, require_server, wipe
    from prometheus_client import multiprocess
    from shop import make_app
    from workers import BACKEND, Worker, wait_for

    from celery_idem import store_from_url

    require_server("redis")
    prefix, broker = f"prom{uuid.uuid4().hex[:8]}", "redis://127.0.0.1:6379/14"
    files = tmp_path / "prometheus"
    files.mkdir()
    worker = Worker(tmp_path, broker, REDIS_URL, prefix, concurrency=2, env={"PROMETHEUS_MULTIPROC_DIR": str(files)})
    try:
        app = make_app(broker=broker, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
        slow = app.tasks["shop.slow"]
        # Four calls that take a while (both children busy), then the same four sent by name: replayed
        handles = [slow.apply_async((0.5, f"t{n}"), idempotency_key=f"k{n}") for n in range(4)]
        assert [handle.get(timeout=30) for handle in handles] == ["slept 0.5"] * 4
        sent = [app.send_task("shop.slow", (0.5, f"t{n}"), idempotency_key=f"k{n}") for n in range(4)]
        assert [handle.get(timeout=30) for handle in sent] == ["slept 0.5"] * 4
        wait_for(lambda: len({path.name for path in files.glob("counter_*.db")}) >= 2, "two processes' files")
    finally:
        worker.stop()
        wipe(store_from_url(REDIS_URL, key_prefix=prefix))
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(files))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }

    def decisions(side: str, decision: str) -> float:
        labels = (("decision", decision), ("side", side), ("task", "shop.slow"))
        return samples.get(("celery_idem_decisions_total", labels), 0.0)

    # Summed over the pool's children (each wrote files of its own, by pid)
    assert (decisions("worker", "RUN"), decisions("worker", "REPLAY")) == (4.0, 4.0)
    pids = {path.stem.rsplit("_", 1)[1] for path in files.glob("counter_*.db")}
    assert len(pids) >= 2, pids
    acquires = [
        value
        for (name, labels), value in samples.items()
        if name.endswith("_count") and ("operation", "acquire") in labels
    ]
    assert sum(acquires) >= 8
    # and no label holds a key or a task id
    labels = {value for _, pairs in samples for _, value in pairs}
    assert not any(value.startswith("k") and value[1:].isdigit() for value in labels)
    assert not any(handle.id in labels for handle in handles)
