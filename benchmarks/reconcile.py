#!/usr/bin/env python
"""What a reconciler run costs as the store grows, and what one record costs in memory.

Run from the repository root::

    python benchmarks/reconcile.py [--quick] [--stores redis,postgresql] [--repeats 7] [--json out.json]

For each store (Redis, PostgreSQL) it fills one namespace per size, 10k, 100k and 1M records (10k
and 100k with ``--quick``), of which exactly 1000 are stale (unsettled, lease expired); the rest are
settled with a 1 KB result or in flight with a live lease. A fourth namespace holds 10k records of
which 5000 are stale. It then times ``Idempotency(app, store=...).reconcile(dry_run=True)`` on
every namespace in interleaved rounds (so that a change of machine load weighs on every size
alike): seconds per run, split into the store's lease-index scan and the wait for worker answers;
store round trips per run; records scanned. A dry run changes nothing, so every repetition sees the
same state; one real run at the end settles the 1000 stale records of the largest namespace. Then
the memory a record takes: ``MEMORY USAGE`` of Redis hashes and of the lease index, PostgreSQL row
and relation sizes.

Round trips are counted on the client (redis-py instrumented; SQLAlchemy's ``before_cursor_execute``
plus a libpq trace), cross-checked on the server (``INFO commandstats``; ``EXPLAIN (ANALYZE,
BUFFERS)`` of the lease-index query). Records are made through the store's public API (claim,
acquire, complete) from a few threads, as an app makes them. Everything lives under fresh key
prefixes (Redis db 15; never flushed) or in fresh tables (PostgreSQL) and is removed at the end,
also when the run fails. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import random
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from _common import (
    POSTGRES_URL,
    REDIS_URL,
    Machine,
    SQLWire,
    choice_list,
    log,
    remove_prefix,
    rotated,
    wire_for,
    write_json,
)
from celery import Celery

from celery_idem import Idempotency
from celery_idem.reconciler import DEFAULT_LIMIT, Reconciler
from celery_idem.records import Decision, Identity
from celery_idem.stores import Store, store_from_url

STORE_KINDS = ("redis", "postgresql")

SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000, 100_000)
STALE = 1000
STALE_HIGH = 5000  # the extra namespace: 5000 stale of 10k
HIGH_TOTAL = 10_000
LIVE_SHARE = 50  # one record in 50 of the non-stale ones is in flight (PENDING, live lease)
TASK = "bench.task"
TTL = 86400.0
STALE_LEASE = 0.001  # a lease that has run out a millisecond after the claim
LIVE_LEASE = 3600.0
WRITERS = 4  # threads making records: each call waits on the server, so a few overlap on 2 cores
INSPECT_TIMEOUT = 0.2
MEMORY_SAMPLE = 1000  # records per kind of the largest namespace whose memory is read
API_SAMPLE = 500  # records made through the store's API for the memory comparison

# A 1 KB JSON result, as a task returning a small document would store it.
RESULT = b'{"blob":"' + secrets.token_hex(507)[:1013].encode() + b'"}'
SMALL_RESULT = b'{"ok":true}'
assert len(RESULT) == 1024

UNSETTLED = ("stale_pending", "stale_running", "live")  # in the lease index
KINDS = (*UNSETTLED, "completed")


def identity(i: int) -> Identity:
    return Identity("", TASK, f"order-{i:08d}")


def fingerprint(key: str) -> str:
    return hashlib.sha256(f"args of {key}".encode()).hexdigest()


def mix(total: int, stale: int) -> dict[str, int]:
    """How many records of each kind a namespace of ``total`` with ``stale`` stale ones holds."""
    live = (total - stale) // LIVE_SHARE
    return {
        "stale_pending": stale // 2,  # claimed, never started (message lost)
        "stale_running": stale - stale // 2,  # started, worker died (IN_PROGRESS)
        "live": live,
        "completed": total - stale - live,
    }


# ---- making the records ----------------------------------------------------------------------------


class Population:
    """The records of one namespace, by kind (indices into ``identity``), made through ``store``'s API."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.indices: dict[str, list[int]] = {kind: [] for kind in KINDS}
        self.next_index = 0

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.indices.values())

    def grow_to(self, total: int, stale: int) -> float:
        """Add records until the namespace holds ``mix(total, stale)``; returns the seconds it took."""
        started = time.perf_counter()
        adding: dict[str, list[int]] = {}
        for kind, want in mix(total, stale).items():
            have = len(self.indices[kind])
            if want < have:
                raise ValueError(f"cannot shrink {kind} from {have} to {want}")
            adding[kind] = list(range(self.next_index, self.next_index + want - have))
            self.next_index += want - have
        # Unsettled records in one thread, in key order: the lease index then orders them as it
        # always does, so the round trips of a run (which follow how the due records spread over
        # the shards) are the same from run to run. Settled ones, most of them, from a few threads.
        wrong = sum(1 for kind in UNSETTLED for i in adding[kind] if not self.make(kind, i))
        completed = adding["completed"]
        pool = ThreadPoolExecutor(WRITERS)
        try:
            wrong += sum(pool.map(self._completed, (completed[i : i + 500] for i in range(0, len(completed), 500))))
        finally:
            pool.shutdown(cancel_futures=True)  # on Ctrl-C: stop after the batches under way
        if wrong:
            raise AssertionError(f"{wrong} records were not made as expected")
        for kind, new in adding.items():
            self.indices[kind].extend(new)
        return time.perf_counter() - started

    def _completed(self, batch: list[int]) -> int:
        """Make these COMPLETED records; how many failed."""
        return sum(1 for i in batch if not self.make("completed", i))

    def make(self, kind: str, i: int) -> bool:
        """One record, the way an app leaves it: a claim (PENDING), an acquire (IN_PROGRESS; the stale
        ones with a 1 ms lease), or an acquire and a complete (COMPLETED, not in the lease index)."""
        ident, task_id = identity(i), str(uuid.uuid4())
        fp = fingerprint(ident.key)
        if kind == "stale_running":
            t = self.store.acquire(ident, fp, task_id, lease_seconds=STALE_LEASE, ttl_seconds=TTL)
            return t.decision is Decision.RUN
        if kind == "completed":
            t = self.store.acquire(ident, fp, task_id, lease_seconds=LIVE_LEASE, ttl_seconds=TTL)
            if t.decision is not Decision.RUN or t.record is None:
                return False
            return self.store.complete(ident, t.record.owner, RESULT).decision is Decision.OK
        lease = STALE_LEASE if kind == "stale_pending" else LIVE_LEASE
        t = self.store.claim(ident, fp, task_id, pending_seconds=lease, ttl_seconds=TTL)
        return t.decision is Decision.NEW

    def stale(self) -> list[int]:
        return self.indices["stale_pending"] + self.indices["stale_running"]

    def sample(self, kind: str, n: int, rng: random.Random) -> list[int]:
        pool = self.indices[kind]
        return rng.sample(pool, min(n, len(pool)))

    def unsettled(self) -> list[int]:
        return [i for kind in UNSETTLED for i in self.indices[kind]]


