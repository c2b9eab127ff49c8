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
BUFFERS)`` of the lease-index query). Records are written in bulk: pipelined Lua claims and direct
hash writes on Redis, ``COPY`` on PostgreSQL, checked against records made through the store's own
API. Everything lives under fresh key prefixes (Redis db 15; never flushed) or in fresh tables
(PostgreSQL) and is removed at the end, also when the run fails. See benchmarks/README.md.
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
import random
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import Celery

from celery_idem import Idempotency
from celery_idem.reconciler import DEFAULT_LIMIT, Reconciler
from celery_idem.records import Decision, Identity, State
from celery_idem.stores import Store, store_from_url

REDIS_URL = os.environ.get("CELERY_IDEM_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get("CELERY_IDEM_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
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
BATCH = 1000
INSPECT_TIMEOUT = 0.2
MEMORY_SAMPLE = 1000  # bulk records per kind whose memory is read
API_SAMPLE = 500  # records made through the store's API for the memory comparison

# A 1 KB JSON result, as a task returning a small document would store it.
RESULT = b'{"blob":"' + secrets.token_hex(507)[:1013].encode() + b'"}'
SMALL_RESULT = b'{"ok":true}'
assert len(RESULT) == 1024

KINDS = ("stale_pending", "stale_running", "live", "completed")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


# ---- bulk writers ---------------------------------------------------------------------------------


class Population:
    """The records of one namespace, by kind (indices into ``identity``), grown by a writer."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
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
        self.writer.write(adding)
        for kind, new in adding.items():
            self.indices[kind].extend(new)
        return time.perf_counter() - started

    def stale(self) -> list[int]:
        return self.indices["stale_pending"] + self.indices["stale_running"]

    def sample(self, kind: str, n: int, rng: random.Random) -> list[int]:
        pool = self.indices[kind]
        return rng.sample(pool, min(n, len(pool)))


def _fmt(x: float) -> str:
    return f"{x:.6f}"  # the prelude's fmt(): POSIX seconds with 6 decimals


class RedisWriter:
    """Unsettled records through the store's own Lua scripts (pipelined, ``BATCH`` a round trip);
    COMPLETED records as direct HSET + PEXPIRE, field for field what claim, acquire and settle
    leave (checked by ``check_redis_layout``), and, like a settled record, not in the lease index."""

    SCRIPT = {"stale_pending": ("claim", STALE_LEASE), "stale_running": ("acquire", STALE_LEASE),
              "live": ("claim", LIVE_LEASE)}  # fmt: skip

    def __init__(self, store: Any, bulk: Any) -> None:
        self.store = store
        self.bulk = bulk  # a client of its own, with a generous socket timeout

    def write(self, adding: dict[str, list[int]]) -> None:
        for kind, indices in adding.items():
            for start in range(0, len(indices), BATCH):
                chunk = indices[start : start + BATCH]
                if kind == "completed":
                    self._completed(chunk)
                else:
                    self._scripted(kind, chunk)

    def _scripted(self, kind: str, chunk: list[int]) -> None:
        name, lease = self.SCRIPT[kind]
        script = self.store._scripts[name]
        pipe = self.bulk.pipeline(transaction=False)
        for i in chunk:
            ident = identity(i)
            args = [
                "",
                fingerprint(ident.key),
                str(uuid.uuid4()),
                uuid.uuid4().hex,
                repr(lease),
                repr(TTL),
                *ident,
                b"",
            ]
            script(keys=self.store.keys_for(ident), args=args, client=pipe)
        expected = b"NEW" if name == "claim" else b"RUN"
        wrong = sum(1 for answer in pipe.execute() if answer[0] != expected)
        if wrong:
            raise AssertionError(f"{wrong} of {len(chunk)} bulk {name} scripts did not answer {expected!r}")

    def _completed(self, chunk: list[int]) -> None:
        pipe = self.bulk.pipeline(transaction=False)
        now = time.time()
        px = max(1, math.ceil(TTL * 1000))
        for i in chunk:
            ident = identity(i)
            key = self.store.keys_for(ident)[0]
            pipe.hset(key, mapping={
                "scope": ident.scope, "task": ident.task_name, "key": ident.key, "fp": fingerprint(ident.key),
                "state": "COMPLETED", "task_id": str(uuid.uuid4()), "owner": uuid.uuid4().hex, "attempt": "1",
                "created": _fmt(now - 1), "updated": _fmt(now), "expires": _fmt(now + TTL), "ttl": repr(TTL),
                "result": RESULT, "ctype": "application/json", "cenc": "utf-8",
            })  # fmt: skip
            pipe.pexpire(key, px)
        pipe.execute()


class PostgresWriter:
    """Every record as a row, through one ``COPY ... FROM STDIN`` per growth step, with the values
    the store's own statements write (checked by ``check_sql_layout``)."""

    def __init__(self, store: Any, admin: Any) -> None:
        self.store = store
        self.admin = admin  # a psycopg connection of its own (no statement timeout)
        self.columns = [c.name for c in store.table.columns]

    def row(self, kind: str, i: int, now: float) -> tuple[Any, ...]:
        ident = identity(i)
        head = (self.store.key_prefix, ident.scope, ident.task_name, ident.key, fingerprint(ident.key))
        task_id, owner = str(uuid.uuid4()), uuid.uuid4().hex
        if kind == "completed":
            # acquire, then complete: attempt 1, no lease, expires = settle time + ttl, the result.
            return (*head, "COMPLETED", task_id, owner, 1, None, now - 1, now, now + TTL, TTL,
                    RESULT, "application/json", "utf-8", None, None)  # fmt: skip
        state, attempt, lease = {
            "stale_pending": ("PENDING", 0, STALE_LEASE),
            "stale_running": ("IN_PROGRESS", 1, STALE_LEASE),
            "live": ("PENDING", 0, LIVE_LEASE),
        }[kind]
        return (*head, state, task_id, owner, attempt, now + lease, now, now, now + lease + TTL, TTL,
                None, None, None, None, None)  # fmt: skip

    def write(self, adding: dict[str, list[int]]) -> None:
        names = ", ".join(f'"{c}"' for c in self.columns)
        now = time.time()
        with self.admin.cursor() as cursor, cursor.copy(f'COPY "{self.store.table.name}" ({names}) FROM STDIN') as copy:
            for kind, indices in adding.items():
                for i in indices:
                    copy.write_row(self.row(kind, i, now))
        self.admin.commit()
        self.admin.execute(f'ANALYZE "{self.store.table.name}"')  # autovacuum is off on the dev server
        self.admin.commit()


# ---- layout checks: bulk records look like the store's own ------------------------------------------


def _api_records(store: Store, tag: str) -> dict[str, Identity]:
    """One record per kind made through the store's API (the reference the bulk ones must match)."""
    made: dict[str, Identity] = {}
    for kind in KINDS:
        ident = Identity("", TASK, f"layout-{tag}-{kind}")
        fp = fingerprint(ident.key)
        if kind == "stale_running":
            t = store.acquire(ident, fp, str(uuid.uuid4()), lease_seconds=STALE_LEASE, ttl_seconds=TTL)
            assert t.decision is Decision.RUN
        elif kind == "completed":
            store.claim(ident, fp, "tid", pending_seconds=LIVE_LEASE, ttl_seconds=TTL)
            t = store.acquire(ident, fp, "tid", lease_seconds=LIVE_LEASE, ttl_seconds=TTL)
            assert t.decision is Decision.RUN and t.record is not None
            assert store.complete(ident, t.record.owner, RESULT).decision is Decision.OK
        else:
            lease = STALE_LEASE if kind == "stale_pending" else LIVE_LEASE
            t = store.claim(ident, fp, str(uuid.uuid4()), pending_seconds=lease, ttl_seconds=TTL)
            assert t.decision is Decision.NEW
        made[kind] = ident
    return made


def _check_parsed(store: Store, population: Population) -> None:
    want = {"stale_pending": State.PENDING, "stale_running": State.IN_PROGRESS, "live": State.PENDING,
            "completed": State.COMPLETED}  # fmt: skip
    for kind in KINDS:
        i = population.indices[kind][0]
        record = store.get(identity(i))
        if record is None or record.state is not want[kind]:
            raise AssertionError(f"bulk {kind} record {identity(i)} reads back as {record!r}")
        if kind == "completed" and record.result != RESULT:
            raise AssertionError("bulk COMPLETED record does not read back its result")


def check_redis_layout(store: Any, population: Population) -> dict[str, Any]:
    client = store.client
    made = _api_records(store, "r")
    time.sleep(0.01)
    found: dict[str, Any] = {}
    try:
        for kind in KINDS:
            ref_key, ref_index = store.keys_for(made[kind])
            bulk_key, bulk_index = store.keys_for(identity(population.indices[kind][0]))
            ref_fields, bulk_fields = set(client.hgetall(ref_key)), set(client.hgetall(bulk_key))
            ref_indexed = client.zscore(ref_index, ref_key) is not None
            bulk_indexed = client.zscore(bulk_index, bulk_key) is not None
            if ref_fields != bulk_fields or ref_indexed != bulk_indexed:
                raise AssertionError(
                    f"bulk {kind} record differs from the API's: fields {sorted(ref_fields ^ bulk_fields)}, "
                    f"in the lease index {bulk_indexed} (API: {ref_indexed})"
                )
            found[kind] = {
                "fields": sorted(f.decode() for f in ref_fields),
                "in_lease_index": ref_indexed,
                "encoding_api": client.object("encoding", ref_key).decode(),
                "encoding_bulk": client.object("encoding", bulk_key).decode(),
            }
        _check_parsed(store, population)
    finally:
        for ident in made.values():
            store.forget(ident)
    return found


def check_sql_layout(store: Any, population: Population) -> dict[str, Any]:
    import sqlalchemy as sa

    made = _api_records(store, "s")
    found: dict[str, Any] = {}
    c = store.table.c
    try:
        with store.engine.connect() as connection:
            for kind in KINDS:
                rows = {}
                for name, ident in (("api", made[kind]), ("bulk", identity(population.indices[kind][0]))):
                    rows[name] = (
                        connection.execute(
                            sa.select(store.table).where(c.namespace == store.key_prefix, c.key == ident.key)
                        )
                        .one()
                        ._asdict()
                    )
                nulls = {name: sorted(k for k, v in row.items() if v is None) for name, row in rows.items()}
                if nulls["api"] != nulls["bulk"] or rows["api"]["state"] != rows["bulk"]["state"]:
                    raise AssertionError(f"bulk {kind} row differs from the API's: NULL columns {nulls}")
                found[kind] = {"null_columns": nulls["api"], "state": rows["api"]["state"]}
        _check_parsed(store, population)
    finally:
        for ident in made.values():
            store.forget(ident)
    return found


# ---- counting round trips -------------------------------------------------------------------------


class RedisWire:
    """Client side: every request redis-py writes (``send_packed_command``: one per command, one per
    pipeline), every reply it reads, and the commands by name (pipelined ones marked). Server side:
    ``INFO commandstats`` deltas from a separate client, which also count the commands Lua runs."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.active = False
        self.sends = 0
        self.replies = 0
        self.commands: Counter[str] = Counter()

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict[str, Any]]:
        from redis.client import Pipeline, Redis
        from redis.connection import AbstractConnection

        originals = {
            (AbstractConnection, "send_packed_command"): AbstractConnection.send_packed_command,
            (AbstractConnection, "read_response"): AbstractConnection.read_response,
            (Redis, "execute_command"): Redis.execute_command,
            (Pipeline, "execute"): Pipeline.execute,
        }
        wire = self

        def send_packed_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            wire.sends += wire.active
            return originals[AbstractConnection, "send_packed_command"](conn, *args, **kwargs)

        def read_response(conn: Any, *args: Any, **kwargs: Any) -> Any:
            wire.replies += wire.active
            return originals[AbstractConnection, "read_response"](conn, *args, **kwargs)

        def execute_command(client: Any, *args: Any, **kwargs: Any) -> Any:
            if wire.active:
                wire.commands[str(args[0]).upper()] += 1
            return originals[Redis, "execute_command"](client, *args, **kwargs)

        def execute(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            if wire.active:
                for command, _ in pipe.command_stack:
                    wire.commands[f"{str(command[0]).upper()} (pipelined)"] += 1
            return originals[Pipeline, "execute"](pipe, *args, **kwargs)

        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
        AbstractConnection.read_response = read_response  # type: ignore[method-assign]
        Redis.execute_command = execute_command  # type: ignore[method-assign]
        Pipeline.execute = execute  # type: ignore[method-assign]
        out: dict[str, Any] = {}
        before, usec_before = self._commandstats()
        self.sends, self.replies, self.commands = 0, 0, Counter()
        self.active = True
        try:
            yield out
        finally:
            self.active = False
            for (owner, name), original in originals.items():
                setattr(owner, name, original)
        after, usec_after = self._commandstats()
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        delta.pop("info", None)  # the reader's own INFO (see store_ops.py)
        server_total = sum(delta.values())
        sent = Counter()
        for name, count in self.commands.items():
            sent[name.removesuffix(" (pipelined)").lower()] += count
        out.update(
            # commandstats is server-wide: another client's commands land in it too.
            # A script's usec include the commands it ran: the top-level commands' usec are the server's time.
            server_usec=sum(usec_after.get(name, 0) - usec_before.get(name, 0) for name in sent),
            server_matches_client=all(delta.get(name, 0) == count for name, count in sent.items()),
            round_trips=self.sends,
            replies=self.replies,
            client_commands=dict(self.commands),
            server_commands=dict(sorted(delta.items())),
            server_total=server_total,
            server_inside_lua=server_total - self.replies,
        )

    def _commandstats(self) -> tuple[dict[str, int], dict[str, int]]:
        """(calls, usec) per command."""
        stats = self.reader.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}
        usec = {name.removeprefix("cmdstat_"): int(value["usec"]) for name, value in stats.items()}
        return calls, usec


class SQLWire:
    """SQL statements (SQLAlchemy ``before_cursor_execute`` on ``store.engine``) and protocol round
    trips (a libpq trace of each pooled connection: one ``ReadyForQuery`` ends each exchange)."""

    def __init__(self, store: Any, workdir: str) -> None:
        self.engine = store.engine
        self.workdir = workdir
        self.statements: Counter[str] = Counter()
        self.selects: list[tuple[str, Any]] = []
        self._traced: list[Any] = []
        self._trace: Any = None

    def _before(self, conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        verb = statement.split(None, 1)[0].upper()
        self.statements[verb] += 1
        if verb == "SELECT":
            self.selects.append((statement, parameters))

    def _checkout(self, dbapi_connection: Any, *_: Any) -> None:
        if any(c is dbapi_connection for c in self._traced):
            return
        from psycopg import pq

        dbapi_connection.pgconn.trace(self._trace.fileno())
        dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        self._traced.append(dbapi_connection)

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict[str, Any]]:
        import sqlalchemy as sa

        self.statements, self.selects, self._traced = Counter(), [], []
        path = os.path.join(self.workdir, f"libpq-{uuid.uuid4().hex[:8]}.trace")
        self._trace = open(path, "w")
        sa.event.listen(self.engine, "before_cursor_execute", self._before)
        sa.event.listen(self.engine.pool, "checkout", self._checkout)
        out: dict[str, Any] = {}
        try:
            yield out
        finally:
            sa.event.remove(self.engine.pool, "checkout", self._checkout)
            sa.event.remove(self.engine, "before_cursor_execute", self._before)
            for dbapi_connection in self._traced:
                dbapi_connection.pgconn.untrace()
            self._trace.close()
        messages: Counter[str] = Counter()
        with open(path) as trace:
            for line in trace:
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 3:
                    continue
                if parts[0] == "B" and parts[2] == "ReadyForQuery":
                    messages["round_trips"] += 1
                elif parts[0] == "F" and parts[2] in ("Parse", "Bind", "Sync"):
                    messages[parts[2]] += 1
                elif parts[0] == "F" and parts[2] == "Query" and len(parts) > 3:
                    messages[f"simple query {parts[3].strip().strip(chr(34)).split(None, 1)[0].upper()}"] += 1
        os.unlink(path)
        out.update(
            round_trips=messages.pop("round_trips", 0),
            statements=sum(self.statements.values()),
            statements_by_verb=dict(self.statements),
            messages=dict(messages),  # simple queries (BEGIN, COMMIT, ...) and extended-protocol messages
        )


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
    wire: dict[str, Any] = field(default_factory=dict)
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
    run.wire = counted
    run.scanned, run.released, run.left = report.scanned, report.released, report.left
    run.purged = getattr(report, "purged", 0)
    if kind == "postgresql" and ns.wire.selects:
        statement, parameters = ns.wire.selects[-1]
        run.plan = explain_due_query(ns.store, statement, parameters)
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
        shift = r % len(plans)
        for run, ns, limit in plans[shift:] + plans[:shift]:
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
    log(f"  {run.store} {run.total:,} records, {run.stale:,} stale, limit {run.limit}: "
        f"{'dry' if run.dry_run else 'REAL'} run scanned {run.scanned} released {run.released}, {run.median:.3f}s "
        f"(scan {_ms(run.scan_seconds)} ms, inspect {_ms(run.inspect_seconds)} ms); "
        f"{run.wire['round_trips']} round trips")  # fmt: skip


# ---- per store --------------------------------------------------------------------------------------


@dataclass
class StoreResult:
    store: str
    detail: str = ""
    server_version: str = ""
    runs: list[Run] = field(default_factory=list)
    layout: dict[str, Any] = field(default_factory=dict)
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
        self.bulk = redis.Redis.from_url(REDIS_URL, socket_timeout=120)
        self.reader = redis.Redis.from_url(REDIS_URL, socket_timeout=30)
        self.bulk.ping()
        self.reader.ping()
        self.wire = RedisWire(self.reader)

    def prefix(self, name: str) -> str:
        return f"rcb{self.run_id}{name}"

    def store(self, name: str) -> Any:
        store = store_from_url(REDIS_URL, key_prefix=self.prefix(name))
        self.stores[name] = store
        return store

    def wire_for(self, store: Any) -> RedisWire:
        return self.wire

    def where(self) -> str:
        return f"db {REDIS_URL.rsplit('/', 1)[-1]}, key prefixes {self.prefix('<ns>')} (ns: n1.. by size, h1, a1)"

    def writer(self, store: Any) -> RedisWriter:
        return RedisWriter(store, self.bulk)

    def version(self) -> str:
        return f"Redis {self.bulk.info('server')['redis_version']}"

    def used_memory(self) -> int:
        return int(self.bulk.info("memory")["used_memory"])

    def memory_usage(self, keys: list[Any]) -> list[int]:
        pipe = self.bulk.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)  # every field, not the default sample of 5
        return [int(n) for n in pipe.execute()]

    def bulk_memory(self, store: Any, population: Population, rng: random.Random) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind in KINDS:
            keys = [store.keys_for(identity(i))[0] for i in population.sample(kind, MEMORY_SAMPLE, rng)]
            sizes = self.memory_usage(keys)
            out[kind] = {"sample": len(sizes), "memory_usage_avg": _avg(sizes),
                         "encoding": self.bulk.object("encoding", keys[0]).decode()}  # fmt: skip
        indexes = [f"{{{store.key_prefix}:{shard}}}:lease" for shard in range(store.index_shards)]
        members = sum(self.bulk.zcard(index) for index in indexes)
        usage = sum(self.memory_usage(indexes))
        out["lease_index"] = {
            "members": members,
            "memory_usage_total": usage,
            "bytes_per_entry": usage / members if members else None,
            "encodings": sorted({self.bulk.object("encoding", index).decode() for index in indexes}),
            "shards": len(indexes),
        }
        return out

    def api_memory(self, store: Any) -> dict[str, Any]:
        """Records made one by one through the store's API, as a running app makes them."""
        made: dict[str, list[Any]] = {"completed_1kb": [], "completed_small": [], "pending": []}
        for i in range(API_SAMPLE):
            for kind in made:
                ident = Identity("", TASK, f"api{kind[-1]}-{i:09d}")  # 14 characters, like the bulk keys
                fp = fingerprint(ident.key)
                t = store.claim(ident, fp, str(uuid.uuid4()), pending_seconds=LIVE_LEASE, ttl_seconds=TTL)
                assert t.decision is Decision.NEW
                if kind != "pending":
                    t = store.acquire(ident, fp, t.record.task_id, lease_seconds=LIVE_LEASE, ttl_seconds=TTL)
                    assert t.record is not None
                    result = RESULT if kind == "completed_1kb" else SMALL_RESULT
                    assert store.complete(ident, t.record.owner, result).decision is Decision.OK
                made[kind].append(store.keys_for(ident)[0])
        out: dict[str, Any] = {}
        for kind, keys in made.items():
            sizes = self.memory_usage(keys)
            out[kind] = {"sample": len(sizes), "memory_usage_avg": _avg(sizes),
                         "encoding": self.bulk.object("encoding", keys[0]).decode()}  # fmt: skip
        return out

    def cleanup(self, name: str) -> int:
        """SCAN + DEL in batches of everything under the prefix (never FLUSHDB: the tests share db 15)."""
        pattern = f"{{{self.prefix(name)}:*"
        deleted = 0
        batch: list[Any] = []
        for key in self.bulk.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(self.bulk.delete(*batch))
                batch = []
        if batch:
            deleted += int(self.bulk.delete(*batch))
        left = sum(1 for _ in self.bulk.scan_iter(match=pattern, count=1000))
        if left:
            log(f"  warning: {left} keys under {pattern} are still there after cleanup")
        return deleted

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.bulk.close()
        self.reader.close()


class PostgresBench:
    kind = "postgresql"

    def __init__(self, run_id: str, workdir: str) -> None:
        import psycopg
        import sqlalchemy as sa

        self.sa = sa
        self.run_id = run_id
        self.stores: dict[str, Any] = {}
        url = sa.make_url(POSTGRES_URL).set(drivername="postgresql")
        self.admin = psycopg.connect(url.render_as_string(hide_password=False))
        self.workdir = workdir

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

    def wire_for(self, store: Any) -> SQLWire:
        return SQLWire(store, self.workdir)

    def where(self) -> str:
        return f"a table per namespace, {self.table('<ns>')} (ns: n1.. by size, h1, a1)"

    def writer(self, store: Any) -> PostgresWriter:
        return PostgresWriter(store, self.admin)

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
        per_index = dict(self.admin.execute(
            "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
            "WHERE indrelid = %(t)s::regclass", {"t": table},
        ).fetchall())  # fmt: skip
        self.admin.commit()
        return {
            "rows": rows, "heap_bytes": heap, "index_bytes": indexes, "total_bytes": total,
            "toast_and_maps_bytes": toast,
            "per_row_total": total / rows if rows else None, "per_row_heap": heap / rows if rows else None,
            "per_row_indexes": indexes / rows if rows else None,
            "per_row_by_index": {k: v / rows for k, v in per_index.items()} if rows else {},
        }  # fmt: skip

    def column_sizes(self, name: str, where: str = "") -> dict[str, Any]:
        table = self.table(name)
        found = self.admin.execute(
            f"SELECT state, result IS NOT NULL AND length(result) > 100, count(*), avg(pg_column_size(t.*)), "
            f'avg(pg_column_size(t.result)) FROM "{table}" t {where} GROUP BY 1, 2 ORDER BY 1, 2'
        ).fetchall()
        self.admin.commit()
        return {f"{state}{' 1 KB result' if big else ''}": {"rows": n, "pg_column_size_row_avg": float(avg),
                "pg_column_size_result_avg": float(res) if res is not None else None}
                for state, big, n, avg, res in found}  # fmt: skip

    def bulk_memory(self, store: Any, population: Population, rng: random.Random) -> dict[str, Any]:
        name = store.key_prefix.removeprefix(self.prefix(""))
        return {"rows": self.column_sizes(name), "relation": self.sizes(name)}

    def api_memory(self, store: Any) -> dict[str, Any]:
        for i in range(API_SAMPLE):
            ident = Identity("", TASK, f"api-{i:010d}")  # 14 characters, like the bulk keys
            fp = fingerprint(ident.key)
            t = store.claim(ident, fp, str(uuid.uuid4()), pending_seconds=LIVE_LEASE, ttl_seconds=TTL)
            t = store.acquire(ident, fp, t.record.task_id, lease_seconds=LIVE_LEASE, ttl_seconds=TTL)
            assert t.record is not None
            assert store.complete(ident, t.record.owner, RESULT).decision is Decision.OK
        out = {"rows": self.column_sizes("a1"), "relation_as_written": self.sizes("a1")}
        self.admin.autocommit = True
        try:
            self.admin.execute(f'VACUUM FULL "{self.table("a1")}"')
        finally:
            self.admin.autocommit = False
        out["relation_after_vacuum_full"] = self.sizes("a1")
        return out

    def used_memory(self) -> int:
        return 0

    def cleanup(self, name: str) -> int:
        table = self.table(name)
        store = self.stores.get(name)
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
        for store in self.stores.values():
            store.close()
        self.admin.close()


def bench_store(kind: str, sizes: tuple[int, ...], repeats: int, run_id: str, workdir: str) -> StoreResult:
    result = StoreResult(kind)
    try:
        bench: Any = RedisBench(run_id) if kind == "redis" else PostgresBench(run_id, workdir)
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
    population = Population(bench.writer(store))
    used_before = bench.used_memory()
    seconds = population.grow_to(total, stale)
    growth: dict[str, Any] = {"namespace": name, "total": total, "stale": stale, "seconds": seconds,
                              "records_per_s": total / seconds}  # fmt: skip
    if bench.kind == "redis":
        growth["used_memory_per_record"] = (bench.used_memory() - used_before) / total
    result.growth.append(growth)
    log(f"  {bench.kind}: namespace {name}: {total:,} records, {stale:,} stale, written in {seconds:.1f}s")
    return Namespace(name, total, stale, store, make_idem(store), bench.wire_for(store), population)


def _measure_store(bench: Any, result: StoreResult, sizes: tuple[int, ...], repeats: int) -> None:
    kind = bench.kind
    namespaces: list[Namespace] = []
    try:
        for number, total in enumerate(sizes, 1):
            namespaces.append(open_namespace(bench, result, f"n{number}", total, STALE))
            if not result.layout:
                check = check_redis_layout if kind == "redis" else check_sql_layout
                result.layout = check(namespaces[0].store, namespaces[0].population)
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
        result.memory["bulk"] = bench.bulk_memory(biggest.store, biggest.population, random.Random(20261122))
        result.memory["bulk"]["namespace_records"] = biggest.total
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
        w = run.wire
        what = "dry" if run.dry_run else "**real**"
        if redis:
            other = "" if w["server_matches_client"] else " ¹"
            tail = f"{w['replies']:,} | {w['server_total']:,}{other} | {w['server_usec']:,}{other} |"
        else:
            tail = f"{w['statements']:,} | {_plan(run.plan)} |"
        lines.append(
            f"| {run.total:,} | {run.stale:,} | {run.limit:,} | {what} | {run.scanned:,} | {run.released:,} "
            f"| {run.median:.3f} | {_ms_range(run.scan_seconds)} | {_ms(run.inspect_seconds)} | {w['round_trips']:,} "
            f"| {tail}"
        )
    if redis and not all(run.wire["server_matches_client"] for run in result.runs):
        lines.append("\n¹ other clients ran the same commands meanwhile (INFO commandstats is server-wide): inflated")
    return "\n".join(lines)


def redis_memory_table(result: StoreResult) -> str:
    bulk, api = result.memory.get("bulk", {}), result.memory.get("api", {})
    index = bulk.get("lease_index", {})
    lines = ["| record | made by | MEMORY USAGE bytes (avg) | encoding | sample |", "|---|---|---:|---|---:|"]
    rows = [
        ("COMPLETED, 1 KB result", "store API (claim, acquire, complete)", api.get("completed_1kb")),
        ("COMPLETED, 1 KB result", "bulk (HSET + PEXPIRE)", bulk.get("completed")),
        ("COMPLETED, 11-byte result", "store API", api.get("completed_small")),
        ("PENDING", "store API (claim)", api.get("pending")),
        ("PENDING (stale)", "bulk (claim script)", bulk.get("stale_pending")),
        ("IN_PROGRESS (stale)", "bulk (acquire script)", bulk.get("stale_running")),
        ("PENDING (live lease)", "bulk (claim script)", bulk.get("live")),
    ]
    for name, how, stats in rows:
        if stats:
            lines.append(f"| {name} | {how} | {stats['memory_usage_avg']:,.0f} | {stats['encoding']} "
                         f"| {stats['sample']:,} |")  # fmt: skip
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
                f"| bulk | {growth['used_memory_per_record']:,.0f} | – | {growth['total']:,} |"
            )
    return "\n".join(lines)


