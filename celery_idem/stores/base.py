"""The store contract: the atomic operations of DESIGN §3 over one record per identity.

Public methods here check their inputs, enforce the result size limit, mint owner tokens and turn
a store's connection or timeout errors into :class:`StoreUnavailableError`. Each store implements
the private primitives (``_claim``, ``_acquire``, ...), and each primitive is ONE atomic operation
on its backend: a Lua script, a conditional SQL statement, or a step under a lock.

The contract, by concern: the rules every store follows and the decision table that states them
(:mod:`~celery_idem.stores.rules`); the types a store takes and returns (``spi``); the settings,
clock and error guard every store has (``core``); the reconciler's and the operators' operations
(``upkeep``); and here, :class:`Store`, the operations on a record and the primitives behind them.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ResultTooLargeError
from ..records import ErrorInfo, IdempotencyRecord, Identity, State, Transition
from .core import positive
from .spi import Clock, Fence, Settlement, Wait, new_token
from .upkeep import StoreUpkeep

__all__ = ["Clock", "Fence", "Settlement", "Store", "Wait", "new_token"]


class Store(StoreUpkeep):
    """Base of every store. Subclasses set ``_unavailable`` to their connection/timeout errors.

    Past the operations here, a store has the reconciler's and the operators' (:class:`StoreUpkeep`)
    and the settings, clock and error guard every store has (:class:`~celery_idem.stores.core.StoreCore`).

    Args:
        key_prefix: Namespace of every key (Redis) or row (SQL) this store writes.
        timeout_seconds: Deadline of every store call; past it the call raises
            :class:`StoreUnavailableError` instead of hanging.
        max_result_bytes: Largest serialized result :meth:`complete` accepts.
        clock: Seconds since the epoch; injected by tests to move time without sleeping.
    """

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
        settled_is_free: bool = False,
    ) -> Transition:
        """Producer side, before publishing: NEW, DUPLICATE, REPLAY or MISMATCH (with the record).

        ``call`` (the serialized arguments) is kept on the record for the reconciler to requeue.
        ``settled_is_free``: a settled record is taken as if absent (NEW), whatever its arguments: the
        claim of a mode that hands no outcome to new calls (``until_done``), whose settled records are
        kept for the messages of the run that ended (copies, duplicates carrying a continuation,
        waiters) and for the reconciler, never for a new call.
        """
        lease, ttl = positive("pending_seconds", pending_seconds), positive("ttl_seconds", ttl_seconds)
        with self._guard("claim", identity):
            return self._claim(identity, fingerprint, task_id, owner or new_token(), lease, ttl, call, settled_is_free)

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
        lease, ttl = positive("lease_seconds", lease_seconds), positive("ttl_seconds", ttl_seconds)
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
        lease = None if pending_seconds is None else positive("pending_seconds", pending_seconds)
        with self._guard("release", identity):
            return self._release(identity, fence, token, lease, new_token(), expired_only)

    def renew(self, identity: Identity, token: str, *, lease_seconds: float) -> Transition:
        """Heartbeat: extend the IN_PROGRESS lease of ``token``'s attempt; OK or LOST."""
        lease = positive("lease_seconds", lease_seconds)
        with self._guard("renew", identity):
            return self._renew(identity, token, lease)

    def hand_over(self, identity: Identity, token: str, new_owner: str, *, lease_seconds: float) -> Transition:
        """Pass ``token``'s IN_PROGRESS record to ``new_owner``, leased exactly ``lease_seconds`` from
        now (shorter or longer than before); OK, or LOST. ``token`` can write nothing after it.

        ``self.replace()`` uses it twice: the replaced attempt hands its record to the token its
        replacement's message carries, and the replacement takes it under its own owner token.
        """
        lease = positive("lease_seconds", lease_seconds)
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

    @contextmanager
    def watch(self, identity: Identity) -> Iterator[Wait]:
        """Watch ``identity`` while waiting for its outcome: yields a :class:`Wait`; ``wait(seconds)``
        returns when the record may have changed (settled, freed, forgotten) or after ``seconds``.

        A notice is a hint, never the answer: the waiter reads the record again after each wait,
        and a record that expires sends none. Enter the watch before the first read, so a change
        between that read and the first wait is not missed. Stores that cannot notify (the base,
        the SQL stores) sleep the whole wait (``wait.notices`` is False): their waiters poll with
        backoff, as do the waiters of a store that could not subscribe this one.
        """
        yield Wait(time.sleep, notices=False)

    def ping(self) -> None:
        """Round-trip to the store; raises StoreUnavailableError if it does not answer in time."""
        with self._guard("ping"):
            self._ping()

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
        settled_is_free: bool,
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

    # ---- the worker's start-up check: optional ------------------------------------------------------

    def _ping(self) -> None:
        """A round trip: by default, a read of a record nobody writes."""
        self._get(Identity("", "celery_idem.ping", "ping"))
