#!/usr/bin/env python
"""Micro-benchmark of the store transitions: claim (new), claim (duplicate), acquire+complete.

Run from the repository root::

    python benchmarks/store_ops.py [--stores memory,sqlite,redis,postgresql] [--ops N] [--json out.json]

For every store it times each operation one call at a time (``time.perf_counter_ns`` around each
call, after an untimed warm-up) and reports ops/s, median and p99 latency. A separate, untimed
accounting pass counts what each transition costs on the wire (``_common.account``, the code
tests/test_round_trips.py holds the counts with):

- Redis: request/response exchanges on the store's connection (redis-py instrumented on the
  client side), cross-checked against ``INFO commandstats`` deltas on the server, which also show
  the commands the Lua scripts run inside the server.
- PostgreSQL: protocol round trips from a libpq trace (one per ``ReadyForQuery``), the SQL
  statements SQLAlchemy executes (``before_cursor_execute``), and, as a server-side cross-check,
  the ``xact_commit`` delta of ``pg_stat_database``.
- SQLite: the statements SQLAlchemy executes, and every statement sqlite3 runs (including the
  ones it issues itself). There is no server, so no round trips.

For Redis it also times a plain ``SET key value NX PX`` from the same client as the baseline a
claim is compared to. Everything the run writes lives under one fresh key prefix and is deleted
at the end. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sqlite3
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from _common import (
    REDIS_URL,
    STORE_KINDS,
    Latency,
    Machine,
    Tally,
    Timed,
    Transitions,
    account,
    choice_list,
    log,
    remove_prefix,
    run_all,
    slice_of,
    store_url,
    time_each,
    wire_for,
    write_json,
)

from celery_idem.stores import Store, store_from_url

SETNX_PX = 3_600_000
SETNX_RATIO_TARGET = 0.5
COMPARE_CHUNKS = 10

OP_CLAIM_NEW = "claim (new)"
OP_CLAIM_DUP = "claim (duplicate)"
OP_ACQ_COMPLETE = "acquire+complete"
OP_SETNX = "SET NX PX (baseline)"
# The accounted transitions each timed op is made of.
PARTS = {
    OP_CLAIM_NEW: ["claim (new)"],
    OP_CLAIM_DUP: ["claim (duplicate)"],
    OP_ACQ_COMPLETE: ["acquire", "complete"],
    OP_SETNX: ["SET NX PX"],
}


# ---- timing ---------------------------------------------------------------------------------------


@dataclass
class Timing(Latency):
    store: str
    op: str
    seconds: float
    ops_per_s: float
    client_cpu_us_per_op: float  # this process's CPU time (the benchmark's client side), per op
    round_trips_per_op: float | None = None

    @classmethod
    def measured(cls, store: str, op: str, timed: Timed) -> Timing:
        n = len(timed.latencies_ns)
        return cls(
            **asdict(Latency.of(timed.latencies_ns)),
            store=store,
            op=op,
            seconds=timed.wall_ns / 1e9,
            ops_per_s=n / (timed.wall_ns / 1e9),
            client_cpu_us_per_op=timed.cpu_ns / n / 1000,
        )


def run_timed(kind: str, plans: list[tuple[str, Callable[[int], bool]]], n: int, *, chunks: int = 1) -> list[Timing]:
    """Call each plan's ``op(i)`` for i in range(n), timing each call; ``op`` says whether it decided as expected.

    With several plans the calls run interleaved in ``chunks`` slices (A B, then B A, ...), so a
    change in machine load during the run weighs on each plan alike. ops/s is n over the summed
    wall time of a plan's slices (so it includes the loop's own overhead).
    """
    timed = {name: Timed() for name, _ in plans}
    for chunk in range(chunks):
        for name, op in plans if chunk % 2 == 0 else plans[::-1]:
            part = time_each(op, slice_of(n, chunks, chunk))
            wrong = part.results.count(False)
            if wrong:
                raise AssertionError(f"{kind} {name}: {wrong} operations did not decide as expected")
            timed[name].add(part)
    return [Timing.measured(kind, name, timed[name]) for name, _ in plans]


def setnx_op(store: Store, tag: str, n: int) -> Callable[[int], bool]:
    client = store.client  # type: ignore[attr-defined]
    # Same hash-tag-and-prefix shape as the store's keys, so the cleanup scan finds them.
    keys = [f"{{{store.key_prefix}:setnx}}:{tag}{i}" for i in range(n)]
    value = uuid.uuid4().hex  # about what a claim stores as its owner token

    def op(i: int) -> bool:
        return bool(client.set(keys[i], value, nx=True, px=SETNX_PX))

    return op


# ---- accounting: what one transition costs on the wire --------------------------------------------


@dataclass
class Accounting:
    store: str
    transition: str
    ops: int
    per_op: dict[str, Any]  # Tally.per_op: round trips, commands (statements), what the driver sent
    server: dict[str, Any] = field(default_factory=dict)  # the server's own count (Tally.server), whole batch

    @property
    def round_trips_per_op(self) -> float | None:
        return self.per_op["round_trips"]


class PgCommits:
    """Server-side cross-check around another counter: ``xact_commit`` of the database, read from
    a separate connection before and after.

    Backends publish their counters lazily (PostgreSQL 15: at most once a second, and only when
    they have table statistics pending), so each read first makes the store's backend and the
    reader's own one flush: ``pg_stat_force_next_flush()`` plus a scan, which gives them pending
    table statistics. Between two reads the delta holds the batch, plus the store's flush
    transaction and two of the reader's (``EXTRA``), plus whatever other sessions committed.
    """

    EXTRA = 3
    FLUSH = "SELECT pg_stat_force_next_flush(), (SELECT count(*) FROM pg_catalog.pg_database)"

    def __init__(self, store: Store, inner: Any) -> None:
        import psycopg

        self.store, self.inner = store, inner
        url = store.engine.url.set(drivername="postgresql")  # type: ignore[attr-defined]
        self.reader = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)

    def read(self) -> int:
        import sqlalchemy as sa

        with self.store.engine.begin() as connection:  # type: ignore[attr-defined]
            connection.execute(sa.text(self.FLUSH))
        self.reader.execute(self.FLUSH)
        row = self.reader.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        return int(row[0])

    @contextlib.contextmanager
    def counting(self) -> Iterator[Tally]:
        before = self.read()
        with self.inner.counting() as tally:
            yield tally
        # In autocommit mode every statement is its own transaction: one commit per round trip.
        delta, commits = self.read() - before - self.EXTRA, tally.round_trips or 0
        # xact_commit is database-wide: another session's commits land in it too. A difference
        # of one in a batch turns up now and then even on an idle server, so it is tolerated.
        tally.server = {"xact_commit": delta, "matches_client": abs(delta - commits) <= 1}

    def close(self) -> None:
        self.reader.close()


def _account(kind: str, store: Store, report: StoreReport, n: int) -> None:
    reader = None
    if kind == "redis":
        import redis

        reader = redis.Redis.from_url(REDIS_URL)
        reader.ping()  # connect (and run redis-py's handshake) before the first reading
    wire: Any = wire_for(store, reader)
    if kind == "postgresql":
        wire = PgCommits(store, wire)
    try:
        tallies = account(store, n, "r", wire)
        if kind == "redis":
            with wire.counting() as tallies["SET NX PX"]:
                run_all(n, setnx_op(store, "rs", n), "redis SET NX PX")
    finally:
        if reader is not None:
            reader.close()
        if kind == "postgresql":
            wire.close()
    for transition, tally in tallies.items():
        if tally.server and not tally.server["matches_client"]:
            log(f"  warning: {kind} {transition}: the server counted other calls than this client sent: {tally.server}")
        report.accounting.append(Accounting(kind, transition, n, tally.per_op(n), tally.server))
    per_transition = {a.transition: a.round_trips_per_op for a in report.accounting}
    for timing in report.timings:
        trips = [per_transition[part] for part in PARTS[timing.op]]
        if all(t is not None for t in trips):
            timing.round_trips_per_op = sum(t for t in trips if t is not None)


# ---- one store ------------------------------------------------------------------------------------


@dataclass
class StoreReport:
    store: str
    url: str
    server_version: str | None = None
    timings: list[Timing] = field(default_factory=list)
    accounting: list[Accounting] = field(default_factory=list)
    cleaned_up: int = 0
    skipped: str | None = None


def server_version(kind: str, store: Store) -> str | None:
    if kind == "redis":
        return str(store.client.info("server")["redis_version"])  # type: ignore[attr-defined]
    if kind == "postgresql":
        import sqlalchemy as sa

        with store.engine.connect() as connection:  # type: ignore[attr-defined]
            return str(connection.execute(sa.text("SHOW server_version")).scalar_one())
    if kind == "sqlite":
        return sqlite3.sqlite_version
    return None


def bench_store(kind: str, prefix: str, ops: int, warmup: int, accounting_ops: int, workdir: str) -> StoreReport:
    url = store_url(kind, workdir)
    report = StoreReport(kind, url)
    try:
        store = store_from_url(url, key_prefix=prefix, timeout_seconds=2.0)
    except Exception as exc:  # noqa: BLE001 - report any reason the store cannot be built
        report.skipped = f"cannot build the store from {url}: {exc}"
        return report
    try:
        store.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means the server is not usable
        report.skipped = f"not reachable at {url}: {exc}"
        store.close()
        return report
    try:
        report.server_version = server_version(kind, store)
        log(f"{kind}: {url} (version {report.server_version}), {ops} ops per measurement, prefix {prefix}")
        _measure(kind, store, report, ops, warmup)
        if kind != "memory":
            _account(kind, store, report, accounting_ops)
    finally:
        report.cleaned_up = remove_prefix(store)
        log(f"  cleanup: removed {report.cleaned_up} {'keys' if kind == 'redis' else 'records'}")
        store.close()
    return report


def _measure(kind: str, store: Store, report: StoreReport, ops: int, warmup: int) -> None:
    # Warm-up: connections, script cache, prepared statements, table creation; not timed.
    warm, warm_acquired = Transitions(store, "wn", warmup), Transitions(store, "wa", warmup)
    run_all(warmup, warm.claim_new, "warm-up claim")
    run_all(warmup, warm.claim_duplicate, "warm-up duplicate claim")
    run_all(warmup, warm_acquired.acquire_complete, "warm-up acquire+complete")
    if kind == "redis":
        run_all(warmup, setnx_op(store, "w", warmup), "warm-up SET NX")

    claimed = Transitions(store, "n", ops)
    plans = [(OP_CLAIM_NEW, claimed.claim_new)]
    if kind == "redis":
        # Interleaved with the claims, so both see the same machine load.
        plans.append((OP_SETNX, setnx_op(store, "s", ops)))
    timed = run_timed(kind, plans, ops, chunks=COMPARE_CHUNKS if len(plans) > 1 else 1)
    timed += run_timed(kind, [(OP_CLAIM_DUP, claimed.claim_duplicate)], ops)
    timed += run_timed(kind, [(OP_ACQ_COMPLETE, Transitions(store, "a", ops).acquire_complete)], ops)
    for timing in timed:
        log(f"  {timing.op}: {timing.ops_per_s:,.0f} ops/s, median {timing.median_us:.1f} µs")
    report.timings.extend(timed)


# ---- output ---------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _counts(counts: dict[str, float]) -> str:
    return ", ".join(f"{name} {count:g}" for name, count in counts.items())


def main_table(reports: list[StoreReport]) -> str:
    lines = [
        "| store | op | ops/s | median µs | p99 µs | round trips/op |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for report in reports:
        for t in report.timings:
            if t.round_trips_per_op is not None:
                trips = _num(t.round_trips_per_op, 2)
            else:
                trips = "n/a (in-process)" if report.store == "sqlite" else "–"
            lines.append(
                f"| {t.store} | {t.op} | {t.ops_per_s:,.0f} | {_num(t.median_us)} | {_num(t.p99_us)} | {trips} |"
            )
    return "\n".join(lines)


def accounting_table(reports: list[StoreReport]) -> str:
    lines = [
        "| store | transition | round trips/op | SQLAlchemy statements/op | what the client sends per op "
        "| server side per op |",
        "|---|---|---:|---:|---|---|",
    ]
    for report in reports:
        for a in report.accounting:
            per_op, server, n = a.per_op, a.server, a.ops
            statements = "–"
            if report.store == "redis":
                sent = _counts(per_op["commands"])
                side = (
                    f"{server['top_level'] / n:g} top-level + {server['inside_lua'] / n:g} inside Lua "
                    f"= {server['total'] / n:g} in commandstats; {server['usec'] / n:.1f} µs of server time"
                )
                if not server["matches_client"]:
                    side += " (other clients active: inflated)"
            else:
                statements = _num(sum(per_op["commands"].values()), 2)
                driver = per_op["driver"]
                if report.store == "postgresql":
                    sent = ", ".join(f"{name} {driver.get(name, 0):g}" for name in ("Parse", "Bind", "Sync"))
                    queries = {name: count for name, count in driver.items() if name.startswith("Query ")}
                    sent += f"; {_counts(queries)}" if queries else ""
                    side = f"{server['xact_commit'] / n:.2f} committed transactions (xact_commit)"
                    if not server["matches_client"]:
                        side += " (other sessions committed too)"
                else:
                    sent, side = f"{_counts(driver)} (sqlite3 trace; in-process)", "–"
            lines.append(
                f"| {a.store} | {a.transition} | {_num(a.round_trips_per_op, 2)} | {statements} | {sent} | {side} |"
            )
    return "\n".join(lines)


def setnx_line(reports: list[StoreReport]) -> tuple[str, float | None]:
    for report in reports:
        by_op = {t.op: t for t in report.timings}
        if report.store == "redis" and OP_SETNX in by_op:
            claim, setnx = by_op[OP_CLAIM_NEW], by_op[OP_SETNX]
            ratio = claim.ops_per_s / setnx.ops_per_s
            verdict = "meets" if ratio >= SETNX_RATIO_TARGET else "MISSES"
            line = (
                f"Redis baseline SET NX PX: {setnx.ops_per_s:,.0f} ops/s (median {setnx.median_us:.1f} µs, "
                f"p99 {setnx.p99_us:.1f} µs); claim (new) / SET NX = {ratio:.2f} "
                f"({verdict} the target of >= {SETNX_RATIO_TARGET}: claim within 2x of SET NX)"
            )
            return line, ratio
    return "Redis baseline SET NX PX: not measured (redis skipped or not selected)", None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stores",
        type=choice_list(STORE_KINDS),
        default=list(STORE_KINDS),
        help=f"comma-separated subset of {','.join(STORE_KINDS)} (default: all)",
    )
    parser.add_argument("--ops", type=int, default=3000, help="operations per measurement (default 3000)")
    parser.add_argument(
        "--memory-factor",
        type=int,
        default=5,
        help="the memory store runs this many times --ops per measurement (default 5)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed operations before each measurement (default ops/10, <= 300)"
    )
    parser.add_argument(
        "--accounting-ops",
        type=int,
        default=None,
        help="operations per round-trip accounting batch (default min(ops, 500))",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.ops < 1 or args.memory_factor < 1:
        parser.error("--ops and --memory-factor must be at least 1")
    if args.warmup is None:
        args.warmup = max(1, min(300, args.ops // 10))
    if args.accounting_ops is None:
        args.accounting_ops = min(args.ops, 500)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prefix = f"bench{uuid.uuid4().hex[:12]}"
    workdir = tempfile.mkdtemp(prefix="celery-idem-bench-")
    reports: list[StoreReport] = []
    machine = Machine()
    try:
        for kind in args.stores:
            factor = args.memory_factor if kind == "memory" else 1
            report = bench_store(kind, prefix, args.ops * factor, args.warmup * factor, args.accounting_ops, workdir)
            if report.skipped:
                log(f"skipping {kind}: {report.skipped}")
            reports.append(report)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine.finish()

    ran = [r for r in reports if not r.skipped]
    print(main_table(ran))
    print()
    line, ratio = setnx_line(ran)
    print(line)
    if any(r.accounting for r in ran):
        print()
        print(f"Round trips per transition (untimed accounting batches of {args.accounting_ops} operations):")
        print()
        print(accounting_table(ran))
    for report in reports:
        if report.skipped:
            print(f"\nSkipped {report.store}: {report.skipped}")
    print(f"\n{machine.summary()} (other processes compete for the cores)")

    if args.json:
        options = {k: getattr(args, k) for k in ("ops", "memory_factor", "warmup", "accounting_ops")}
        payload = {
            "meta": machine.meta(**options, key_prefix=prefix),
            "stores": [asdict(r) for r in reports],
            "setnx_ratio": ratio,
            "setnx_ratio_target": SETNX_RATIO_TARGET,
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
