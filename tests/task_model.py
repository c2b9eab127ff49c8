"""The world the task-level model (tests/models/test_task_model.py) acts on, and the invariants it checks.

A :class:`World` is real infrastructure: two ``celery worker`` subprocesses (prefork; one recycles
its children every 2 tasks), a broker (Redis, or RabbitMQ with quorum queues), a Redis result
backend, a store (Redis or PostgreSQL)
reached through a TCP proxy that can cut the link, a second producer subprocess with another hash
seed, and the test process as the first producer. Its steps are what users and the infrastructure
do: calls in every form (from producers of two releases), copies of messages, kills, worker
replacements, deploys, revokes, outages, time passing, reconcile runs, ``get()`` on any handle.

The invariants are judged from outside the library: the bodies log every execution on the counter
Redis (tests/task_model_app.py), the continuation counts its runs per call, the ledger task's
business table holds one row per payment. :func:`problems_of_executions`, :func:`answer_problem`
and friends are pure functions over those facts, so tests/models/test_task_model.py proves they bite on
made-up histories that break each rule.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from kombu import Connection
from proxy import Proxy
from task_model_app import (
    BACKEND,
    BROKERS,
    BUSY_WAIT,
    COUNTER_URL,
    LEASE,
    LEDGER_URL,
    LIVENESS,
    PENDING,
    RABBITMQ_RETURN,
    RELAY_LEASE,
    RELEASES,
    STORE_TIMEOUT,
    TTL,
    VISIBILITY,
    continuation_key,
    create_tables,
    drop_tables,
    exec_log,
    make_app,
    outbox_of,
    payments,
    quorum_queue,
)

from celery_idem import Idempotency

TESTS = Path(__file__).parent
# A body's effect is its execution; its outcome is stored a moment later. An execution whose
# outcome a kill may have kept from the store (killed from its start to this long after its end)
# may legitimately run again without the ledger.
KILL_REACH_SECONDS = 2.0
# Two clocks meet at a TTL boundary (the body's end by time.time(), the record's expiry by the
# store server's, a moment later): answers this close to the boundary may go either way.
BOUNDARY_SLACK_SECONDS = 1.0
# How long the last look of a waiting duplicate may keep a settled record past its TTL (busy.py:
# the gap to its next look, two store calls and some slack).
LINGER_SECONDS = LEASE + PENDING + 2 * STORE_TIMEOUT + 1.0
GET_BOUND_SECONDS = 45.0  # every handle answers within this once the world is quiet


# ---- facts -----------------------------------------------------------------------------------------


@dataclass
class Execution:
    """One run of a body, from the execution log: ``end``/``run`` are None if it never returned."""

    task: str
    key: str
    task_id: str
    pid: int
    start: float
    end: float | None = None
    run: int | None = None
    error: str | None = None  # the class it failed with (then ``end`` is None)
    failed: float | None = None  # when
    final: bool = False  # its failure is the stored outcome of its key (a permanent one)
    answered: float | None = None  # when the ledger answered it with a committed outcome (no effect of its own)
    hard: float | None = None  # the call's hard time limit, if it had one: past it, the pool kills it

    @property
    def running(self) -> bool:
        return self.end is None and self.failed is None and self.answered is None

    @property
    def settled(self) -> float | None:
        """When its outcome was made: it returned, or failed for good; None otherwise."""
        return self.end if self.end is not None else (self.failed if self.final else None)


@dataclass
class Kill:
    at: float
    pids: frozenset[int]
    what: str
    requeues: bool = True  # what the killed processes held comes back after the visibility timeout


@dataclass
class Handle:
    """What a call returned, and what its answer must be."""

    label: str
    how: str
    task: str
    key: str | None  # None until known (a key-less call from the other producer tells it)
    amount: int
    id: str
    at: float  # time.time() just before the call
    deduplicated: bool
    result: Any = field(repr=False)
    ignore_result: bool = False
    tag: str | None = None  # the continuation's tag, for a call that carries one
    head_id: str | None = None  # a chain's handle names its last step: its head's task id runs the body
    # What its caller saw once the world was quiet: "value", an error's class name, or None (nothing)
    seen: str | None = None

    @property
    def own_ids(self) -> tuple[str, ...]:
        """The task ids whose executions are this call's own (a message delivered late runs as one)."""
        return (self.id,) if self.head_id is None else (self.id, self.head_id)

    def __str__(self) -> str:
        flag = " dedup" if self.deduplicated else ""
        return f"{self.label}[{self.how} {self.task} key={self.key} amount={self.amount} id={self.id[:8]}{flag}]"


