#!/usr/bin/env python
"""What an idempotency layer costs a Celery task: celery-idem against plain Celery, celery-once and
celery-singleton, on one broker, result backend and worker.

Run from the repository root::

    python benchmarks/overhead.py [--tasks N] [--json out.json]

It starts one ``celery -A overhead_app worker -P prefork -c 2`` subprocess (the app is
``benchmarks/overhead_app.py``: one no-op task and one counting task per variant, all on the same
queue) and measures, per variant:

- end-to-end throughput: N no-op tasks with distinct arguments, published in interleaved rounds
  (every round runs every variant once, in a rotated order); wall time from the first publish to
  the last result the worker stored (the latest ``date_done``);
- ``apply_async`` latency of a new call and of a duplicate call (same key/arguments as an earlier
  call), with the originals parked on a queue no worker consumes, so that they stay in flight;
- store round trips per task: the top-level commands each variant's store database receives
  during an isolated, untimed batch, seen with ``MONITOR``; cross-checked with ``INFO
  commandstats`` deltas over the whole server minus the same batch of plain Celery tasks;
- executions in a duplicate-heavy workload: 2000 calls over 50 argument sets from 4 threads,
  counted by an INCR in the task body.

It uses Redis databases 6-11 of ``CELERY_IDEM_BENCH_REDIS`` (default ``redis://127.0.0.1:6379``):
6-9 are its own and flushed before and after the run; in the broker (10) and result backend (11)
databases, which other clients may share, it deletes only the keys it wrote. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import os
import platform
import re
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

import overhead_app as bench  # the app module lives beside this script, on sys.path as the script's folder
import redis
from _common import (
    Latency,
    Machine,
    choice_list,
    commandstats,
    log,
    rotated,
    slice_of,
    time_each,
    versions,
    write_json,
)

HERE = Path(__file__).resolve().parent

LABELS = {
    "plain": "plain Celery (`@app.task`)",
    "idem": "IdempotentTask, `idempotency_key`",
    "idem_keyless": "IdempotentTask, key-less (argument fingerprint)",
    "once": "celery-once `QueueOnce`",
    "singleton": "celery-singleton `Singleton`",
}
PEERS = ("celery_once", "celery-singleton")  # their versions go in the report
THROUGHPUT_TARGET = 0.9  # IdempotentTask tasks/s >= 90% of plain Celery's
RESULT_TIMEOUT = 120.0
POLL_SECONDS = 0.005
SETTLE_SECONDS = 0.3  # peers release their locks just after the result is stored
WORKER_START_TIMEOUT = 60.0


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


# ---- publishing -----------------------------------------------------------------------------------


PUBLISHED: list[str] = []  # the id every call returned


class Caller:
    """Calls one variant's task (the no-op one, or the counting one) the way its library means."""

    def __init__(self, variant: str, *, counting: bool = False) -> None:
        self.variant = variant
        self.task = bench.TASKS[variant][1 if counting else 0]
        self.keyed = variant == "idem"
        self.refusal: tuple[type[BaseException], ...] = ()  # what the library raises for a duplicate
        if variant == "once":
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