def pg_memory_table(result: StoreResult) -> str:
    bulk, api = result.memory.get("bulk", {}), result.memory.get("api", {})
    lines = ["| what | bytes per row | rows |", "|---|---:|---:|"]
    for made_by, rows in (("bulk (COPY)", bulk.get("rows", {})), ("store API", api.get("rows", {}))):
        for state, stats in rows.items():
            lines.append(f"| pg_column_size(t.*), {state}, {made_by} | {stats['pg_column_size_row_avg']:,.0f} "
                         f"| {stats['rows']:,} |")  # fmt: skip
    for label, rel in (
        ("bulk (COPY) table, ANALYZEd", bulk.get("relation")),
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
    parser.add_argument("--quick", action="store_true", help="10k and 100k records only (under 2 minutes)")
    parser.add_argument("--stores", default=",".join(STORE_KINDS), help="comma-separated: redis,postgresql")
    parser.add_argument("--repeats", type=int, default=7, help="timed dry runs per measurement (default 7)")
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers to this JSON file")
    args = parser.parse_args(argv)
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if set(args.stores) - set(STORE_KINDS) or args.repeats < 1:
        parser.error(f"--stores takes {','.join(STORE_KINDS)}; --repeats at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    run_id = secrets.token_hex(4)
    load_start = os.getloadavg()
    log(f"{os.cpu_count()} cores, load average {load_start[0]:.2f}; sizes {sizes}, run id {run_id}")
    started = time.perf_counter()
    results: list[StoreResult] = []
    with tempfile.TemporaryDirectory(prefix="celery-idem-reconcile-") as workdir:
        for kind in args.stores:
            result = bench_store(kind, sizes, args.repeats, run_id, workdir)
            if result.skipped:
                log(f"skipping {kind}: {result.skipped}")
            results.append(result)
    elapsed = time.perf_counter() - started
    load_end = os.getloadavg()

    for result in results:
        if result.skipped:
            print(f"\nSkipped {result.store}: {result.skipped}")
            continue
        print(f"\n### {result.store} ({result.server_version}; {result.detail})\n")
        print(runs_table(result))
        print()
        print(redis_memory_table(result) if result.store == "redis" else pg_memory_table(result))
        print("\nBulk writes: " + ", ".join(
            f"{g['total']:,} in {g['seconds']:.1f}s ({g['records_per_s']:,.0f}/s)" for g in result.growth))  # fmt: skip
    print(
        f"\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}; 1-minute load average "
        f"{load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end; {args.repeats} timed dry runs per row; "
        f"total {elapsed:.0f}s"
    )
    log(f"total {elapsed:.1f}s")
    if args.json:
        payload = {
            "meta": {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "sizes": sizes,
                "stale": STALE,
                "repeats": args.repeats,
                "inspect_timeout_seconds": INSPECT_TIMEOUT,
                "elapsed_seconds": elapsed,
                "load_average_at_start": load_start,
                "load_average_at_end": load_end,
            },
            "stores": [asdict(r) for r in results],
        }
        with open(args.json, "w") as out:
            json.dump(payload, out, indent=2, default=str)
            out.write("\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
