"""What celery-idem decided about each call and message, per task and key, for a test to assert on.

:class:`IdempotencyRecorder` is a telemetry witness (:mod:`celery_idem.telemetry`): while it
listens, every decision the state machine logs reaches it with its identity and task id. A call
is answered at publish (``side="publish"``) and a message on the worker (``side="worker"``):

=========  ===========  =====================================================================
side       decision     what happened
=========  ===========  =====================================================================
publish    NEW          the call claimed its key and was published (or run inline, eager)
publish    DUPLICATE    deduplicated: handed the task id of the call that holds the key
publish    REPLAY       replayed: handed the stored outcome; nothing was published
publish    MISMATCH     refused: the key belongs to other arguments (``PayloadMismatchError``)
worker     RUN          ran: the message took the key and its body ran
worker     REPLAY       replayed: the message was answered with the stored outcome
worker     BUSY         busy: another attempt held the key; the message waited or went back
worker     MISMATCH     refused: the key belongs to other arguments
=========  ===========  =====================================================================

Only decisions made in this process are seen: eager calls, and workers that run in the test's
process (``celery.contrib.pytest``'s ``celery_worker``, a solo or threads pool), never the children
of a prefork worker.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..keys import keyed_identity
from ..records import Decision, IdempotencyRecord, Identity, State
from ..telemetry import add_witness, remove_witness

__all__ = ["Decided", "IdempotencyRecorder"]


@dataclass(frozen=True)
class Decided:
    """One decision about a call or a message, as the recorder saw it."""

    identity: Identity
    side: str  # "publish" (a call) or "worker" (a message)
    decision: Decision
    task_id: str  # the call's or message's own task id
    original_task_id: str  # the task id the store holds the key under
    state: State  # the record's state when the decision was made

    def __str__(self) -> str:
        original = "" if self.original_task_id == self.task_id else f", key held by task {self.original_task_id}"
        return f"{self.side} {self.decision.value} (task {self.task_id}, record {self.state.value}{original})"


def _task_name(task: Any) -> str:
    return task if isinstance(task, str) else str(task.name)


class IdempotencyRecorder:
    """Records every decision celery-idem makes in this process while it listens.

    ``with recorder:`` (or :meth:`start` and :meth:`stop`) bounds the listening; the ``idem``
    fixture of :mod:`celery_idem.contrib.pytest` listens for the whole test. A task is given as the
    task or its name; a key and scope as given to ``apply_async`` (a call without a key is recorded
    under its fingerprint, which :meth:`keys` lists).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a worker thread decides while the test thread reads
        self._seen: list[Decided] = []

    def __call__(self, identity: Identity, side: str, decision: str, task_id: str, record: IdempotencyRecord) -> None:
        seen = Decided(identity, side, Decision(decision), task_id, record.task_id, record.state)
        with self._lock:
            self._seen.append(seen)

    def start(self) -> None:
        add_witness(self)

    def stop(self) -> None:
        remove_witness(self)

    def __enter__(self) -> IdempotencyRecorder:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def clear(self) -> None:
        """Forget what was recorded so far (the setup of a test, say)."""
        with self._lock:
            self._seen.clear()

    def __iter__(self) -> Iterator[Decided]:
        with self._lock:
            return iter(list(self._seen))

    # ---- reading -------------------------------------------------------------------------------

    def history(self, task: Any, key: str, *, scope: str | None = None) -> list[Decided]:
        """Every decision about the calls and messages of ``key``, in the order they were made."""
        identity = keyed_identity(_task_name(task), key, scope)
        return [seen for seen in self if seen.identity == identity]

    def decisions(self, task: Any, key: str, *, scope: str | None = None) -> list[str]:
        """:meth:`history` as ``"side DECISION"`` strings: ``["publish NEW", "worker RUN", "publish REPLAY"]``."""
        return [f"{seen.side} {seen.decision.value}" for seen in self.history(task, key, scope=scope)]

    def keys(self, task: Any) -> list[str]:
        """The keys (and fingerprints of key-less calls) decided about for ``task``, first seen first."""
        name = _task_name(task)
        return list(dict.fromkeys(seen.identity.key for seen in self if seen.identity.task_name == name))

    def count(self, task: Any, key: str, side: str, decision: Decision, *, scope: str | None = None) -> int:
        """How many times ``key`` was answered ``decision`` on ``side``."""
        return sum(s.side == side and s.decision is decision for s in self.history(task, key, scope=scope))

    # ---- assertions ----------------------------------------------------------------------------

    def assert_ran_once(self, task: Any, key: str, *, scope: str | None = None) -> None:
        """The body of ``key``'s call ran exactly once (one message took the key).

        Raises:
            AssertionError: it never ran or ran more than once; the message lists what happened.
        """
        __tracebackhide__ = True
        self.assert_ran(task, key, times=1, scope=scope)

    def assert_ran(self, task: Any, key: str, *, times: int, scope: str | None = None) -> None:
        """The body of ``key``'s call ran exactly ``times`` times (0: it never ran).

        Raises:
            AssertionError: it ran another number of times; the message lists what happened.
        """
        __tracebackhide__ = True
        ran = self.count(task, key, "worker", Decision.RUN, scope=scope)
        if ran != times:
            expected = {0: "never to run", 1: "to run once"}.get(times, f"to run {times} times")
            self._fail(task, key, scope, f"expected {expected}, {_ran(ran)}")

    def assert_replayed(self, task: Any, key: str, *, scope: str | None = None) -> None:
        """A call or a message of ``key`` was answered with the stored outcome instead of running.

        Raises:
            AssertionError: nothing was replayed; the message lists what happened.
        """
        __tracebackhide__ = True
        if not any(seen.decision is Decision.REPLAY for seen in self.history(task, key, scope=scope)):
            self._fail(task, key, scope, "expected a replay of its stored outcome, there was none")

    def assert_deduplicated(self, task: Any, key: str, *, scope: str | None = None) -> None:
        """A call of ``key`` was answered at publish without a new message (``result.deduplicated``):
        handed the running call's task id (``DUPLICATE``) or the stored outcome (``REPLAY``).

        Raises:
            AssertionError: every call was published; the message lists what happened.
        """
        __tracebackhide__ = True
        answered = (Decision.DUPLICATE, Decision.REPLAY)
        if not any(s.side == "publish" and s.decision in answered for s in self.history(task, key, scope=scope)):
            self._fail(task, key, scope, "expected a call deduplicated at publish, there was none")

    def assert_mismatch(self, task: Any, key: str, *, scope: str | None = None) -> None:
        """A call or a message of ``key`` was refused because the key belongs to other arguments
        (``PayloadMismatchError``).

        Raises:
            AssertionError: nothing was refused; the message lists what happened.
        """
        __tracebackhide__ = True
        if not any(seen.decision is Decision.MISMATCH for seen in self.history(task, key, scope=scope)):
            self._fail(task, key, scope, "expected a call refused for other arguments (MISMATCH), there was none")

    def _fail(self, task: Any, key: str, scope: str | None, problem: str) -> None:
        __tracebackhide__ = True  # pytest shows the failing test's line, not these frames
        name = _task_name(task)
        where = f"task {name!r}, key {key!r}" + (f" (scope {scope!r})" if scope else "")
        history = self.history(task, key, scope=scope)
        if history:
            happened = "; what happened:\n" + "\n".join(f"  {seen}" for seen in history)
        else:
            others = self.keys(task)
            happened = (
                f"; nothing was decided about this key (keys seen for this task: {', '.join(map(repr, others))})"
                if others
                else "; celery-idem decided nothing about this task in this process (is it an IdempotentTask, "
                "and does its worker run in the test's process?)"
            )
        raise AssertionError(f"{where}: {problem}{happened}")


def _ran(n: int) -> str:
    return {0: "it never ran", 1: "it ran once"}.get(n, f"it ran {n} times")
