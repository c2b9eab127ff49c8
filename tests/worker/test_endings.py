"""Every way a task can end, through real ``celery worker`` processes, on Redis and on RabbitMQ
(quorum queues), with ``acks_late`` on and off: what the record ends as, what a duplicate call then
gets, and how many times the body ran (counted in Redis by the body itself).

Cost is kept down by running all cells of a broker at once: one shared prefork worker runs every
cell that leaves its worker standing (concurrency 8, a key per cell, both acks_late variants, see
tests/endings_app.py); one worker is shut down warm by its cells; one has spawned children. Each
cell goes through three phases, all cells of a phase concurrently: the ending; then, once the
leases of unsettled records ran out, one reconcile; then the duplicate call.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import states
from celery.result import AsyncResult
from conftest import REDIS_URL, require_rabbitmq, require_server
from endings import BROKERS, ENDINGS, VARIANTS, Ending, Seen, docs_block, render, write_docs_block
from endings_app import executions_key, make_app
from kombu import Connection
from shop import COUNTER_URL
from shop_worker import BACKEND
from shop_worker import BROKERS as BROKER_URLS
from workers import Worker, wait_for

from celery_idem import Idempotency, State

pytestmark = pytest.mark.slow
GET = 30
INSPECT = 3  # seconds the reconciler waits for workers busy with this matrix to answer inspect
WORKERS = {"shared": 8, "warm": 2, "spawn": 2}  # concurrency of each worker of a broker's run
OBSERVED: dict[tuple[str, str, str], Seen] = {}
ARTEFACT = Path(__file__).resolve().parents[2] / "build" / "endings.json"  # what the last run saw


@dataclass
class Cell:
    ending: Ending
    variant: str
    key: str
    result: Any = None
    end: str = ""
    late_hook: bool = False  # the parent's hook came after the lease had run out, and freed it
    executions: int = 0

    @property
    def task(self) -> str:
        return f"end.{self.ending.kind}.{self.variant}"


class Run:
    """One broker's run: its workers, producer app and the counter."""

    def __init__(self, broker: str, tmp: Path) -> None:
        self.prefix = f"e{uuid.uuid4().hex[:10]}"
        self.queues = {name: f"{self.prefix}-{name}" for name in [*WORKERS, "idle"]}  # idle: no worker
        quorum = broker == "rabbitmq"
        queues = list(self.queues.values())
        self.app = make_app(
            broker=BROKER_URLS[broker],
            backend=BACKEND,
            store=REDIS_URL,
            prefix=self.prefix,
            queues=queues,
            quorum=quorum,
            inspect_timeout_seconds=INSPECT,
        )
        self.idem = Idempotency.of(self.app)
        self.counter = redis.Redis.from_url(COUNTER_URL)
        env = {"ENDINGS_QUEUES": json.dumps(queues), "ENDINGS_QUORUM": "1" if quorum else ""}
        self.workers: dict[str, Worker] = {}

        def start(name: str) -> None:
            self.workers[name] = Worker(
                tmp,
                BROKER_URLS[broker],
                REDIS_URL,
                self.prefix,
                app="endings_app",
                queue=self.queues[name],
                concurrency=WORKERS[name],
                env={**env, "ENDINGS_SPAWN": "1" if name == "spawn" else ""},
            )

        with ThreadPoolExecutor(len(WORKERS)) as pool:
            list(pool.map(start, WORKERS))
        warm = [e for e in ENDINGS if e.worker == "warm"]
        self.warm_started = threading.Barrier(len(warm) * len(VARIANTS), action=self._shut_down_warm)

    def _shut_down_warm(self) -> None:
        os.kill(self.workers["warm"].process.pid, signal.SIGTERM)  # the parent only: a warm shutdown

    def executions(self, key: str, suffix: str = "") -> int:
        return int(self.counter.get(executions_key(self.prefix, key) + suffix) or 0)

    def record(self, cell: Cell) -> str:
        """The record as the table says it: its state, and the error class of a FAILED one."""
        record = self.idem.get(cell.task, cell.key)
        if record is None:
            return "none"
        if record.error is not None:
            return f"`{record.state.value}` (`{record.error.type}`)"
        return f"`{record.state.value}`"

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        self.app.close()


@pytest.fixture(params=BROKERS)
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Run]:
    require_server("redis")
    if request.param == "rabbitmq":
        require_rabbitmq()
    started = Run(request.param, tmp_path)
    try:
        yield started
    finally:
        started.close()
        with Connection(BROKER_URLS[request.param]) as connection:  # durable queues, quorum ones on RabbitMQ
            for queue in started.queues.values():
                connection.default_channel.queue_delete(queue)


