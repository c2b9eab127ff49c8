#!/usr/bin/env python
"""What an idempotency layer costs a Celery task: celery-idem against plain Celery, celery-once and
celery-singleton, on one broker, result backend and worker.

Run from the repository root::

    python benchmarks/overhead.py [--tasks N] [--rounds R] [--store redis|postgresql] [--json out.json]
    python benchmarks/overhead.py --smoke          # every phase, small: under a minute

It starts a private ``redis-server`` on a free port (broker, result backend and the Redis stores;
``--redis-url`` uses an external server instead) and one ``celery -A overhead_app worker -P
prefork -c 2`` subprocess (the app is ``benchmarks/overhead_app.py``: one no-op task and one
counting task per variant, all on the same queue), and measures, per variant:

- end-to-end throughput and CPU per task: N no-op tasks with distinct arguments, published in
  interleaved rounds (every round runs every variant once, in a rotated order); wall time from the
  first publish to the last result the worker stored (the latest ``date_done``); CPU time of the
  producer's publish loop, of the worker's process tree, of the redis-server and (``--store
  postgresql``) of the PostgreSQL backends serving the store, each per task and as a ratio to plain
  Celery in the same round;
- ``apply_async`` latency of a new call and of a duplicate call (same key/arguments as an earlier
  call), with the originals parked on a queue no worker consumes, so that they stay in flight;
- store round trips per task: the top-level commands each variant's store database receives
  during an isolated, untimed batch, seen with ``MONITOR``; cross-checked with ``INFO
  commandstats`` deltas over the whole server minus the same batch of plain Celery tasks;
- executions in a duplicate-heavy workload: 2000 calls over 50 argument sets from 4 threads,
  counted by an INCR in the task body.

It uses Redis databases 6-11: 6-9 are its own and flushed before and after the run; in the broker
(10) and result backend (11) databases, which other clients of an external server may share, it
deletes only the keys it wrote. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from _common import (
    CLOCK_TICKS,
    POSTGRES_URL,
    Latency,
    Machine,
    PrivateRedis,
    choice_list,
    commandstats,
    log,
    process_cpu_seconds,
    redis_cpu_seconds,
    rotated,
    slice_of,
    time_each,
    tree_cpu,
    versions,
    write_json,
)

HERE = Path(__file__).resolve().parent
# overhead_app (beside this script, on sys.path as the script's folder) reads its servers from the
# environment when it is imported: main() chooses them, sets the environment, then imports it.
bench: Any = None
PEERS = ("celery_once", "celery-singleton")  # their versions go in the report
THROUGHPUT_TARGET = 0.9  # IdempotentTask tasks/s >= 90% of plain Celery's
RESULT_TIMEOUT = 120.0
POLL_SECONDS = 0.005
SETTLE_SECONDS = 0.3  # peers release their locks just after the result is stored
WORKER_START_TIMEOUT = 60.0
IDLE_SECONDS = 2.0  # the idle CPU reading after the warm-up


CPU_PARTS = ("producer", "worker", "redis", "postgres")
CPU_PART_LABELS = {
    "producer": "producer",
    "worker": "worker",
    "redis": "redis-server",
    "postgres": "PostgreSQL backends",
}


@dataclass
class CpuReading:
    """CPU seconds, at one moment, of what serves a batch (see :class:`CpuMeter`)."""

    producer_process: float  # the whole benchmark process: publishing, waiting, polling
    worker: float
    worker_pids: tuple[int, ...]
    redis: float
    postgres: float | None = None
    postgres_pids: tuple[int, ...] = ()


@dataclass
class CpuRound:
    """What one variant's batch of one throughput round cost, in CPU seconds."""

    tasks: int
    seconds: float  # the batch's wall time: first publish to last date_done
    producer: float  # the publish loop of the benchmark process (apply_async and its loop)
    producer_process: float  # the benchmark process over the whole window, waiting and polling included
    worker: float  # the worker's parent and pool children
    redis: float  # the redis-server (broker, result backend, Redis stores)
    postgres: float | None = None  # the PostgreSQL backends of the store's connections (--store postgresql)
    worker_pids_changed: bool = False  # a pool child was replaced during the batch (its CPU is kept: cutime)
    postgres_backends: int = 0  # the store's connections' backends at the end of the batch
    postgres_backends_ended: int = 0  # backends that were gone at the end: their CPU since the start is lost

    @classmethod
    def between(cls, before: CpuReading, after: CpuReading, *, tasks: int, seconds: float, producer: float) -> CpuRound:
        postgres = None
        if before.postgres is not None and after.postgres is not None:
            postgres = after.postgres - before.postgres
        return cls(
            tasks=tasks,
            seconds=seconds,
            producer=producer,
            producer_process=after.producer_process - before.producer_process,
            worker=after.worker - before.worker,
            redis=after.redis - before.redis,
            postgres=postgres,
            worker_pids_changed=before.worker_pids != after.worker_pids,
            postgres_backends=len(after.postgres_pids),
            postgres_backends_ended=len(set(before.postgres_pids) - set(after.postgres_pids)),
        )

    def part(self, name: str) -> float:
        """CPU seconds of one part; ``total``: the parts summed (the producer's publish loop only)."""
        if name == "total":
            return sum(self.part(p) for p in CPU_PARTS)
        value = getattr(self, name)
        return 0.0 if value is None else float(value)

    def us_per_task(self, name: str) -> float:
        return self.part(name) / self.tasks * 1e6


@dataclass
class VariantReport:
    variant: str
    label: str
    tasks: int = 0
    seconds: float = 0.0
    tasks_per_s: float = 0.0
    round_tasks_per_s: list[float] = field(default_factory=list)
    publish_seconds: float = 0.0  # summed time of the publish loops alone
    new_under_load: Latency | None = None  # apply_async during the throughput rounds
    new: Latency | None = None  # apply_async of a new call, originals held
    duplicate: Latency | None = None
    duplicate_outcome: str = ""
    store_round_trips_per_task: float | None = None
    accounting: dict[str, Any] = field(default_factory=dict)
    executions: int | None = None
    dup_calls: int = 0
    dup_published: int = 0
    dup_seconds: float = 0.0
    cpu_rounds: list[CpuRound] = field(default_factory=list)


# ---- publishing -----------------------------------------------------------------------------------


PUBLISHED: list[str] = []  # the id every call returned