@dataclass
class OutboxRow:
    """A row of the model's outbox table: a staged call not published yet, or dead."""

    task_id: str
    dead: bool
    attempts: int
    last_error: str | None


def parse_executions(lines: list[bytes]) -> list[Execution]:
    """The execution log as executions: each ``end`` line closes its ``start`` (same task id and pid)."""
    executions: list[Execution] = []
    open_: dict[tuple[str, int], Execution] = {}
    for raw in lines:
        line = json.loads(raw)
        if "start" in line:
            execution = Execution(line["task"], line["key"], line["task_id"], line["pid"], line["start"])
            execution.hard = line.get("hard")
            executions.append(execution)
            open_[(line["task_id"], line["pid"])] = execution
        else:
            found = open_.pop((line["task_id"], line["pid"]), None)
            if found is None:
                continue
            if "failed" in line:
                found.failed, found.error, found.final = line["failed"], line["error"], line["final"]
            elif "answered" in line:
                found.answered = line["answered"]
            else:
                found.end, found.run = line["end"], line["run"]
    return executions


# ---- invariants (pure) -------------------------------------------------------------------------------


def _killed(execution: Execution, kills: list[Kill]) -> bool:
    """Whether a kill may have taken this execution before its outcome was stored."""
    last = (execution.settled if execution.settled is not None else float("inf")) + KILL_REACH_SECONDS
    return any(execution.pid in kill.pids and execution.start <= kill.at <= last for kill in kills)


def problems_of_executions(executions: list[Execution], kills: list[Kill], ttl: float = TTL) -> list[str]:
    """A key's body runs at most once per TTL window: after an execution that returned or failed for
    good (and whose process no kill took before its outcome was stored), the next starts only once
    the TTL passed. An attempt that failed retryably frees its key (or hands it to its retry)."""
    found = []
    by_key: dict[tuple[str, str], list[Execution]] = defaultdict(list)
    for execution in executions:
        by_key[(execution.task, execution.key)].append(execution)
    for (task, key), runs in by_key.items():
        runs.sort(key=lambda e: e.start)
        for i, first in enumerate(runs):
            end = first.settled
            if end is None or _killed(first, kills):
                continue
            for later in runs[i + 1 :]:
                if later.start < end + ttl - BOUNDARY_SLACK_SECONDS:
                    found.append(
                        f"{task} key {key}: ran again {later.start - end:+.2f}s after a run ended "
                        f"(task {first.task_id} ended at {end:.2f}; task {later.task_id} started at "
                        f"{later.start:.2f}; TTL {ttl}s)"
                    )
    return found


def redeliveries(handle: Handle, kills: list[Kill], visibility: float = VISIBILITY) -> list[float]:
    """When the broker may have delivered ``handle``'s message again: a kill after its publish may
    have taken it, and it comes back at once (a pool child's, rejected) or after the visibility
    timeout (a whole worker's on Redis; the restore runs a second or two later; on RabbitMQ,
    ``visibility`` is the moment the broker takes to see the dead worker's channel closed)."""
    found = []
    for kill in kills:
        if kill.requeues and kill.at >= handle.at:
            found += [kill.at, kill.at + visibility, kill.at + visibility + 2.0]
    return found


def allowed_answers(
    handle: Handle, executions: list[Execution], redelivered: list[float] | None = None
) -> list[Execution]:
    """The executions whose value may answer ``handle``: its own task id's, and by the record's
    lifetime when its message was published (or delivered again, ``redelivered``: it is then a new
    call if its TTL has passed): the last completed run of its key within the TTL (a duplicate or a
    replay), and the first run that completed after it (the run it waited for, or a takeover of
    it)."""
    runs = sorted(
        (e for e in executions if e.task == handle.task and e.key == handle.key and e.settled is not None),
        key=lambda e: e.settled or 0.0,
    )
    allowed = [e for e in runs if e.task_id in handle.own_ids]
    for at in [handle.at, *(redelivered or [])]:
        before = [e for e in runs if (e.settled or 0.0) <= at + BOUNDARY_SLACK_SECONDS]
        if before and at - (before[-1].settled or 0.0) <= TTL + LINGER_SECONDS:
            allowed.append(before[-1])
        after = [e for e in runs if (e.settled or 0.0) >= at - BOUNDARY_SLACK_SECONDS]
        if after:
            allowed.append(after[0])
    return allowed