def act(run: Run, cell: Cell) -> None:
    """Submit the cell's call and do to it what its ending says."""
    ending, worker = cell.ending, run.workers.get(cell.ending.worker)
    options: dict[str, Any] = {"queue": run.queues[ending.worker], **ending.options()}
    if ending.act == "revoke_first":
        options["task_id"] = str(uuid.uuid4())
        assert worker is not None
        replies: Any = None
        for _ in range(3):  # a loaded worker may answer a broadcast late; revoking again is harmless
            replies = run.app.control.revoke(options["task_id"], destination=[worker.name], reply=True, timeout=10)
            if replies:
                break
        assert replies, f"{worker.name} did not answer the revoke of {options['task_id']} in 3 tries"
    cell.result = run.app.tasks[cell.task].apply_async(ending.args, idempotency_key=cell.key, **options)
    if ending.act in ("sigkill", "terminate", "terminate_kill", "warm_shutdown"):
        until(lambda: run.executions(cell.key) >= 1, f"{cell.task} to start", GET)
    if ending.act == "sigkill":
        # The parent acks an early-ack message when it sees the pool take the job; a child killed before
        # the parent saw that leaves the message unacked, and the broker redelivers it (Celery's own race,
        # seen in CI under load). The matrix kills once the parent has taken the job: its ack is decided.
        assert worker is not None
        until(lambda: accepted(run, worker.name, cell.result.id), f"{worker.name} to accept {cell.task}", GET)
        os.kill(int(run.counter.get(executions_key(run.prefix, cell.key) + ":pid")), signal.SIGKILL)
    elif ending.act == "terminate":
        run.app.control.revoke(cell.result.id, terminate=True, destination=[getattr(worker, "name", "")])
    elif ending.act == "terminate_kill":
        run.app.control.revoke(
            cell.result.id, terminate=True, signal="SIGKILL", destination=[getattr(worker, "name", "")]
        )
    elif ending.act == "warm_shutdown":
        run.warm_started.wait(timeout=GET)


def accepted(run: Run, worker: str, task_id: str) -> bool:
    """The worker's parent has seen its pool take the task (``inspect active`` lists it with a pid)."""
    replies = run.app.control.inspect(destination=[worker], timeout=2).active() or {}
    return any(r["id"] == task_id and r.get("worker_pid") for active in replies.values() for r in active)


def until(predicate: Any, what: str, seconds: float) -> None:
    """wait_for, polling at a pace 40 threads can share with the workers on 2 cores."""
    wait_for(lambda: predicate() or time.sleep(0.15), what, seconds)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ended(run: Run, cell: Cell) -> bool:
    """The ending is over: the record settled, gone or lapsed, or the result backend has the last word."""
    record = run.idem.get(cell.task, cell.key)
    if record is None or record.state.settled:
        return True
    if record.state is State.PENDING and run.idem.store.now() > record.lease_expires_at:
        return True  # a claim whose message nobody will run: it lapsed
    return AsyncResult(cell.result.id, app=run.app).state in states.READY_STATES


def phase_end(run: Run, cell: Cell) -> None:
    try:
        _end(run, cell)
    except AssertionError as exc:  # a cell that did not end as it must: reported with the others
        cell.end = f"did not end: {exc}"


def _end(run: Run, cell: Cell) -> None:
    act(run, cell)
    until(lambda: ended(run, cell), f"the end of {cell.task}", GET)
    backend = AsyncResult(cell.result.id, app=run.app)
    if backend.state == states.SUCCESS:
        # A body (or a replacement) that returned settles the record: a moment after the backend has it.
        until(
            lambda: getattr(run.idem.get(cell.task, cell.key), "state", None) is not State.IN_PROGRESS,
            "the record to settle after SUCCESS",
            GET,
        )
    hard = type(backend.result).__name__ in ("WorkerLostError", "TimeLimitExceeded")
    if backend.state == states.REVOKED or (backend.state == states.FAILURE and hard):
        # The record as the parent's hook left it, once the child that ran the body is gone.
        worker = run.workers[cell.ending.worker]
        until(lambda: f"of task {cell.result.id}: record" in worker.output(), "the parent's hook", GET)
        # The hook frees an IN_PROGRESS record only once its lease ran out (its fence): on a machine
        # too loaded for the kill and the hook to come within the lease, that is what it must do.
        # (The record is shown as the logs show it: "end.hangs.late (key_hash=...)", spaces included.)
        cell.late_hook = bool(
            re.search(rf"failure of task {cell.result.id}: record [^\n]* released\b", worker.output())
        )
        pid = run.counter.get(executions_key(run.prefix, cell.key) + ":pid")
        if pid is not None:
            until(lambda: not alive(int(pid)), "the child to be gone", GET)
    if cell.ending.worker == "warm":
        until(lambda: run.workers["warm"].process.poll() is not None, "the warm shutdown", GET)
    cell.end = run.record(cell)
    cell.executions = run.executions(cell.key)


