"""The endings matrix: every way a task can end, what each must leave behind, and the docs table.

tests/worker/test_endings.py runs each :class:`Ending` through real workers, on every broker, with
``acks_late`` on and off, and asserts that what it saw is :meth:`Ending.expect`. The table in
docs/concepts.md (between the markers below) is rendered from those cells, so the docs say what
the matrix saw; ``CELERY_IDEM_WRITE_ENDINGS=1 python -m pytest tests/worker/test_endings.py`` rewrites it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from celery_idem.endings import Ending as Code

DOCS = Path(__file__).resolve().parent.parent / "docs" / "concepts.md"
START, END = "<!-- endings-table:start -->", "<!-- endings-table:end -->"
BROKERS = ("redis", "rabbitmq")
VARIANTS = ("late", "early")  # acks_late=True, acks_late=False


class Seen(NamedTuple):
    """One cell: what a call that ended this way leaves behind ("A or B": either is right)."""

    end: str  # the record once the ending is over (Idempotency.get)
    settled: str  # the record after its lease ran out and one reconcile
    duplicate: str  # what apply_async with the same key gets after that
    executions: str  # executions of the body, counted in Redis by the body itself


def same(seen: Seen) -> Callable[[str, str], Seen]:
    return lambda broker, variant: seen


def by_ack(late: Seen, early: Seen) -> Callable[[str, str], Seen]:
    return lambda broker, variant: late if variant == "late" else early


def _past() -> dict[str, Any]:
    return {"expires": dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)}


@dataclass(frozen=True)
class Ending:
    label: str  # the row of the docs table
    kind: str  # the task in tests/endings_app.py
    why: str
    expect: Callable[[str, str], Seen]  # (broker, variant) -> the cell
    args: tuple[Any, ...] = ()
    options: Callable[[], dict[str, Any]] = dict  # apply_async options, made at submit
    act: str | None = None  # what the test does to the call: see test_endings.act
    worker: str = "shared"  # "shared", "warm" (shut down by the test), "spawn" (spawned children), "idle" (none)
    first: bool = False  # submitted before the other cells, while the worker has room
    takes: tuple[Code, ...] = ()  # the endings in code (celery_idem.endings) its attempts end by


VALUE = "deduplicated: the stored value"
RUNS = "runs again (not deduplicated)"
KILLED = Seen("`IN_PROGRESS`", "none", RUNS, "1, then 2")
REDELIVERED = Seen("`COMPLETED`", "`COMPLETED`", VALUE, "2")

ENDINGS: tuple[Ending, ...] = (
    Ending(
        "returns a value", "returns", "", same(Seen("`COMPLETED`", "`COMPLETED`", VALUE, "1")), takes=(Code.RETURNED,)
    ),
    Ending(
        "raises a permanent error (`PermanentError`)",
        "permanent",
        "stored; replayed to every duplicate as the same exception class",
        same(
            Seen(
                "`FAILED` (`PermanentError`)",
                "`FAILED` (`PermanentError`)",
                "deduplicated: raises `PermanentError`",
                "1",
            )
        ),
        takes=(Code.PERMANENT,),
    ),
    Ending(
        "raises a retryable error, no retry",
        "retryable",
        "a transient error is never frozen as the answer to a key: released, so a new call runs",
        same(Seen("none", "none", RUNS, "1, then 2")),
        takes=(Code.RETRYABLE,),
    ),
    Ending(
        "`self.retry()`, then returns",
        "retries",
        "the retry is the same attempt chain: `PENDING` under the same task id meanwhile (lease "
        "`pending_timeout_seconds` + countdown, never past the expiry the retry message inherits + 5 s)",
        same(Seen("`COMPLETED`", "`COMPLETED`", VALUE, "2")),
        takes=(Code.RETRIED, Code.RETURNED),
    ),
    Ending(
        "`autoretry_for`, a retry left, then returns",
        "autoretried",
        "as `self.retry()`",
        same(Seen("`COMPLETED`", "`COMPLETED`", VALUE, "2")),
        args=(1,),
        takes=(Code.RETRIED, Code.RETURNED),
    ),
    Ending(
        "`autoretry_for`, retries exhausted",
        "autoretried",
        "as a retryable error with no retry left",
        same(Seen("none", "none", RUNS, "2, then 3")),
        args=(2,),
        takes=(Code.RETRIED, Code.RETRYABLE),
    ),
    Ending(
        "`self.replace(sig)`",
        "replaced",
        "the body handed its work on and must not run again: a replacement by its own call takes the record "
        "over at once (a handover token the store checks); any other keeps it `IN_PROGRESS` (lease "
        "`pending_timeout_seconds` + `lease_seconds`) until callbacks linked to the replacement settle it with "
        "its outcome, fenced by the owner token; duplicates get the original task id, whose result is the "
        "replacement's",
        same(Seen("`COMPLETED`", "`COMPLETED`", VALUE, "1 (+ 1 replacement)")),
        takes=(Code.REPLACED,),
    ),
    Ending(
        "`Reject(requeue=True)`",
        "rejects",
        "with `acks_late` the broker redelivers the message (`PENDING` meanwhile); without, Celery acked it "
        "already and it is gone, so the key is freed",
        by_ack(REDELIVERED, Seen("none", "none", RUNS, "1, then 2")),
        args=(True,),
        takes=(Code.REQUEUED, Code.DROPPED),
    ),
    Ending(
        "`Reject(requeue=False)`",
        "rejects",
        "the task said this message must not be processed: a duplicate message is rejected too; to process it "
        "again (say, from a dead-letter queue), `forget` the key first",
        same(Seen("`FAILED` (`Reject`)", "`FAILED` (`Reject`)", "deduplicated: raises `Reject`", "1")),
        args=(False,),
        takes=(Code.PERMANENT,),
    ),
    Ending(
        "`Ignore`",
        "ignores",
        "ended on purpose without a result: a duplicate message is acknowledged quietly, as the original was; a "
        "caller's `get()` raises `Ignore` instead of waiting for a result that never comes",
        same(Seen("`FAILED` (`Ignore`)", "`FAILED` (`Ignore`)", "deduplicated: raises `Ignore`", "1")),
        takes=(Code.PERMANENT,),
    ),
    Ending(
        "revoked before it ran",
        "returns",
        "the worker's `task_revoked` hook frees the `PENDING` claim",
        same(Seen("none", "none", RUNS, "0, then 1")),
        act="revoke_first",
        first=True,
        takes=(Code.REVOKED,),
    ),
    Ending(
        "`expires` passed when the worker received it",
        "returns",
        "the worker revokes it: the same hook frees the claim",
        same(Seen("none", "none", RUNS, "0, then 1")),
        options=_past,
        first=True,
        takes=(Code.REVOKED,),
    ),
    Ending(
        "`expires` passed with no worker to take it",
        "returns",
        "RabbitMQ drops it unseen (message TTL), Redis keeps it unseen: nobody is told, so the claim lapses "
        "at the expiry + 5 s, and the reconciler releases it (no worker holds it)",
        same(Seen("`PENDING`", "none", RUNS, "0, then 1")),
        options=_past,
        worker="idle",
        takes=(),
    ),
    Ending(
        "`revoke(terminate=True)` while it runs (SIGTERM)",
        "hangs",
        "the child gets SIGTERM: the attempt sees `SystemExit` (never an outcome) and releases its record under "
        "its owner token",
        same(Seen("none", "none", RUNS, "1, then 2")),
        act="terminate",
        takes=(Code.REVOKED,),
    ),
    Ending(
        '`revoke(terminate=True, signal="SIGKILL")` while it runs',
        "hangs",
        "as a SIGKILL of the child (below)",
        same(KILLED),
        act="terminate_kill",
        takes=(Code.REVOKED,),
    ),
    Ending(
        "soft time limit",
        "hangs",
        "`SoftTimeLimitExceeded` is raised in the body: an unlisted error, retryable by default",
        same(Seen("none", "none", RUNS, "1, then 2")),
        options=lambda: {"soft_time_limit": 1},
        takes=(Code.RETRYABLE,),
    ),
    Ending(
        "hard time limit",
        "hangs",
        "billiard sends the child SIGTERM, then SIGKILL 0.1 s later: the attempt's `SystemExit` path releases "
        "its record under its owner token if it can in that time; if not, the lease runs out and the "
        "reconciler releases it (`TimeLimitExceeded` is retryable)",
        same(Seen("none or `IN_PROGRESS`", "none", RUNS, "1, then 2")),
        options=lambda: {"time_limit": 1},
        takes=(Code.KILLED,),
    ),
    Ending(
        "SIGKILL of its prefork child",
        "hangs",
        "no heartbeat renews the lease now; the parent's hook (fenced by the task id) may free only a `PENDING` "
        "claim or an expired lease, as a live record under that id may be a copy running elsewhere; once the "
        "lease ran out, the reconciler releases it on the result backend's `WorkerLostError` (retryable), and "
        "a redelivery or the next call takes over",
        same(KILLED),
        act="sigkill",
        takes=(Code.KILLED,),
    ),
    Ending(
        "SIGKILL of its child, `task_reject_on_worker_lost`",
        "hangs_reject_lost",
        "with `acks_late` the message goes back to the broker: the copy waits for the dead attempt's lease "
        "(`busy_wait_seconds`), then runs; without, the message is gone (as above)",
        by_ack(REDELIVERED, KILLED),
        act="sigkill",
        takes=(Code.KILLED,),
    ),
    Ending(
        "SIGKILL of its child, `task_retry_on_worker_lost`",
        "hangs_retry_lost",
        "Celery sends a retry under the same task id, with either ack: it waits for the dead attempt's lease, "
        "then runs",
        same(REDELIVERED),
        act="sigkill",
        takes=(Code.KILLED, Code.RETURNED),
    ),
    Ending(
        "warm shutdown (SIGTERM to the worker) while it runs",
        "hangs",
        "the worker finishes its running tasks before it exits",
        same(Seen("`COMPLETED`", "`COMPLETED`", VALUE, "1")),
        args=(2,),
        act="warm_shutdown",
        worker="warm",
        takes=(Code.RETURNED,),
    ),
    Ending(
        "returns a value, `spawn` pool",
        "returns",
        "settings given in code reach spawned children",
        same(Seen("`COMPLETED`", "`COMPLETED`", VALUE, "1")),
        worker="spawn",
        takes=(Code.RETURNED,),
    ),
    Ending(
        "SIGKILL of its child, `spawn` pool",
        "hangs",
        "as with fork",
        same(KILLED),
        act="sigkill",
        worker="spawn",
        takes=(Code.KILLED,),
    ),
)


def merged(cells: dict[tuple[str, str], str]) -> str:
    """One table cell from the four (broker, variant) cells: one value where they agree."""
    values = set(cells.values())
    if len(values) == 1:
        return values.pop()
    by_variant = {variant: {cells[(broker, variant)] for broker in BROKERS} for variant in VARIANTS}
    if all(len(v) == 1 for v in by_variant.values()):
        return f"`acks_late`: {by_variant['late'].pop()}; otherwise: {by_variant['early'].pop()}"
    return "; ".join(
        f"{broker}, {'`acks_late`' if variant == 'late' else 'early ack'}: {value}"
        for (broker, variant), value in sorted(cells.items())
    )


def render(seen: dict[tuple[str, str, str], Seen]) -> str:
    """The markdown table of ``seen`` (label, broker, variant) -> cell, in the order of ENDINGS."""
    lines = [
        "| the attempt ends with | the record | after its lease and one reconcile | a duplicate call then gets "
        "| executions | why |",
        "|---|---|---|---|---|---|",
    ]
    for ending in ENDINGS:
        columns = [
            merged({(b, v): getattr(seen[(ending.label, b, v)], name) for b in BROKERS for v in VARIANTS})
            for name in Seen._fields
        ]
        lines.append("| " + " | ".join([ending.label, *columns, ending.why]) + " |")
    return "\n".join(lines)


def expected() -> dict[tuple[str, str, str], Seen]:
    return {(e.label, b, v): e.expect(b, v) for e in ENDINGS for b in BROKERS for v in VARIANTS}


def docs_block() -> str:
    text = DOCS.read_text()
    assert START in text and END in text, f"{DOCS} has no {START} ... {END} block"
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def write_docs_block(table: str) -> None:
    text = DOCS.read_text()
    head, rest = text.split(START, 1)
    DOCS.write_text(f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")
