#!/usr/bin/env python
"""Plot the benchmarks' JSON output as PNGs for the documentation site (docs/img/).

Run from the repository root, on the JSON files the benchmark scripts write with ``--json``::

    python benchmarks/store_ops.py --json /tmp/store_ops.json
    python benchmarks/overhead.py --json /tmp/overhead.json
    python benchmarks/reconcile.py --quick --json /tmp/reconcile.json
    python benchmarks/plot.py --store-ops /tmp/store_ops.json --overhead /tmp/overhead.json \\
        --reconcile /tmp/reconcile.json

Every input is optional; each one given writes its figures:

- ``--store-ops``: ``store_ops_latency.png`` (median and p99 latency of each store transition);
- ``--overhead``: ``overhead_throughput.png`` (tasks/s per variant, with the per-round range),
  ``overhead_apply_async.png`` (apply_async latency of a new and of a duplicate call) and
  ``overhead_executions.png`` (executions in the duplicate-heavy workload);
- ``--reconcile``: ``reconcile_seconds.png`` (seconds per reconciler dry run against the number of
  records in the store).

Each figure says in its footer which run it shows (date, machine, options), taken from the JSON's
``meta``. Needs matplotlib (not a dependency of celery-idem: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
from _common import STORE_KINDS, read_json

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

ROOT = Path(__file__).resolve().parent.parent
COLORS = {"median": "#3f51b5", "p99": "#9fa8da", "new": "#3f51b5", "duplicate": "#ef6c00"}


def footer(fig: Any, meta: dict[str, Any], extra: str = "") -> None:
    load_start = (meta.get("load_average_at_start") or [None])[0]
    parts = [
        f"run {meta.get('date', '?')}",
        f"{meta.get('cpu_count', '?')} cores",
        f"Python {meta.get('python', '?')}",
    ]
    if load_start is not None:
        parts.append(f"load {load_start:.2f} at start")
    if extra:
        parts.append(extra)
    fig.tight_layout(rect=(0, 0.04, 1, 1))  # room at the bottom for this line
    fig.text(0.01, 0.005, "; ".join(parts), fontsize=7, color="#666666", ha="left", va="bottom")


def save(fig: Any, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.savefig(path, dpi=130, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


# ---- store_ops.py --------------------------------------------------------------------------------


def plot_store_ops(data: dict[str, Any], out: Path) -> list[Path]:
    timings = [t for store in data.get("stores", []) if not store.get("skipped") for t in store.get("timings", [])]
    if not timings:
        print("store_ops: no timings in the JSON (every store skipped?)", file=sys.stderr)
        return []
    # Stores in a fixed order; operations in the order the script measured them.
    timings.sort(key=lambda t: STORE_KINDS.index(t["store"]) if t["store"] in STORE_KINDS else len(STORE_KINDS))
    labels = [f"{t['store']}: {t['op']}" for t in timings]
    medians = [t["median_us"] for t in timings]
    p99s = [t["p99_us"] for t in timings]

    fig, ax = plt.subplots(figsize=(8, 0.42 * len(timings) + 1.4))
    rows = range(len(timings))
    ax.barh([r + 0.2 for r in rows], p99s, height=0.4, color=COLORS["p99"], label="p99")
    ax.barh([r - 0.2 for r in rows], medians, height=0.4, color=COLORS["median"], label="median")
    for r, value in zip(rows, medians, strict=True):
        ax.text(
            value * 1.08, r - 0.2, f"{value:,.0f} µs" if value >= 10 else f"{value:.1f} µs", va="center", fontsize=7
        )
    ax.set_yticks(list(rows), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(left=1)
    ax.set_xlabel("latency per operation, µs (log scale)")
    ax.set_title("One store transition: latency by store (one client, one thread)")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.25)
    meta = data.get("meta", {})
    footer(fig, meta, f"store_ops.py --ops {meta.get('ops', '?')}")
    return [save(fig, out, "store_ops_latency.png")]


# ---- overhead.py ---------------------------------------------------------------------------------


def _short(label: str) -> str:
    return label.replace("`", "")


def plot_overhead(data: dict[str, Any], out: Path) -> list[Path]:
    variants = data.get("variants", [])
    if not variants:
        print("overhead: no variants in the JSON", file=sys.stderr)
        return []
    meta = data.get("meta", {})
    options = meta.get("options", {})
    labels = [_short(v["label"]) for v in variants]
    rows = list(range(len(variants)))
    written = []

    # Throughput, with the range of the interleaved rounds.
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(variants) + 1.4))
    rates = [v["tasks_per_s"] for v in variants]
    lows = [v["tasks_per_s"] - min(v["round_tasks_per_s"] or [v["tasks_per_s"]]) for v in variants]
    highs = [max(v["round_tasks_per_s"] or [v["tasks_per_s"]]) - v["tasks_per_s"] for v in variants]
    ax.barh(rows, rates, xerr=[lows, highs], color=COLORS["median"], ecolor="#555555", capsize=3)
    for r, value in zip(rows, rates, strict=True):
        ax.text(value * 0.02, r, f"{value:,.0f}", va="center", color="white", fontsize=8, fontweight="bold")
    ax.set_yticks(rows, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("no-op tasks per second, end to end\n(bar: the whole run; whiskers: its slowest and fastest round)")
    ax.set_title("Throughput: one prefork worker (-c 2), Redis broker and result backend")
    ax.grid(axis="x", alpha=0.25)
    footer(fig, meta, f"overhead.py --tasks {options.get('tasks', '?')} --rounds {options.get('rounds', '?')}")
    written.append(save(fig, out, "overhead_throughput.png"))

    # apply_async latency, new call and duplicate call.
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(variants) + 1.4))
    for offset, kind in ((-0.2, "new"), (0.2, "duplicate")):
        medians = [(v.get(kind) or {}).get("median_us", 0) for v in variants]
        p99s = [(v.get(kind) or {}).get("p99_us", 0) for v in variants]
        ax.barh([r + offset for r in rows], medians, height=0.38, color=COLORS[kind], label=f"{kind} call, median")
        ax.scatter(p99s, [r + offset for r in rows], marker="|", s=120, color=COLORS[kind], label=f"{kind} call, p99")
    ax.set_yticks(rows, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("apply_async latency, µs")
    ax.set_title("apply_async: a new call and a duplicate of a call still in flight")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.25)
    footer(fig, meta, f"overhead.py --latency-calls {options.get('latency_calls', '?')}")
    written.append(save(fig, out, "overhead_apply_async.png"))

    # Executions in the duplicate-heavy workload.
    with_counts = [v for v in variants if v.get("executions") is not None]
    if with_counts:
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(with_counts) + 1.4))
        count_rows = list(range(len(with_counts)))
        executions = [v["executions"] for v in with_counts]
        ax.barh(count_rows, executions, color=COLORS["duplicate"])
        for r, value in zip(count_rows, executions, strict=True):
            ax.text(value + max(executions) * 0.01, r, f"{value:,}", va="center", fontsize=8)
        sets = options.get("dup_sets")
        if sets:
            ax.axvline(sets, color="#2e7d32", linestyle="--", linewidth=1)
            ax.text(
                sets, len(with_counts) - 0.45, f" {sets}: once per argument set", color="#2e7d32", fontsize=7, va="top"
            )
        ax.set_yticks(count_rows, [_short(v["label"]) for v in with_counts], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("times the task body ran")
        ax.set_title(
            f"Duplicate-heavy workload: {options.get('dup_calls', '?')} calls over {sets or '?'} argument sets, "
            f"{options.get('dup_threads', '?')} threads"
        )
        ax.grid(axis="x", alpha=0.25)
        footer(fig, meta)
        written.append(save(fig, out, "overhead_executions.png"))
    return written


# ---- reconcile.py --------------------------------------------------------------------------------


def plot_reconcile(data: dict[str, Any], out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    for store in data.get("stores", []):
        if store.get("skipped"):
            continue
        stale_counts = Counter(run.get("stale") for run in store.get("runs", []) if run.get("dry_run"))
        if not stale_counts:
            continue
        stale = stale_counts.most_common(1)[0][0]  # the main series: the same number of stale records
        runs = sorted(
            (
                run
                for run in store.get("runs", [])
                if run.get("dry_run") and run.get("stale") == stale and run["seconds"]
            ),
            key=lambda run: run["total"],
        )
        if not runs:
            continue
        totals = [run["total"] for run in runs]
        line = ax.plot(
            totals,
            [statistics.median(run["seconds"]) * 1000 for run in runs],
            marker="o",
            label=f"{store['store']}: whole run ({stale:,} stale)",
        )
        if all(run.get("scan_seconds") for run in runs):
            ax.plot(
                totals,
                [statistics.median(run["scan_seconds"]) * 1000 for run in runs],
                marker="s",
                linestyle="--",
                color=line[0].get_color(),
                label=f"{store['store']}: the lease-index scan alone",
            )
        plotted = True
    if not plotted:
        plt.close(fig)
        print("reconcile: no dry runs in the JSON", file=sys.stderr)
        return []
    ax.set_xscale("log")
    ax.set_xlabel("records in the store (log scale)")
    ax.set_ylabel("median dry run, ms")
    ax.set_ylim(bottom=0)
    ax.set_title("Reconciler run against store size (the stale count fixed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.25, which="both")
    meta = data.get("meta", {})
    wait = meta.get("inspect_timeout_seconds")
    extra = f"; the whole run includes the wait for workers' answers ({wait:g} s)" if wait is not None else ""
    footer(fig, meta, f"reconcile.py, {meta.get('repeats', '?')} dry runs per point{extra}")
    return [save(fig, out, "reconcile_seconds.png")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store-ops", type=Path, help="JSON of benchmarks/store_ops.py --json")
    parser.add_argument("--overhead", type=Path, help="JSON of benchmarks/overhead.py --json")
    parser.add_argument("--reconcile", type=Path, help="JSON of benchmarks/reconcile.py --json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="output directory (docs/img)")
    args = parser.parse_args(argv)
    if not (args.store_ops or args.overhead or args.reconcile):
        parser.error("give at least one of --store-ops, --overhead, --reconcile")
    written: list[Path] = []
    if args.store_ops:
        written += plot_store_ops(read_json(args.store_ops), args.out)
    if args.overhead:
        written += plot_overhead(read_json(args.overhead), args.out)
    if args.reconcile:
        written += plot_reconcile(read_json(args.reconcile), args.out)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