# ---- the lease-index query ---------------------------------------------------------------------


def explain_due_query(store: Any, statement: str, parameters: Any) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the exact lease-index query the reconciler's scan sent."""
    with store.engine.connect() as connection:
        plan = connection.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", parameters)
        top = plan.scalar_one()[0]
    nodes, stack = [], [top["Plan"]]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.get("Plans", []))
    scan = nodes[-1]
    return {
        "nodes": " -> ".join(
            n["Node Type"] + (f" using {n['Index Name']}" if "Index Name" in n else "") for n in nodes
        ),
        "buffers": top["Plan"].get("Shared Hit Blocks", 0) + top["Plan"].get("Shared Read Blocks", 0),
        "rows": top["Plan"]["Actual Rows"],
        "scan_rows_removed_by_filter": scan.get("Rows Removed by Filter", 0),
        "execution_ms": top["Execution Time"],
    }


# ---- one reconciler measurement -------------------------------------------------------------------


@dataclass
class Run:
    store: str
    total: int
    stale: int
    limit: int
    dry_run: bool
    scanned: int = 0
    released: int = 0
    left: int = 0
    purged: int = 0  # rows past their TTL a real run deleted (reconcilers that purge; none are expired here)
    seconds: list[float] = field(default_factory=list)
    scan_seconds: list[float] = field(default_factory=list)
    inspect_seconds: list[float] = field(default_factory=list)
    wire: dict[str, Any] = field(default_factory=dict)  # Tally.totals() of the counted run
    plan: dict[str, Any] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


