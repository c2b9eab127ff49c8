#!/usr/bin/env python
"""Micro-benchmark of the store transitions: claim (new), claim (duplicate), acquire+complete.

Run from the repository root::

    python benchmarks/store_ops.py [--stores memory,sqlite,redis,postgresql] [--ops N] [--json out.json]

For every store it times each operation one call at a time (``time.perf_counter_ns`` around each
call, after an untimed warm-up) and reports ops/s, median and p99 latency. A separate, untimed
accounting pass counts what each transition costs on the wire:

- Redis: request/response exchanges on the store's connection (redis-py instrumented on the
  client side), cross-checked against ``INFO commandstats`` deltas on the server, which also show
  the commands the Lua scripts run inside the server.
- PostgreSQL: protocol round trips from a libpq trace (one per ``ReadyForQuery``), the SQL
  statements SQLAlchemy executes (``before_cursor_execute``), and, as a server-side cross-check,
  the ``xact_commit`` delta of ``pg_stat_database``.
- SQLite: the statements SQLAlchemy executes, and every statement sqlite3 runs (including the
  BEGIN/COMMIT it issues itself). There is no server, so no round trips.

For Redis it also times a plain ``SET key value NX PX`` from the same client as the baseline a
claim is compared to. Everything the run writes lives under one fresh key prefix and is deleted
at the end. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from celery_idem.records import Decision, Identity
from celery_idem.stores import Store, store_from_url

STORE_KINDS = ("memory", "sqlite", "redis", "postgresql")
REDIS_URL = os.environ.get("CELERY_IDEM_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get("CELERY_IDEM_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

TASK = "bench.task"
FINGERPRINT = hashlib.sha256(b"celery-idem benchmark arguments").hexdigest()
RESULT = b'{"ok":true}'
LEASE = 3600.0
TTL = 3600.0
SETNX_PX = 3_600_000
SETNX_RATIO_TARGET = 0.5
COMPARE_CHUNKS = 10

OP_CLAIM_NEW = "claim (new)"
OP_CLAIM_DUP = "claim (duplicate)"
OP_ACQ_COMPLETE = "acquire+complete"
OP_SETNX = "SET NX PX (baseline)"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- timing ---------------------------------------------------------------------------------------


@dataclass
class Timing:
    store: str
    op: str
    ops: int
    seconds: float
    ops_per_s: float
    median_us: float
    p99_us: float
    mean_us: float
    min_us: float
    max_us: float
    client_cpu_us_per_op: float  # this process's CPU time (the benchmark's client side), per op
    round_trips_per_op: float | None = None


def _percentile(ordered: list[int], fraction: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _time_range(op: Callable[[int], bool], lo: int, hi: int, latencies: list[int]) -> tuple[int, int, int]:
    """Time ``op(i)`` for i in [lo, hi) into ``latencies``; returns (wall ns, CPU ns, wrong decisions)."""
    wrong = 0
    clock = time.perf_counter_ns
    gc.collect()
    cpu = time.process_time_ns()
    start = clock()
    for i in range(lo, hi):
        t0 = clock()
        ok = op(i)
        latencies[i] = clock() - t0
        if not ok:
            wrong += 1
    wall = clock() - start
    return wall, time.process_time_ns() - cpu, wrong


def _timing(store_kind: str, op_name: str, latencies: list[int], wall: int, cpu: int) -> Timing:
    n = len(latencies)
    ordered = sorted(latencies)
    return Timing(
        store=store_kind,
        op=op_name,
        ops=n,
        seconds=wall / 1e9,
        ops_per_s=n / (wall / 1e9),
        median_us=statistics.median(ordered) / 1000,
        p99_us=_percentile(ordered, 0.99) / 1000,
        mean_us=statistics.fmean(ordered) / 1000,
        min_us=ordered[0] / 1000,
        max_us=ordered[-1] / 1000,
        client_cpu_us_per_op=cpu / n / 1000,
    )


def run_timed(
    store_kind: str, plans: list[tuple[str, Callable[[int], bool]]], n: int, *, chunks: int = 1
) -> list[Timing]:
    """Call each plan's ``op(i)`` for i in range(n), timing each call; ``op`` says whether it decided as expected.

    With several plans the calls run interleaved in ``chunks`` slices (A B, then B A, ...), so a
    change in machine load during the run weighs on each plan alike. ops/s is n over the summed
    wall time of a plan's slices (so it includes the loop's own overhead).
    """
    latencies = {name: [0] * n for name, _ in plans}
    walls, cpus = dict.fromkeys(latencies, 0), dict.fromkeys(latencies, 0)
    for chunk in range(chunks):
        lo, hi = n * chunk // chunks, n * (chunk + 1) // chunks
        for name, op in plans if chunk % 2 == 0 else plans[::-1]:
            wall, cpu, wrong = _time_range(op, lo, hi, latencies[name])
            if wrong:
                raise AssertionError(f"{store_kind} {name}: {wrong} operations did not decide as expected")
            walls[name] += wall
            cpus[name] += cpu
    return [_timing(store_kind, name, latencies[name], walls[name], cpus[name]) for name, _ in plans]


# ---- the operations -------------------------------------------------------------------------------


def identities(tag: str, n: int) -> list[Identity]:
    return [Identity("", TASK, f"{tag}{i}") for i in range(n)]


def claim_new_op(store: Store, ids: list[Identity], tag: str) -> Callable[[int], bool]:
    task_ids = [f"{tag}-task-{i}" for i in range(len(ids))]

    def op(i: int) -> bool:
        t = store.claim(ids[i], FINGERPRINT, task_ids[i], pending_seconds=LEASE, ttl_seconds=TTL)
        return t.decision is Decision.NEW

    return op


def claim_dup_op(store: Store, ids: list[Identity], tag: str) -> Callable[[int], bool]:
    # A second producer call with the same arguments: same fingerprint, its own task id.
    task_ids = [f"{tag}-dup-{i}" for i in range(len(ids))]

    def op(i: int) -> bool:
        t = store.claim(ids[i], FINGERPRINT, task_ids[i], pending_seconds=LEASE, ttl_seconds=TTL)
        return t.decision is Decision.DUPLICATE

    return op


def acquire_op(store: Store, ids: list[Identity], tag: str, owners: list[str]) -> Callable[[int], bool]:
    task_ids = [f"{tag}-task-{i}" for i in range(len(ids))]

    def op(i: int) -> bool:
        t = store.acquire(ids[i], FINGERPRINT, task_ids[i], lease_seconds=LEASE, ttl_seconds=TTL)
        if t.decision is not Decision.RUN or t.record is None:
            return False
        owners[i] = t.record.owner
        return True

    return op


def complete_op(store: Store, ids: list[Identity], owners: list[str]) -> Callable[[int], bool]:
    def op(i: int) -> bool:
        return store.complete(ids[i], owners[i], RESULT).decision is Decision.OK

    return op


def acquire_complete_op(store: Store, ids: list[Identity], tag: str) -> Callable[[int], bool]:
    task_ids = [f"{tag}-task-{i}" for i in range(len(ids))]

    def op(i: int) -> bool:
        identity = ids[i]
        t = store.acquire(identity, FINGERPRINT, task_ids[i], lease_seconds=LEASE, ttl_seconds=TTL)
        if t.decision is not Decision.RUN or t.record is None:
            return False
        return store.complete(identity, t.record.owner, RESULT).decision is Decision.OK

    return op


def setnx_op(store: Store, tag: str, n: int) -> Callable[[int], bool]:
    client = store.client  # type: ignore[attr-defined]
    # Same hash-tag-and-prefix shape as the store's keys, so the cleanup scan finds them.
    keys = [f"{{{store.key_prefix}:setnx}}:{tag}{i}" for i in range(n)]
    value = uuid.uuid4().hex  # about what a claim stores as its owner token

    def op(i: int) -> bool:
        return bool(client.set(keys[i], value, nx=True, px=SETNX_PX))

    return op


def run_untimed(n: int, op: Callable[[int], bool], what: str) -> None:
    wrong = sum(1 for i in range(n) if not op(i))
    if wrong:
        raise AssertionError(f"{what}: {wrong} of {n} operations did not decide as expected")


# ---- accounting: what one transition costs on the wire --------------------------------------------


@dataclass
class Accounting:
    store: str
    transition: str
    ops: int
    round_trips_per_op: float | None = None
    statements_per_op: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class RedisWire:
    """Counts, on the client side, what redis-py sends while ``active``.

    Every command redis-py sends outside a pipeline is one ``send_packed_command`` (one write)
    followed by one ``read_response`` (one reply): one request/response exchange, one round trip.
    """

    def __init__(self) -> None:
        self.active = False
        self.sends = 0
        self.replies = 0
        self.commands: Counter[str] = Counter()

    def reset(self) -> None:
        self.sends, self.replies, self.commands = 0, 0, Counter()

    @contextlib.contextmanager
    def installed(self) -> Iterator[RedisWire]:
        from redis.connection import AbstractConnection

        originals = {
            name: getattr(AbstractConnection, name) for name in ("send_command", "send_packed_command", "read_response")
        }
        wire = self

        def send_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if wire.active:
                name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
                wire.commands[name.lower()] += 1
            return originals["send_command"](conn, *args, **kwargs)

        def send_packed_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if wire.active:
                wire.sends += 1
            return originals["send_packed_command"](conn, *args, **kwargs)

        def read_response(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if wire.active:
                wire.replies += 1
            return originals["read_response"](conn, *args, **kwargs)

        AbstractConnection.send_command = send_command  # type: ignore[method-assign]
        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
        AbstractConnection.read_response = read_response  # type: ignore[method-assign]
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(AbstractConnection, name, original)


def _commandstats(reader: Any) -> tuple[Counter[str], Counter[str]]:
    """(calls, usec) per command, from ``INFO commandstats``."""
    stats = reader.info("commandstats")
    calls = Counter({name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()})
    usec = Counter({name.removeprefix("cmdstat_"): int(value["usec"]) for name, value in stats.items()})
    return calls, usec


def redis_accounting(
    store: Store, reader: Any, wire: RedisWire, transition: str, n: int, op: Callable[[int], bool]
) -> Accounting:
    """Run ``n`` operations of one kind between two ``INFO commandstats`` reads.

    ``reader`` is a separate client. Its INFO calls are not part of the batch: the first read's
    own INFO is counted by the server only after it has answered, so it shows up in the second
    read, and ``info`` is left out of the server totals for that reason (the batch sends none).
    """
    before, usec_before = _commandstats(reader)
    wire.reset()
    wire.active = True
    try:
        run_untimed(n, op, f"redis {transition}")
    finally:
        wire.active = False
    after, usec_after = _commandstats(reader)
    delta = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    delta.pop("info", None)
    sent = dict(wire.commands)
    server_total = sum(delta.values())
    # The batch's top-level commands are the ones the client sent; the rest ran inside its Lua scripts.
    server_top = sum(delta.get(name, 0) for name in sent)
    consistent = all(delta.get(name, 0) == count for name, count in sent.items())
    # A script's usec include the commands it ran, so the top-level commands' usec are the server's time.
    server_usec = sum(usec_after[name] - usec_before.get(name, 0) for name in sent)
    detail: dict[str, Any] = {
        "client_requests_per_op": wire.sends / n,
        "client_replies_per_op": wire.replies / n,
        "client_commands": {name: count / n for name, count in sent.items()},
        "server_top_level_per_op": server_top / n,
        "server_usec_per_op": server_usec / n,
        "server_commands_per_op_incl_lua": server_total / n,
        "server_lua_nested_per_op": (server_total - server_top) / n,
        "server_commandstats_delta_per_op": {name: count / n for name, count in sorted(delta.items())},
        "server_matches_client": consistent,
    }
    if not consistent:
        log(
            f"  warning: redis {transition}: the server counted other calls of {sorted(sent)} than this client "
            "sent; another client was active on the server, so its server-side numbers are inflated"
        )
    return Accounting("redis", transition, n, round_trips_per_op=wire.sends / n, detail=detail)


class SQLCounter:
    """Counts SQLAlchemy's cursor executes, and what the driver itself sends, while installed.

    PostgreSQL: a libpq trace of each pooled connection; every ``ReadyForQuery`` the server sends
    ends one exchange the client waited for (a simple Query, or an extended-protocol Sync), so
    their number is the number of round trips. SQLite: ``set_trace_callback`` sees every statement
    sqlite3 runs, including the BEGIN and COMMIT the driver issues on its own.
    """

    def __init__(self, store: Store, workdir: str) -> None:
        self.store = store
        self.engine = store.engine  # type: ignore[attr-defined]
        self.dialect = self.engine.dialect.name
        self.workdir = workdir
        self.statements: Counter[str] = Counter()
        self.driver_statements: Counter[str] = Counter()
        self._traced: list[Any] = []
        self._trace_path = ""
        self._trace_file: Any = None

    def _before_cursor_execute(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        self.statements[statement.split(None, 1)[0].upper()] += 1

    def _sqlite_trace(self, statement: str) -> None:
        self.driver_statements[statement.split(None, 1)[0].upper()] += 1

    def _checkout(self, dbapi_connection: Any, *_: Any) -> None:
        if any(c is dbapi_connection for c in self._traced):
            return
        if self.dialect == "postgresql":
            from psycopg import pq

            pgconn = dbapi_connection.pgconn
            pgconn.trace(self._trace_file.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        else:
            dbapi_connection.set_trace_callback(self._sqlite_trace)
        self._traced.append(dbapi_connection)

    @contextlib.contextmanager
    def counting(self) -> Iterator[SQLCounter]:
        import sqlalchemy as sa

        self.statements, self.driver_statements, self._traced = Counter(), Counter(), []
        self._trace_path = os.path.join(self.workdir, f"libpq-trace-{uuid.uuid4().hex[:8]}.txt")
        self._trace_file = open(self._trace_path, "w")
        sa.event.listen(self.engine, "before_cursor_execute", self._before_cursor_execute)
        sa.event.listen(self.engine.pool, "checkout", self._checkout)
        try:
            yield self
        finally:
            sa.event.remove(self.engine.pool, "checkout", self._checkout)
            sa.event.remove(self.engine, "before_cursor_execute", self._before_cursor_execute)
            for dbapi_connection in self._traced:
                if self.dialect == "postgresql":
                    dbapi_connection.pgconn.untrace()  # flushes the trace
                else:
                    dbapi_connection.set_trace_callback(None)
            self._trace_file.close()

    def wire(self) -> dict[str, int]:
        """Message counts of the libpq trace (PostgreSQL only)."""
        counts: Counter[str] = Counter()
        with open(self._trace_path) as trace:
            for line in trace:
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 3:
                    continue
                direction, message = parts[0], parts[2]
                if direction == "B" and message == "ReadyForQuery":
                    counts["round_trips"] += 1
                elif direction == "F" and message == "Query":
                    text = parts[3].strip().strip('"').split(None, 1)[0].upper() if len(parts) > 3 else "?"
                    counts[f"simple_query_{text}"] += 1
                elif direction == "F" and message in ("Parse", "Bind", "Execute", "Sync"):
                    counts[message.lower()] += 1
        os.unlink(self._trace_path)
        return dict(counts)


class PgTransactions:
    """Server-side cross-check: ``xact_commit`` of the database, read from a separate connection.

    Backends publish their counters lazily (PostgreSQL 15: at most once a second, and only when
    they have table statistics pending), so each read first makes the store's backend and the
    reader's own one flush: ``pg_stat_force_next_flush()`` plus a scan, which gives them pending
    table statistics. Between two reads the delta holds the batch, plus the store's flush
    transaction and two of the reader's (``EXTRA``), plus whatever other sessions committed.
    """

    EXTRA = 3
    FLUSH = "SELECT pg_stat_force_next_flush(), (SELECT count(*) FROM pg_catalog.pg_database)"

    def __init__(self, store: Store) -> None:
        import psycopg

        self.store = store
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

    def close(self) -> None:
        self.reader.close()


def sql_accounting(
    kind: str, counter: SQLCounter, pg_xacts: PgTransactions | None, transition: str, n: int, op: Callable[[int], bool]
) -> Accounting:
    before = pg_xacts.read() if pg_xacts else 0
    with counter.counting():
        run_untimed(n, op, f"{kind} {transition}")
    detail: dict[str, Any] = {"sqlalchemy_statements_per_op": {k: v / n for k, v in counter.statements.items()}}
    round_trips = None
    if kind == "postgresql":
        wire = counter.wire()
        round_trips = wire.get("round_trips", 0) / n
        detail["libpq_messages_per_op"] = {k: v / n for k, v in sorted(wire.items())}
    else:
        detail["sqlite3_statements_per_op"] = {k: v / n for k, v in counter.driver_statements.items()}
    if pg_xacts:
        delta = pg_xacts.read() - before - PgTransactions.EXTRA
        commits = detail["libpq_messages_per_op"].get("simple_query_COMMIT", 0) * n
        detail["server_xact_commit_per_op"] = delta / n
        detail["server_xact_commit_delta"] = delta
        # xact_commit is database-wide: another session's commits land in it too. A difference
        # of one in a batch turns up now and then even on an idle server, so it is tolerated.
        detail["server_matches_client"] = abs(delta - commits) <= 1
        if abs(delta - commits) > 1:
            log(
                f"  warning: postgresql {transition}: the server counted {delta} commits, this client sent "
                f"{commits:g} COMMITs; other sessions committed meanwhile"
            )
    statements = sum(counter.statements.values()) / n
    return Accounting(kind, transition, n, round_trips_per_op=round_trips, statements_per_op=statements, detail=detail)


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


def store_url(kind: str, workdir: str) -> str:
    return {
        "memory": "memory://",
        "sqlite": f"sqlite:///{workdir}/bench.db",
        "redis": REDIS_URL,
        "postgresql": POSTGRES_URL,
    }[kind]


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


def cleanup(kind: str, store: Store) -> int:
    """Delete every key/row this run wrote under the store's prefix; returns how many."""
    if kind == "redis":
        client = store.client  # type: ignore[attr-defined]
        keys = list(client.scan_iter(match=f"{{{store.key_prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
        left = sum(1 for _ in client.scan_iter(match=f"{{{store.key_prefix}:*", count=1000))
        if left:
            log(f"  warning: {left} redis keys under {{{store.key_prefix}:* are still there after cleanup")
        return len(keys)
    if kind in ("sqlite", "postgresql"):
        import sqlalchemy as sa

        table = store.table  # type: ignore[attr-defined]
        with store.engine.begin() as connection:  # type: ignore[attr-defined]
            return int(connection.execute(sa.delete(table).where(table.c.namespace == store.key_prefix)).rowcount)
    return len(store)  # type: ignore[arg-type]  # memory: dropped with the store


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
            _account(kind, store, report, accounting_ops, workdir)
    finally:
        report.cleaned_up = cleanup(kind, store)
        log(f"  cleanup: removed {report.cleaned_up} {'keys' if kind == 'redis' else 'records'}")
        store.close()
    return report


def _measure(kind: str, store: Store, report: StoreReport, ops: int, warmup: int) -> None:
    # Warm-up: connections, script cache, prepared statements, table creation; not timed.
    warm = identities("wn", warmup)
    run_untimed(warmup, claim_new_op(store, warm, "wn"), "warm-up claim")
    run_untimed(warmup, claim_dup_op(store, warm, "wn"), "warm-up duplicate claim")
    run_untimed(warmup, acquire_complete_op(store, identities("wa", warmup), "wa"), "warm-up acquire+complete")
    if kind == "redis":
        run_untimed(warmup, setnx_op(store, "w", warmup), "warm-up SET NX")

    claimed = identities("n", ops)
    plans = [(OP_CLAIM_NEW, claim_new_op(store, claimed, "n"))]
    if kind == "redis":
        # Interleaved with the claims, so both see the same machine load.
        plans.append((OP_SETNX, setnx_op(store, "s", ops)))
    timed = run_timed(kind, plans, ops, chunks=COMPARE_CHUNKS if len(plans) > 1 else 1)
    timed += run_timed(kind, [(OP_CLAIM_DUP, claim_dup_op(store, claimed, "n"))], ops)
    timed += run_timed(kind, [(OP_ACQ_COMPLETE, acquire_complete_op(store, identities("a", ops), "a"))], ops)
    for timing in timed:
        log(f"  {timing.op}: {timing.ops_per_s:,.0f} ops/s, median {timing.median_us:.1f} µs")
    report.timings.extend(timed)


def _account(kind: str, store: Store, report: StoreReport, n: int, workdir: str) -> None:
    claimed, acquired = identities("rn", n), identities("ra", n)
    owners = [""] * n
    batches: list[tuple[str, Callable[[int], bool]]] = [
        ("claim (new)", claim_new_op(store, claimed, "rn")),
        ("claim (duplicate)", claim_dup_op(store, claimed, "rn")),
        ("acquire", acquire_op(store, acquired, "ra", owners)),
        ("complete", complete_op(store, acquired, owners)),
    ]
    if kind == "redis":
        import redis

        batches.append(("SET NX PX", setnx_op(store, "rs", n)))
        reader = redis.Redis.from_url(REDIS_URL)
        reader.ping()  # connect (and run redis-py's handshake) before the first reading
        wire = RedisWire()
        try:
            with wire.installed():
                for transition, op in batches:
                    report.accounting.append(redis_accounting(store, reader, wire, transition, n, op))
        finally:
            reader.close()
    else:
        counter = SQLCounter(store, workdir)
        pg_xacts = PgTransactions(store) if kind == "postgresql" else None
        try:
            for transition, op in batches:
                report.accounting.append(sql_accounting(kind, counter, pg_xacts, transition, n, op))
        finally:
            if pg_xacts:
                pg_xacts.close()
    per_transition = {a.transition: a for a in report.accounting}
    for timing in report.timings:
        parts = {
            OP_CLAIM_NEW: ["claim (new)"],
            OP_CLAIM_DUP: ["claim (duplicate)"],
            OP_ACQ_COMPLETE: ["acquire", "complete"],
            OP_SETNX: ["SET NX PX"],
        }[timing.op]
        trips = [per_transition[p].round_trips_per_op for p in parts]
        if all(t is not None for t in trips):
            timing.round_trips_per_op = sum(t for t in trips if t is not None)


# ---- output ---------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


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
            d = a.detail
            if report.store == "redis":
                sent = ", ".join(f"{k.upper()} {v:g}" for k, v in d["client_commands"].items())
                server = (
                    f"{d['server_top_level_per_op']:g} top-level + {d['server_lua_nested_per_op']:g} inside Lua "
                    f"= {d['server_commands_per_op_incl_lua']:g} in commandstats; "
                    f"{d['server_usec_per_op']:.1f} µs of server time"
                )
                if not d["server_matches_client"]:
                    server += " (other clients active: inflated)"
            elif report.store == "postgresql":
                msgs = d["libpq_messages_per_op"]
                sent = ", ".join(
                    f"{k.removeprefix('simple_query_')} {v:g}" for k, v in msgs.items() if k.startswith("simple_query")
                )
                sent += f"; Parse {msgs.get('parse', 0):g}, Bind {msgs.get('bind', 0):g}, Sync {msgs.get('sync', 0):g}"
                server = f"{d['server_xact_commit_per_op']:.2f} committed transactions (xact_commit)"
                if not d["server_matches_client"]:
                    server += " (other sessions committed too)"
            else:
                sent = ", ".join(f"{k} {v:g}" for k, v in d["sqlite3_statements_per_op"].items())
                sent += " (sqlite3 trace; in-process)"
                server = "–"
            lines.append(
                f"| {a.store} | {a.transition} | {_num(a.round_trips_per_op, 2) if a.round_trips_per_op else '–'} "
                f"| {_num(a.statements_per_op, 2) if a.statements_per_op else '–'} | {sent} | {server} |"
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
        default=",".join(STORE_KINDS),
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
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = sorted(set(args.stores) - set(STORE_KINDS))
    if unknown:
        parser.error(f"unknown store(s) {unknown}; choose from {','.join(STORE_KINDS)}")
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
    load_at_start = os.getloadavg()
    log(f"{os.cpu_count()} cores, load average {load_at_start[0]:.2f} {load_at_start[1]:.2f} {load_at_start[2]:.2f}")
    started = time.perf_counter()
    try:
        for kind in args.stores:
            ops = args.ops * (args.memory_factor if kind == "memory" else 1)
            warmup = args.warmup * (args.memory_factor if kind == "memory" else 1)
            report = bench_store(kind, prefix, ops, warmup, args.accounting_ops, workdir)
            if report.skipped:
                log(f"skipping {kind}: {report.skipped}")
            reports.append(report)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - started

    ran = [r for r in reports if not r.skipped]
    print(main_table(ran))
    print()
    line, ratio = setnx_line(ran)
    print(line)
    if any(r.accounting for r in ran):
        print()
        print("Round trips per transition (untimed accounting batches of", args.accounting_ops, "operations):")
        print()
        print(accounting_table(ran))
    for report in reports:
        if report.skipped:
            print(f"\nSkipped {report.store}: {report.skipped}")
    load_at_end = os.getloadavg()
    print(
        f"\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}; 1-minute load average "
        f"{load_at_start[0]:.2f} at the start, {load_at_end[0]:.2f} at the end (other processes compete for the cores)"
    )
    log(f"total {elapsed:.1f} s")

    if args.json:
        payload = {
            "meta": {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "ops": args.ops,
                "memory_factor": args.memory_factor,
                "warmup": args.warmup,
                "accounting_ops": args.accounting_ops,
                "key_prefix": prefix,
                "elapsed_seconds": elapsed,
                "load_average_at_start": load_at_start,
                "load_average_at_end": load_at_end,
            },
            "stores": [asdict(r) for r in reports],
            "setnx_ratio": ratio,
            "setnx_ratio_target": SETNX_RATIO_TARGET,
        }
        with open(args.json, "w") as out:
            json.dump(payload, out, indent=2)
            out.write("\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
