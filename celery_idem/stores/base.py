"""The store contract: the atomic operations of DESIGN §3 over one record per identity.

Public methods here check their inputs, enforce the result size limit, mint owner tokens and turn
a store's connection or timeout errors into :class:`StoreUnavailableError`. Each store implements
the private primitives (``_claim``, ``_acquire``, ...), and each primitive is ONE atomic operation
on its backend: a Lua script, a conditional SQL statement, or a step under a lock.

The rules every store follows (the memory store states them most plainly):

- A record whose ``expires_at`` has passed is absent, whatever is still physically stored.
- claim: absent -> NEW (PENDING); other fingerprint -> MISMATCH; settled -> REPLAY;
  lease expired -> NEW (the new claim takes over); else DUPLICATE.
- acquire: absent -> RUN (IN_PROGRESS); other fingerprint and other task id -> MISMATCH;
  settled -> REPLAY; IN_PROGRESS with a live lease -> BUSY; else RUN. The same task id is the same
  attempt chain (a Celery retry), so it may run with changed arguments; the record keeps the
  fingerprint of the caller's call.
- hand_over: IN_PROGRESS under the token -> the same record under the new token, its lease set to
  exactly the given length (not only extended); otherwise LOST.
- complete/fail/release/renew: only while the record is PENDING or IN_PROGRESS (renew:
  IN_PROGRESS) and its owner token still holds the caller's value; otherwise LOST and nothing is
  written.
- release fenced by the task id (the parent-process signal hooks, which have no owner token): only
  what that delivery may still hold, a PENDING record or an IN_PROGRESS one whose lease has run
  out. A live IN_PROGRESS record under the same task id is a copy of the task running elsewhere
  (or the task itself): LOST.
- Liveness (DESIGN "Death is a fact"): a worker process keeps a record of its own, named by an id it
  mints, under a token of its own, for ``seconds`` of the server's clock. keep_alive creates it
  (``create``: absent or expired -> OK; live under the same token -> OK, a retried create) or renews
  it (live under the same token -> OK); anything else is LOST, and an expired record is never
  revived by a renewal: a process once seen dead stays dead under that id. alive() reads many ids at
  once and answers the ones whose record is live.
- A claim or acquire that takes over an unsettled record keeps ``previous_task_id``: the task id of
  an IN_PROGRESS record it takes (an attempt past its lease, whose body may have run), else the
  previous_task_id of the PENDING record it takes; None on an absent record.
- Times: ``lease_expires_at`` while unsettled; ``expires_at`` = lease + ttl while unsettled (a dead
  attempt's record is still collected), now + ttl once settled, but never before a BUSY waiter's
  next look (below).
- A waiting duplicate gets its answer: an acquire that answers BUSY records, in the same atomic
  step and by the server's clock, that the record must live until now + ``next_look_seconds`` (a
  hidden field, never part of the record read back; it only grows). complete/fail set ``expires_at``
  to the later of now + ttl and that time, so a short TTL never lets an outcome vanish between a
  waiter's looks. The mark stays with the record while it lives (takeovers keep it); a record
  that is absent (never claimed, deleted, past its expiry) starts without one.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from typing import ClassVar, Literal, NamedTuple

from celery.exceptions import SoftTimeLimitExceeded

from ..config import MAX_STORE_TIMEOUT_SECONDS, MIN_STORE_TIMEOUT_SECONDS
from ..errors import ConfigurationError, IdempotencyError, ResultTooLargeError, StoreUnavailableError
from ..records import Decision, ErrorInfo, IdempotencyRecord, Identity, State, Transition

__all__ = ["Clock", "Fence", "Settlement", "Store", "new_token"]

Clock = Callable[[], float]
"""An injected clock, in seconds (tests); a store otherwise reads its server's time."""
Fence = Literal["owner", "task_id"]
"""What a write is fenced by: the owner token the writer holds, or the task id (a hook that holds no token)."""
UNSETTLED = (State.PENDING, State.IN_PROGRESS)


class Settlement(NamedTuple):
    """What complete or fail writes: the final state and its result or error."""

    state: State
    result: bytes | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    error: ErrorInfo | None = None


def new_token() -> str:
    """A fresh owner token: unique per attempt, so a write under it proves the attempt owns the record."""
    return uuid.uuid4().hex


def _positive(name: str, value: float) -> float:
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of seconds; got {value!r}")
    return float(value)