class Probe:
    """Times the parts of a run: the store's ``expired_leases`` and the reconciler's worker query."""

    def __init__(self) -> None:
        self.scan: list[float] = []
        self.inspect: list[float] = []

    @contextlib.contextmanager
    def installed(self, store: Store) -> Iterator[Probe]:
        scan, live = store.expired_leases, Reconciler._live_task_ids
        probe = self

        def timed_scan(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return scan(*args, **kwargs)
            finally:
                probe.scan.append(time.perf_counter() - started)

        def timed_live(reconciler: Any, task_ids: list[str]) -> Any:
            started = time.perf_counter()
            try:
                return live(reconciler, task_ids)
            finally:
                probe.inspect.append(time.perf_counter() - started)

        store.expired_leases = timed_scan  # type: ignore[method-assign]
        Reconciler._live_task_ids = timed_live  # type: ignore[method-assign]
        try:
            yield self
        finally:
            del store.expired_leases
            Reconciler._live_task_ids = live  # type: ignore[method-assign]


def make_idem(store: Store) -> Idempotency:
    app = Celery("bench", broker="memory://", backend=None)
    return Idempotency(
        app,
        store=store,
        key_prefix=store.key_prefix,
        inspect_timeout_seconds=INSPECT_TIMEOUT,
        stale_grace_seconds=0,
    )


@dataclass
class Namespace:
    """One key prefix (Redis) or table (PostgreSQL) of ``total`` records, ``stale`` of them stale."""

    name: str
    total: int
    stale: int
    store: Any
    idem: Idempotency
    wire: Any
    population: Population


def counted_run(kind: str, ns: Namespace, limit: int | None = None, *, dry_run: bool = True) -> Run:
    """One run under the round-trip counters (after an untimed warm-up, for dry runs)."""
    run = Run(kind, ns.total, ns.stale if dry_run else len(ns.population.stale()), limit or DEFAULT_LIMIT, dry_run)
    if dry_run:
        ns.idem.reconcile(limit=limit, dry_run=True)  # warm-up: connections, scripts, prepared statements
    probe = Probe()
    with probe.installed(ns.store), ns.wire.counting() as counted:
        report = ns.idem.reconcile(limit=limit, dry_run=dry_run)
    run.wire = counted.totals()
    run.scanned, run.released, run.left = report.scanned, report.released, report.left
    run.purged = getattr(report, "purged", 0)
    # The scan is the run's first SELECT from the namespace's table (the others read the clock).
    scans = [(statement, parameters) for statement, parameters in counted.selects if ns.store.table.name in statement]
    if scans:
        run.plan = explain_due_query(ns.store, *scans[0])
    if not dry_run:
        # The one real run is the counted one (its instrumentation adds a few µs per command).
        run.seconds.append(report.seconds)
        run.scan_seconds, run.inspect_seconds = probe.scan, probe.inspect
        summarize(run)
    return run


def timed_rounds(plans: list[tuple[Run, Namespace, int | None]], repeats: int) -> None:
    """``repeats`` rounds; each round runs every plan once, starting one plan later than the round
    before, so that a change of machine load weighs on every plan alike."""
    for r in range(repeats):
        for run, ns, limit in rotated(plans, r):
            gc.collect()
            probe = Probe()
            with probe.installed(ns.store):
                report = ns.idem.reconcile(limit=limit, dry_run=True)
            if report.scanned != run.scanned:
                raise AssertionError(f"dry runs disagree: scanned {report.scanned}, then {run.scanned}")
            run.seconds.append(report.seconds)
            run.scan_seconds += probe.scan
            run.inspect_seconds += probe.inspect
    for run, _, _ in plans:
        summarize(run)


def summarize(run: Run) -> None:
    log(
        f"  {run.store} {run.total:,} records, {run.stale:,} stale, limit {run.limit}: "
        f"{'dry' if run.dry_run else 'REAL'} run scanned {run.scanned} released {run.released}, {run.median:.3f}s "
        f"(scan {_ms(run.scan_seconds)} ms, inspect {_ms(run.inspect_seconds)} ms); "
        f"{run.wire['round_trips']} round trips"
    )


# ---- per store --------------------------------------------------------------------------------------


@dataclass
class StoreResult:
    store: str
    detail: str = ""
    server_version: str = ""
    runs: list[Run] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    growth: list[dict[str, Any]] = field(default_factory=list)
    cleaned_up: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None


def _avg(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


class RedisBench:
    kind = "redis"

    def __init__(self, run_id: str) -> None:
        import redis

        self.run_id = run_id
        self.stores: dict[str, Any] = {}
        self.admin = redis.Redis.from_url(REDIS_URL, socket_timeout=120)  # memory readings, INFO
        self.reader = redis.Redis.from_url(REDIS_URL, socket_timeout=30)  # commandstats, around counted runs
        self.admin.ping()
        self.reader.ping()

    def prefix(self, name: str) -> str:
        return f"rcb{self.run_id}{name}"

    def store(self, name: str) -> Any:
        store = store_from_url(REDIS_URL, key_prefix=self.prefix(name))
        self.stores[name] = store
        return store

    def counter(self, store: Any) -> Any:
        return wire_for(store, self.reader)

    def filler(self, name: str) -> Any:
        """The store that makes the records: the namespace's own."""
        return self.stores[name]

    def written(self, name: str) -> None:
        """Nothing to do after the writes."""

    def where(self) -> str:
        return f"db {REDIS_URL.rsplit('/', 1)[-1]}, key prefixes {self.prefix('<ns>')} (ns: n1.. by size, h1, a1)"

    def version(self) -> str:
        return f"Redis {self.admin.info('server')['redis_version']}"

    def used_memory(self) -> int:
        return int(self.admin.info("memory")["used_memory"])

    def memory_usage(self, keys: list[Any]) -> list[int]:
        pipe = self.admin.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)  # every field, not the default sample of 5
        return [int(n) for n in pipe.execute()]

    def records_memory(self, keys: list[Any]) -> dict[str, Any]:
        sizes = self.memory_usage(keys)
        encoding = self.admin.object("encoding", keys[0]).decode()
        return {"sample": len(sizes), "memory_usage_avg": _avg(sizes), "encoding": encoding}

    def namespace_memory(self, store: Any, population: Population, rng: random.Random) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind in KINDS:
            keys = [store.keys_for(identity(i))[0] for i in population.sample(kind, MEMORY_SAMPLE, rng)]
            out[kind] = self.records_memory(keys)
        # Only unsettled records are in the lease index; their shards are all of it.
        indexes = sorted({store.keys_for(identity(i))[1] for i in population.unsettled()})
        members = sum(self.admin.zcard(index) for index in indexes)
        usage = sum(self.memory_usage(indexes))
        out["lease_index"] = {
            "members": members,
            "memory_usage_total": usage,
            "bytes_per_entry": usage / members if members else None,
            "encodings": sorted({self.admin.object("encoding", index).decode() for index in indexes}),
            "shards": len(indexes),
        }
        return out

    def api_memory(self, store: Any) -> dict[str, Any]:
        """Records made one by one through the store's API, each kind its own sample."""
        made: dict[str, list[Any]] = {"completed_1kb": [], "completed_small": [], "pending": []}
        for i in range(API_SAMPLE):
            for kind in made:
                ident = Identity("", TASK, f"api{kind[-1]}-{i:09d}")  # 14 characters, like the namespaces' keys
                fp = fingerprint(ident.key)
                t = store.claim(ident, fp, str(uuid.uuid4()), pending_seconds=LIVE_LEASE, ttl_seconds=TTL)
                assert t.decision is Decision.NEW
                if kind != "pending":
                    t = store.acquire(ident, fp, t.record.task_id, lease_seconds=LIVE_LEASE, ttl_seconds=TTL)
                    assert t.record is not None
                    result = RESULT if kind == "completed_1kb" else SMALL_RESULT
                    assert store.complete(ident, t.record.owner, result).decision is Decision.OK
                made[kind].append(store.keys_for(ident)[0])
        return {kind: self.records_memory(keys) for kind, keys in made.items()}

    def cleanup(self, name: str) -> int:
        """Everything under the namespace's prefix (never FLUSHDB: the tests share db 15)."""
        return remove_prefix(self.stores[name])

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.admin.close()
        self.reader.close()


class PostgresBench:
    kind = "postgresql"

    def __init__(self, run_id: str) -> None:
        import psycopg
        import sqlalchemy as sa

        self.run_id = run_id
        self.stores: dict[str, Any] = {}
        self.fillers: dict[str, Any] = {}
        url = sa.make_url(POSTGRES_URL).set(drivername="postgresql")
        self.admin = psycopg.connect(url.render_as_string(hide_password=False))

    def prefix(self, name: str) -> str:
        return f"rcb{self.run_id}{name}"

    def table(self, name: str) -> str:
        return f"celery_idem_bench_{self.run_id}_{name}"

    def store(self, name: str) -> Any:
        from celery_idem.stores.sql import SQLStore

        store = SQLStore.from_url(POSTGRES_URL, key_prefix=self.prefix(name), table_name=self.table(name))
        store.create_schema()
        self.stores[name] = store
        return store

    def filler(self, name: str) -> Any:
        """A second store on the namespace's table whose connections commit asynchronously
        (``synchronous_commit=off``: no WAL flush to wait for), to make the records about three
        times as fast; the measured store's connections keep the server's setting."""
        import sqlalchemy as sa

        from celery_idem.stores.sql import SQLStore

        url = sa.make_url(POSTGRES_URL).update_query_dict({"options": "-c synchronous_commit=off"})
        self.fillers[name] = SQLStore.from_url(
            url.render_as_string(hide_password=False), key_prefix=self.prefix(name), table_name=self.table(name)
        )
        return self.fillers[name]

    def counter(self, store: Any) -> SQLWire:
        return SQLWire(store)

    def where(self) -> str:
        return f"a table per namespace, {self.table('<ns>')} (ns: n1.. by size, h1, a1)"

    def written(self, name: str) -> None:
        """What autovacuum would do after the writes (it is off on the dev server): drop the dead
        tuples each complete leaves (an UPDATE of the acquire's row), and give the planner statistics."""
        self._autocommit(f'VACUUM ANALYZE "{self.table(name)}"')

    def _autocommit(self, statement: str) -> None:
        self.admin.commit()  # end the transaction an earlier reading opened
        self.admin.autocommit = True
        try:
            self.admin.execute(statement)
        finally:
            self.admin.autocommit = False

    def version(self) -> str:
        return "PostgreSQL " + str(self.admin.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]

    def sizes(self, name: str) -> dict[str, Any]:
        table = self.table(name)
        rows, heap, indexes, total, toast = self.admin.execute(
            f'SELECT (SELECT count(*) FROM "{table}"), pg_relation_size(%(t)s::regclass), '
            "pg_indexes_size(%(t)s::regclass), pg_total_relation_size(%(t)s::regclass), "
            "pg_total_relation_size(%(t)s::regclass) - pg_relation_size(%(t)s::regclass) "
            "- pg_indexes_size(%(t)s::regclass)",
            {"t": table},
        ).fetchone()  # type: ignore[misc]
        by_index = self.admin.execute(
            "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
            "WHERE indrelid = %(t)s::regclass",
            {"t": table},
        ).fetchall()
        self.admin.commit()
        per_row = {"total": total, "heap": heap, "indexes": indexes}
        return {
            "rows": rows,
            "heap_bytes": heap,
            "index_bytes": indexes,
            "total_bytes": total,
            "toast_and_maps_bytes": toast,
            **{f"per_row_{name}": value / rows if rows else None for name, value in per_row.items()},
            "per_row_by_index": {name: size / rows for name, size in by_index} if rows else {},
        }

    def column_sizes(self, name: str, where: str = "") -> dict[str, Any]:
        table = self.table(name)
        found = self.admin.execute(
            f"SELECT state, result IS NOT NULL AND length(result) > 100, count(*), avg(pg_column_size(t.*)), "
            f'avg(pg_column_size(t.result)) FROM "{table}" t {where} GROUP BY 1, 2 ORDER BY 1, 2'
        ).fetchall()
        self.admin.commit()
        return {
            f"{state}{' 1 KB result' if big else ''}": {
                "rows": n,
                "pg_column_size_row_avg": float(avg),
                "pg_column_size_result_avg": float(res) if res is not None else None,
            }
            for state, big, n, avg, res in found
        }

    def namespace_memory(self, store: Any, population: Population, rng: random.Random) -> dict[str, Any]:
        name = store.key_prefix.removeprefix(self.prefix(""))
        return {"rows": self.column_sizes(name), "relation": self.sizes(name)}

    def api_memory(self, store: Any) -> dict[str, Any]:
        for i in range(API_SAMPLE):
            ident = Identity("", TASK, f"api-{i:010d}")  # 14 characters, like the namespaces' keys
            fp = fingerprint(ident.key)
            t = store.claim(ident, fp, str(uuid.uuid4()), pending_seconds=LIVE_LEASE, ttl_seconds=TTL)
            t = store.acquire(ident, fp, t.record.task_id, lease_seconds=LIVE_LEASE, ttl_seconds=TTL)
            assert t.record is not None
            assert store.complete(ident, t.record.owner, RESULT).decision is Decision.OK
        out = {"rows": self.column_sizes("a1"), "relation_as_written": self.sizes("a1")}
        self._autocommit(f'VACUUM FULL "{self.table("a1")}"')
        out["relation_after_vacuum_full"] = self.sizes("a1")
        return out

    def used_memory(self) -> int:
        return 0

    def cleanup(self, name: str) -> int:
        table = self.table(name)
        for store in (self.stores.get(name), self.fillers.pop(name, None)):
            if store is not None:
                store.close()  # its pooled connections would hold the table open
        self.admin.rollback()
        rows = self.admin.execute(f'SELECT count(*) FROM "{table}"').fetchone() if self._exists(table) else (0,)
        self.admin.execute(f'DROP TABLE IF EXISTS "{table}"')
        self.admin.commit()
        return int(rows[0]) if rows else 0

    def _exists(self, table: str) -> bool:
        return self.admin.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()[0]  # type: ignore[index]

    def close(self) -> None:
        for store in [*self.stores.values(), *self.fillers.values()]:
            store.close()
        self.admin.close()


def bench_store(kind: str, sizes: tuple[int, ...], repeats: int, run_id: str) -> StoreResult:
    result = StoreResult(kind)
    try:
        bench: Any = RedisBench(run_id) if kind == "redis" else PostgresBench(run_id)
    except Exception as exc:  # noqa: BLE001 - any reason the server is not usable
        result.skipped = f"not reachable: {exc}"
        return result
    try:
        result.server_version = bench.version()
        result.detail = bench.where()
        log(f"{kind}: {result.server_version}; {result.detail}")
        _measure_store(bench, result, sizes, repeats)
    finally:
        for name in list(bench.stores):
            if name not in result.cleaned_up:
                with contextlib.suppress(Exception):
                    result.cleaned_up[name] = bench.cleanup(name)
        log(f"  {kind}: cleanup removed {result.cleaned_up}")
        bench.close()
    return result


def open_namespace(bench: Any, result: StoreResult, name: str, total: int, stale: int) -> Namespace:
    store = bench.store(name)
    population = Population(bench.filler(name))
    used_before = bench.used_memory()
    seconds = population.grow_to(total, stale)
    bench.written(name)
    growth: dict[str, Any] = {"namespace": name, "total": total, "stale": stale}
    growth.update(seconds=seconds, records_per_s=total / seconds)
    if bench.kind == "redis":
        growth["used_memory_per_record"] = (bench.used_memory() - used_before) / total
    result.growth.append(growth)
    log(f"  {bench.kind}: namespace {name}: {total:,} records, {stale:,} stale, written in {seconds:.1f}s")
    return Namespace(name, total, stale, store, make_idem(store), bench.counter(store), population)


def _measure_store(bench: Any, result: StoreResult, sizes: tuple[int, ...], repeats: int) -> None:
    kind = bench.kind
    namespaces: list[Namespace] = []
    try:
        for number, total in enumerate(sizes, 1):
            namespaces.append(open_namespace(bench, result, f"n{number}", total, STALE))
        high = open_namespace(bench, result, "h1", HIGH_TOTAL, STALE_HIGH)
        namespaces.append(high)
        time.sleep(0.05)  # every stale lease (1 ms) has run out
        plans: list[tuple[Run, Namespace, int | None]] = []
        for ns, limit in [(ns, None) for ns in namespaces] + [(high, HIGH_TOTAL)]:
            run = counted_run(kind, ns, limit)
            if run.scanned != min(ns.stale, run.limit):
                raise AssertionError(f"{kind} {ns.name}: a dry run scanned {run.scanned} records, not the stale ones")
            plans.append((run, ns, limit))
        log(f"  {kind}: {repeats} interleaved rounds of {len(plans)} dry runs")
        timed_rounds(plans, repeats)
        result.runs.extend(run for run, _, _ in plans)

        biggest = max(namespaces[:-1], key=lambda ns: ns.total)
        log(f"  {kind}: memory in namespace {biggest.name}")
        result.memory["namespace"] = bench.namespace_memory(biggest.store, biggest.population, random.Random(20261122))
        result.memory["namespace"]["namespace_records"] = biggest.total
        real = counted_run(kind, biggest, dry_run=False)
        if real.released != STALE:
            raise AssertionError(f"{kind}: the real run released {real.released}, not {STALE}")
        biggest.stale = 0
        after = counted_run(kind, biggest)
        if after.scanned != 0:
            raise AssertionError(f"{kind}: after the real run a dry run still scanned {after.scanned}")
        timed_rounds([(after, biggest, None)], repeats)
        result.runs.extend([real, after])
    finally:
        for ns in namespaces:
            ns.idem.disconnect()
    for ns in namespaces:
        result.cleaned_up[ns.name] = bench.cleanup(ns.name)  # free the memory before the next part
    log(f"  {kind}: {API_SAMPLE} records per kind through the store's API, for their memory")
    result.memory["api"] = bench.api_memory(bench.store("a1"))


# ---- output -----------------------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.1f}" if values else "–"


def _ms_range(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.1f} / {min(values) * 1000:,.1f}" if values else "–"


def _plan(plan: dict[str, Any] | None) -> str:
    if not plan:
        return "–"
    nodes = plan["nodes"].replace("Limit -> ", "")
    nodes = " ".join("(lease index)" if word.endswith("_lease") else word for word in nodes.split())
    return f"{nodes.replace(' using ', ' ')}: {plan['buffers']:,} buffers, {plan['execution_ms']:.1f} ms"


def runs_table(result: StoreResult) -> str:
    redis = result.store == "redis"
    head = (
        "| total records | stale | limit | run | records scanned | released | seconds per run (median) "
        "| store scan ms (median / min) | worker-inspect wait ms | round trips per run | "
        + (
            "top-level commands | server commands incl. Lua | server µs |"
            if redis
            else "SQL statements | lease-index query (EXPLAIN ANALYZE) |"
        )
    )
    lines = [head, "|" + "---:|" * 3 + "---|" + "---:|" * 6 + ("---:|" * 3 if redis else "---:|---|")]
    for run in result.runs:
        w, server = run.wire, run.wire["server"]
        what = "dry" if run.dry_run else "**real**"
        top_level = sum(w["commands"].values())
        if redis:
            other = "" if server["matches_client"] else " ¹"
            tail = f"{top_level:,} | {server['total']:,}{other} | {server['usec']:,}{other} |"
        else:
            tail = f"{top_level:,} | {_plan(run.plan)} |"
        lines.append(
            f"| {run.total:,} | {run.stale:,} | {run.limit:,} | {what} | {run.scanned:,} | {run.released:,} "
            f"| {run.median:.3f} | {_ms_range(run.scan_seconds)} | {_ms(run.inspect_seconds)} | {w['round_trips']:,} "
            f"| {tail}"
        )
    if redis and not all(run.wire["server"]["matches_client"] for run in result.runs):
        lines.append("\n¹ other clients ran the same commands meanwhile (INFO commandstats is server-wide): inflated")
    return "\n".join(lines)


def redis_memory_table(result: StoreResult) -> str:
    ns, api = result.memory.get("namespace", {}), result.memory.get("api", {})
    index = ns.get("lease_index", {})
    lines = ["| record | made by | MEMORY USAGE bytes (avg) | encoding | sample |", "|---|---|---:|---|---:|"]
    rows = [
        ("COMPLETED, 1 KB result", "store API (claim, acquire, complete)", api.get("completed_1kb")),
        ("COMPLETED, 1 KB result", "namespace (acquire, complete)", ns.get("completed")),
        ("COMPLETED, 11-byte result", "store API", api.get("completed_small")),
        ("PENDING", "store API (claim)", api.get("pending")),
        ("PENDING (stale)", "namespace (claim)", ns.get("stale_pending")),
        ("IN_PROGRESS (stale)", "namespace (acquire)", ns.get("stale_running")),
        ("PENDING (live lease)", "namespace (claim)", ns.get("live")),
    ]
    for name, how, stats in rows:
        if stats:
            usage = f"{stats['memory_usage_avg']:,.0f} | {stats['encoding']} | {stats['sample']:,}"
            lines.append(f"| {name} | {how} | {usage} |")
    if index.get("bytes_per_entry"):
        lines.append(
            f"| lease-index entry (share of the {index['shards']} shard zsets) | claim/acquire scripts "
            f"| {index['bytes_per_entry']:,.0f} | {'/'.join(index['encodings'])} | {index['members']:,} entries |"
        )
    for growth in result.growth:
        if "used_memory_per_record" in growth:
            lines.append(
                f"| INFO used_memory growth per record, namespace of {growth['total']:,} "
                f"({growth['stale']:,} stale, {mix(growth['total'], growth['stale'])['completed']:,} COMPLETED) "
                f"| namespace | {growth['used_memory_per_record']:,.0f} | – | {growth['total']:,} |"
            )
    return "\n".join(lines)


def pg_memory_table(result: StoreResult) -> str:
    ns, api = result.memory.get("namespace", {}), result.memory.get("api", {})
    lines = ["| what | bytes per row | rows |", "|---|---:|---:|"]
    for made_by, rows in (("namespace", ns.get("rows", {})), ("store API", api.get("rows", {}))):
        for state, stats in rows.items():
            size = f"{stats['pg_column_size_row_avg']:,.0f} | {stats['rows']:,}"
            lines.append(f"| pg_column_size(t.*), {state}, {made_by} | {size} |")
    for label, rel in (
        ("namespace table, after VACUUM ANALYZE", ns.get("relation")),
        (f"store API table ({API_SAMPLE} records), as written", api.get("relation_as_written")),
        (f"store API table ({API_SAMPLE} records), after VACUUM FULL", api.get("relation_after_vacuum_full")),
    ):
        if rel and rel["rows"]:
            lines.append(
                f"| pg_total_relation_size / rows, {label}: heap {rel['per_row_heap']:,.0f} + indexes "
                f"{rel['per_row_indexes']:,.0f} + TOAST and maps {rel['toast_and_maps_bytes'] / rel['rows']:,.0f} "
                f"| {rel['per_row_total']:,.0f} | {rel['rows']:,} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k records only")
    parser.add_argument(
        "--stores", type=choice_list(STORE_KINDS), default=list(STORE_KINDS), help="comma-separated: redis,postgresql"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed dry runs per measurement (default 7)")
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    run_id = secrets.token_hex(4)
    machine = Machine()
    log(f"sizes {sizes}, run id {run_id}")
    results: list[StoreResult] = []
    for kind in args.stores:
        result = bench_store(kind, sizes, args.repeats, run_id)
        if result.skipped:
            log(f"skipping {kind}: {result.skipped}")
        results.append(result)
    machine.finish()

    for result in results:
        if result.skipped:
            print(f"\nSkipped {result.store}: {result.skipped}")
            continue
        print(f"\n### {result.store} ({result.server_version}; {result.detail})\n")
        print(runs_table(result))
        print()
        print(redis_memory_table(result) if result.store == "redis" else pg_memory_table(result))
        writes = (f"{g['total']:,} in {g['seconds']:.1f}s ({g['records_per_s']:,.0f}/s)" for g in result.growth)
        print("\nRecords written through the store's API: " + ", ".join(writes))
    print(f"\n{machine.summary()}; {args.repeats} timed dry runs per row; total {machine.elapsed:.0f}s")
    if args.json:
        options = {"sizes": sizes, "stale": STALE, "repeats": args.repeats, "inspect_timeout_seconds": INSPECT_TIMEOUT}
        write_json(args.json, {"meta": machine.meta(**options), "stores": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