class Caller:
    """Calls one variant's task (the no-op one, or the counting one) the way its library means."""

    def __init__(self, variant: str, *, counting: bool = False) -> None:
        self.variant = variant
        self.spec = bench.BY_NAME[variant]
        self.task = bench.TASKS[variant][1 if counting else 0]
        self.keyed = self.spec.keyed
        self.refusal: tuple[type[BaseException], ...] = ()  # what the library raises for a duplicate
        if self.spec.library == "once":
            from celery_once import AlreadyQueued

            self.refusal = (AlreadyQueued,)

    def __call__(self, x: int, key: str, **options: Any) -> tuple[Any, bool]:
        """Publish ``task(x)``; returns (result or None, whether the library refused it as queued).

        celery-once raises AlreadyQueued for a duplicate: it is caught here, inside the timed call.
        """
        if self.keyed:
            options["idempotency_key"] = key
        try:
            result = self.task.apply_async((x,), **options)
        except self.refusal:
            return None, True
        PUBLISHED.append(result.id)  # its result is deleted at the end, whatever happens meanwhile
        return result, False


def publisher(call: Caller, tag: str, **options: Any) -> Callable[[int], tuple[Any, bool]]:
    """``call(x)`` keyed ``<tag>-<x>`` (the key only matters to ``idem``; every ``x`` is fresh)."""
    return lambda x: call(x, f"{tag}-{x}", **options)


def wait_for(app: Any, task_ids: Iterable[str], timeout: float = RESULT_TIMEOUT) -> float:
    """Poll the result keys (MGET, every 5 ms) until every task has stored SUCCESS.

    Returns the latest ``date_done`` (epoch seconds): when the last result was stored.
    """
    backend = app.backend
    client = backend.client
    pending = {backend.get_key_for_task(task_id): task_id for task_id in task_ids}
    latest = 0.0
    deadline = time.monotonic() + timeout
    while pending:
        keys = list(pending)
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            for key, value in zip(chunk, client.mget(chunk), strict=True):
                if value is None:
                    continue
                meta = backend.decode_result(value)
                if meta["status"] != "SUCCESS":
                    raise AssertionError(f"task {pending[key]} ended {meta['status']}: {meta.get('result')!r}")
                done = datetime.datetime.fromisoformat(meta["date_done"])
                if done.tzinfo is None:
                    done = done.replace(tzinfo=datetime.timezone.utc)
                latest = max(latest, done.timestamp())
                del pending[key]
        if pending:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(pending)} results not ready after {timeout:.0f} s")
            time.sleep(POLL_SECONDS)
    return latest


def finish(app: Any, variant: str, task_ids: Iterable[str]) -> float:
    """Wait until a batch has run; returns the latest ``date_done`` of its results and the sentinel's.

    A plain sentinel task with a result is published after the batch, to the same queue: the
    worker takes messages in order, so once the sentinel's result is stored every task of the batch
    has run or is running in the other pool child. Polling its one key (not the whole batch's) keeps
    the waiting cheap for the producer and the server; then the batch's own results are read (a
    variant with ``ignore_result=True`` has none: the sentinel is its end). Every variant's batch
    gets a sentinel, so each carries the same one extra plain task.
    """
    mark = bench.sentinel.apply_async()
    PUBLISHED.append(mark.id)
    wait_for(app, [mark.id])
    ids = list(task_ids) if bench.BY_NAME[variant].stores_result else []
    return wait_for(app, [*ids, mark.id])


def drain_result_channel(app: Any) -> int:
    """Read what Celery's Redis result consumer was sent on its pub/sub connection.

    Every apply_async subscribes to the task's result channel (Celery's own behaviour with a Redis
    backend). The benchmark waits by polling instead, so the published results pile up unread on
    that connection; reading them between batches (untimed) keeps the socket and the server's
    output buffer empty.
    """
    pubsub = getattr(app.backend.result_consumer, "_pubsub", None)
    read = 0
    while pubsub is not None and pubsub.connection is not None:
        response = pubsub.parse_response(block=False, timeout=0)
        if response is None:
            break
        pubsub.handle_message(response, ignore_subscribe_messages=True)
        read += 1
    return read


def release(app: Any, results: list[Any]) -> None:
    """Drop a batch's results (Celery unsubscribes their channels) and read the replies."""
    drain_result_channel(app)
    results.clear()
    gc.collect()
    drain_result_channel(app)


class Args:
    """Distinct task arguments for the whole run (celery-idem keeps records: never reuse one)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


# ---- the worker -----------------------------------------------------------------------------------


class Worker:
    """``celery -A overhead_app worker`` in its own process group, logging to a temporary file."""

    def __init__(self, logdir: str) -> None:
        self.log_path = Path(logdir) / "worker.log"
        # No --max-tasks-per-child: the two pool children live through the run, so the CPU readings
        # between batches see the same processes (a replaced child's time is kept anyway: cutime).
        pool = "-P prefork -c 2 --without-gossip --without-mingle --without-heartbeat".split()
        name = f"overhead-{uuid.uuid4().hex[:6]}@%h"
        self.command = [sys.executable, "-m", "celery", "-A", "overhead_app", "worker", *pool]
        self.command += ["-Q", bench.QUEUE, "-n", name, "-l", "WARNING"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
        with self.log_path.open("wb") as out:
            self.process = subprocess.Popen(
                self.command, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def check(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the worker exited with {self.process.returncode}:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def problems(self) -> list[str]:
        """Warning and error lines of the worker's log (it runs at -l WARNING), but for Celery's
        warning about running as root."""
        text = self.log_path.read_text(errors="replace")
        text = re.sub(
            r"(?s)SecurityWarning: You're running the worker with superuser.*?_warn_or_raise_security_error\(.*?\n",
            "",
            text,
        )
        return [line for line in text.splitlines() if re.search(r"WARNING|ERROR|CRITICAL|Traceback|Error\b", line)]

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        # Warm shutdown: the parent lets its children finish their tasks (a SIGTERM to the children
        # themselves would kill them mid-task). The whole group is killed only if that hangs.
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


# ---- CPU time ------------------------------------------------------------------------------------


class PgBackends:
    """The PostgreSQL server processes behind the store's connections: every connection the run's
    store opens (producer and pool children) carries the run's ``application_name``, and
    ``pg_stat_activity`` gives their backend pids, whose CPU time /proc has (the server runs on this
    machine). A backend that ends between two readings takes its CPU time with it: counted as ended.
    """

    def __init__(self, url: str, application_name: str) -> None:
        import psycopg
        import sqlalchemy as sa

        plain = sa.engine.make_url(url).set(drivername="postgresql", query={})
        self.connection = psycopg.connect(plain.render_as_string(hide_password=False), autocommit=True)
        self.application_name = application_name
        row = self.connection.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        self.local = process_cpu_seconds(int(row[0])) is not None  # its own backend is visible in /proc

    def read(self) -> tuple[float, tuple[int, ...]]:
        rows = self.connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (self.application_name,)
        ).fetchall()
        pids = tuple(sorted(int(pid) for (pid,) in rows))
        return sum(process_cpu_seconds(pid) or 0.0 for pid in pids), pids

    def close(self) -> None:
        self.connection.close()


class CpuMeter:
    """Reads the CPU seconds of what serves the benchmark: this process, the worker's process tree
    (:func:`_common.tree_cpu`, 10 ms ticks), the redis-server (``INFO cpu``, microseconds) and the
    PostgreSQL backends of the store (:class:`PgBackends`, 10 ms ticks)."""

    def __init__(self, worker_pid: int, postgres: PgBackends | None) -> None:
        self.worker_pid = worker_pid
        self.redis = redis.Redis.from_url(bench.url(bench.DB_COUNTER))
        self.postgres = postgres

    def read(self) -> CpuReading:
        tree = tree_cpu(self.worker_pid)
        postgres, pids = self.postgres.read() if self.postgres else (None, ())
        return CpuReading(
            producer_process=time.process_time_ns() / 1e9,
            worker=tree.seconds,
            worker_pids=tree.pids,
            redis=redis_cpu_seconds(self.redis),
            postgres=postgres,
            postgres_pids=pids,
        )

    def idle(self, seconds: float) -> dict[str, float | None]:
        """CPU µs per second of each part while nothing is sent (the worker polls its broker, the
        heartbeat threads tick): what a batch's window carries whatever its tasks."""
        before = self.read()
        time.sleep(seconds)
        after = self.read()
        spent = CpuRound.between(before, after, tasks=1, seconds=seconds, producer=0.0)
        rates: dict[str, float | None] = {part: spent.part(part) / seconds * 1e6 for part in ("worker", "redis")}
        rates["postgres"] = None if spent.postgres is None else spent.postgres / seconds * 1e6
        return rates

    def close(self) -> None:
        self.redis.close()
        if self.postgres:
            self.postgres.close()


