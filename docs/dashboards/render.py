"""Draw docs/img/dashboard.png: the dashboard's own queries, answered by a real Prometheus.

Not a Grafana screenshot (no Grafana here): this runs a prefork worker and a producer with
celery-idem's Prometheus metrics in multiprocess mode, an exporter over them, and Prometheus
scraping it every second; it makes traffic for about two minutes (repeated keys, a mismatch now
and then, copies of running messages, forgotten running keys, two pauses of the store, a
reconciler run), then asks Prometheus each panel's PromQL from celery-idem.json and draws the
answers with matplotlib, laid out by the panels' gridPos.

Needs redis-server and prometheus on PATH (Debian: apt-get install redis-server prometheus) and a
Redis for the broker (CELERY_IDEM_RENDER_BROKER, default redis://127.0.0.1:6379/7):

    python docs/dashboards/render.py  # writes docs/img/dashboard.png
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from celery_idem import Idempotency, IdempotentTask, StoreUnavailableError
from celery_idem.records import Identity

HERE = Path(__file__).resolve().parent
BOARD = HERE / "celery-idem.json"
IMAGE = HERE.parent / "img" / "dashboard.png"
BROKER = os.environ.get("CELERY_IDEM_RENDER_BROKER", "redis://127.0.0.1:6379/7")
SECONDS = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    # prometheus-client reads this when it is first imported (by Idempotency(app) below): set it
    # first. The worker inherits both; the store is a redis-server of our own, which main() pauses.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="celery-idem-dash-")
    os.environ["DASH_STORE"] = f"redis://127.0.0.1:{free_port()}/0"
    os.environ["DASH_QUEUE"] = f"dash-{uuid.uuid4().hex[:8]}"

app = Celery("dash", broker=BROKER, backend=BROKER)
app.conf.update(worker_hijack_root_logger=False, task_default_queue=os.environ.get("DASH_QUEUE", "dash"))
idem = Idempotency(
    app,
    store=os.environ.get("DASH_STORE", "memory://"),
    store_timeout_seconds=0.5,
    lease_seconds=3,
    stale_grace_seconds=0,
    inspect_timeout_seconds=0.5,
)


@app.task(base=IdempotentTask, name="dash.charge")
def charge(order_id: int, amount: int) -> int:
    time.sleep(random.uniform(0.02, 0.2))
    return amount


@app.task(base=IdempotentTask, name="dash.ship", idempotency={"busy_wait_seconds": 10})
def ship(order_id: int, seconds: float) -> int:
    time.sleep(seconds)
    return order_id


def wait_port(port: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def traffic(store_server: subprocess.Popen[bytes]) -> None:
    """About SECONDS of calls, with the events a dashboard is for."""
    started, orders, pause_at = time.monotonic(), 20, {45.0, 85.0}
    next_copy, next_forget, stale_ids = 5.0, 12.0, []
    rng = random.Random(19)
    while (elapsed := time.monotonic() - started) < SECONDS:
        orders += 1  # new orders arrive; clients retry the recent ones
        for _ in range(rng.randint(3, 8)):
            order = rng.randint(max(0, orders - 40), orders)
            amount = order * 10 + (1 if rng.random() < 0.02 else 0)  # now and then a reused key
            try:
                charge.apply_async((order, amount), idempotency_key=f"order-{order}")
            except StoreUnavailableError:
                pass  # fail closed: the caller sees it; the panel counts it
            except Exception as exc:  # PayloadMismatchError: the mismatch panel counts it
                if type(exc).__name__ != "PayloadMismatchError":
                    raise
        if elapsed >= next_copy:  # a message sent again while the first runs: BUSY, then REPLAY
            next_copy += rng.uniform(3, 6)
            key = f"ship-{uuid.uuid4().hex[:8]}"
            ship.apply_async((orders, 1.5), idempotency_key=key)
            time.sleep(0.3)
            app.send_task("dash.ship", (orders, 1.5), headers={"idempotency_key": key})
        if elapsed >= next_forget:  # an operator forgets a running key: its write is refused (lost lock)
            next_forget += rng.uniform(10, 20)
            key = f"ship-{uuid.uuid4().hex[:8]}"
            ship.apply_async((orders, 2.0), idempotency_key=key)
            time.sleep(0.8)
            idem.forget("dash.ship", key)
        if any(elapsed >= at for at in pause_at):  # the store stalls for 4 s: outages
            pause_at = {at for at in pause_at if elapsed < at}
            store_server.send_signal(signal.SIGSTOP)
            threading.Timer(4, store_server.send_signal, (signal.SIGCONT,)).start()
        if 95 <= elapsed and not stale_ids:  # claims whose messages were lost, some with a result
            for n in range(6):
                task_id = str(uuid.uuid4())
                identity = Identity("", "dash.charge", f"lost-{task_id}")
                idem.store.claim(identity, "f" * 64, task_id, pending_seconds=2, ttl_seconds=600)
                if n % 2:
                    app.backend.store_result(task_id, n, "SUCCESS")
                stale_ids.append(task_id)
        if 105 <= elapsed and len(stale_ids) == 6:
            stale_ids.append("reconciled")
            print("reconcile:", idem.reconcile(), flush=True)
        time.sleep(0.5)


def query(prometheus: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    params = {"query": expr, "start": str(start), "end": str(end), "step": "2"}
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{urllib.parse.urlencode(params)}") as answer:
        return json.load(answer)["data"]["result"]  # type: ignore[no-any-return]


def instant(prometheus: str, expr: str, at: float) -> list[dict[str, Any]]:
    params = {"query": expr, "time": str(at)}
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?{urllib.parse.urlencode(params)}") as answer:
        return json.load(answer)["data"]["result"]  # type: ignore[no-any-return]


def legend(template: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        template = template.replace("{{" + name + "}}", value)
    return template


def draw(prometheus: str, start: float, end: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    board = json.loads(BOARD.read_text())
    panels = board["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    figure = plt.figure(figsize=(16, rows * 0.34), dpi=80)
    figure.suptitle(
        "celery-idem.json: each panel's queries answered by Prometheus, drawn with matplotlib (not Grafana)",
        fontsize=12,
    )
    grid = figure.add_gridspec(rows, 24, hspace=0.0, wspace=0.6, top=0.95, bottom=0.02, left=0.04, right=0.99)
    span = f"{int(end - start)}s"
    for panel in panels:
        g = panel["gridPos"]
        if panel["type"] == "row":
            axes = figure.add_subplot(grid[g["y"], :])
            axes.axis("off")
            axes.text(0, 0.2, panel["title"], fontsize=12, fontweight="bold", transform=axes.transAxes)
            continue
        axes = figure.add_subplot(grid[g["y"] + 1 : g["y"] + g["h"] - 1, g["x"] : g["x"] + g["w"]])
        axes.set_title(panel["title"], fontsize=10, loc="left")
        axes.tick_params(labelsize=7)
        unit = panel["fieldConfig"]["defaults"].get("unit")
        for target in panel["targets"]:
            expr = target["expr"].replace("$task", ".*").replace("$__rate_interval", "10s").replace("$__range", span)
            if target.get("instant"):
                results = instant(prometheus, expr, end)
                names = [legend(target["legendFormat"], r["metric"]) for r in results]
                values = [float(r["value"][1]) for r in results]
                axes.barh(names, values, color="tab:blue")
                axes.set_xlim(0, max([*values, 1]) * 1.2)
                for y, value in enumerate(values):
                    axes.text(value, y, f" {value:g}", va="center", fontsize=8)
                continue
            for result in query(prometheus, expr, start, end):
                times = [float(t) - start for t, _ in result["values"]]
                values = [float(v) for _, v in result["values"]]
                axes.plot(times, values, linewidth=1.2, label=legend(target["legendFormat"], result["metric"]))
        if panel["type"] == "timeseries":
            axes.set_xlim(0, end - start)
            axes.set_xlabel("seconds", fontsize=7)
            if unit == "percentunit":
                axes.yaxis.set_major_formatter(PercentFormatter(1.0))
            elif unit == "s":
                axes.set_yscale("log")
                axes.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1000:g} ms"))
            else:
                axes.set_ylabel("per second", fontsize=7)
            if axes.lines:
                axes.legend(fontsize=7, loc="upper left", ncol=3, frameon=False)
            else:
                axes.text(0.5, 0.5, "No data", ha="center", transform=axes.transAxes, color="grey")
        axes.grid(alpha=0.3)
    IMAGE.parent.mkdir(exist_ok=True)
    figure.savefig(IMAGE)
    from PIL import Image  # matplotlib's own dependency: 256 colours keep the PNG small

    Image.open(IMAGE).convert("RGB").quantize(256).save(IMAGE, optimize=True)
    print(f"wrote {IMAGE} ({IMAGE.stat().st_size // 1024} KiB)")


def main() -> None:
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    work = Path(tempfile.mkdtemp(prefix="celery-idem-render-"))
    store = os.environ["DASH_STORE"]
    store_port = int(urllib.parse.urlsplit(store).port or 0)
    exporter_port, prometheus_port = free_port(), free_port()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        store_server = subprocess.Popen(
            ["redis-server", "--port", str(store_port), "--save", "", "--appendonly", "no", "--dir", str(work)],
            stdout=subprocess.DEVNULL,
        )
        processes.append(store_server)
        wait_port(store_port)
        queue, env = os.environ["DASH_QUEUE"], dict(os.environ)
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "--workdir", str(HERE), "-A", "render", "worker",
             "--pool", "prefork", "-c", "2", "-Q", queue, "-l", "WARNING", "-n", f"{queue}@%h"],
            env=env,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        processes.append(worker)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        start_http_server(exporter_port, addr="127.0.0.1", registry=registry)
        (work / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s}\n"
            "scrape_configs: [{job_name: celery_idem, static_configs: "
            f"[{{targets: ['127.0.0.1:{exporter_port}']}}]}}]\n"
        )
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        processes.append(prometheus)
        wait_port(prometheus_port)
        # This process is the producer (its own files in the same directory): make traffic
        start = time.time()
        traffic(store_server)
        time.sleep(3)  # the last scrapes
        draw(f"http://127.0.0.1:{prometheus_port}", start, time.time())
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


if __name__ == "__main__":
    main()
