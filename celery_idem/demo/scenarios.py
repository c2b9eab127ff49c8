"""The demo's scenarios. Each runs on the real worker of :class:`~celery_idem.demo.harness.Demo` and
returns a :class:`Shown`: whether the guarantee held, counted outside the library (the bodies' effects
file, the payments table), a one-line detail for the summary, and the story of what happened."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import PayloadMismatchError, PermanentError
from ..reconciler import ReconcileReport
from ..records import IdempotencyRecord, State
from .app import LEASE_SECONDS, LIVENESS_SECONDS
from .harness import Demo

__all__ = ["SCENARIOS", "Shown", "play"]

CALLERS, CALLS_EACH = 8, 25
WAIT = 60.0  # seconds a call's answer, or a job's start, is waited for


@dataclass
class Shown:
    held: bool
    detail: str
    story: list[str] = field(default_factory=list)


def play(demo: Demo, scenario: Callable[[Demo], Shown]) -> Shown:
    """Run a scenario on a live worker; one that crashes, or whose worker died, did not hold."""
    if (dead := demo.dead()) is not None:
        return Shown(False, dead)
    try:
        shown = scenario(demo)
    except Exception as exc:  # noqa: BLE001 - a scenario that crashes did not hold
        shown = Shown(False, f"{type(exc).__name__}: {exc}")
    if not shown.held and (dead := demo.dead()) is not None:
        shown.detail += f" ({dead})"
    return shown


def _storm(demo: Demo, task: str, key: str | None) -> set[tuple[str, str]]:
    """CALLERS threads, each making CALLS_EACH calls of one charge and waiting for each answer."""
    answers: set[tuple[str, str]] = set()
    errors: list[Exception] = []
    lock = threading.Lock()
    options = {"idempotency_key": key} if key else {}

    def caller() -> None:
        try:
            for _ in range(CALLS_EACH):
                result = demo.call(task, 1001, 4200, **options)
                value = result.get(timeout=WAIT, interval=0.05)
                with lock:
                    answers.add((result.id, repr(value)))
        except Exception as exc:  # noqa: BLE001 - raised below, on the demo's thread
            errors.append(exc)

    # Daemon threads: a Ctrl-C on the demo's thread stops the demo without waiting out their calls.
    threads = [threading.Thread(target=caller, daemon=True) for _ in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return answers


def storm(demo: Demo) -> Shown:
    calls, key = CALLERS * CALLS_EACH, f"order-1001-{demo.prefix}"
    _storm(demo, "demo.plain_charge", None)
    plain = demo.executions_of("demo.plain_charge")
    answers = _storm(demo, "demo.charge", key)
    runs = demo.executions("demo.charge", key)
    ids, values = {a[0] for a in answers}, {a[1] for a in answers}
    held = plain == calls and runs == 1 and len(ids) == 1 and len(values) == 1
    return Shown(
        held,
        f"plain Celery: {plain} charges; celery-idem: {runs} charge, {len(ids)} task id, {len(values)} answer",
        [
            f"{calls} calls of charge(1001, 4200) from {CALLERS} threads, the same body on two tasks:",
            f"plain Celery ran it {plain} times; with the key {key!r}, celery-idem ran it {runs} time and "
            f"handed all {calls} calls the same task id and answer",
        ],
    )


def mismatch(demo: Demo) -> Shown:
    key = f"order-1002-{demo.prefix}"
    demo.call("demo.charge", 1002, 4200, idempotency_key=key).get(timeout=WAIT, interval=0.05)
    try:
        demo.call("demo.charge", 1002, 9900, idempotency_key=key)
    except PayloadMismatchError:
        runs = demo.executions("demo.charge", key)
        return Shown(runs == 1, f"amount 9900 under the key of 4200: PayloadMismatchError, still {runs} charge")
    return Shown(False, "a different amount under a used key was accepted")


def final_failure(demo: Demo) -> Shown:
    key = f"order-77-{demo.prefix}"
    outcomes = []
    for _ in range(2):
        try:
            demo.call("demo.declined", 77, idempotency_key=key).get(timeout=WAIT, interval=0.05)
            outcomes.append("no error")
        except PermanentError as exc:
            outcomes.append(f"{type(exc).__name__}({exc})")
    runs = demo.executions("demo.declined", key)
    held = runs == 1 and outcomes[0] == outcomes[1] != "no error"
    return Shown(held, f"declined twice with {outcomes[0]}, body ran {runs} time: the second call was a replay")


def retry(demo: Demo) -> Shown:
    key = f"order-88-{demo.prefix}"
    result = demo.call("demo.flaky", 88, idempotency_key=key)
    value = result.get(timeout=WAIT, interval=0.05)
    again = demo.call("demo.flaky", 88, idempotency_key=key)
    runs = demo.executions("demo.flaky", key)
    held = value["attempts"] == 2 and runs == 2 and again.deduplicated and again.get(timeout=WAIT) == value
    return Shown(held, f"timed out once, retried under task id {result.id[:8]}: {runs} attempts, then replayed")


def _started(demo: Demo, task: str, key: str, started: Callable[[], bool]) -> str | None:
    """Wait for a job's first attempt to reach where the demo kills it; why not, if it does not."""
    deadline = time.monotonic() + WAIT
    while not started():
        if time.monotonic() > deadline:
            record = demo.idem.get(task, key)
            state = record.state.value if record else "no record"
            lines = [line for line in demo.log().read_text(errors="replace").splitlines() if line.strip()]
            last = lines[-1].strip()[:200] if lines else "empty"
            return f"the job did not start within {WAIT:g} s (its record: {state}; the worker's last line: {last})"
        time.sleep(0.05)
    return None


