"""How an attempt's outcome is written: fenced by the attempt's owner token, retried while its lease
lasts, then handed to the heartbeat thread. Which write an ending takes is the task's mode's table
(:mod:`celery_idem.endings`); this module carries it out.

A write answers True (written), False (LOST: another attempt owns the record) or None (the store
did not answer while the lease lasted, or the soft time limit struck: the heartbeat thread goes on
trying, so the outcome lands as soon as the store is back, before a duplicate can take the lease
that ran out meanwhile).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry, SoftTimeLimitExceeded

from . import attempts, evidence, telemetry, timing
from .calling import TaskCalls
from .endings import Ending, Step, ending_of
from .errors import IdempotencyError, LedgerUnavailableError, SerializationError, StoreUnavailableError
from .failures import classify_failure
from .ledger.calls import joined
from .outcome import encode_result
from .records import ErrorInfo, IdempotencyRecord, Identity, Transition
from .stores.base import Fence

if TYPE_CHECKING:
    from .heartbeat import Lease
    from .runtime import Runtime

__all__ = ["Settler"]

logger = logging.getLogger("celery_idem.handler")

Write = Callable[[], Transition]


class Settler:
    """The writes that settle one task's records, on its runtime's store."""

    def __init__(self, idem: Runtime, calls: TaskCalls) -> None:
        self.idem = idem
        self.calls = calls
        self._autoretry_for: tuple[type[BaseException], ...] = tuple(getattr(calls.task, "autoretry_for", ()) or ())

    def give_back(
        self,
        identity: Identity,
        token: str,
        pending_seconds: float | None = None,
        *,
        fence: Fence = "owner",
        settled_is_fine: bool = False,
        may_not_have_landed: bool = False,
    ) -> None:
        """Release under ``token``; a store error here is logged, never raised over the real error.

        ``may_not_have_landed``: what is given back is a claim or acquire whose reply the store's
        outage lost; failing to give it back is then logged at DEBUG, the outage being reported
        already (a record that may not exist is no news of its own)."""
        try:
            answer = self.idem.store.release(identity, token, pending_seconds=pending_seconds, fence=fence)
        except IdempotencyError as exc:
            logger.log(
                logging.DEBUG if may_not_have_landed else logging.WARNING,
                "could not release %s: %s; it frees itself when its lease runs out",
                telemetry.shown(identity),
                exc,
            )
            self.idem.count("store_errors")
            return
        if not answer.ok and not settled_is_fine:
            self.idem.count("lost_locks")
            logger.warning("release of %s was LOST: another attempt owns it now", telemetry.shown(identity))

    def store_value(self, identity: Identity, owner: str, task_id: str, value: Any) -> bool | None:
        """Complete with ``value``, as :meth:`write` answers.

        Raises:
            SerializationError: ``value`` cannot be encoded, or is over max_result_bytes; the record
                is FAILED with this error (the effect happened: the key is never freed).
        """
        store = self.idem.store
        try:
            payload, content_type, encoding = encode_result(value, self.calls.serializer)
            return self.write(
                identity, owner, task_id, self._complete(identity, owner, payload, content_type, encoding)
            )
        except SerializationError as exc:  # from the encoding, or the store's max_result_bytes
            error = ErrorInfo.from_exception(exc)
            self.write(identity, owner, task_id, lambda: store.fail(identity, owner, error))
            raise

    def when_committed(self, attempt: attempts.Attempt, record: IdempotencyRecord, store: Callable[[], str]) -> str:
        """The body returned with its ledger row on a transaction it joined: the outcome is stored
        only if that row is committed now, never for an effect that may still roll back.

        Not committed (the transaction rolled back, or is still open: a caller's transaction that
        outlives the attempt), or the ledger cannot say, the key is freed: a later attempt's row waits
        on any transaction still holding this one's, and gets the committed outcome or runs, so the
        ledger decides. Nothing is left for the reconciler to settle from weaker evidence. Returns the
        step taken, as the ENDED line says it: ``store``'s, or ``release``.
        """
        identity = record.identity
        try:
            stands = bool(attempt.ledger.stands(attempt))
        except Exception as exc:  # noqa: BLE001 - a ledger that cannot answer: freeing the key is safe
            logger.warning(
                "%s returned and the ledger cannot say whether its row committed (%s)", telemetry.shown(identity), exc
            )
            stands = False
        if stands:
            return store()
        logger.info(
            "%s returned with its ledger row in a transaction that is not known committed (still open, or "
            "rolled back): the key is freed, and the ledger decides any later attempt",
            telemetry.shown(identity),
        )
        self.free_for_the_ledger(record)
        return Step.RELEASE.value

    def free_for_the_ledger(self, record: IdempotencyRecord) -> None:
        """Free the key of an attempt whose ledger row stands on a transaction it joined; retried while
        the lease lasts, then by the heartbeat (a record left IN_PROGRESS would be settled by the
        reconciler from weaker evidence than the ledger)."""
        self.write(record.identity, record.owner, record.task_id, self.release_write(record))

    def release_write(self, record: IdempotencyRecord) -> Write:
        """The write that frees ``record``'s key under its owner's token."""
        return functools.partial(self.idem.store.release, record.identity, record.owner)

    def defer_value(self, record: IdempotencyRecord, value: Any) -> None:
        """Hand the value's write to the heartbeat thread, and leave it in the result backend."""
        identity, owner = record.identity, record.owner
        logger.warning(
            "the soft time limit struck while %s stored its outcome: the heartbeat stores it", telemetry.shown(identity)
        )
        payload, content_type, encoding = encode_result(value, self.calls.serializer)
        self.defer(identity, owner, self._complete(identity, owner, payload, content_type, encoding))
        evidence.leave(self.calls.task, value)

    def _complete(self, identity: Identity, owner: str, payload: bytes, content_type: str, encoding: str) -> Write:
        store = self.idem.store
        return functools.partial(
            store.complete, identity, owner, payload, content_type=content_type, content_encoding=encoding
        )

    def write(self, identity: Identity, owner: str, task_id: str, write: Write) -> bool | None:
        """Settle the record through ``write``, as the module docstring says it answers."""
        try:
            return self._write_while_the_lease_lasts(identity, owner, task_id, write)
        except SoftTimeLimitExceeded:
            # Struck anywhere in the write or its retries: whether it landed is unknown, and this
            # thread must stop. The heartbeat finishes it; the task keeps its own ending.
            logger.warning(
                "the soft time limit struck while %s (task %s) was settled: the heartbeat finishes the write",
                telemetry.shown(identity),
                task_id,
            )
            self.defer(identity, owner, write)
            return None

    def _write_while_the_lease_lasts(self, identity: Identity, owner: str, task_id: str, write: Write) -> bool | None:
        deadline = time.monotonic() + self.calls.policy.lease_seconds
        pause = 0.05
        retried = False
        while True:
            try:
                answer = write()
                if not answer.ok and retried and self.settled_by(identity, owner):
                    return True  # an earlier try was written and only its reply was lost
            except StoreUnavailableError as exc:
                retried = True
                self.idem.count("store_errors")
                if time.monotonic() + pause >= deadline:
                    logger.error(
                        "could not settle %s (task %s) while its lease lasted: %s; the heartbeat goes on trying",
                        telemetry.shown(identity),
                        task_id,
                        exc,
                    )
                    self.defer(identity, owner, write)
                    return None
                logger.warning(
                    "settling %s (task %s) failed, retrying in %gs: %s", telemetry.shown(identity), task_id, pause, exc
                )
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            if not answer.ok:
                self.idem.count("lost_locks")
                logger.warning(
                    "outcome of %s (task %s) was LOST: another attempt owns the record",
                    telemetry.shown(identity),
                    task_id,
                )
            return answer.ok

    def defer(self, identity: Identity, owner: str, write: Write) -> None:
        """Hand ``write`` to the heartbeat thread, which tries it until it lands or the record expires."""
        landed = functools.partial(self.settled_by, identity, owner)
        self.idem.heartbeat.defer(identity, write, landed, seconds=self.calls.policy.ttl_seconds)

    def settled_by(self, identity: Identity, owner: str) -> bool:
        """Whether the record stands settled under ``owner``'s token (its own write landed)."""
        try:
            record = self.idem.store.get(identity)
        except StoreUnavailableError:
            return False
        return record is not None and record.state.settled and record.held_by(owner)

    def permanent(self, exc: BaseException) -> bool:
        """Whether a failure is final (stored and replayed) rather than retryable (DESIGN §3)."""
        return classify_failure(exc, self.calls.policy, self._autoretry_for) == "permanent"

    def ended(self, record: IdempotencyRecord, exc: BaseException, lease: Lease | None = None) -> Ending:
        """Settle an attempt that raised ``exc`` (or returned a Retry) as its mode's table says.

        ``lease`` is the attempt's, renewed by the heartbeat until its record is written or handed on.
        """
        task = self.calls.task
        attempt = attempts.current(task)
        replaced = attempt is not None and attempt.replaced
        ending = ending_of(
            exc,
            permanent=self.permanent,
            replaced=replaced,
            acks_late=bool(task.acks_late),
            eager=bool(task.request.is_eager),
        )
        step = self.calls.mode.after[ending]
        identity, owner = record.identity, record.owner
        if step is Step.REQUEUE:
            # The message that carries the call on (a retry inherits this message's expiry, and a
            # requeued message is this one): the claim never outlives it.
            delay: dict[str, Any] = {}
            if isinstance(exc, Retry):
                delay = {"countdown": exc.when} if isinstance(exc.when, (int, float)) else {"eta": exc.when}
            pending = timing.pending_seconds(self.calls.policy.pending_timeout_seconds, delay, task.request.expires)
            self.give_back(identity, owner, pending_seconds=pending)
        elif step is Step.HAND_OVER:
            # Handed to the replacement's token before it was sent (replacement.on_replace): no renewal
            # under the old token may follow.
            if lease is not None:
                self.idem.heartbeat.remove(lease)
        elif step in (Step.FAIL, Step.RELEASE):
            self.settle_failure(
                identity, owner, exc, record.fingerprint, step=step, earlier_attempts=record.attempt > 1
            )
        else:
            raise AssertionError(f"an attempt that raised cannot take the {step.value} step ({ending.value})")
        return ending

    def failure_step(self, exc: BaseException) -> Step:
        """The step of a failure that reaches no attempt (a replacement's, on its error link): no
        message of the replaced attempt carries the call on (no retry, requeue or handover), so it
        ended permanent or retryable, whatever else its class is (a Retry the policy calls permanent)."""
        permanent = isinstance(exc, Exception) and self.permanent(exc)
        return self.calls.mode.after[Ending.PERMANENT if permanent else Ending.RETRYABLE]

    def settle_failure(
        self,
        identity: Identity,
        owner: str,
        exc: BaseException,
        fingerprint: str | None = None,
        *,
        step: Step,
        earlier_attempts: bool = False,
    ) -> None:
        """Store a failure (``Step.FAIL``) or free the key (``Step.RELEASE``). Where the ledger holds
        the call committed, the record is completed with the ledger's value instead, whatever was
        raised: the ledger wins. The exception still propagates (the task did raise); results read
        through celery-idem answer with the record.
        """
        retryable = step is not Step.FAIL
        attempt = attempts.current(self.calls.task)  # None: a callback settles a replaced attempt's record
        # Its row stands on a transaction it joined, which may still commit: the ledger decides the
        # next run, so the key is freed and no failure is stored (a stored one would outlive a commit).
        in_flight = attempt is not None and joined(attempt)
        # Whether an effect of this identity may stand committed: this attempt's run_once left a row (not
        # one rolled back with fn's error), or an earlier attempt (a retry, a redelivery, a takeover) ran.
        touched = (attempt is not None and attempt.ledger_nonce is not None) or (
            earlier_attempts and self.idem.settings.ledger is not None
        )
        if retryable and not touched:
            self.give_back(identity, owner)
            return
        try:
            entry = self.idem.committed(identity, fingerprint, attempt.ledger if attempt else None)
        except LedgerUnavailableError as down:
            if touched and not in_flight:
                # Unknown is not failed: no outcome is stored and the key is not freed. The lease runs
                # out and the reconciler settles the record from the ledger once it answers.
                logger.warning(
                    "%s raised %r and the ledger cannot say whether its effect committed (%s): left to the reconciler",
                    telemetry.shown(identity),
                    exc,
                    down,
                )
                return
            logger.warning("%s; %s", down, "the key is freed" if in_flight else "the failure is stored")
            entry = None
        except Exception as broken:  # noqa: BLE001 - a misconfigured ledger never hides the task's error
            logger.error("could not read the ledger for %s: %r; the failure stands", telemetry.shown(identity), broken)
            entry = None
        store = self.idem.store
        if entry is not None:
            logger.warning(
                "%s raised %r after its effect committed: completed from the ledger", telemetry.shown(identity), exc
            )
            payload = entry.result or b"null"
            content_type = entry.content_type or "application/json"
            self.write(
                identity,
                owner,
                "-",
                self._complete(identity, owner, payload, content_type, entry.content_encoding or "utf-8"),
            )
            return
        if retryable or in_flight:
            self.give_back(identity, owner)
        else:
            self.write(identity, owner, "-", lambda: store.fail(identity, owner, ErrorInfo.from_exception(exc)))
