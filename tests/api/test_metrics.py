"""The counters as Prometheus metrics (the ``prometheus`` extra), after real calls on eager apps.

Each test builds its own apps and its own ``CollectorRegistry``; what a scrape would read is taken from
``generate_latest`` and compared with ``Idempotency.metrics()`` and with the calls the test made.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL
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
    prefix, broker = f"prom{uuid.uuid4().hex[:8]}", REDIS_BROKER_URL
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


def test_every_counter_is_exposed_at_zero_before_it_first_moves() -> None:
    # A series born with its first increment has no earlier sample: rate() and increase() never see
    # that increment, so the first lost lock of a process would not show on a dashboard or fire an alert.
    from celery_idem.metrics import PrometheusSink

    registry = CollectorRegistry()
    PrometheusSink(registry)
    samples = {
        sample.labels["event"]: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == "celery_idem_events_total"
    }
    assert samples == dict.fromkeys(PROMISED, 0.0)


# ---- the Grafana dashboard (docs/dashboards/celery-idem.json) reads what a scrape exposes -------------

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docs" / "dashboards" / "celery-idem.json"
# The selectors of a PromQL expression: a metric name, then its {label matchers}.
SELECTOR = re.compile(r"\b([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def dashboard_panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query, with Grafana's variables as a query would see them
    ($task matching every task, the intervals a duration)."""
    exprs = [(panel["title"], target["expr"]) for panel in dashboard_panels() for target in panel["targets"]]
    return [
        (title, expr.replace("$task", ".*").replace("$__rate_interval", "1m").replace("$__range", "1h"))
        for title, expr in exprs
    ]


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """[(metric name, [(label, operator, value)])] of every selector in ``expr``."""
    found = []
    for name, body in SELECTOR.findall(expr):
        matchers = MATCHER.findall(body)
        assert "".join(m[0] for m in MATCHER.finditer(body)).strip() == body.strip(), f"unparsed matchers in {expr}"
        found.append((name, [(label, op, value) for label, op, value in matchers]))
    found += [(name, []) for name in re.findall(r"\bcelery_idem_\w+", SELECTOR.sub("", expr))]
    return found


def dashboard_scrape() -> dict[str, list[dict[str, str]]]:
    """{sample name: [labels of each sample]} as a scrape reads the extension's own metric types
    after real traffic that makes every decision, store outcome and event the dashboard matches on."""
    from celery import states
    from redis_servers import free_port

    from celery_idem import LockLostError, StoreUnavailableError, telemetry
    from celery_idem.metrics import PrometheusSink
    from celery_idem.records import Identity
    from celery_idem.stores import MemoryStore

    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    telemetry.add_sink(sink)
    try:
        # Given the calls of a shop at publish: NEW, REPLAY, MISMATCH, DUPLICATE (and RUN on the "worker")
        app, idem = shop("dashboard-shop")
        traffic(app)
        started, finish = threading.Event(), threading.Event()

        @app.task(base=IdempotentTask, shared=False, name="m.hold", idempotency={"busy_wait_seconds": 5})
        def hold(n: int) -> int:
            started.set()
            finish.wait(5)
            return n

        @app.task(base=IdempotentTask, bind=True, shared=False, name="m.forgotten")
        def forgotten(self: Any) -> None:
            idem.forget("m.forgotten", self.request.idempotency_key)  # an operator's forget, mid-run

        # a message of an identity that is running (BUSY, then REPLAY once it is done); a message after
        # that (REPLAY on the worker side); a write refused because the record was forgotten (lost_locks)
        first = threading.Thread(target=hold.apply_async, args=((1,),), kwargs={"idempotency_key": "h"})
        first.start()
        assert started.wait(5)
        copy = threading.Thread(target=hold.apply, args=((1,),), kwargs={"headers": {"idempotency_key": "h"}})
        copy.start()
        threading.Timer(0.3, finish.set).start()
        first.join(10)
        copy.join(10)
        assert hold.apply((1,), headers={"idempotency_key": "h"}).get() == 1
        with pytest.raises(LockLostError):
            forgotten.apply_async(idempotency_key="f")
        # a store that does not answer (outage, store_errors)
        down = Celery("dashboard-down", set_as_current=False)
        down.conf.task_always_eager = True
        Idempotency(down, store=f"redis://127.0.0.1:{free_port()}/0", store_timeout_seconds=0.5)

        @down.task(base=IdempotentTask, shared=False, name="m.unreachable")
        def unreachable() -> None: ...

        with pytest.raises(StoreUnavailableError):
            unreachable.apply_async(idempotency_key="u")
        # and a reconciler run over three stale claims: one completed, one failed, one released
        now = [1_700_000_000.0]
        store = MemoryStore(clock=lambda: now[0])
        stale = Celery("dashboard-stale", set_as_current=False, broker="memory://", backend="cache+memory://")
        reconciling = Idempotency(stale, store=store, inspect_timeout_seconds=0.1, stale_grace_seconds=0)

        @stale.task(base=IdempotentTask, shared=False, name="m.stale", idempotency={"permanent": (KeyError,)})
        def settled_by_the_reconciler() -> None: ...

        for name, result, state in (
            ("done", "ok", states.SUCCESS),
            ("declined", KeyError("card"), states.FAILURE),
            ("flaky", ConnectionError("down"), states.FAILURE),
        ):
            store.claim(Identity("", "m.stale", name), "f" * 64, f"task-{name}", pending_seconds=10, ttl_seconds=60)
            stale.backend.store_result(f"task-{name}", result, state)
        now[0] += 60
        report = reconciling.reconcile()
        assert (report.completed, report.failed, report.released) == (1, 1, 1)
        text = generate_latest(registry).decode()
    finally:
        telemetry.remove_sink(sink)
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def matches(op: str, pattern: str, value: str) -> bool:
    if op in ("=", "!="):
        return (value == pattern) == (op == "=")
    return bool(re.fullmatch(pattern, value)) == (op == "=~")  # PromQL anchors its regexes