def answer_problem(
    handle: Handle, value: Any, executions: list[Execution], redelivered: list[float] | None = None
) -> str | None:
    """Why ``value`` cannot be ``handle``'s answer; None when it can (``redelivered``: see
    :func:`allowed_answers`)."""
    if not isinstance(value, dict) or not {"key", "amount", "task_id", "run"} <= set(value):
        return f"{handle}: answered {value!r}, not a body's value"
    if handle.key is not None and value["key"] != handle.key:
        return f"{handle}: answered another key's value {value!r}"
    if value["amount"] != handle.amount:
        return f"{handle}: answered another call's value {value!r}"
    made = [e for e in executions if e.task_id == value["task_id"] and e.run == value["run"] and e.key == value["key"]]
    if not made:
        return f"{handle}: answered {value!r}, which no execution returned"
    allowed = allowed_answers(handle, executions, redelivered)
    if value["task_id"] in handle.own_ids or made[0] in allowed:
        return None
    shown = ", ".join(_shown(e) for e in allowed) or "none"
    return (
        f"{handle} published at {handle.at:.2f}: answered run {value['run']} of task {value['task_id'][:8]} "
        f"(ended {made[0].end:.2f}), another call's; its own answer is one of: {shown}"
    )


# What a caller sees when its call's outcome is no longer kept (the TTL passed, the result backend
# never had it): not a verdict on the call, so the call must have run, or been another's duplicate.
GONE = "RecordGoneError"


def lost_calls(handles: list[Handle], executions: list[Execution]) -> list[str]:
    """No message is lost: every call ends in one of ran, answered as a duplicate, or refused with an
    error its caller sees. Judged once the world is quiet, from what each caller saw (``seen``) and
    the execution log: a value (judged by :func:`answer_problem`) or an error is a verdict, except
    that the outcome is gone, which counts only if a body ran for the call (its own task id's, or the
    run of its key its answer may be); no answer at all never is."""
    found = []
    for handle in handles:
        if handle.seen is None:
            found.append(f"{handle}: lost, its caller saw neither a value nor an error")
        elif handle.seen == GONE:
            own = any(e.task_id in handle.own_ids for e in executions)
            if not own and not allowed_answers(handle, executions):
                found.append(f"{handle}: lost, its outcome is gone ({GONE}) and no body ran for it")
    return found


def _shown(execution: Execution) -> str:
    if execution.end is not None:
        return f"run {execution.run} of task {execution.task_id[:8]} ended {execution.end:.2f}"
    return f"{execution.error} of task {execution.task_id[:8]} at {execution.failed}"


def error_problem(handle: Handle, error: str, executions: list[Execution]) -> str | None:
    """Why a body's failure ``error`` (a class name) cannot be ``handle``'s answer; None when it can:
    an attempt of its own task id failed with it (a retryable failure frees the key, and the caller
    of that attempt sees it; never Celery's ``Retry``, whose retry answers), or it is a permanent
    failure whose stored outcome may answer the call (:func:`allowed_answers`)."""
    own = [e for e in executions if e.task_id in handle.own_ids and _failed_with(e, error) and error != "Retry"]
    if own or any(e.error == error for e in allowed_answers(handle, executions)):
        return None
    shown = ", ".join(_shown(e) for e in allowed_answers(handle, executions)) or "none"
    return (
        f"{handle} published at {handle.at:.2f}: raised {error}, which answers none of its attempts; allowed: {shown}"
    )


def _failed_with(execution: Execution, error: str) -> bool:
    """Whether ``execution`` ended with ``error``: logged by its body, or (TimeLimitExceeded, which
    its parent reports) killed by its hard time limit, never to log its end."""
    if error == "TimeLimitExceeded":
        return execution.hard is not None and execution.running
    return execution.error == error