class Store(ABC):
    """Base of every store. Subclasses set ``_unavailable`` to their connection/timeout errors.

    Args:
        key_prefix: Namespace of every key (Redis) or row (SQL) this store writes.
        timeout_seconds: Deadline of every store call; past it the call raises
            :class:`StoreUnavailableError` instead of hanging.
        max_result_bytes: Largest serialized result :meth:`complete` accepts.
        clock: Seconds since the epoch; injected by tests to move time without sleeping.
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
        try:
            yield
        except (IdempotencyError, SoftTimeLimitExceeded, NotImplementedError):
            raise  # ours; the soft time limit, raised into whatever the task was doing; an optional query
        except Exception as exc:
            fix = self._misconfiguration(exc)
            if fix is not None:
                # A setting that can never work: no waiting fixes it, so it is never an outage
                # (which would keep the message forever and nudge a producer to run unprotected).
                raise ConfigurationError(
                    f"the idempotency store {self.url or repr(self)} (setting 'store') cannot work: "
                    f"{type(exc).__name__}: {exc}; {fix}"
                ) from exc
            where = f" for {identity}" if identity else ""
            if self._is_outage(exc):
                message = (
                    f"{self!r} did not complete {operation}{where} within {self.timeout_seconds:g}s: {exc}; "
                    "check that the store is up, or set on_store_error='proceed' to run unprotected"
                )
            else:
                message = (
                    f"{self!r} failed {operation}{where} with an unexpected {type(exc).__name__}: {exc}; "
                    "whether it was applied is unknown, so it is handled as an outage (see the cause)"
                )
            error = StoreUnavailableError(
                message, key=identity.key if identity else None, task_name=identity.task_name if identity else None
            )
            error.unexpected = not self._is_outage(exc)  # may never pass: a worker gives up on it in time
            raise error from exc

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

    # ---- public operations -------------------------------------------------------------------

    def claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        *,
        pending_seconds: float,
        ttl_seconds: float,
        owner: str | None = None,
        call: bytes | None = None,
    ) -> Transition:
        """Producer side, before publishing: NEW, DUPLICATE, REPLAY or MISMATCH (with the record).

        ``call`` (the serialized arguments) is kept on the record for the reconciler to requeue.
        """
        lease, ttl = _positive("pending_seconds", pending_seconds), _positive("ttl_seconds", ttl_seconds)
        with self._guard("claim", identity):
            return self._claim(identity, fingerprint, task_id, owner or new_token(), lease, ttl, call)

    def acquire(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        *,
        lease_seconds: float,
        ttl_seconds: float,
        owner: str | None = None,
        call: bytes | None = None,
        next_look_seconds: float = 0.0,
        retry: bool = False,
    ) -> Transition:
        """Worker side, before the body: RUN, BUSY, REPLAY or MISMATCH (with the record).

        ``call`` is kept as with :meth:`claim`; None keeps the call the claim stored, if any.
        ``next_look_seconds``: on BUSY, the longest the caller may take to look again; the record,
        once settled, lives at least that long past now, whatever its TTL.
        ``retry``: the message is a Celery retry (``request.retries > 0``) of ``task_id``: the same
        attempt chain, which may carry other arguments than the record's, once an attempt of it ran
        (``attempt > 0``; a claim alone has no retry). Any other message with other arguments is
        MISMATCH, whatever its task id.
        """
        lease, ttl = _positive("lease_seconds", lease_seconds), _positive("ttl_seconds", ttl_seconds)
        if not 0 <= next_look_seconds < math.inf:
            raise ValueError(f"next_look_seconds must be a finite number of seconds >= 0; got {next_look_seconds!r}")
        with self._guard("acquire", identity):
            return self._acquire(
                identity,
                fingerprint,
                task_id,
                owner or new_token(),
                lease,
                ttl,
                call,
                float(next_look_seconds),
                bool(retry),
            )

    def complete(
        self,
        identity: Identity,
        token: str,
        result: bytes,
        *,
        content_type: str = "application/json",
        content_encoding: str = "utf-8",
    ) -> Transition:
        """Store the outcome: OK, or LOST if ``token`` no longer owns the record.

        Raises:
            ResultTooLargeError: ``result`` is longer than ``max_result_bytes``.
        """
        if len(result) > self.max_result_bytes:
            raise ResultTooLargeError(
                f"the serialized result is {len(result)} bytes, over max_result_bytes={self.max_result_bytes}; "
                "return a smaller result (an id to look up), or raise max_result_bytes",
                key=identity.key,
                task_name=identity.task_name,
            )
        with self._guard("complete", identity):
            return self._settle(identity, token, Settlement(State.COMPLETED, result, content_type, content_encoding))

    def fail(self, identity: Identity, token: str, error: ErrorInfo) -> Transition:
        """Store a final failure: OK, or LOST if ``token`` no longer owns the record."""
        with self._guard("fail", identity):
            return self._settle(identity, token, Settlement(State.FAILED, error=error))

    def release(
        self,
        identity: Identity,
        token: str,
        *,
        pending_seconds: float | None = None,
        fence: Fence = "owner",
        expired_only: bool = False,
    ) -> Transition:
        """Give the identity back: to PENDING for ``pending_seconds`` (a retry is queued), or delete.

        Args:
            identity: The record's identity.
            token: The owner token (or task id, with ``fence="task_id"``).
            pending_seconds: Keep the record PENDING this long, under a fresh token; None deletes it.
            fence: Which field ``token`` must match. ``"task_id"`` (the parent-process hooks) frees
                only a PENDING record or an IN_PROGRESS one past its lease; a live attempt is LOST.
            expired_only: Also require the lease to have expired (the reconciler's compare-and-set).
        """
        lease = None if pending_seconds is None else _positive("pending_seconds", pending_seconds)
        with self._guard("release", identity):
            return self._release(identity, fence, token, lease, new_token(), expired_only)

    def renew(self, identity: Identity, token: str, *, lease_seconds: float) -> Transition:
        """Heartbeat: extend the IN_PROGRESS lease of ``token``'s attempt; OK or LOST."""
        lease = _positive("lease_seconds", lease_seconds)
        with self._guard("renew", identity):
            return self._renew(identity, token, lease)

    def hand_over(self, identity: Identity, token: str, new_owner: str, *, lease_seconds: float) -> Transition:
        """Pass ``token``'s IN_PROGRESS record to ``new_owner``, leased exactly ``lease_seconds`` from
        now (shorter or longer than before); OK, or LOST. ``token`` can write nothing after it.

        ``self.replace()`` uses it twice: the replaced attempt hands its record to the token its
        replacement's message carries, and the replacement takes it under its own owner token.
        """
        lease = _positive("lease_seconds", lease_seconds)
        with self._guard("hand_over", identity):
            return self._hand_over(identity, token, new_owner, lease)

    def get(self, identity: Identity) -> IdempotencyRecord | None:
        """The live record of ``identity``, or None."""
        with self._guard("get", identity):
            return self._get(identity)

    def forget(self, identity: Identity) -> bool:
        """Remove the record in any state; True if there was one. A running attempt is fenced out."""
        with self._guard("forget", identity):
            return self._forget(identity)

    def keep_alive(self, process: str, token: str, *, seconds: float, create: bool = False) -> Transition:
        """Liveness: keep the record of the worker process ``process`` live for ``seconds`` more.

        Args:
            process: The process's liveness id (fresh per process, never reused).
            token: The process's own token: a renewal under another token, or of a record that has
                expired, is LOST (the process was taken for dead; it mints a new id).
            seconds: How long the record lives without another beat (the server's clock).
            create: The first beat: an absent record is written.
        """
        _check_process(process)
        lifetime = _positive("seconds", seconds)
        with self._guard("keep_alive"):
            return self._keep_alive(process, token, lifetime, create)

    def alive(self, processes: Collection[str]) -> frozenset[str]:
        """Which of ``processes`` (liveness ids) have a live record now, in one round trip."""
        wanted = sorted(set(processes))
        for process in wanted:
            _check_process(process)
        if not wanted:
            return frozenset()
        with self._guard("alive"):
            return frozenset(self._alive(wanted))

    def expired_leases(self, *, limit: int = 100) -> list[IdempotencyRecord]:
        """Unsettled records whose lease has expired, oldest lease first, at most ``limit``.

        Found through an index ordered by lease expiry: the cost grows with the number returned,
        not with the number of records stored.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit!r}")
        with self._guard("expired_leases"):
            return self._expired_leases(limit)

    def purge_expired(self, *, limit: int = 1000) -> int:
        """Delete up to ``limit`` records past their TTL; how many went.

        Records past their TTL are already absent to every operation; this only frees their space.
        Redis expires keys itself (0); the SQL store deletes rows; the reconciler calls this.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit!r}")
        with self._guard("purge_expired"):
            return self._purge_expired(limit)

    def _purge_expired(self, limit: int) -> int:
        return 0

    def records(
        self, *, state: State | None = None, task_name: str | None = None, limit: int = 100
    ) -> list[IdempotencyRecord]:
        """Live records, optionally of one state and one task, at most ``limit`` (for operators).

        Not for hot paths: on Redis it scans the key space.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit!r}")
        with self._guard("records"):
            return self._records(state, task_name, limit)

    def count_by_state(self) -> dict[State, int]:
        """How many live records each state holds (for operators; scans on Redis)."""
        with self._guard("count_by_state"):
            counts = dict.fromkeys(State, 0)
            for record_state, n in self._count_by_state().items():
                counts[record_state] += n
            return counts

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

    def ping(self) -> None:
        """Round-trip to the store; raises StoreUnavailableError if it does not answer in time."""
        with self._guard("ping"):
            self._ping()

    def close(self) -> None:
        """Release connections. The store reconnects if used again."""
        return None  # nothing held by default

    # ---- primitives: one atomic operation each; a store of one's own implements these -------------

    @abstractmethod
    def _claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
    ) -> Transition: ...

    @abstractmethod
    def _acquire(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        next_look: float,
        retry: bool,
    ) -> Transition: ...

    @abstractmethod
    def _settle(self, identity: Identity, token: str, outcome: Settlement) -> Transition: ...

    @abstractmethod
    def _release(
        self, identity: Identity, fence: Fence, token: str, lease: float | None, new_owner: str, expired_only: bool
    ) -> Transition: ...

    @abstractmethod
    def _renew(self, identity: Identity, token: str, lease: float) -> Transition: ...

    @abstractmethod
    def _hand_over(self, identity: Identity, token: str, new_owner: str, lease: float) -> Transition: ...

    @abstractmethod
    def _get(self, identity: Identity) -> IdempotencyRecord | None: ...

    @abstractmethod
    def _forget(self, identity: Identity) -> bool: ...

    # ---- the reconciler's: stale records and worker liveness --------------------------------------

    @abstractmethod
    def _expired_leases(self, limit: int) -> list[IdempotencyRecord]: ...

    @abstractmethod
    def _keep_alive(self, process: str, token: str, seconds: float, create: bool) -> Transition: ...

    @abstractmethod
    def _alive(self, processes: list[str]) -> set[str]: ...

    # ---- operator queries (the CLI's list and count, the worker's start-up check): optional -------

    def _records(self, state: State | None, task_name: str | None, limit: int) -> list[IdempotencyRecord]:
        raise NotImplementedError(f"{type(self).__name__} does not list its records (celery idem list needs it)")

    def _count_by_state(self) -> dict[State, int]:
        raise NotImplementedError(f"{type(self).__name__} does not count its records (celery idem count needs it)")

    def _ping(self) -> None:
        """A round trip: by default, a read of a record nobody writes."""
        self._get(Identity("", "celery_idem.ping", "ping"))


PROCESS_MAX_LENGTH = 64


def _check_process(process: str) -> None:
    if not (isinstance(process, str) and 0 < len(process) <= PROCESS_MAX_LENGTH and process.isprintable()):
        raise ValueError(f"a liveness id must be 1-{PROCESS_MAX_LENGTH} printable characters; got {process!r}")


def classify(
    record: IdempotencyRecord, fingerprint: str, *, claiming: bool, task_id: str, retry: bool = False
) -> Decision:
    """The decision table: what claim (``claiming``) or acquire decides about a live record it may
    not take (DESIGN §3). Other arguments are a MISMATCH (but for a Celery retry or a replacement
    under the record's own task id once an attempt ran: the same attempt chain), a settled record is
    a REPLAY, an unsettled one a DUPLICATE (claim) or BUSY (acquire).

    The one source of these rules: the memory store asks it before taking a record, the SQL store
    names the outcome of an upsert that declined with it, and the Redis Lua scripts, which must
    restate it, are held to it by the model tests (tests/models/test_model_stores.py).
    """
    same_chain = not claiming and retry and record.task_id == task_id and record.attempt > 0
    if record.fingerprint != fingerprint and not same_chain:
        return Decision.MISMATCH
    if record.state.settled:
        return Decision.REPLAY
    return Decision.DUPLICATE if claiming else Decision.BUSY


def taken_over(record: IdempotencyRecord | None) -> str | None:
    """The previous_task_id a claim or acquire that takes ``record`` over writes (see the rules above)."""
    if record is None:
        return None
    return record.task_id if record.state is State.IN_PROGRESS else record.previous_task_id


LOST = Transition(Decision.LOST)
OK = Transition(Decision.OK)