def test_the_dashboard_queries_only_metrics_labels_and_values_a_real_scrape_exposes() -> None:
    samples = dashboard_scrape()
    checked = set()
    for title, expr in dashboard_exprs():
        found = selectors(expr)
        assert found, f"{title}: no celery_idem metric in {expr}"
        for name, matchers in found:
            assert name in samples, f"{title}: {name} is not in a scrape; it has {sorted(samples)}"
            series = samples[name]
            for label, op, value in matchers:
                assert any(label in labels for labels in series), f"{title}: {name} has no label {label!r}"
                observed = {labels[label] for labels in series if label in labels}
                if op in ("=", "!="):
                    # a value compared with must be one the metric takes (a typo matches nothing)
                    assert value in observed, f"{title}: {name}{{{label}}} is never {value!r}; it is {observed}"
                elif value != ".*":
                    # every alternative of a regex is a series the panel should be able to show
                    for alternative in value.split("|"):
                        assert any(re.fullmatch(alternative, v) for v in observed), (
                            f"{title}: {name}{{{label}=~{alternative!r}}} matches none of {observed}"
                        )
                checked.add((name, label, value))
            assert any(all(matches(op, v, labels.get(label, "")) for label, op, v in matchers) for labels in series), (
                f"{title}: {name}{{...}} selects no series of a real scrape"
            )
            # what the panel groups by must be a label of what it reads (le: the histogram's buckets)
            for grouping in GROUPING.findall(expr):
                for label in filter(None, (part.strip() for part in grouping.split(","))):
                    assert any(label in labels for labels in series), f"{title}: {name} has no label {label!r}"
    assert len(checked) >= 10  # the parser read the matchers (not an empty pass)

    # The task variable lists the values of a label the decisions carry
    [variable] = [v for v in dashboard()["templating"]["list"] if v["name"] == "task"]
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"]).groups()  # type: ignore[union-attr]
    assert {labels[label] for labels in samples[metric]} >= {"m.charge", "m.hold"}


