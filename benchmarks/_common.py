"""What the benchmark scripts share: where the servers are, timing and percentiles, counting round
trips, the machine a run measured on, and JSON output.

The scripts run as ``python benchmarks/<script>.py``, so this folder is on ``sys.path`` and they
``import _common``. tests/test_round_trips.py imports it as ``benchmarks._common``: the round trips a
benchmark reports and the ones the test holds are counted by the same code, on the same
transitions (:class:`Transitions`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from celery_idem.records import Decision, Identity
from celery_idem.stores import MemoryStore, Store

REDIS_URL = os.environ.get("CELERY_IDEM_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get("CELERY_IDEM_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
STORE_KINDS = ("memory", "sqlite", "redis", "postgresql")

T = TypeVar("T")
R = TypeVar("R")


def log(message: str) -> None:
    """Progress and warnings go to stderr; the tables to stdout."""
    print(message, file=sys.stderr, flush=True)


def store_url(kind: str, workdir: str) -> str:
    """The URL of a store kind; SQLite is a file in ``workdir``."""
    if kind == "sqlite":
        return f"sqlite:///{workdir}/bench.db"
    return {"memory": "memory://", "redis": REDIS_URL, "postgresql": POSTGRES_URL}[kind]


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type`` for a comma-separated subset of ``choices``."""

    def parse(text: str) -> list[str]:
        chosen = [part.strip() for part in text.split(",") if part.strip()]
        unknown = sorted(set(chosen) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
        return chosen

    return parse


def remove_prefix(store: Store) -> int:
    """Delete every record (and Redis key) written under the store's prefix; how many went."""
    if type(store).__name__ == "RedisStore":
        client = store.client  # type: ignore[attr-defined]
        pattern, deleted, batch = f"{{{store.key_prefix}:*", 0, []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) == 1000:
                deleted, batch = deleted + int(client.delete(*batch)), []
        deleted += int(client.delete(*batch)) if batch else 0
        left = sum(1 for _ in client.scan_iter(match=pattern, count=1000))
        if left:
            log(f"  warning: {left} redis keys under {pattern} are still there after cleanup")
        return deleted
    if type(store).__name__ == "SQLStore":
        import sqlalchemy as sa

        table = store.table  # type: ignore[attr-defined]
        with store.engine.begin() as connection:  # type: ignore[attr-defined]
            return int(connection.execute(sa.delete(table).where(table.c.namespace == store.key_prefix)).rowcount)
    return len(store)  # type: ignore[arg-type]  # memory: dropped with the store


# ---- timing ---------------------------------------------------------------------------------------


def percentile(ordered: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


@dataclass
class Latency:
    """Per-call latencies in µs: median, nearest-rank p99, mean, min, max."""

    calls: int
    median_us: float
    p99_us: float
    mean_us: float
    min_us: float
    max_us: float

    @classmethod
    def of(cls, nanoseconds: Sequence[int]) -> Latency:
        ordered = sorted(nanoseconds)
        return cls(
            calls=len(ordered),
            median_us=statistics.median(ordered) / 1000,
            p99_us=percentile(ordered, 0.99) / 1000,
            mean_us=statistics.fmean(ordered) / 1000,
            min_us=ordered[0] / 1000,
            max_us=ordered[-1] / 1000,
        )


@dataclass
class Timed:
    """What :func:`time_each` measured: each call's answer and latency, the loop's wall and CPU time."""

    results: list[Any] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list)
    wall_ns: int = 0
    cpu_ns: int = 0  # this process's CPU time: the client side of a call
    started: float = 0.0  # time.time() when the first call began (to compare with a server's timestamps)

    def add(self, other: Timed) -> None:
        self.results += other.results
        self.latencies_ns += other.latencies_ns
        self.wall_ns += other.wall_ns
        self.cpu_ns += other.cpu_ns


def time_each(op: Callable[[T], R], items: Iterable[T]) -> Timed:
    """Call ``op(item)`` for every item, timing each call on its own with ``perf_counter_ns``.

    ``gc.collect()`` runs first; the collector stays on during the loop. The wall time is the whole
    loop's, so ops/s computed from it includes the loop's own small overhead.
    """
    gc.collect()
    clock, timed = time.perf_counter_ns, Timed(started=time.time())
    cpu, start = time.process_time_ns(), clock()
    for item in items:
        t0 = clock()
        timed.results.append(op(item))
        timed.latencies_ns.append(clock() - t0)
    timed.wall_ns = clock() - start
    timed.cpu_ns = time.process_time_ns() - cpu
    return timed