def continuation_problems(counts: dict[str, int], heads_succeeded: set[str], quiet: bool) -> list[str]:
    """A call's continuation runs at most once; once the world is quiet, exactly once for every call
    whose head succeeded."""
    found = [f"continuation {tag} ran {n} times" for tag, n in counts.items() if n > 1]
    if quiet:
        found += [f"continuation {tag} never ran, its head succeeded" for tag in heads_succeeded if not counts.get(tag)]
    return found


def ledger_problems(rows: dict[str, int]) -> list[str]:
    """One payment per key, whatever ran: the ledger keeps one row per identity for good."""
    return [f"ledger key {key}: {n} payments" for key, n in rows.items() if n > 1]


def outbox_problems(
    rows: list[OutboxRow], rolled_back: set[str], executions: list[Execution], quiet: bool
) -> list[str]:
    """The transactional outbox: a call staged in a transaction that rolled back never runs and leaves
    no row; once the world is quiet (a last relay pass after the leases ran out), every row a commit
    left is gone (published) or dead with the reason its operator reads (``last_error``). That a
    committed call runs once, or is answered as a duplicate, is judged from its handle as any call's."""
    found = [
        f"outbox: task {e.task_id[:8]} ran, its transaction rolled back" for e in executions if e.task_id in rolled_back
    ]
    found += [
        f"outbox: a row for task {r.task_id[:8]}, whose transaction rolled back"
        for r in rows
        if r.task_id in rolled_back
    ]
    if quiet:
        found += [
            f"outbox: row of task {r.task_id[:8]} neither sent nor dead with a reason (dead {r.dead}, "
            f"attempts {r.attempts}, last error {r.last_error!r})"
            for r in rows
            if not (r.dead and r.last_error)
        ]
    return found


def joined_ledger_problems(rows: dict[str, int], modes: dict[str, set[str]], paid: set[str]) -> list[str]:
    """The ledger joined to a transaction the body opened (tm.ledger_tx; rows keyed ``tx:<key>``): a
    key whose every call rolled back has no payment; a key a call answered with a value (it committed)
    has exactly one. ``modes``: each key's calls' modes; ``paid``: the keys answered with a value."""
    found = [
        f"ledger_tx key {key}: {rows.get(key, 0)} payments, its calls all rolled back"
        for key, m in modes.items()
        if m == {"rollback"} and rows.get(key, 0)
    ]
    found += [
        f"ledger_tx key {key}: {rows.get(key, 0)} payments, a call was answered with its value"
        for key in paid
        if rows.get(key, 0) != 1
    ]
    return found


# ---- the world -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WorkerProcess:
    """A ``celery -A task_model_app worker`` subprocess."""

    def __init__(self, tmp: Path, env: dict[str, str], queues: list[str], *, extra: tuple[str, ...] = ()) -> None:
        self.name = f"tm-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        self.log = tmp / f"{self.name.partition('@')[0]}.log"
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "task_model_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "-Q",
            ",".join(queues),
            "-n",
            self.name,
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            *extra,
        ]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=TESTS, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def ready(self) -> WorkerProcess:
        deadline = time.monotonic() + 60
        while "ready." not in self.output() and self.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.name} did not start:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        assert self.process.poll() is None, f"worker exited:\n{self.output()[-3000:]}"
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> frozenset[int]:
        """The main process and its pool children."""
        found = {self.process.pid}
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["ps", "-o", "pid=", "--ppid", str(self.process.pid)], capture_output=True, text=True, timeout=5
            ).stdout
            found |= {int(p) for p in out.split()}
        return frozenset(found)

    def kill(self) -> frozenset[int]:
        pids = self.pids()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        return pids

    def stop(self, *, wait: bool = True) -> bool:
        """A warm shutdown (running bodies finish, reserved messages go back to the broker); False
        if it had to be SIGKILLed after 20 s. ``wait=False`` only starts it (see :meth:`stopped`)."""
        if self.process.poll() is None:
            # To the main process alone, as `docker stop` or an orchestrator sends it: a SIGTERM to a
            # pool child ends the body it runs (what revoke's terminate=True does).
            os.kill(self.process.pid, signal.SIGTERM)
        return self.stopped() if wait else True

    def stopped(self) -> bool:
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
                return False
        return True