def warm_up(app: Any, variants: list[str], args: Args, worker: Worker, n: int) -> None:
    """Untimed: connections, Lua scripts, handlers and imports in the producer and both children;
    the held queue is declared here too."""
    results: list[Any] = []
    for variant in variants:
        for counting in (False, True):
            call = Caller(variant, counting=counting)
            for x in args.take(n // 4 if counting else n):
                result, _ = call(x, f"warm-{x}")
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
    release(app, results)


# ---- 1. throughput --------------------------------------------------------------------------------


def throughput(
    app: Any, variants: list[str], args: Args, reports: dict[str, VariantReport], n: int, rounds: int
) -> None:
    latencies: dict[str, list[int]] = {v: [] for v in variants}
    for round_ in range(rounds):
        order = rotated(variants, round_)
        size = len(slice_of(n, rounds, round_))
        for variant in order:
            report = reports[variant]
            timed = time_each(publisher(Caller(variant), "tp"), args.take(size))
            latencies[variant] += timed.latencies_ns
            if any(refused or getattr(result, "deduplicated", False) for result, refused in timed.results):
                raise AssertionError(f"{variant}: a new call with distinct arguments was taken for a duplicate")
            results = [result for result, _ in timed.results]
            last_done = wait_for(app, [r.id for r in results])
            seconds = last_done - timed.started
            report.tasks += size
            report.seconds += seconds
            report.publish_seconds += timed.wall_ns / 1e9
            report.round_tasks_per_s.append(size / seconds)
            release(app, results)
            time.sleep(SETTLE_SECONDS)
        log(
            f"  round {round_ + 1}/{rounds}: "
            + ", ".join(f"{v} {reports[v].round_tasks_per_s[-1]:,.0f}/s" for v in order)
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
        expected = "published again" if variant == "plain" else None
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
    if variant.startswith("idem"):
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
            last_done = wait_for(app, task_ids)
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
            wait_for(app, [r.id for r in results])
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
        store_db = bench.STORE_DB.get(variant)
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
        reports[variant].store_round_trips_per_task = sum(top.values()) / n
        reports[variant].accounting = {
            "tasks": n,
            "store_db": store_db,
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
            store = dup_store = "– (no store)"
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


def verdicts(by_variant: dict[str, VariantReport], dup_calls: int, dup_sets: int) -> list[str]:
    lines = []
    idem, plain = by_variant.get("idem"), by_variant.get("plain")
    if idem and plain:
        ratio = idem.tasks_per_s / plain.tasks_per_s
        verdict = "meets" if ratio >= THROUGHPUT_TARGET else "MISSES"
        lines.append(
            f"IdempotentTask / plain Celery throughput = {ratio:.3f} ({verdict} the target of >= {THROUGHPUT_TARGET}); "
            f"median of the per-round ratios {_paired(idem, plain):.2f}"
        )
    for peer in ("once", "singleton"):
        if idem and peer in by_variant:
            ratio = idem.tasks_per_s / by_variant[peer].tasks_per_s
            verdict = "meets" if ratio >= 1 else "MISSES"
            lines.append(
                f"IdempotentTask / {LABELS[peer]} throughput = {ratio:.3f} ({verdict} the target of >= 1); "
                f"median of the per-round ratios {_paired(idem, by_variant[peer]):.2f}"
            )
    for variant in ("idem", "idem_keyless"):
        report = by_variant.get(variant)
        if report and report.executions is not None:
            verdict = "meets" if report.executions == dup_sets else "MISSES"
            lines.append(
                f"{LABELS[variant]}: {report.executions} executions of {dup_calls} calls over {dup_sets} sets "
                f"({verdict} the target of exactly {dup_sets})"
            )
    return lines


def _paired(a: VariantReport, b: VariantReport) -> float:
    """Median over the rounds of a's tasks/s over b's in the same round (the two ran back to back)."""
    return statistics.median(x / y for x, y in zip(a.round_tasks_per_s, b.round_tasks_per_s, strict=True))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
        "--variants",
        type=choice_list(bench.VARIANTS),
        default=list(bench.VARIANTS),
        help=f"subset of {','.join(bench.VARIANTS)} (plain always runs: it is the baseline)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers to this JSON file")
    args = parser.parse_args(argv)
    args.variants = [v for v in bench.VARIANTS if v in args.variants or v == "plain"]
    if min(args.tasks, args.rounds, args.latency_calls, args.latency_slices, args.dup_calls, args.dup_sets) < 1:
        parser.error("counts must be at least 1")
    if args.rounds > args.tasks or args.latency_slices > args.latency_calls:
        parser.error("--rounds must not exceed --tasks, nor --latency-slices --latency-calls")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = [v for v in args.variants if v in bench.TASKS]
    for variant, reason in bench.MISSING.items():
        log(f"skipping {variant}: {reason}")
    app = bench.app
    ping = redis.Redis.from_url(bench.url(bench.DB_COUNTER))
    server = ping.info("server")
    ping.close()
    machine = Machine(*PEERS)
    log(f"Redis {server['redis_version']}")
    lock = RunLock()
    if not lock.acquire():
        return 2
    try:
        clean("before the run", [], keep_lock=True)
        return _run(args, variants, app, server, machine, lock)
    finally:
        lock.release()


def _run(
    args: argparse.Namespace,
    variants: list[str],
    app: Any,
    server: dict[str, Any],
    machine: Machine,
    lock: RunLock,
) -> int:
    reports = {v: VariantReport(v, LABELS[v]) for v in variants}
    numbers = Args()
    with tempfile.TemporaryDirectory(prefix="celery-idem-overhead-") as logdir:
        worker = Worker(logdir)
        try:
            log(f"worker: {' '.join(worker.command[1:])}")
            warm_up(app, variants, numbers, worker, args.warmup)
            lock.refresh()
            log(f"throughput: {args.tasks} tasks per variant in {args.rounds} interleaved rounds")
            throughput(app, variants, numbers, reports, args.tasks, args.rounds)
            lock.refresh()
            log(f"latency: {args.latency_calls} new + {args.latency_calls} duplicate calls per variant")
            latency(app, variants, numbers, reports, args.latency_calls, args.latency_slices)
            lock.refresh()
            log(f"duplicate-heavy: {args.dup_calls} calls over {args.dup_sets} sets from {args.dup_threads} threads")
            duplicate_heavy(app, variants, numbers, reports, args.dup_calls, args.dup_sets, args.dup_threads)
            lock.refresh()
            log(f"store round trips: {args.accounting_tasks} tasks per variant under MONITOR")
            store_round_trips(app, variants, numbers, reports, args.accounting_tasks)
            worker.check()
            worker_problems = worker.problems()
        except BaseException:
            log(f"worker log (tail):\n{worker.output()}")
            raise
        finally:
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
    print(main_table(ordered, args.dup_calls, args.dup_sets))
    print()
    for line in verdicts(reports, args.dup_calls, args.dup_sets):
        print(line)
    print()
    print(detail_table(ordered))
    packages = ", ".join(f"{name} {version}" for name, version in versions(*PEERS).items())
    print(f"\n{machine.summary('Redis ' + server['redis_version'], packages)}")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "json"}
        meta = machine.meta(
            redis_server=server["redis_version"],
            worker_command=worker.command[1:],
            options=options,
            worker_warning_lines=worker_problems,
        )
        verdict_lines = verdicts(reports, args.dup_calls, args.dup_sets)
        write_json(args.json, {"meta": meta, "variants": [asdict(r) for r in ordered], "verdicts": verdict_lines})
    return 0


if __name__ == "__main__":
    sys.exit(main())