def test_every_decision_store_outcome_and_counter_the_code_reports_is_on_the_dashboard() -> None:
    # The other way round: a decision, an outcome or a counter the dashboard never shows is a blind spot.
    from celery_idem.records import Decision
    from celery_idem.runtime import COUNTERS

    matched = " ".join(expr for _, expr in dashboard_exprs())
    shown_by_grouping = {
        "decision": "sum by (decision)" in matched,
        "event": "sum by (event)" in matched,
        "outcome": "by (operation, outcome)" in matched,
    }
    assert all(shown_by_grouping.values()), shown_by_grouping
    events = set()
    for _, expr in dashboard_exprs():
        for _, matchers in selectors(expr):
            events |= {
                counter
                for label, op, value in matchers
                if label == "event"
                for counter in COUNTERS
                if matches(op, value, counter)
            }
    # claims/duplicates/replays/mismatches are the decisions panels, by task and side
    assert set(COUNTERS) - events == {"claims", "duplicates", "replays", "mismatches"}
    worker_side = {Decision.RUN, Decision.BUSY, Decision.REPLAY, Decision.MISMATCH}
    publish_side = {Decision.NEW, Decision.DUPLICATE, Decision.REPLAY, Decision.MISMATCH}
    descriptions = " ".join(panel["description"] for panel in dashboard_panels())
    for decision in worker_side | publish_side:
        assert decision.value in descriptions, f"no panel description says what {decision.value} means"


def test_the_dashboard_is_what_grafana_imports() -> None:
    board = dashboard()
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 39
    assert board["uid"] == "celery-idem" and board["title"] and board["time"]["from"].startswith("now-")
    # The data source is a variable (asked for at import, and what provisioning resolves), and every
    # query goes through it: no data source uid of one Grafana is baked in
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["task"]["type"] == "query" and variables["task"]["includeAll"] and variables["task"]["multi"]
    assert variables["task"]["allValue"] == ".*"
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    assert variables["task"]["datasource"] == source
    ids, cells = set(), set()
    for panel in board["panels"]:
        assert isinstance(panel["id"], int) and panel["id"] not in ids, f"panel ids must be unique: {panel['id']}"
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "bargauge", "stat"}, panel["type"]
        assert panel["datasource"] == source, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs) and all(target["datasource"] == source for target in panel["targets"])
        for target in panel["targets"]:
            assert "$task" in target["expr"] or "celery_idem_decisions_total" not in target["expr"], (
                f"{panel['title']}: a decisions query that ignores the task variable"
            )


def _anchors(page: Path) -> set[str]:
    """The ids MkDocs (toc, default slugify) gives the page's headings."""
    headings = re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.lower()).strip()) for heading in headings}


def test_every_panel_says_what_to_do_and_links_a_section_that_exists() -> None:
    for panel in dashboard_panels():
        description = panel.get("description", "")
        links = re.findall(r"(docs/[\w/-]+\.md)#([\w-]+)", description)
        assert "What to do" in description and links, f"{panel['title']}: no runbook link in its description"
        for page, anchor in links:
            assert anchor in _anchors(REPO / page), f"{panel['title']}: {page}#{anchor} is not a heading"


def test_a_copy_of_a_message_that_ends_quietly_is_no_replay_whichever_message_it_copies() -> None:
    # Given a completed call, and a duplicate of it carrying a link (each message run as a worker's pool
    # runs it: Celery's own Request), replayed once into its link
    from workers import execute_as_worker

    from celery_idem import MemoryStore

    app = Celery("metrics-copies", set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store=MemoryStore())

    @app.task(base=IdempotentTask, shared=False, name="metrics.charge")
    def charge(order: int) -> int:
        return order

    @app.task(shared=False, name="metrics.noted")
    def noted(value: int) -> None:
        return None

    app.finalize()
    original, duplicate = str(uuid.uuid4()), str(uuid.uuid4())
    execute_as_worker(app, charge.name, original, args=(1,), idempotency_key="k")
    link = [dict(noted.s())]
    execute_as_worker(app, charge.name, duplicate, args=(1,), idempotency_key="k", callbacks=link)
    replays = idem.metrics()["replays"]
    # When a copy of the original's message comes, then a copy of the duplicate's: both end quietly
    execute_as_worker(app, charge.name, original, args=(1,), idempotency_key="k")
    assert idem.metrics()["replays"] == replays  # the original's copy is no replay
    execute_as_worker(app, charge.name, duplicate, args=(1,), idempotency_key="k", callbacks=link)
    # Then neither is counted as a replay: nothing was replayed to anyone
    assert idem.metrics()["replays"] == replays, "a copy of the duplicate that ended quietly counted as a replay"