def phase_duplicate(run: Run, cell: Cell) -> tuple[str, str]:
    """apply_async with the same key and arguments (to the shared worker: any other may be gone)."""
    again = run.app.tasks[cell.task].apply_async(cell.ending.args, idempotency_key=cell.key, queue=run.queues["shared"])
    try:
        value = again.get(timeout=GET)
        outcome = "the stored value" if value == "done" else repr(value)
    except Exception as exc:  # noqa: BLE001 - the outcome is what is observed
        outcome = f"raises `{type(exc).__name__}`"
    after = run.executions(cell.key)
    executions = str(cell.executions) if after == cell.executions else f"{cell.executions}, then {after}"
    if cell.ending.kind == "replaced":
        executions += f" (+ {run.executions(cell.key, ':replacement')} replacement)"
    if again.deduplicated:
        return f"deduplicated: {outcome}", executions
    return ("runs again (not deduplicated)" if outcome == "the stored value" else f"runs again: {outcome}"), executions


def test_every_ending_through_real_workers(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="celery_idem.reconciler")
    broker = run.app.conf.broker_url.split(":", 1)[0].replace("amqp", "rabbitmq")
    cells = [Cell(e, v, f"{e.kind}-{v}-{uuid.uuid4().hex[:8]}") for e in ENDINGS for v in VARIANTS]
    started = time.monotonic()
    for cell in cells:
        if cell.ending.first:  # while the worker has room: RabbitMQ drops an expired message nobody takes
            phase_end(run, cell)
    with ThreadPoolExecutor(len(cells)) as pool:
        list(pool.map(lambda c: phase_end(run, c), [c for c in cells if not c.ending.first]))
    ends = time.monotonic()
    # The leases of the records left unsettled run out; then one reconcile settles what it can.
    leases = [r.lease_expires_at for c in cells if (r := run.idem.get(c.task, c.key)) and not r.state.settled]
    if leases:
        until(lambda: run.idem.store.now() > max(leases), "the leases to run out", GET)
    report = run.idem.reconcile()
    settled = {c.key: run.record(c) for c in cells}
    with ThreadPoolExecutor(len(cells)) as pool:
        duplicates = dict(zip([c.key for c in cells], pool.map(lambda c: phase_duplicate(run, c), cells), strict=True))
    print(f"{broker}: endings {ends - started:.1f}s, reconcile {report}, total {time.monotonic() - started:.1f}s")
    failures = []
    for cell in cells:
        dup, executions = duplicates[cell.key]
        seen = Seen(cell.end, settled[cell.key], dup, executions)
        want = documented = cell.ending.expect(broker, cell.variant)
        if cell.late_hook and want.end == "`IN_PROGRESS`":
            print(f"{cell.ending.label} ({cell.variant}): the hook came after the lease ran out")
            want = want._replace(end="none")
        met = all(saw in wanted.split(" or ") for saw, wanted in zip(seen, want, strict=True))
        if not met:
            failures.append(f"{cell.ending.label} ({cell.variant}): saw {seen}, expected {want}")
        # As the docs say it: the expectation it met ("A or B" where either is right), else what it saw.
        OBSERVED[(cell.ending.label, broker, cell.variant)] = documented if met else seen
    reconciled = "\n".join(r.getMessage() for r in caplog.records if r.name == "celery_idem.reconciler")
    assert not failures, "\n".join([*failures, "reconciler:", reconciled])


def test_the_docs_table_is_what_the_matrix_saw() -> None:
    """docs/concepts.md shows the matrix as the runs above saw it; with CELERY_IDEM_WRITE_ENDINGS=1
    this rewrites the table instead (after the runs: ``python -m pytest tests/worker/test_endings.py``)."""
    ARTEFACT.parent.mkdir(exist_ok=True)
    ARTEFACT.write_text(
        json.dumps(
            [
                {"ending": label, "broker": broker, "acks_late": variant == "late", **seen._asdict()}
                for (label, broker, variant), seen in OBSERVED.items()
            ],
            indent=1,
        )
    )
    missing = [(e.label, b, v) for e in ENDINGS for b in BROKERS for v in VARIANTS if (e.label, b, v) not in OBSERVED]
    if missing:
        pytest.skip(f"the matrix did not run on every broker here ({len(missing)} cells missing)")
    table = render(OBSERVED)
    if os.environ.get("CELERY_IDEM_WRITE_ENDINGS"):
        write_docs_block(table)
    assert docs_block() == table, (
        "docs/concepts.md's endings table is not what the matrix saw; rewrite it with "
        "CELERY_IDEM_WRITE_ENDINGS=1 python -m pytest tests/worker/test_endings.py"
    )
