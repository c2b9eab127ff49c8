"""The state machine driver: what happens to a call and to a message, for one task.

IdempotentTask hands both sides of every call here. The producer side is :func:`publish.publish`
(claim, then publish or hand back the original); this module is the worker side:

Worker (``run``): acquire, then
    RUN    -> run the body under a heartbeat; its ending takes its step (complete, fail, release...)
    REPLAY -> return or raise the stored outcome without running
    BUSY   -> look again until the running attempt settles, then replay it (celery_idem.busy)
    MISMATCH -> PayloadMismatchError, record untouched

What a duplicate gets and which step each ending takes are the task's mode's two tables
(:mod:`celery_idem.endings`); how a step is written is :mod:`celery_idem.settle`; how a call is
identified, :mod:`celery_idem.calling`, which the handler extends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry, SoftTimeLimitExceeded

from . import attempts, continuations, events, evidence, outage, publish, replacement, timing
from .busy import BusyWait
from .calling import TaskCalls, log_decision, log_ending
from .endings import Answer, Ending, Step
from .errors import LockLostError, StoreUnavailableError
from .ledger.calls import joined
from .owners import worker_token
from .protocol import BYPASS_HEADER, KEY_HEADER, SCOPE_HEADER, request_header
from .records import Decision, IdempotencyRecord
from .releases import continues_its_chain, message_fingerprint, same_call
from .send_back import send_back
from .settle import Settler

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["HandledTask", "Handler"]

logger = logging.getLogger("celery_idem.handler")


class HandledTask:
    """The mark of a task class whose calls go through a :class:`Handler` (``IdempotentTask``, which
    gives its handler as ``idempotency_handler``): the signal hooks tell celery-idem's tasks by it."""

    app: Any


#: The ENDED step of a returned body whose outcome the store never took: left for the reconciler.
UNWRITTEN = "not written: left for the reconciler"


