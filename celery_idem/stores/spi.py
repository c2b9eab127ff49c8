"""The types a store's primitives take and return, beside the record's own (:mod:`celery_idem.records`).

A store of one's own imports them from :mod:`celery_idem.stores`, with :class:`Store` itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Literal, NamedTuple

from ..records import ErrorInfo, State

__all__ = ["Clock", "Fence", "Settlement", "Wait", "new_token"]

Clock = Callable[[], float]
"""An injected clock, in seconds (tests); a store otherwise reads its server's time."""
Fence = Literal["owner", "task_id"]
"""What a write is fenced by: the owner token the writer holds, or the task id (a hook that holds no token)."""


class Settlement(NamedTuple):
    """What complete or fail writes: the final state and its result or error."""

    state: State
    result: bytes | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    error: ErrorInfo | None = None


class Wait:
    """What :meth:`Store.watch` yields: call it with seconds to wait that long, or less if a notice
    comes; ``notices`` says whether one can (False: a plain sleep, so the waiter backs off)."""

    def __init__(self, wait: Callable[[float], None], *, notices: bool) -> None:
        self._wait = wait
        self.notices = notices

    def __call__(self, seconds: float) -> None:
        self._wait(seconds)


def new_token() -> str:
    """A fresh owner token: unique per attempt, so a write under it proves the attempt owns the record."""
    return uuid.uuid4().hex
