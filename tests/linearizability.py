"""A small linearizability checker (Wing & Gong's search, with Lowe's memoization, as in Knossos/Porcupine).

A history is a list of :class:`Call`: an operation, its answer, and when it was invoked and when it
returned (monotonic clock). It is linearizable if the calls can be put in one sequential order that
(a) keeps real-time order: a call that returned before another was invoked comes first, and (b) gives,
run one by one on the sequential model, the very answers the calls got. The search tries, at each
point, every call not yet placed that could go next (one invoked before the earliest return among the
calls left), and remembers (calls placed, model state) pairs that led nowhere. Exponential in the
worst case; fine for the short histories the tests record (a dozen or two of calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Call", "linearize", "render"]


class State(Protocol):
    def copy(self) -> State: ...

    def key(self) -> Any: ...


@dataclass
class Call:
    """One operation as a thread saw it."""

    thread: int
    op: Any
    start: float
    end: float
    answer: Any = None


def linearize(
    history: Sequence[Call],
    initial: State,
    apply: Callable[[State, Any], Any],
    agree: Callable[[Any, Any, Any], bool],
) -> list[Call] | None:
    """A sequential order of ``history`` that explains every answer, or None if there is none.

    Args:
        history: The calls, in any order.
        initial: The model's state before the first call (left untouched).
        apply: Runs an operation on a state (changing it) and returns the model's answer.
        agree: ``agree(op, model_answer, real_answer)``: whether the real answer is the model's.
    """
    calls = sorted(history, key=lambda c: c.start)
    everything = frozenset(range(len(calls)))
    dead_ends: set[tuple[frozenset[int], Any]] = set()

    def search(placed: frozenset[int], state: State) -> list[int] | None:
        if placed == everything:
            return []
        memo = (placed, state.key())
        if memo in dead_ends:
            return None
        left = [n for n in range(len(calls)) if n not in placed]
        horizon = min(calls[n].end for n in left)  # whoever returned first must precede later invocations
        for n in left:
            if calls[n].start > horizon:
                break  # sorted by start: no later call may go next either
            after = state.copy()
            if agree(calls[n].op, apply(after, calls[n].op), calls[n].answer):
                rest = search(placed | {n}, after)
                if rest is not None:
                    return [n, *rest]
        dead_ends.add(memo)
        return None

    order = search(frozenset(), initial)
    return None if order is None else [calls[n] for n in order]


def render(history: Sequence[Call], show: Callable[[Any], str] = repr) -> str:
    """The history as a table, by invocation time: when (ms from the first call), thread, call, answer."""
    if not history:
        return "(empty history)"
    t0 = min(c.start for c in history)
    lines = []
    for call in sorted(history, key=lambda c: c.start):
        span = f"{(call.start - t0) * 1000:9.3f} .. {(call.end - t0) * 1000:9.3f} ms"
        lines.append(f"{span}  T{call.thread:<2} {call.op}  ->  {show(call.answer)}")
    return "\n".join(lines)