class Handler(TaskCalls):
    """Drives one task's calls and messages through the store. One per task, built on first use."""

    def __init__(self, idem: Runtime, task: Any) -> None:
        super().__init__(
            task, idem.policy_for(task), accept_pickle=idem.settings.accept_pickle, mode=idem.mode_for(task)
        )
        self.idem = idem
        self.settle = Settler(idem, self)

    def publish(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: dict[str, Any],
        send: Callable[[Any, Any, dict[str, Any]], Any],
    ) -> Any:
        """Claim, then publish through ``send`` (Celery's own apply_async) or hand back the original."""
        return publish.publish(self, self.idem, self.settle, args, kwargs, options, send)

    # ---- worker side ---------------------------------------------------------------------------

    def run(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Acquire and run the body once per identity, or replay/wait/refuse."""
        task, request = self.task, self.task.request
        if request_header(request, BYPASS_HEADER) is False:
            request.idempotency_key = request.idempotency_scope = None  # bypassed: the body holds no identity
            return self._run_function(*args, **kwargs)
        # A message that another release's signature cannot bind ends here (celery_idem.releases).
        fp = message_fingerprint(self, self.settle, args, kwargs)
        key, scope = request_header(request, KEY_HEADER), request_header(request, SCOPE_HEADER)
        identity = self.identify(key, scope, fp)
        if key is not None and KEY_HEADER not in (request.headers or {}):
            # Delivered as a message property: a retry or a re-publish copies the headers only.
            request.headers = {**(request.headers or {}), KEY_HEADER: key, **({SCOPE_HEADER: scope} if scope else {})}
        request.idempotency_key = identity.key
        request.idempotency_scope = identity.scope or None
        attempts.begin(task, identity, fp)  # what the library keeps of this attempt: never on the request
        task_id = request.id
        policy = self.policy
        # The store is opened by the first look, inside the outage handling below.
        wait = BusyWait(task, identity, policy, lambda: self.idem.store, self.republish, self.idem.count)
        call = self.kept_call(args, kwargs)
        while True:
            owner = worker_token(getattr(request, "hostname", None), self.idem.heartbeat.process_id)
            try:
                # A replacement takes the record its replaced attempt handed it, by its token, first.
                taken = replacement.take_over(self, identity, owner) or self.idem.store.acquire(
                    identity,
                    fp,
                    task_id,
                    lease_seconds=policy.lease_seconds,
                    ttl_seconds=policy.ttl_seconds,
                    owner=owner,
                    call=call,
                    next_look_seconds=wait.next_look_seconds(),
                    retry=continues_its_chain(request),
                )
            except StoreUnavailableError as exc:
                if self.idem.proceed_unprotected("acquire", identity, task_id):
                    return self._run_function(*args, **kwargs)
                if request.is_eager or outage.gives_up(request, exc):
                    # No broker keeps an eager call (and a store error no outage mapping knows that
                    # outlived every trip back may never pass): the caller is told. The acquire that
                    # may have landed (reply lost) is given back whole, and so is the claim waiting
                    # under this task id, which no message will carry now.
                    self.settle.give_back(identity, owner, settled_is_fine=True, may_not_have_landed=True)
                    self.settle.give_back(identity, task_id, fence="task_id", settled_is_fine=True)
                    raise
                # The acquire may have landed with only its reply lost: hand the record back to
                # PENDING for the message kept below, or its copy would wait out a lease nobody holds.
                pending = timing.pending_seconds(policy.pending_timeout_seconds, {}, request.expires)
                self.settle.give_back(identity, owner, pending, settled_is_fine=True, may_not_have_landed=True)
                raise outage.keep_message(task, args, kwargs, exc, self.republish) from None
            record = taken.record
            assert record is not None
            log_decision(taken.decision, identity, task_id, record, side="worker")
            if taken.decision is Decision.RUN:
                return self._run_owned(record, args, kwargs)
            events.send_decision_event(task, taken.decision, identity, record)
            answer = self.mode.duplicate[taken.decision]  # a duplicate: what its mode gives it
            if answer is Answer.REPLAY:
                if (quiet := wait.replayed(record)) is not None:
                    raise quiet
                return continuations.replay(self, self.idem, record, args, kwargs, owner, self.republish)
            if answer is Answer.REFUSE:
                if fp != record.fingerprint and same_call(self, record, args, kwargs):
                    fp = record.fingerprint  # this very call, bound by another release: the caller's call
                    continue
                self.idem.count("mismatches")
                raise wait.mismatched(record) or self.mismatch(identity, record)
            wait.busy(record, args, kwargs)  # WAIT: another attempt holds a live lease (celery_idem.busy)

    def republish(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        countdown: float,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """Send this very message back to the broker, ``countdown`` seconds from now (whole seconds,
        rounded up); kept even when the broker refuses it (:func:`celery_idem.send_back.send_back`)."""
        patience = self.policy.pending_timeout_seconds  # as long as the call's claim waits for a message
        send_back(self.task, args, kwargs, countdown=countdown, headers=headers, patience=patience)

    def _run_owned(self, record: IdempotencyRecord, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        identity, owner, policy, store = record.identity, record.owner, self.policy, self.idem.store
        attempt = attempts.current(self.task)
        assert attempt is not None  # begun by run()
        # The caller's call, which a retry with changed arguments still answers for (the ledger checks it).
        attempt.fingerprint, attempt.owner = record.fingerprint, owner
        # The lease is kept from the moment it is taken: reading an earlier attempt's evidence may take
        # longer than the lease, and a record left unrenewed meanwhile would be taken by a copy.
        lease = attempt.lease = self.idem.heartbeat.add(store, identity, owner, policy.lease_seconds)
        try:
            found = evidence.earlier_outcome(self.idem, self.task, record)  # its body may have run
            if found is not None:
                return found.value
            if lease.lost:
                raise self._lost(record, "before its body ran")
            try:
                value = self._run_function(*args, **kwargs)
            except BaseException as exc:
                self._ended(record, self.settle.ended(record, exc, lease))
                raise
            if isinstance(value, Retry):
                # ``return self.retry(throw=False)``: the retry is sent, so it settles as a raised one.
                # Eager, Celery's apply runs a returned Retry's retry inline, so it is returned; on a
                # worker it is raised (state RETRY), where Celery would try to store it as the result.
                self._ended(record, self.settle.ended(record, value, lease))
                if self.task.request.is_eager:
                    return value
                raise value
            try:
                step = self._settle_value(record, value)
            except SoftTimeLimitExceeded:
                # The body returned: a time limit that strikes while its value is stored must not
                # turn the effect into a failure the reconciler would free the key on. (A row on a
                # transaction it joined is not known committed: its key is freed, never completed.)
                attempt = attempts.current(self.task)
                if attempt is not None and joined(attempt):
                    self.settle.defer(record.identity, record.owner, self.settle.release_write(record))
                    step = f"{Step.RELEASE.value} (deferred)"
                else:
                    self.settle.defer_value(record, value)
                    step = f"{Step.COMPLETE.value} (deferred)"
            self._ended(record, Ending.RETURNED, step)
            return value
        finally:
            self.idem.heartbeat.remove(lease)

    def _ended(self, record: IdempotencyRecord, ending: Ending, step: str | None = None) -> None:
        """The attempt's ENDED line, with the step its record was given (by default, its mode's)."""
        log_ending(record.identity, record.task_id, ending.value, step or self.mode.after[ending].value)

    def _settle_value(self, record: IdempotencyRecord, value: Any) -> str:
        """The body returned: the effect happened. Store the value (an unstorable one is stored as a
        permanent failure about it); a store outage is retried while the lease lasts, then left as
        evidence for the reconciler. An effect whose ledger row is on a transaction it joined is
        stored once that row commits (:meth:`Settler.when_committed`), else its key is freed.
        Returns the step taken, for the attempt's ENDED line."""
        attempt = attempts.current(self.task)
        if attempt is not None and joined(attempt):
            return self.settle.when_committed(attempt, record, lambda: self._store_value(record, value))
        return self._store_value(record, value)

    def _store_value(self, record: IdempotencyRecord, value: Any) -> str:
        written = self.settle.store_value(record.identity, record.owner, record.task_id, value)
        if written is None:
            evidence.leave(self.task, value)
            return UNWRITTEN
        if not written:
            raise self._lost(record, "its outcome was not stored")
        return Step.COMPLETE.value

    def _lost(self, record: IdempotencyRecord, consequence: str) -> LockLostError:
        return LockLostError(
            f"task {self.task.name!r} ({record.task_id}) lost its lease on idempotency key "
            f"{record.key!r} to another attempt; {consequence}",
            key=record.key,
            task_name=self.task.name,
            task_id=record.task_id,
        )