@dataclass
class Crash:
    """What followed a worker's SIGKILL, as observed: the record it left, the reconciler's run, the
    executions before the client's retry (a broker that redelivers at once ran one more), the retry."""

    stuck: IdempotencyRecord | None
    before: IdempotencyRecord | None  # read once the dead attempt's lease and liveness ran out
    report: ReconcileReport
    runs_before_retry: int
    retried: Any
    answer: Any
    runs: int

    def reconciler(self) -> str:
        report = self.report
        if report.completed:
            return "the reconciler found the outcome in the ledger and completed the record with it"
        if report.released:
            return (
                f"its lease ({LEASE_SECONDS:g} s) and its process's liveness record ({LIVENESS_SECONDS:g} s) ran "
                "out unrenewed: the reconciler took the holder for dead and released the record"
            )
        if report.left_records:
            return f"the reconciler left the record: {report.left_records[0].why}"
        return "the reconciler had nothing left to settle"

    def redelivery(self, again: str) -> list[str]:
        """What a message the broker redelivered at once (RabbitMQ; acks_late) did before the reconciler."""
        redelivered = (
            "the broker redelivered the unacked message (acks_late) to the new worker at once: it waited out the "
            "dead attempt's lease, took the key over and "
        )
        if self.runs_before_retry >= 2:
            return [redelivered + again]
        if self.before is not None and self.before.state is State.COMPLETED:
            return [redelivered + "found the outcome in the ledger: it completed the record, the body not run again"]
        return []

    def retry(self) -> str:
        if self.retried.deduplicated:
            return "the client's retry was answered from the store, the body not run for it"
        return "the client's retry ran the body again, to completion"


def _crash(
    demo: Demo, task: str, key: str, first: tuple[Any, ...], again: tuple[Any, ...], started: Callable[[], bool]
) -> Crash | str:
    """Call, SIGKILL the worker where ``started`` says, start another, wait out the dead attempt's lease
    and liveness, reconcile, retry the call as a client would."""
    demo.call(task, *first, idempotency_key=key)
    if (why := _started(demo, task, key, started)) is not None:
        return why
    demo.kill_worker()
    stuck = demo.idem.get(task, key)
    demo.start_worker()
    if stuck is not None and stuck.lease_expires_at is not None:
        time.sleep(max(0.0, stuck.lease_expires_at - time.time()) + LIVENESS_SECONDS + 0.5)
    before = demo.idem.get(task, key)
    report = demo.idem.reconcile()
    runs_before_retry = demo.executions(task, key)
    retried = demo.call(task, *again, idempotency_key=key)
    answer = retried.get(timeout=WAIT, interval=0.05)
    return Crash(stuck, before, report, runs_before_retry, retried, answer, demo.executions(task, key))


def crash_before_effect(demo: Demo) -> Shown:
    key = f"db-1-{demo.prefix}"
    crash = _crash(
        demo, "demo.provision", key, (key, 120), (key, 0.1), lambda: demo.executions("demo.provision", key) >= 1
    )
    if isinstance(crash, str):
        return Shown(False, crash)
    final = demo.idem.get("demo.provision", key)
    completed = final is not None and final.state is State.COMPLETED and crash.answer == f"{key} is up"
    held = crash.stuck is not None and crash.stuck.state is State.IN_PROGRESS and completed and crash.runs == 2
    return Shown(
        held,
        f"killed mid-job, before its effect: the key freed, the body ran again to completion ({crash.runs} runs)",
        [
            "the worker was SIGKILLed while the job ran, before it had done anything: its record stayed "
            f"{crash.stuck.state.value if crash.stuck else 'absent'}",
            *crash.redelivery("ran the body again, to completion"),
            crash.reconciler(),
            f"{crash.retry()}: {crash.runs} executions of the body, its effect made once",
            "safe here because the first attempt died before its effect; an effect it had made before the kill "
            "would have happened twice: without a ledger the store cannot know it landed (next scenario)",
        ],
    )


def crash_after_payment(demo: Demo) -> Shown:
    order, key = 2002, f"order-2002-{demo.prefix}"
    crash = _crash(demo, "demo.pay", key, (order, 1500, 120), (order, 1500, 0), lambda: len(demo.payments(order)) >= 1)
    if isinstance(crash, str):
        return Shown(False, crash)
    rows = demo.payments(order)
    held = crash.stuck is not None and rows == [crash.answer["payment_id"]]
    return Shown(
        held,
        f"killed after the payment, before its outcome was stored: {len(rows)} payment row, retry replayed",
        [
            "the worker was SIGKILLed after the payment committed (through the ledger, in the payment's own "
            "transaction) and before its outcome reached the store or its message was acked: record "
            f"{crash.stuck.state.value if crash.stuck else 'absent'}",
            *crash.redelivery("ran the body again: the ledger answered it with the committed payment, unpaid again"),
            crash.reconciler(),
            f"{crash.retry()}: payment {crash.answer['payment_id']}; {len(rows)} payment row, the body ran "
            f"{crash.runs} time{'s' if crash.runs > 1 else ''}",
        ],
    )


SCENARIOS: list[tuple[str, Callable[[Demo], Shown]]] = [
    ("storm of duplicate calls", storm),
    ("payload mismatch refused", mismatch),
    ("final failure replayed", final_failure),
    ("retryable failure retried", retry),
    ("worker killed mid-job", crash_before_effect),
    ("worker killed after the payment", crash_after_payment),
]