def slice_of(n: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` near-equal consecutive slices of ``range(n)``."""
    return range(n * index // parts, n * (index + 1) // parts)


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` started ``shift`` places later (round ``r`` of an interleaved run starts at ``r``), so a
    change of machine load during the run weighs on every item alike."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


# ---- the store transitions store_ops.py times and tests/test_round_trips.py counts -----------------

TASK = "bench.task"
FINGERPRINT = hashlib.sha256(b"celery-idem benchmark arguments").hexdigest()
RESULT = b'{"ok":true}'
LEASE = TTL = 3600.0


class Transitions:
    """Store transitions on the keys ``<tag>0`` .. ``<tag><n-1>``, through the store's public API.

    Each method takes an index and says whether the store decided as expected. Run ``claim_new``
    before ``claim_duplicate`` (a second producer's call: same fingerprint, its own task id) and
    ``acquire`` before ``complete`` on the same object; ``acquire_complete`` does both as one unit.
    """

    def __init__(self, store: Store, tag: str, n: int) -> None:
        self.store = store
        self.ids = [Identity("", TASK, f"{tag}{i}") for i in range(n)]
        self.task_ids = [f"{tag}-task-{i}" for i in range(n)]
        self.duplicate_ids = [f"{tag}-dup-{i}" for i in range(n)]
        self.owners = [""] * n

    def claim_new(self, i: int) -> bool:
        t = self.store.claim(self.ids[i], FINGERPRINT, self.task_ids[i], pending_seconds=LEASE, ttl_seconds=TTL)
        return t.decision is Decision.NEW

    def claim_duplicate(self, i: int) -> bool:
        t = self.store.claim(self.ids[i], FINGERPRINT, self.duplicate_ids[i], pending_seconds=LEASE, ttl_seconds=TTL)
        return t.decision is Decision.DUPLICATE

    def acquire(self, i: int) -> bool:
        t = self.store.acquire(self.ids[i], FINGERPRINT, self.task_ids[i], lease_seconds=LEASE, ttl_seconds=TTL)
        if t.decision is not Decision.RUN or t.record is None:
            return False
        self.owners[i] = t.record.owner
        return True

    def complete(self, i: int) -> bool:
        return self.store.complete(self.ids[i], self.owners[i], RESULT).decision is Decision.OK

    def acquire_complete(self, i: int) -> bool:
        return self.acquire(i) and self.complete(i)


def run_all(n: int, op: Callable[[int], bool], what: str) -> None:
    """``op(i)`` for i in range(n), untimed; fails if any did not decide as expected."""
    wrong = sum(1 for i in range(n) if not op(i))
    if wrong:
        raise AssertionError(f"{what}: {wrong} of {n} operations did not decide as expected")


# ---- round trips ----------------------------------------------------------------------------------


@dataclass
class Tally:
    """What a counted stretch of work sent to its store."""

    round_trips: int | None = None  # None: in-process (memory, SQLite), nothing crosses a wire
    # Redis: top-level commands by name (pipelined ones marked); SQL: statements SQLAlchemy ran, by verb.
    commands: Counter[str] = field(default_factory=Counter)
    # PostgreSQL: libpq messages (Parse, Bind, Execute, Sync; "Query <VERB>" for a simple query);
    # SQLite: every statement sqlite3 ran, by verb (also what the driver issues itself).
    driver: Counter[str] = field(default_factory=Counter)
    server: dict[str, Any] = field(default_factory=dict)  # Redis with a reader: INFO commandstats deltas
    selects: list[tuple[str, Any]] = field(default_factory=list)  # SQL: each SELECT and its parameters

    def totals(self) -> dict[str, Any]:
        """The counts as plain values (``dataclasses.asdict`` would mangle the Counters)."""
        return {
            "round_trips": self.round_trips,
            "commands": dict(sorted(self.commands.items())),
            "driver": dict(sorted(self.driver.items())),
            "server": self.server,
        }

    def per_op(self, n: int) -> dict[str, Any]:
        """The counts divided by ``n`` operations (the server-side numbers left out)."""
        return {
            "round_trips": None if self.round_trips is None else self.round_trips / n,
            "commands": {name: count / n for name, count in sorted(self.commands.items())},
            "driver": {name: count / n for name, count in sorted(self.driver.items())},
        }


Stats = tuple[Counter[str], Counter[str]]


def commandstats(reader: Any) -> Stats:
    """(calls, usec) per command, from ``INFO commandstats``; ``reader`` is a redis-py client."""
    stats = reader.info("commandstats")
    calls = Counter({name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()})
    usec = Counter({name.removeprefix("cmdstat_"): int(value["usec"]) for name, value in stats.items()})
    return calls, usec


class RedisWire:
    """Counts, on the client side, what redis-py sends while counting (every client in the process).

    Every request it writes (``send_packed_command``: one per command, one per pipeline) is a round
    trip; commands are named where they are sent (a connection's ``send_command``, whichever path
    called it: redis-py's ``execute_command`` or the Redis store's own), and ``Pipeline.execute``.
    With a ``reader`` (a client of its own) it also reads ``INFO commandstats`` before and after:
    the server's count, which includes the commands Lua scripts run inside the server.
    ``commandstats`` is server-wide, so another client's commands land in it too
    (``server_matches_client`` says whether they did). The reader's first ``INFO`` is counted by the
    server only after it has answered, so ``info`` is left out of the delta.
    """

    def __init__(self, reader: Any = None) -> None:
        self.reader = reader

    @contextlib.contextmanager
    def counting(self) -> Iterator[Tally]:
        from redis.client import Pipeline
        from redis.connection import AbstractConnection

        tally = Tally(round_trips=0)
        originals = {
            (AbstractConnection, "send_packed_command"): AbstractConnection.send_packed_command,
            (AbstractConnection, "send_command"): AbstractConnection.send_command,
            (Pipeline, "execute"): Pipeline.execute,
        }

        def send_packed_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            tally.round_trips = (tally.round_trips or 0) + 1
            return originals[AbstractConnection, "send_packed_command"](conn, *args, **kwargs)

        def send_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            tally.commands[str(args[0]).upper()] += 1
            return originals[AbstractConnection, "send_command"](conn, *args, **kwargs)

        def execute(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            for command, _ in pipe.command_stack:
                tally.commands[f"{str(command[0]).upper()} (pipelined)"] += 1
            return originals[Pipeline, "execute"](pipe, *args, **kwargs)

        before = commandstats(self.reader) if self.reader else None
        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
        AbstractConnection.send_command = send_command  # type: ignore[method-assign]
        Pipeline.execute = execute  # type: ignore[method-assign]
        try:
            yield tally
        finally:
            for (owner, name), original in originals.items():
                setattr(owner, name, original)
        if before is not None:
            tally.server = self._server(tally, before, commandstats(self.reader))

    @staticmethod
    def _server(tally: Tally, before: Stats, after: Stats) -> dict[str, Any]:
        delta = after[0] - before[0]
        delta.pop("info", None)
        sent = Counter()
        for name, count in tally.commands.items():
            sent[name.removesuffix(" (pipelined)").lower()] += count
        top = sum(delta[name] for name in sent)
        return {
            "commands": dict(sorted(delta.items())),
            "total": delta.total(),  # top-level commands and the ones run inside scripts
            "top_level": top,
            "inside_lua": delta.total() - top,
            # A script's usec include the commands it ran: the top-level commands' usec are the server's time.
            "usec": sum(after[1][name] - before[1][name] for name in sent),
            "matches_client": all(delta[name] == count for name, count in sent.items()),
        }


class SQLWire:
    """Counts what a SQL store's engine runs while counting.

    Statements: a SQLAlchemy ``before_cursor_execute`` listener (it does not see what the driver
    issues itself, such as BEGIN and COMMIT). PostgreSQL: a libpq trace of every connection the pool
    hands out; each ``ReadyForQuery`` the server sends ends one exchange the client waited for (a
    simple Query, or an extended-protocol Sync), so their number is the number of round trips.
    SQLite: sqlite3's trace callback sees every statement it runs, its own included; in-process,
    so no round trips. MySQL/MariaDB: every command PyMySQL sends (``_execute_command``: a query, or
    the ROLLBACK of a pool's reset) waits for its reply, so their number is the number of round
    trips; the driver's count is the queries by verb (what the server ran, the driver's own included).
    """

    def __init__(self, store: Store) -> None:
        self.engine = store.engine  # type: ignore[attr-defined]
        self.postgres = self.engine.dialect.name == "postgresql"
        self.mysql = self.engine.dialect.name in ("mysql", "mariadb")

    @contextlib.contextmanager
    def counting(self) -> Iterator[Tally]:
        import sqlalchemy as sa

        tally = Tally(round_trips=0 if self.postgres or self.mysql else None)
        traced: list[Any] = []
        descriptor, path = tempfile.mkstemp(prefix="celery-idem-libpq-", suffix=".trace")
        trace = os.fdopen(descriptor, "w")

        def before(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
            verb = statement.split(None, 1)[0].upper()
            tally.commands[verb] += 1
            if verb == "SELECT":
                tally.selects.append((statement, parameters))

        def sqlite_statement(statement: str) -> None:
            tally.driver[statement.split(None, 1)[0].upper()] += 1

        def checkout(dbapi_connection: Any, *_: Any) -> None:
            if any(c is dbapi_connection for c in traced):
                return
            if self.postgres:
                from psycopg import pq

                dbapi_connection.pgconn.trace(trace.fileno())
                dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            elif self.mysql:
                send = type(dbapi_connection)._execute_command

                def counted(command: int, sql: Any, *, _send: Any = send, _conn: Any = dbapi_connection) -> Any:
                    tally.round_trips = (tally.round_trips or 0) + 1
                    text = sql.decode(errors="replace") if isinstance(sql, bytes) else str(sql)
                    tally.driver[(text.split(None, 1) or ["?"])[0].upper()] += 1
                    return _send(_conn, command, sql)

                dbapi_connection._execute_command = counted
            else:
                dbapi_connection.set_trace_callback(sqlite_statement)
            traced.append(dbapi_connection)

        sa.event.listen(self.engine, "before_cursor_execute", before)
        sa.event.listen(self.engine.pool, "checkout", checkout)
        try:
            yield tally
        finally:
            sa.event.remove(self.engine.pool, "checkout", checkout)
            sa.event.remove(self.engine, "before_cursor_execute", before)
            for dbapi_connection in traced:
                if self.postgres:
                    dbapi_connection.pgconn.untrace()  # flushes the trace
                elif self.mysql:
                    del dbapi_connection._execute_command  # the class's own again
                else:
                    dbapi_connection.set_trace_callback(None)
            trace.close()
            with open(path) as lines:
                self._read_trace(lines, tally)
            os.unlink(path)

    @staticmethod
    def _read_trace(trace: Iterable[str], tally: Tally) -> None:
        for line in trace:
            direction, _, message, *rest = [*line.rstrip("\n").split("\t"), "", ""][:4]
            if direction == "B" and message == "ReadyForQuery":
                tally.round_trips = (tally.round_trips or 0) + 1
            elif direction == "F" and message in ("Parse", "Bind", "Execute", "Sync"):
                tally.driver[message] += 1
            elif direction == "F" and message == "Query":
                tally.driver[f"Query {rest[0].strip().strip(chr(34)).split(None, 1)[0].upper()}"] += 1


class InProcess:
    """The memory store: nothing to count."""

    @contextlib.contextmanager
    def counting(self) -> Iterator[Tally]:
        yield Tally()


def wire_for(store: Store, reader: Any = None) -> RedisWire | SQLWire | InProcess:
    """The counter for ``store``'s kind (``reader``: see :class:`RedisWire`)."""
    if isinstance(store, MemoryStore):
        return InProcess()
    return RedisWire(reader) if type(store).__name__ == "RedisStore" else SQLWire(store)


ACCOUNTED = ("claim (new)", "claim (duplicate)", "acquire", "complete")


def account(store: Store, n: int, tag: str, wire: RedisWire | SQLWire | InProcess) -> dict[str, Tally]:
    """Count each transition of :data:`ACCOUNTED` over ``n`` operations on fresh keys, one batch each."""
    claimed, acquired = Transitions(store, f"{tag}n", n), Transitions(store, f"{tag}a", n)
    tallies = {}
    for transition, op in zip(
        ACCOUNTED, (claimed.claim_new, claimed.claim_duplicate, acquired.acquire, acquired.complete), strict=True
    ):
        with wire.counting() as tallies[transition]:
            run_all(n, op, f"{type(store).__name__} {transition}")
    return tallies


# ---- a private redis-server, and CPU time of processes -------------------------------------------


class PrivateRedis:
    """A redis-server of the run's own on a free loopback port: no persistence (``--save ""
    --appendonly no``), its files in a temporary directory, stopped by :meth:`stop`. Its CPU time is
    then this run's alone, and its memory holds only what the run wrote.
    """

    def __init__(self, binary: str | None = None) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise RuntimeError("redis-server is not installed")
        self.dir = tempfile.TemporaryDirectory(prefix="celery-idem-bench-redis-")
        with socket.socket() as probe:  # the kernel's pick; redis-server binds it a moment later
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.command = [found, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.command += ["--dir", self.dir.name, "--logfile", "redis.log"]
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self.process.pid
        self.url = f"redis://127.0.0.1:{self.port}"
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self.log()}")
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def log(self) -> str:
        path = os.path.join(self.dir.name, "redis.log")
        return open(path).read()[-2000:] if os.path.exists(path) else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.dir.cleanup()


def redis_cpu_seconds(client: Any) -> float:
    """The Redis server's user + system CPU seconds (``INFO cpu``: getrusage of the whole server
    process, microsecond resolution). Server-wide: on a shared server, other clients' work too."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first); None if
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def process_cpu_seconds(pid: int, *, reaped_children: bool = False) -> float | None:
    """user + system CPU seconds of a process (all its threads, alive or ended: /proc/<pid>/stat
    utime + stime, in clock ticks, 10 ms at USER_HZ 100); with ``reaped_children``, plus cutime +
    cstime: its children (and theirs) that ended and were waited for. None if it is gone."""
    fields = _proc_stat(pid)
    if fields is None:
        return None
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + ((cutime + cstime) if reaped_children else 0)) / CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, theirs, ...), from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class TreeCPU:
    """CPU seconds of a process tree at one moment, and the processes it was summed over."""

    seconds: float
    pids: tuple[int, ...]


def tree_cpu(root: int) -> TreeCPU:
    """user + system CPU seconds of ``root`` and every live descendant, each with its ended children
    that were waited for (cutime + cstime). A pool child that ends and is reaped between two readings
    moves from its own count into its parent's cutime, so the difference of two readings loses
    nothing (unless a process ends and is never waited for by a process of the tree)."""
    pids = (root, *descendants(root))
    total = 0.0
    for pid in pids:
        seconds = process_cpu_seconds(pid, reaped_children=True)
        total += seconds or 0.0
    return TreeCPU(total, pids)


# ---- the machine, and JSON ------------------------------------------------------------------------

PACKAGES = ("celery-idem", "celery", "kombu", "redis", "hiredis", "sqlalchemy", "psycopg")


def versions(*more: str) -> dict[str, str]:
    """Installed versions of the packages a run depends on (and ``more``)."""
    found = {}
    for name in (*PACKAGES, *more):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


class Machine:
    """The machine a run measures on: cores, Python, load average at the start and the end, wall time.

    Made at the start of a run; :meth:`finish` at its end.
    """

    def __init__(self, *more_packages: str) -> None:
        self.more_packages = more_packages
        self.load_at_start = os.getloadavg()
        self.load_at_end = self.load_at_start
        self.started = time.perf_counter()
        self.elapsed = 0.0
        log(f"{os.cpu_count()} cores, load average " + " ".join(f"{x:.2f}" for x in self.load_at_start))

    def finish(self) -> None:
        self.elapsed = time.perf_counter() - self.started
        self.load_at_end = os.getloadavg()
        log(f"total {self.elapsed:.1f} s")

    def summary(self, *details: str) -> str:
        """One line for the end of a report; ``details`` follow the Python version."""
        return (
            f"Machine: {', '.join([f'{os.cpu_count()} cores', f'Python {platform.python_version()}', *details])}; "
            f"1-minute load average {self.load_at_start[0]:.2f} at the start, {self.load_at_end[0]:.2f} at the end"
        )

    def meta(self, **more: Any) -> dict[str, Any]:
        """The ``meta`` of a JSON report (benchmarks/plot.py reads it for its footers)."""
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "versions": versions(*self.more_packages),
            "elapsed_seconds": self.elapsed,
            "load_average_at_start": self.load_at_start,
            "load_average_at_end": self.load_at_end,
            **more,
        }


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as out:
        json.dump(payload, out, indent=2, default=str)
        out.write("\n")
    log(f"wrote {path}")


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path) as handle:
        data: dict[str, Any] = json.load(handle)
    return data
