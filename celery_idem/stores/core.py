"""What every store stands on: its settings, its clock, and the guard that turns whatever its
backend raises into :class:`StoreUnavailableError` (or, for a setting that can never work, a
:class:`ConfigurationError`). :class:`~celery_idem.stores.base.Store` builds the operations on it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import ClassVar

from celery.exceptions import SoftTimeLimitExceeded

from .. import telemetry
from ..config import MAX_STORE_TIMEOUT_SECONDS, MIN_STORE_TIMEOUT_SECONDS
from ..errors import ConfigurationError, IdempotencyError, StoreUnavailableError
from ..records import Identity
from .spi import Clock

__all__ = ["StoreCore", "positive"]


def positive(name: str, value: float) -> float:
    """``value`` in seconds (a lease, a TTL, a lifetime), refused unless positive and finite."""
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of seconds; got {value!r}")
    return float(value)


class StoreCore:
    """The settings, the clock and the error guard every store has (the arguments are documented
    on :class:`~celery_idem.stores.base.Store`). Subclasses set ``_unavailable`` to their
    connection/timeout errors.
    """

    _unavailable: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(
        self,
        *,
        key_prefix: str = "idem",
        timeout_seconds: float = 2.0,
        max_result_bytes: int = 1_048_576,
        clock: Clock | None = None,
    ) -> None:
        if not key_prefix:
            raise ValueError("key_prefix must be a non-empty string")
        self.key_prefix = key_prefix
        if not MIN_STORE_TIMEOUT_SECONDS <= timeout_seconds <= MAX_STORE_TIMEOUT_SECONDS:
            raise ConfigurationError(
                f"timeout_seconds must be a positive number of seconds from {MIN_STORE_TIMEOUT_SECONDS:g} to "
                f"{MAX_STORE_TIMEOUT_SECONDS:g} (a store call waits at least a millisecond, at most an hour); "
                f"got {timeout_seconds!r}"
            )
        self.timeout_seconds = float(timeout_seconds)
        self.max_result_bytes = int(max_result_bytes)
        self.clock: Clock = clock or time.time
        # Without an injected clock a store times leases by its server's clock (Redis TIME, the
        # database's clock), so clients whose clocks disagree still agree on every lease.
        self._injected_clock = clock is not None
        self._time_offset = 0.0  # tests only: see advance_clock_for_tests
        self.url: str | None = None  # the URL it was built from, password redacted (store_from_url sets it)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} prefix={self.key_prefix!r}>"

    @contextlib.contextmanager
    def _guard(self, operation: str, identity: Identity | None = None) -> Iterator[None]:
        """Turn whatever the backend raises into StoreUnavailableError (our own errors pass).

        Past the store's own connection and timeout errors, any other error of a store call (a
        driver's surprise, a reply no mapping knows) also leaves the caller not knowing whether the
        operation was applied: every caller handles that one way, as an outage, never as a raw
        error that would consume a message or fail a task whose effect happened.
        """
        started, outcome = time.perf_counter(), "ok"
        try:
            yield
        except (IdempotencyError, SoftTimeLimitExceeded, NotImplementedError):
            raise  # ours; the soft time limit, raised into whatever the task was doing; an optional query
        except Exception as exc:
            outcome = "outage" if self._is_outage(exc) else "error"
            fix = self._misconfiguration(exc)
            if fix is not None:
                # A setting that can never work: no waiting fixes it, so it is never an outage
                # (which would keep the message forever and nudge a producer to run unprotected).
                raise ConfigurationError(
                    f"the idempotency store {self.url or repr(self)} (setting 'store') cannot work: "
                    f"{type(exc).__name__}: {exc}; {fix}"
                ) from exc
            where = f" for {telemetry.shown(identity)}" if identity else ""
            if self._is_outage(exc):
                # What happened and how long it took: a refusal ends at once, a timeout at the limit.
                message = (
                    f"{self!r} could not complete {operation}{where}: {self._describe(exc)} (after "
                    f"{time.perf_counter() - started:.2f}s, timeout {self.timeout_seconds:g}s); check that "
                    "the store is up and reachable"
                )
            else:
                message = (
                    f"{self!r} failed {operation}{where} with an unexpected {self._describe(exc)}; "
                    "whether it was applied is unknown, so it is handled as an outage (see the cause)"
                )
            error = StoreUnavailableError(
                message, key=identity.key if identity else None, task_name=identity.task_name if identity else None
            )
            error.unexpected = not self._is_outage(exc)  # may never pass: a worker gives up on it in time
            raise error from exc
        finally:
            telemetry.store_call(operation, time.perf_counter() - started, outcome)

    @classmethod
    def _is_mistake(cls, exc: Exception) -> bool:
        """Whether opening the store failed on a mistake in its URL or options (no waiting fixes it)."""
        return isinstance(exc, (ValueError, TypeError))

    @classmethod
    def _misconfiguration(cls, exc: Exception) -> str | None:
        """What to fix, when ``exc`` from a store call says the configuration can never work (a
        database that does not exist); None for anything else."""
        return None

    @classmethod
    def _is_outage(cls, exc: Exception) -> bool:
        """Whether ``exc`` says the store is down, slow or refusing writes (its ``_unavailable``)."""
        return isinstance(exc, cls._unavailable)

    @classmethod
    def _describe(cls, exc: Exception) -> str:
        """What went wrong, for the message of the error the caller gets and the logs print: never a
        key or an argument of the command that failed (the error itself stays its ``__cause__``)."""
        return telemetry.described(exc)

    def now(self) -> float:
        """The store server's current time (POSIX seconds): the clock every lease is judged by.

        The injected clock when there is one; otherwise Redis ``TIME`` or the database's clock.
        Anything that compares a record's times (the reconciler's grace period) asks this.
        """
        with self._guard("now"):
            return self._server_now()

    def _server_now(self) -> float:
        return self._clock_now()

    def _clock_now(self) -> float:
        """The injected (or local) clock, plus the test-only shift."""
        return self.clock() + self._time_offset

    def advance_clock_for_tests(self, seconds: float) -> None:
        """TESTS ONLY: move this store's "now" ``seconds`` forward, for this store object alone.

        The shift is added to the server's own clock (Redis ``TIME``, the database's clock) inside
        every script and statement, so a test moves time through the production path instead of
        replacing it with an injected clock. Never called in production (the offset is 0 there).

        Raises:
            ValueError: ``seconds`` is negative. Time only moves forward: Redis expires keys in real
                time, relative to the shifted clock of their last write, so a key may outlive its
                logical expiry (every script treats it as absent) but never dies before it.
        """
        if not seconds >= 0:
            raise ValueError(f"the test clock only moves forward; got {seconds!r} seconds")
        self._time_offset += float(seconds)

    def close(self) -> None:
        """Release connections. The store reconnects if used again."""
        return None  # nothing held by default