class Producer:
    """The second producer: a subprocess under another hash seed (task_model_app.py ``produce``)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "task_model_app.py", "produce"],
            cwd=TESTS,
            env={**env, "PYTHONHASHSEED": "4242"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, task: str, args: list[Any], kwargs: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        command = {"task": task, "args": args, "kwargs": kwargs, "options": options}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the producer subprocess exited"
        return dict(json.loads(line))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


class World:
    """Everything one store kind's histories run on; :meth:`begin` starts a history on fresh keys."""

    def __init__(self, kind: str, tmp: Path, redis_url: str, postgres_url: str, broker: str = "redis") -> None:
        self.kind, self.tmp, self.broker = kind, tmp, broker
        self.broker_url = BROKERS[broker]
        # How long after a whole worker's death the broker may deliver what it held again
        self.visibility = VISIBILITY if broker == "redis" else RABBITMQ_RETURN
        self.prefix = f"tm{uuid.uuid4().hex[:8]}"
        self.queue, self.heavy = self.prefix, f"{self.prefix}-heavy"
        if kind == "redis":
            parsed = redis.connection.parse_url(redis_url)
            self.proxy = Proxy(int(parsed.get("port", 6379)))
            self.store_url = f"redis://127.0.0.1:{self.proxy.port}/{parsed.get('db', 0)}"
        else:
            url = sa.engine.make_url(postgres_url)
            self.proxy = Proxy(url.port or 5432)
            self.store_url = url.set(host="127.0.0.1", port=self.proxy.port).render_as_string(hide_password=False)
        create_tables(self.prefix)
        self.env = {
            **os.environ,
            "TM_STORE": self.store_url,
            "TM_PREFIX": self.prefix,
            "TM_QUEUE": self.queue,
            "TM_BROKER": self.broker_url,
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        }
        # The test process is a producer of every release (the first one's app runs the rest)
        self.apps = {
            release: make_app(
                store=self.store_url, prefix=self.prefix, queue=self.queue, release=release, broker=self.broker_url
            )
            for release in RELEASES
        }
        self.app = self.apps[RELEASES[0]]
        self.counter = redis.Redis.from_url(COUNTER_URL)
        self.engine = sa.create_engine(LEDGER_URL, poolclass=sa.pool.NullPool)
        self.outbox = outbox_of(self.prefix)
        self.workers: list[WorkerProcess] = []
        self.releases: list[str] = []  # each worker's release
        self.producer = Producer(self.env)
        self.kills: list[Kill] = []
        self.history = 0
        self.idle = ""
        self.idles: list[str] = []  # every history's idle queue (deleted from RabbitMQ at the end)
        self.limit_killed: set[tuple[str, int]] = set()  # (task id, pid) of bodies a hard time limit killed
        self.outage_until = 0.0
        self.had_outage = False
        self.cuts = 0
        self.start_workers()

    # ---- workers

    def _worker(self, index: int, release: str, *, ready: bool = True) -> WorkerProcess:
        recycling = index == 1
        queues = [self.queue] + ([] if recycling else [self.heavy])
        extra = ("--max-tasks-per-child=2",) if recycling else ()
        worker = WorkerProcess(self.tmp, {**self.env, "TM_RELEASE": release}, queues, extra=extra)
        return worker.ready() if ready else worker

    def start_workers(self) -> None:
        while len(self.workers) < 2:  # booting side by side
            self.releases.append(RELEASES[0])
            self.workers.append(self._worker(len(self.workers), RELEASES[0], ready=False))
        for worker in self.workers:
            worker.ready()

    def replace_worker(self, index: int) -> str:
        """SIGKILL a whole worker (a node that never comes back under its name) and start another."""
        index %= len(self.workers)
        doomed = self.workers[index]
        pids = doomed.kill()
        self.kills.append(Kill(time.time(), pids, f"worker {doomed.name}"))
        self.workers[index] = self._worker(index, self.releases[index])
        return f"killed {doomed.name} ({len(pids)} processes), started {self.workers[index].name}"

    def deploy(self, index: int, release: str) -> str:
        """A worker restarted onto ``release``: a warm shutdown (its running bodies finish, what it
        had reserved goes back to the queue, where messages of the old release wait), then a worker
        of the new code under a new name, beside the other worker, which may run the other release."""
        index %= len(self.workers)
        old = self.workers[index]
        pids = old.pids()
        old.stop(wait=False)  # the new code boots meanwhile, as a rolling deploy overlaps them
        self.releases[index] = release
        self.workers[index] = self._worker(index, release, ready=False)
        if not old.stopped():
            self.kills.append(Kill(time.time(), pids, f"worker {old.name}, its warm shutdown past 20 s"))
        self.workers[index].ready()
        return f"deployed {release} on {old.name}: now {self.workers[index].name}; releases {self.releases}"

    def kill_child(self, index: int) -> str:
        """SIGKILL one pool child of a worker, preferring one that is running a body now."""
        running = {e.pid for e in self.executions() if e.running}
        worker = self.workers[index % len(self.workers)]
        children = sorted(worker.pids() - {worker.process.pid})
        if not children:
            return "no child to kill"
        victim = next((p for p in children if p in running), children[0])
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        self.kills.append(Kill(time.time(), frozenset({victim}), f"child {victim} of {worker.name}"))
        return f"killed child {victim} of {worker.name}"

    def terminated(self, task_id: str) -> str:
        """After ``revoke(task_id, terminate=True)``: the processes whose body of that task id its
        SIGTERM may end (running now, or just returned, its outcome perhaps not yet stored) are
        noted as a kill once the workers had a moment to act on it."""
        time.sleep(0.5)
        at = time.time()
        pids = {
            e.pid
            for e in self.executions()
            if e.task_id == task_id and (e.running or (e.settled or 0.0) >= at - 0.5 - KILL_REACH_SECONDS)
        }
        if pids:
            # the revoked message is acked: nothing comes back
            self.kills.append(Kill(at, frozenset(pids), f"revoke of {task_id[:8]} (terminate)", requeues=False))
        return f"  terminated bodies of {task_id[:8]} in {sorted(pids)}" if pids else "  no body of it ran"

    # ---- histories

    def begin(self) -> None:
        """A new history: fresh keys (the namespace holds the history's number), a fresh idle queue."""
        if self.had_outage:
            # A pooled PostgreSQL connection the last cut broke fails its first use (docs/stores.md:
            # one refused call per process): the producers use theirs up before this history starts.
            for _ in range(2):
                with contextlib.suppress(Exception):
                    Idempotency.of(self.app).store.ping()
            self.producer.send("ping", [], {}, {})
        self.history += 1
        self.idle = f"{self.prefix}-idle{self.history}"
        self.idles.append(self.idle)
        self.limit_killed = set()
        self.kills = []
        self.had_outage = False
        self.counter.delete(exec_log(self.prefix))

    def key(self, n: int) -> str:
        return f"h{self.history}-k{n}"

    def stale_connection(self, exc: BaseException) -> bool:
        """A pooled PostgreSQL connection an earlier cut broke, failing its first use: documented
        (docs/stores.md, one refused call per process; pool_pre_ping is the user's choice)."""
        return self.kind == "postgresql" and self.cuts > 0 and "closed the connection" in str(exc)

    def cut(self, seconds: float) -> None:
        self.cuts += 1
        self.had_outage = True
        self.outage_until = max(self.outage_until, time.monotonic() + seconds)
        self.proxy.cut(seconds)

    def executions(self) -> list[Execution]:
        return parse_executions(self.counter.lrange(exec_log(self.prefix), 0, -1))

    def continuations(self, tags: list[str]) -> dict[str, int]:
        if not tags:
            return {}
        values = self.counter.mget([continuation_key(self.prefix, t) for t in tags])
        return {t: int(v) for t, v in zip(tags, values, strict=True) if v is not None}

    def payments(self) -> dict[str, int]:
        table = payments(self.prefix)
        with self.engine.connect() as connection:
            rows = connection.execute(sa.select(table.c.key, sa.func.count()).group_by(table.c.key)).all()
        return {str(key): int(n) for key, n in rows}

    def idle_destination(self) -> Any:
        """What ``queue=`` names the idle queue by: on RabbitMQ, a quorum queue like the others."""
        return self.idle if self.broker == "redis" else quorum_queue(self.idle)

    def consume_idle(self) -> None:
        """The queue nobody consumed gets a consumer (the first worker)."""
        declared: dict[str, Any] = {}
        if self.broker != "redis":
            queue = quorum_queue(self.idle)
            declared = {
                "exchange": self.idle,
                "exchange_type": "topic",
                "routing_key": self.idle,
                "options": {"queue_arguments": queue.queue_arguments},
            }
        self.app.control.add_consumer(self.idle, destination=[self.workers[0].name], reply=True, timeout=5, **declared)

    def hard_limit_kills(self) -> None:
        """Bodies past their hard time limit were killed by their pool (its parent reports
        TimeLimitExceeded and acks the message: nothing comes back): noted as kills."""
        now = time.time()
        for e in self.executions():
            if e.hard is not None and e.running and now > e.start + e.hard + 1.0:
                if (e.task_id, e.pid) not in self.limit_killed:
                    self.limit_killed.add((e.task_id, e.pid))
                    what = f"hard time limit of {e.task_id[:8]}"
                    self.kills.append(Kill(e.start + e.hard, frozenset({e.pid}), what, requeues=False))

    def settle_down(self) -> None:
        """Wait out any cut, and give every queue a consumer."""
        time.sleep(max(0.0, self.outage_until - time.monotonic()))
        self.consume_idle()

    def drain(self, bound: float = 60.0) -> None:
        """Wait until the broker has delivered again what killed workers held (their visibility
        timeout) and no body runs, so that what is judged next is the world at rest."""
        redelivered = max((kill.at for kill in self.kills if kill.requeues), default=0.0) + self.visibility + 1.0
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            self.hard_limit_kills()
            killed = {pid for kill in self.kills for pid in kill.pids}
            running = [e for e in self.executions() if e.running and e.pid not in killed]
            if time.time() >= redelivered and not running:
                return
            time.sleep(0.2)

    # ---- transactions (the outbox's relay, the rows it leaves, the joined ledger's payments)

    def relay(self, dies: str | None) -> str:
        """One relay pass in a process of its own, SIGKILLed where ``dies`` says (task_model_app.py)."""
        done = subprocess.run(
            [sys.executable, "task_model_app.py", "relay"],
            cwd=TESTS,
            env={**self.env, "TM_RELAY_DIES": dies or ""},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(f"the relay process failed ({done.returncode}):\n{done.stderr[-3000:]}")
        said = "killed" if done.returncode else done.stdout.strip()
        return f"  relay pass{f' dying {dies}' if dies else ''}: {said}"

    def last_relay(self, bound: float = 30.0) -> list[str]:
        """Once the world is quiet: relay passes in this process until no row is due or leased (their
        leases and backoffs moved back, as time would), so every row ends published or dead."""
        t, notes = self.outbox.table, []
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            with self.outbox.engine.begin() as connection:
                connection.execute(sa.update(t).where(t.c.dead.is_(False)).values(available_at=0.0))
            report = self.outbox.relay(self.app)
            notes.append(f"last relay pass: {report}")
            if not any(not row.dead for row in self.outbox_rows()):
                break
            time.sleep(RELAY_LEASE)
        return notes

    def outbox_rows(self) -> list[OutboxRow]:
        t = self.outbox.table
        with self.outbox.engine.connect() as connection:
            found = connection.execute(sa.select(t.c.task_id, t.c.dead, t.c.attempts, t.c.last_error)).all()
        return [OutboxRow(str(r.task_id), bool(r.dead), int(r.attempts), r.last_error) for r in found]

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.producer.close()
        self.proxy.close()
        keys = list(self.counter.scan_iter(f"tm:{self.prefix}:*"))
        if keys:
            self.counter.delete(*keys)
        drop_tables(self.prefix)
        self.engine.dispose()
        self.outbox.engine.dispose()
        if self.broker != "redis":
            with Connection(self.broker_url) as connection:
                channel = connection.default_channel
                for name in [self.queue, self.heavy, *self.idles]:
                    channel.queue_delete(name)
                    channel.exchange_delete(name)

    def summary(self) -> str:
        return f"{SETTINGS_SUMMARY}; broker {self.broker_url}" + (
            f" (quorum queues, x-delivery-limit, native delayed delivery; returned at once, {self.visibility}s slack)"
            if self.broker != "redis"
            else ""
        )


SETTINGS_SUMMARY = (
    f"lease {LEASE}s, TTL {TTL}s, pending {PENDING}s, busy wait {BUSY_WAIT}s, liveness {LIVENESS}s, "
    f"store timeout {STORE_TIMEOUT}s, visibility {VISIBILITY}s (a Redis broker); backend {BACKEND}"
)