def warm_up(app: Any, variants: list[str], args: Args, worker: Worker, n: int) -> None:
    """Untimed: connections, Lua scripts, handlers and imports in the producer and both children;
    the held queue is declared here too."""
    results: list[Any] = []
    for variant in variants:
        for counting in (False, True):
            call = Caller(variant, counting=counting)
            for x in args.take(n // 4 if counting else n):
                result, _ = call(x, f"warm-{x}")
                if call.spec.stores_result:
                    results.append(result)
        Caller(variant)(args.take(1)[0], f"warm-held-{variant}", queue=bench.HELD_QUEUE)
    deadline = time.monotonic() + WORKER_START_TIMEOUT
    while True:
        worker.check()
        try:
            wait_for(app, [r.id for r in results], timeout=1.0)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
    finish(app, "plain", [])  # the tasks that keep no result have run too
    release(app, results)


# ---- 1. throughput --------------------------------------------------------------------------------


def throughput(
    app: Any,
    variants: list[str],
    args: Args,
    reports: dict[str, VariantReport],
    n: int,
    rounds: int,
    meter: CpuMeter,
) -> None:
    """Each batch: read the CPU meter, publish (timed), wait for the batch (:func:`finish`), pause
    ``SETTLE_SECONDS`` (the peers release their locks, celery-idem may settle, just after the result
    is stored), read the meter again."""
    latencies: dict[str, list[int]] = {v: [] for v in variants}
    for round_ in range(rounds):
        order = rotated(variants, round_)
        size = len(slice_of(n, rounds, round_))
        for variant in order:
            report = reports[variant]
            before = meter.read()
            timed = time_each(publisher(Caller(variant), "tp"), args.take(size))
            latencies[variant] += timed.latencies_ns
            if any(refused or getattr(result, "deduplicated", False) for result, refused in timed.results):
                raise AssertionError(f"{variant}: a new call with distinct arguments was taken for a duplicate")
            results = [result for result, _ in timed.results]
            last_done = finish(app, variant, [r.id for r in results])
            time.sleep(SETTLE_SECONDS)
            after = meter.read()
            seconds = last_done - timed.started
            spent = CpuRound.between(before, after, tasks=size, seconds=seconds, producer=timed.cpu_ns / 1e9)
            if spent.worker_pids_changed:
                log(f"  note: the worker's processes changed during a {variant} batch: {after.worker_pids}")
            if spent.postgres_backends_ended:
                log(f"  note: {spent.postgres_backends_ended} PostgreSQL backends ended during a {variant} batch")
            report.cpu_rounds.append(spent)
            report.tasks += size
            report.seconds += seconds
            report.publish_seconds += timed.wall_ns / 1e9
            report.round_tasks_per_s.append(size / seconds)
            release(app, results)
        log(
            f"  round {round_ + 1}/{rounds}: "
            + ", ".join(
                f"{v} {reports[v].round_tasks_per_s[-1]:,.0f}/s "
                f"{reports[v].cpu_rounds[-1].us_per_task('total'):,.0f} µs"
                for v in order
            )
        )
    for variant in variants:
        report = reports[variant]
        report.tasks_per_s = report.tasks / report.seconds
        report.new_under_load = Latency.of(latencies[variant])


# ---- 2. apply_async latency, new and duplicate ----------------------------------------------------


def latency(app: Any, variants: list[str], args: Args, reports: dict[str, VariantReport], k: int, slices: int) -> None:
    """New calls, then a duplicate of each, all on the held queue (no worker consumes it), so every
    original is still queued when its duplicate comes: the case each library deduplicates."""
    new: dict[str, list[int]] = {v: [] for v in variants}
    dup: dict[str, list[int]] = {v: [] for v in variants}
    outcomes: dict[str, Counter[str]] = {v: Counter() for v in variants}
    for slice_ in range(slices):
        order = rotated(variants, slice_)
        size = len(slice_of(k, slices, slice_))
        originals: dict[str, list[tuple[int, str]]] = {}
        held: list[Any] = []
        for variant in order:
            batch = args.take(size)
            timed = time_each(publisher(Caller(variant), "lat", queue=bench.HELD_QUEUE), batch)
            new[variant] += timed.latencies_ns
            originals[variant] = []
            for x, (result, refused) in zip(batch, timed.results, strict=True):
                if refused or result is None or getattr(result, "deduplicated", False):
                    raise AssertionError(f"{variant}: a new call was taken for a duplicate")
                originals[variant].append((x, result.id))
                held.append(result)
        for variant in order:
            batch = [x for x, _ in originals[variant]]
            timed = time_each(publisher(Caller(variant), "lat", queue=bench.HELD_QUEUE), batch)
            dup[variant] += timed.latencies_ns
            for (_, original_id), (result, refused) in zip(originals[variant], timed.results, strict=True):
                outcomes[variant][_duplicate_outcome(variant, result, refused, original_id)] += 1
                held.append(result)
        release(app, held)
    for variant in variants:
        reports[variant].new = Latency.of(new[variant])
        reports[variant].duplicate = Latency.of(dup[variant])
        reports[variant].duplicate_outcome = ", ".join(f"{name} {count}" for name, count in outcomes[variant].items())
        expected = "published again" if bench.BY_NAME[variant].library == "celery" else None
        if expected is None and len(outcomes[variant]) != 1:
            raise AssertionError(f"{variant}: duplicates were not all refused: {dict(outcomes[variant])}")
        if expected and set(outcomes[variant]) != {expected}:
            raise AssertionError(f"{variant}: unexpected duplicate outcomes {dict(outcomes[variant])}")


def _duplicate_outcome(variant: str, result: Any, refused: bool, original_id: str) -> str:
    if refused:
        return "AlreadyQueued raised"
    if result is None:
        return "no result"
    if result.id != original_id:
        return "published again"
    if bench.BY_NAME[variant].library == "idem":
        return "original id, deduplicated=True" if result.deduplicated else "original id, deduplicated=False"
    return "original id returned"


# ---- 3. duplicate-heavy workload ------------------------------------------------------------------


def _publish_concurrently(call: Caller, set_args: list[int], calls: int, threads: int) -> tuple[set[str], float]:
    """``calls`` calls spread round-robin over the argument sets, from ``threads`` threads started
    together; returns the ids of the tasks that were published and when the first call began."""
    published: list[list[Any]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def publisher(t: int) -> None:
        mine = published[t]
        barrier.wait()
        for j in range(t, calls, threads):
            s = j % len(set_args)
            result, refused = call(set_args[s], f"set-{s}")
            if not refused:
                mine.append(result)

    pool = [threading.Thread(target=publisher, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait()
    start_wall = time.time()
    for thread in pool:
        thread.join()
    return {r.id for batch in published for r in batch}, start_wall


def duplicate_heavy(
    app: Any, variants: list[str], args: Args, reports: dict[str, VariantReport], calls: int, sets: int, threads: int
) -> None:
    """Same arguments published many times at once; the task body INCRs a counter per execution.
    IdempotentTask is called with ``idempotency_key=f"set-{i}"`` (and key-less); the peers dedupe
    on the arguments by themselves."""
    counter = redis.Redis.from_url(bench.url(bench.DB_COUNTER))
    try:
        for variant in variants:
            report = reports[variant]
            counter.delete(bench.counter_key(variant))
            task_ids, start_wall = _publish_concurrently(
                Caller(variant, counting=True), args.take(sets), calls, threads
            )
            last_done = finish(app, variant, task_ids)
            time.sleep(SETTLE_SECONDS)
            report.executions = int(counter.get(bench.counter_key(variant)) or 0)
            report.dup_calls = calls
            report.dup_published = len(task_ids)
            report.dup_seconds = last_done - start_wall
            release(app, [])
            log(f"  {variant}: {report.executions} executions of {calls} calls, {len(task_ids)} tasks published")
    finally:
        counter.close()


# ---- 4. store round trips -------------------------------------------------------------------------


_MONITOR_LINE = re.compile(r'^\S+ \[(\d+) ([^\]]*)\] "([^"]*)"')


class MonitorTap:
    """Reads ``MONITOR`` in a thread and counts, per window, every command by (db, top-level or
    inside a Lua script, name). Windows are delimited by ECHO markers sent from another client, so
    they are cut exactly where the server executed the markers."""

    MARK = "celery-idem-overhead-mark:"

    def __init__(self) -> None:
        self.client = redis.Redis.from_url(bench.url(bench.DB_COUNTER), protocol=2)
        self.marker = redis.Redis.from_url(bench.url(bench.DB_COUNTER), protocol=2)
        self.windows: dict[str, Counter[tuple[int, str, str]]] = {}
        self._current: Counter[tuple[int, str, str]] | None = None
        self._seen = threading.Event()
        self._marks: list[str] = []
        self._monitor = self.client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._read, name="monitor", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        connection = self._monitor.connection
        while True:
            line = connection.read_response()
            if isinstance(line, bytes):
                line = line.decode("utf-8", "replace")
            match = _MONITOR_LINE.match(line)
            if match is None:
                continue
            db, source, name = int(match[1]), match[2], match[3].lower()
            if name == "echo" and self.MARK in line:
                mark = line.split(self.MARK, 1)[1].split('"', 1)[0]
                if mark == "stop":
                    self._seen.set()
                    return
                self._current = self.windows.setdefault(mark, Counter()) if mark.startswith("begin:") else None
                self._seen.set()
                continue
            if self._current is not None:
                self._current[(db, "lua" if source == "lua" else "top", name)] += 1

    def mark(self, what: str) -> None:
        self._seen.clear()
        self.marker.echo(self.MARK + what)
        if not self._seen.wait(30):
            raise RuntimeError(f"MONITOR did not show the marker {what!r}")

    def close(self) -> None:
        try:
            self.mark("stop")
            self._thread.join(5)
        finally:
            self._monitor.__exit__()
            self.marker.close()
            self.client.close()


def store_round_trips(app: Any, variants: list[str], args: Args, reports: dict[str, VariantReport], n: int) -> None:
    reader = redis.Redis.from_url(bench.url(bench.DB_COUNTER), protocol=2)
    tap = MonitorTap()
    deltas: dict[str, Counter[str]] = {}
    try:
        for variant in ["plain", *[v for v in variants if v != "plain"]]:
            call = Caller(variant)
            results: list[Any] = []
            gc.collect()
            before = commandstats(reader)[0]
            tap.mark(f"begin:{variant}")
            for x in args.take(n):
                result, _ = call(x, f"rt-{x}")
                results.append(result)
            finish(app, variant, [r.id for r in results])
            time.sleep(SETTLE_SECONDS)
            tap.mark(f"end:{variant}")
            after = commandstats(reader)[0]
            delta = after - before
            for noise in ("echo", "info"):  # the markers, and the readings themselves
                delta.pop(noise, None)
            deltas[variant] = delta
            release(app, results)
            # Duplicates: originals parked on the held queue first, outside the window.
            originals = args.take(n)
            for x in originals:
                result, _ = call(x, f"rt-{x}", queue=bench.HELD_QUEUE)
                results.append(result)
            tap.mark(f"begin:dup:{variant}")
            for x in originals:
                result, _ = call(x, f"rt-{x}", queue=bench.HELD_QUEUE)
                results.append(result)
            tap.mark(f"end:dup:{variant}")
            release(app, results)
    finally:
        tap.close()
        reader.close()
    ours = set(bench.DBS)
    own = {variant: _own_commands(deltas[variant], tap.windows[f"begin:{variant}"], ours) for variant in deltas}
    for variant in variants:
        window = tap.windows[f"begin:{variant}"]
        spec = bench.BY_NAME[variant]
        store_db = bench.store_db(spec)
        sql = spec.library == "idem" and bool(bench.SQL_STORE)
        per_db: dict[str, dict[str, float]] = {}
        for (db, source, name), count in sorted(window.items()):
            if db in ours:
                per_db.setdefault(f"db{db} {source}", {})[name] = count / n
        excess = own[variant].copy()
        excess.subtract(own["plain"])
        top = Counter({name: c for (db, source, name), c in window.items() if db == store_db and source == "top"})
        nested = sum(c for (db, source, _), c in window.items() if db == store_db and source == "lua")
        dup_window = tap.windows[f"begin:dup:{variant}"]
        dup_top = Counter(
            {name: c for (db, source, name), c in dup_window.items() if db == store_db and source == "top"}
        )
        # A SQL store's statements do not show in MONITOR: store_ops.py counts them (1 round trip each).
        reports[variant].store_round_trips_per_task = None if sql else sum(top.values()) / n
        reports[variant].accounting = {
            "tasks": n,
            "store_db": store_db,
            "store_note": "SQL store, see store_ops.py" if sql else "",
            "store_top_level_per_task": sum(top.values()) / n,
            "store_lua_nested_per_task": nested / n,
            "store_commands_per_task": {name: c / n for name, c in top.items()},
            "store_top_level_per_duplicate": sum(dup_top.values()) / n,
            "store_commands_per_duplicate": {name: c / n for name, c in dup_top.items()},
            "monitor_per_db_per_task": per_db,
            "monitor_foreign_commands": _foreign(window, ours).total(),
            "commandstats_per_task": own[variant].total() / n,
            "commandstats_excess_over_plain_per_task": excess.total() / n,
            "commandstats_excess_by_command_per_task": {
                name: c / n for name, c in sorted(excess.items()) if abs(c) >= n / 100
            },
        }


def _own_commands(delta: Counter[str], window: Counter[tuple[int, str, str]], ours: set[int]) -> Counter[str]:
    """A batch's commandstats delta less what other clients ran meanwhile on other databases (seen
    with MONITOR) and less the benchmark's own MGET polling of the results."""
    own = delta.copy()
    own.subtract(_foreign(window, ours))
    own.pop("mget", None)
    return own


def _foreign(window: Counter[tuple[int, str, str]], ours: set[int]) -> Counter[str]:
    """Commands other clients ran meanwhile on databases this benchmark does not use, by name."""
    foreign: Counter[str] = Counter()
    for (db, _, name), count in window.items():
        if db not in ours:
            foreign[name] += count
    return foreign


# ---- setup, output --------------------------------------------------------------------------------


KOMBU_BOOKKEEPING = ("_kombu.binding_deadlines", "unacked", "unacked_index", "unacked_mutex")
RUN_LOCK_KEY = "celery-idem-overhead:running"
RUN_LOCK_SECONDS = 900


class RunLock:
    """One run at a time: two runs would share the queue and the databases (and flush each other's)."""

    def __init__(self) -> None:
        self.client = redis.Redis.from_url(bench.url(bench.DB_COUNTER), decode_responses=True)
        self.token = f"{platform.node()} pid {os.getpid()} {uuid.uuid4().hex[:8]}"

    def acquire(self) -> bool:
        if self.client.set(RUN_LOCK_KEY, self.token, nx=True, ex=RUN_LOCK_SECONDS):
            return True
        holder, ttl = self.client.get(RUN_LOCK_KEY), self.client.ttl(RUN_LOCK_KEY)
        log(
            f"another overhead.py run is in progress ({holder}; its lock {RUN_LOCK_KEY} in db "
            f"{bench.DB_COUNTER} expires in {ttl} s): not starting, and not touching its data"
        )
        self.client.close()
        return False

    def refresh(self) -> None:
        if self.client.get(RUN_LOCK_KEY) != self.token:
            raise RuntimeError(f"lost the run lock {RUN_LOCK_KEY}: another run may be using the databases")
        self.client.expire(RUN_LOCK_KEY, RUN_LOCK_SECONDS)

    def release(self) -> None:
        # The final cleanup flushes db 6, the lock with it; this covers a run that failed before it.
        if self.client.get(RUN_LOCK_KEY) == self.token:
            self.client.delete(RUN_LOCK_KEY)
        self.client.close()


def clean(reason: str, result_keys: Iterable[str], *, keep_lock: bool = False) -> None:
    """Remove what the benchmark wrote to Redis, and nothing else.

    Databases 6-9 are the benchmark's alone: FLUSHDB (before the run, db 6 keeps the run lock).
    The broker and backend databases may be shared (the demo tests use 10 and 11 too), so there it
    deletes its own keys only: its two queues and their kombu bindings, kombu's shared bookkeeping
    keys when nothing else is left beside them, and the result of every task it published.
    """
    flushed = {}
    for db in bench.OWN_DBS:
        client = redis.Redis.from_url(bench.url(db))
        try:
            flushed[db] = int(client.dbsize())
            if db == bench.DB_COUNTER and keep_lock:
                stale = [key for key in client.scan_iter(count=1000) if key != RUN_LOCK_KEY.encode()]
                if stale:
                    client.delete(*stale)
            else:
                client.flushdb()
        finally:
            client.close()
    broker = redis.Redis.from_url(bench.url(bench.DB_BROKER), decode_responses=True)
    backend = redis.Redis.from_url(bench.url(bench.DB_BACKEND))
    try:
        mine = [key for key in broker.scan_iter(count=1000) if bench.QUEUE in key]
        others = [key for key in broker.scan_iter(count=1000) if key not in mine]
        if set(others) <= set(KOMBU_BOOKKEEPING):
            mine += others
            others = []
        if mine:
            broker.delete(*mine)
        results = list(result_keys)
        deleted_results = 0
        for start in range(0, len(results), 1000):
            deleted_results += int(backend.delete(*results[start : start + 1000]))
        left = int(backend.dbsize())
    finally:
        broker.close()
        backend.close()
    parts = [f"FLUSHDB on dbs {', '.join(f'{db} ({n} keys)' for db, n in flushed.items())}"]
    parts.append(
        f"db {bench.DB_BROKER}: deleted {len(mine)} keys" + (f", left {len(others)} of other clients" if others else "")
    )
    parts.append(
        f"db {bench.DB_BACKEND}: deleted {deleted_results} results"
        + (f", left {left} keys of other clients" if left else "")
    )
    log(f"{reason}: " + "; ".join(parts))


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def main_table(reports: list[VariantReport], calls: int, sets: int) -> str:
    lines = [
        "| variant | tasks/s | new apply_async median / p99 µs | duplicate median / p99 µs "
        f"| store round trips/task | executions of {calls} ({sets} sets) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        new = f"{_num(r.new.median_us)} / {_num(r.new.p99_us)}" if r.new else "–"
        dup = f"{_num(r.duplicate.median_us)} / {_num(r.duplicate.p99_us)}" if r.duplicate else "–"
        trips = _num(r.store_round_trips_per_task, 2)
        executions = "–" if r.executions is None else f"{r.executions:,}"
        lines.append(f"| {r.label} | {_num(r.tasks_per_s)} | {new} | {dup} | {trips} | {executions} |")
    return "\n".join(lines)


def detail_table(reports: list[VariantReport]) -> str:
    lines = [
        "| variant | tasks/s per round (min–max) | publish loop calls/s | new apply_async under load median / p99 µs "
        "| a duplicate call | store commands/task (top-level + inside Lua) | store commands/duplicate call "
        "| commandstats excess over plain/task "
        "| duplicate-heavy: tasks published, seconds |",
        "|---|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for r in reports:
        acc = r.accounting
        rates = f"{min(r.round_tasks_per_s):,.0f}–{max(r.round_tasks_per_s):,.0f}" if r.round_tasks_per_s else "–"
        load = f"{_num(r.new_under_load.median_us)} / {_num(r.new_under_load.p99_us)}" if r.new_under_load else "–"
        if acc.get("store_db") is None:
            store = dup_store = f"– ({acc.get('store_note') or 'no store'})"
        else:
            names = ", ".join(f"{k.upper()} {v:g}" for k, v in sorted(acc["store_commands_per_task"].items()))
            store = f"db {acc['store_db']}: {names} (+ {acc['store_lua_nested_per_task']:g} inside Lua)"
            dup_store = ", ".join(f"{k.upper()} {v:g}" for k, v in sorted(acc["store_commands_per_duplicate"].items()))
        excess = _num(acc.get("commandstats_excess_over_plain_per_task"), 2) if acc else "–"
        publish = _num(r.tasks / r.publish_seconds) if r.publish_seconds else "–"
        lines.append(
            f"| {r.label} | {rates} | {publish} | {load} | {r.duplicate_outcome or '–'} | {store} | {dup_store} "
            f"| {excess} | {r.dup_published:,}, {r.dup_seconds:.2f} |"
        )
    return "\n".join(lines)


def cpu_summary(reports: dict[str, VariantReport], parts: list[str]) -> dict[str, dict[str, Any]]:
    """Per variant: tasks/s and CPU µs per task (each part and their total), pooled over the rounds;
    each also per round, as a ratio to plain Celery's batch of the same round, and the median of
    those ratios; and the extra µs per task over plain, the median of the per-round differences."""
    plain = reports["plain"]
    summary: dict[str, dict[str, Any]] = {}
    for variant, report in reports.items():
        rounds = report.cpu_rounds
        if not rounds:
            continue
        tasks = sum(r.tasks for r in rounds)
        rate_ratios = [a / b for a, b in zip(report.round_tasks_per_s, plain.round_tasks_per_s, strict=True)]
        entry: dict[str, Any] = {
            "tasks_per_s": report.tasks_per_s,
            "tasks_per_s_round_ratios": rate_ratios,
            "tasks_per_s_ratio_median": statistics.median(rate_ratios),
        }
        for part in [*parts, "total"]:
            mine = [r.us_per_task(part) for r in rounds]
            base = [r.us_per_task(part) for r in plain.cpu_rounds]
            ratios = [m / b if b > 0 else None for m, b in zip(mine, base, strict=True)]
            known = [x for x in ratios if x is not None]
            entry[part] = {
                "us_per_task": sum(r.part(part) for r in rounds) / tasks * 1e6,
                "round_us_per_task": mine,
                "round_ratios": ratios,
                "ratio_median": statistics.median(known) if known else None,
                "extra_us_median": statistics.median(m - b for m, b in zip(mine, base, strict=True)),
            }
        summary[variant] = entry
    return summary


def _times(value: float | None) -> str:
    return "–" if value is None else f"×{value:.2f}"


def cpu_table(reports: list[VariantReport], summary: dict[str, dict[str, Any]], parts: list[str]) -> str:
    heads = " | ".join(f"{CPU_PART_LABELS[p]} µs (× plain)" for p in parts)
    lines = [
        f"| variant | tasks/s (× plain) | CPU µs/task (× plain) | extra CPU µs/task over plain | {heads} |",
        "|---|---:|---:|---:|" + "---:|" * len(parts),
    ]
    for r in reports:
        entry = summary.get(r.variant)
        if entry is None:
            continue
        total = entry["total"]
        cells = [f"{_num(r.tasks_per_s)} ({_times(entry['tasks_per_s_ratio_median'])})"]
        cells.append(f"{_num(total['us_per_task'])} ({_times(total['ratio_median'])})")
        cells.append(f"{total['extra_us_median']:+,.0f}")
        for part in parts:
            cells.append(f"{_num(entry[part]['us_per_task'])} ({_times(entry[part]['ratio_median'])})")
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_rounds_table(reports: list[VariantReport], summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| variant | CPU µs/task, per round | × plain, per round | tasks/s × plain, per round |",
        "|---|---|---|---|",
    ]
    for r in reports:
        entry = summary.get(r.variant)
        if entry is None:
            continue
        us = " · ".join(f"{x:,.0f}" for x in entry["total"]["round_us_per_task"])
        ratios = " · ".join(_times(x) for x in entry["total"]["round_ratios"])
        rates = " · ".join(_times(x) for x in entry["tasks_per_s_round_ratios"])
        lines.append(f"| {r.label} | {us} | {ratios} | {rates} |")
    return "\n".join(lines)


IDEM_VARIANTS = ("idem", "idem_keyless", "idem_store", "idem_store_keyless")


def verdicts(
    by_variant: dict[str, VariantReport], dup_calls: int, dup_sets: int, summary: dict[str, dict[str, Any]]
) -> list[str]:
    """Each celery-idem variant against the issue's targets: throughput at least THROUGHPUT_TARGET of
    plain Celery's and at least each peer's, extra CPU per task no more than celery-once's (medians of
    the per-round ratios and differences), and exactly one execution per set in the duplicate run."""
    lines = []
    plain = by_variant.get("plain")
    once_extra = summary.get("once", {}).get("total", {}).get("extra_us_median")
    for variant in IDEM_VARIANTS:
        idem = by_variant.get(variant)
        if not (idem and plain and plain.tasks_per_s and idem.round_tasks_per_s):
            continue
        paired = _paired(idem, plain)
        verdict = "meets" if paired >= THROUGHPUT_TARGET else "MISSES"
        lines.append(
            f"{idem.label} / plain Celery throughput: median of the per-round ratios {paired:.2f} "
            f"({verdict} the target of >= {THROUGHPUT_TARGET}); whole run {idem.tasks_per_s / plain.tasks_per_s:.3f}"
        )
        for peer in ("once", "singleton"):
            if peer in by_variant and by_variant[peer].tasks_per_s:
                paired = _paired(idem, by_variant[peer])
                verdict = "meets" if paired >= 1 else "MISSES"
                lines.append(
                    f"{idem.label} / {by_variant[peer].label} throughput: median of the per-round ratios "
                    f"{paired:.2f} ({verdict} the target of >= 1)"
                )
        if variant in summary and "plain" in summary and once_extra is not None:
            extra = summary[variant]["total"]["extra_us_median"]
            verdict = "meets" if extra <= once_extra else "MISSES"
            lines.append(
                f"{idem.label}: extra CPU per task {extra:+,.0f} µs against celery-once's {once_extra:+,.0f} µs "
                f"({verdict} the target of no more than celery-once's)"
            )
    for variant in (*IDEM_VARIANTS, "once", "singleton"):
        if variant in summary and "plain" in summary:
            total = summary[variant]["total"]
            lines.append(
                f"{by_variant[variant].label}: CPU per task {_times(total['ratio_median'])} plain Celery's "
                f"(median of the per-round ratios), {total['extra_us_median']:+,.0f} µs per task "
                "(median of the per-round differences)"
            )
    for variant in IDEM_VARIANTS:
        report = by_variant.get(variant)
        if report and report.executions is not None:
            verdict = "meets" if report.executions == dup_sets else "MISSES"
            lines.append(
                f"{report.label}: {report.executions} executions of {dup_calls} calls over {dup_sets} sets "
                f"({verdict} the target of exactly {dup_sets})"
            )
    return lines


def _paired(a: VariantReport, b: VariantReport) -> float:
    """Median over the rounds of a's tasks/s over b's in the same round (the two ran back to back)."""
    return statistics.median(x / y for x, y in zip(a.round_tasks_per_s, b.round_tasks_per_s, strict=True))


PHASES = ("throughput", "latency", "duplicates", "round-trips")
# --smoke: every phase, small (under a minute on a loaded 2-core machine).
SMOKE = {
    "tasks": 160,
    "rounds": 2,
    "latency_calls": 40,
    "latency_slices": 2,
    "dup_calls": 160,
    "dup_sets": 10,
    "accounting_tasks": 20,
    "warmup": 10,
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=4000, help="no-op tasks per variant for throughput (4000)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved throughput rounds (10)")
    parser.add_argument(
        "--latency-calls", type=int, default=1000, help="new calls, and as many duplicates, per variant (1000)"
    )
    parser.add_argument("--latency-slices", type=int, default=10, help="interleaved latency slices (10)")
    parser.add_argument("--dup-calls", type=int, default=2000, help="calls in the duplicate-heavy workload (2000)")
    parser.add_argument("--dup-sets", type=int, default=50, help="argument sets they spread over (50)")
    parser.add_argument("--dup-threads", type=int, default=4, help="publishing threads (4)")
    parser.add_argument("--accounting-tasks", type=int, default=300, help="tasks per round-trip batch (300)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed no-op tasks per variant first (100)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every phase, small: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()),
    )
    parser.add_argument(
        "--phases",
        type=choice_list(PHASES),
        default=list(PHASES),
        help=f"subset of {','.join(PHASES)} (all)",
    )
    parser.add_argument(
        "--variants", default="", help="comma-separated subset of the variants (all; plain always runs)"
    )
    parser.add_argument(
        "--store",
        choices=("redis", "postgresql"),
        default="redis",
        help="celery-idem's store: Redis db 9 of the run's server (default), or PostgreSQL "
        "($CELERY_IDEM_BENCH_POSTGRES_URL, a table of the run's own)",
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="use this Redis server (its dbs 6-11) instead of starting a private redis-server; the default "
        "when redis-server is not installed is $CELERY_IDEM_BENCH_REDIS or redis://127.0.0.1:6379",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if min(args.tasks, args.rounds, args.latency_calls, args.latency_slices, args.dup_calls, args.dup_sets) < 1:
        parser.error("counts must be at least 1")
    if args.rounds > args.tasks or args.latency_slices > args.latency_calls:
        parser.error("--rounds must not exceed --tasks, nor --latency-slices --latency-calls")
    return args, parser


class Servers:
    """Where the run's data goes, chosen before overhead_app is imported (it reads the environment,
    and the worker inherits it): a private redis-server unless ``--redis-url`` (or no redis-server
    binary), and with ``--store postgresql`` a records table of the run's own, whose connections carry
    an ``application_name`` of the run (so their server processes can be found)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.private: PrivateRedis | None = None
        if args.redis_url:
            base = args.redis_url
        elif shutil.which("redis-server"):
            self.private = PrivateRedis()
            base = self.private.url
            log(f"private redis-server on {base} (pid {self.private.pid})")
        else:
            base = os.environ.get("CELERY_IDEM_BENCH_REDIS", "redis://127.0.0.1:6379")
            log(f"redis-server is not installed: using {base}, whose CPU time other clients share")
        os.environ["CELERY_IDEM_BENCH_REDIS"] = base.rstrip("/")
        self.shared_redis = self.private is None
        self.table = self.application_name = self.sql_url = None
        os.environ.pop("CELERY_IDEM_BENCH_STORE", None)
        if args.store == "postgresql":
            import sqlalchemy as sa

            run = uuid.uuid4().hex[:8]
            self.table, self.application_name = f"celery_idem_overhead_{run}", f"celery-idem-overhead-{run}"
            url = sa.engine.make_url(POSTGRES_URL).update_query_dict({"application_name": self.application_name})
            self.sql_url = url.render_as_string(hide_password=False)
            os.environ["CELERY_IDEM_BENCH_STORE"] = self.sql_url
            os.environ["CELERY_IDEM_BENCH_TABLE"] = self.table

    def postgres_backends(self) -> PgBackends | None:
        if self.sql_url is None or self.application_name is None:
            return None
        backends = PgBackends(self.sql_url, self.application_name)
        if backends.local:
            return backends
        log("the PostgreSQL server's processes are not visible in /proc: its CPU time is left out")
        backends.close()
        return None

    def stop(self) -> None:
        if self.table is not None and bench is not None:
            import sqlalchemy as sa

            store = bench.IDEM_STORE
            with store.engine.begin() as connection:
                for table in (self.table, f"{self.table}_liveness"):
                    connection.execute(sa.text(f'DROP TABLE IF EXISTS "{table}"'))
            store.close()
            log(f"dropped the tables {self.table}, {self.table}_liveness")
        if self.private is not None:
            self.private.stop()


def main(argv: list[str] | None = None) -> int:
    global bench
    args, parser = parse_args(argv)
    servers = Servers(args)
    try:
        import overhead_app

        bench = overhead_app
        asked = [v.strip() for v in args.variants.split(",") if v.strip()] or list(bench.NAMES)
        unknown = sorted(set(asked) - set(bench.NAMES))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {','.join(bench.NAMES)}")
        variants = [v for v in bench.NAMES if (v in asked or v == "plain") and v in bench.TASKS]
        for variant, reason in bench.MISSING.items():
            log(f"skipping {variant}: {reason}")
        app = bench.app
        ping = redis.Redis.from_url(bench.url(bench.DB_COUNTER))
        server = ping.info("server")
        ping.close()
        machine = Machine(*PEERS)
        log(
            f"Redis {server['redis_version']}"
            + (f"; celery-idem store: table {servers.table}" if servers.table else "")
        )
        lock = RunLock()
        if not lock.acquire():
            return 2
        try:
            clean("before the run", [], keep_lock=True)
            return _run(args, variants, app, server, machine, lock, servers)
        finally:
            lock.release()
    finally:
        servers.stop()


def _run(
    args: argparse.Namespace,
    variants: list[str],
    app: Any,
    server: dict[str, Any],
    machine: Machine,
    lock: RunLock,
    servers: Servers,
) -> int:
    reports = {v: VariantReport(v, bench.BY_NAME[v].label) for v in variants}
    numbers = Args()
    phases = set(args.phases)
    parts = ["producer", "worker", "redis"]
    idle: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="celery-idem-overhead-") as logdir:
        worker = Worker(logdir)
        meter: CpuMeter | None = None
        try:
            log(f"worker: {' '.join(worker.command[1:])}")
            warm_up(app, variants, numbers, worker, args.warmup)
            lock.refresh()
            postgres = servers.postgres_backends()
            if postgres is not None:
                parts.append("postgres")
            meter = CpuMeter(worker.process.pid, postgres)
            idle = meter.idle(IDLE_SECONDS)
            log("idle CPU µs per second: " + ", ".join(f"{k} {_num(v)}" for k, v in idle.items() if v is not None))
            if "throughput" in phases:
                log(f"throughput and CPU: {args.tasks} tasks per variant in {args.rounds} interleaved rounds")
                throughput(app, variants, numbers, reports, args.tasks, args.rounds, meter)
                lock.refresh()
            if "latency" in phases:
                log(f"latency: {args.latency_calls} new + {args.latency_calls} duplicate calls per variant")
                latency(app, variants, numbers, reports, args.latency_calls, args.latency_slices)
                lock.refresh()
            if "duplicates" in phases:
                log(
                    f"duplicate-heavy: {args.dup_calls} calls over {args.dup_sets} sets from {args.dup_threads} threads"
                )
                duplicate_heavy(app, variants, numbers, reports, args.dup_calls, args.dup_sets, args.dup_threads)
                lock.refresh()
            if "round-trips" in phases:
                log(f"store round trips: {args.accounting_tasks} tasks per variant under MONITOR")
                store_round_trips(app, variants, numbers, reports, args.accounting_tasks)
            worker.check()
            worker_problems = worker.problems()
        except BaseException:
            log(f"worker log (tail):\n{worker.output()}")
            raise
        finally:
            if meter is not None:
                meter.close()
            worker.stop()
            result_keys = {app.backend.get_key_for_task(task_id) for task_id in PUBLISHED}
            app.close()
            clean("cleanup", result_keys)
    machine.finish()
    if worker_problems:
        log(f"the worker logged {len(worker_problems)} warning/error lines, the first ones:")
        for line in worker_problems[:20]:
            log(f"  {line}")

    ordered = [reports[v] for v in variants]
    summary = cpu_summary(reports, parts) if "throughput" in phases else {}
    print(main_table(ordered, args.dup_calls, args.dup_sets))
    if summary:
        print()
        print(cpu_table(ordered, summary, parts))
        print()
        print(cpu_rounds_table(ordered, summary))
        print()
        print(cpu_notes(idle, servers, args, parts))
    print()
    verdict_lines = verdicts(reports, args.dup_calls, args.dup_sets, summary)
    for line in verdict_lines:
        print(line)
    if phases - {"throughput"}:
        print()
        print(detail_table(ordered))
    packages = ", ".join(f"{name} {version}" for name, version in versions(*PEERS).items())
    where = "private redis-server" if servers.private else "external Redis server, shared"
    store = "celery-idem store: PostgreSQL" if servers.table else "celery-idem store: Redis"
    redis_line = f"Redis {server['redis_version']} ({where})"
    print(f"\n{machine.summary(redis_line, store, packages)}")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "json"}
        meta = machine.meta(
            redis_server=server["redis_version"],
            redis_private=servers.private is not None,
            idem_store=args.store,
            worker_command=worker.command[1:],
            options=options,
            worker_warning_lines=worker_problems,
            idle_cpu_us_per_second=idle,
            clock_ticks_per_second=CLOCK_TICKS,
        )
        write_json(
            args.json,
            {
                "meta": meta,
                "variants": [asdict(r) for r in ordered],
                "cpu": summary,
                "verdicts": verdict_lines,
            },
        )
    return 0


def cpu_notes(idle: dict[str, float | None], servers: Servers, args: argparse.Namespace, parts: list[str]) -> str:
    """What the CPU table's numbers include, and how fine they are, for this run."""
    batch = args.tasks // args.rounds
    notes = [
        f"CPU per task: user + system CPU of each part over each batch of {batch} tasks (from before its first "
        f"publish to {SETTLE_SECONDS} s after its last result), over its tasks. producer = the publish loop of the "
        "benchmark process; worker = the celery parent and its 2 pool children; redis-server = "
        + (
            "the run's private server (broker, results, Redis stores)"
            if servers.private
            else "an EXTERNAL server, its CPU includes other clients'"
        )
        + ("; PostgreSQL backends = the server processes of the store's connections" if "postgres" in parts else "")
        + ". (× plain) = median over the rounds of the ratio to plain Celery's batch in the same round; extra = "
        "median of the per-round differences in total CPU per task.",
        "Resolution: worker and PostgreSQL backends in 10 ms ticks (/proc), redis-server and producer in µs. "
        "Idle CPU µs per second (charged to every batch alike): "
        + ", ".join(f"{k} {_num(v)}" for k, v in idle.items() if v is not None)
        + ".",
    ]
    return "\n".join(notes)


if __name__ == "__main__":
    sys.exit(main())
