"""IdempotentResult: the AsyncResult every apply_async of an idempotent task returns.

``.deduplicated`` says whether this call was a duplicate; ``.idempotency_key`` is the key (the
fingerprint for a key-less call). ``.get()`` answers from the store when the result backend cannot:
a replayed outcome at once, and a task that keeps no result in the backend (``ignore_result=True``,
``results="store"``, no backend configured) by watching the store: woken by the store's notices
(Redis, memory), polling with backoff where it sends none (SQL).

A handle answers for its own task id. The store is read by key, and after the key's TTL the record
under it may be a later call's: a record is this handle's answer only when it names the handle's
task id, or when it is the very record the call was handed at publish (same ``created_at``: a copy
under another task id acquired it, and the handle's own message replays it), or when it took this
task id's attempt over once its lease ran out (``previous_task_id``). Anything else is
another call's, and where nothing else answers for the id, ``get()`` raises RecordGoneError.

A handle also waits on whatever can answer it. The backend may never hear of a duplicate's id: the
original was sent with ``ignore_result=True`` by another process (nothing is written), or ``rpc://``
sends the result to the publishing process's reply queue only. So ``get()`` waits on the backend in
short slices (the backend answers at once when it can) and looks at the store between them, with
backoff.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from celery import states
from celery.backends.base import DisabledBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from . import telemetry
from .errors import RecordGoneError, StoreUnavailableError
from .outcome import accepted_content_types, rebuild_exception, replay

if TYPE_CHECKING:
    from .records import IdempotencyRecord, Identity
    from .runtime import Runtime

__all__ = ["IdempotentResult", "bind_handle"]

logger = logging.getLogger("celery_idem")

_UNASKED = object()
# Seconds between looks at the store while get() also waits on the backend: doubling from the first
# to the longest, so a long task costs one store read a second and a short one is answered quickly.
_FIRST_LOOK, _LONGEST_LOOK = 0.05, 1.0
# Seconds the backend may still answer once the store holds nothing for this task id: a retryable
# failure's record is released on the worker before Celery writes the FAILURE to the backend.
_BACKEND_GRACE_SECONDS = 5.0


def bind_handle(
    result: Any,
    identity: Identity,
    idempotency: Runtime,
    *,
    deduplicated: bool,
    record: IdempotencyRecord | None = None,
) -> Any:
    """Make ``result`` (what Celery's apply_async returned, or a new handle) the handle of a call
    whose claim answered ``record`` (None when the store could not be asked)."""
    result.deduplicated = deduplicated
    result.idempotency_key = identity.key
    result.identity = identity
    result.idempotency = idempotency
    if isinstance(result, IdempotentResult) and record is not None:
        result._handed(record)
    return result


class IdempotentResult(AsyncResult):  # type: ignore[misc]
    """An AsyncResult that knows its idempotency identity and can answer from the store."""

    deduplicated: bool = False
    idempotency_key: str | None = None
    identity: Identity | None = None
    idempotency: Runtime | None = None

    def __init__(
        self,
        id: str,
        *args: Any,
        deduplicated: bool = False,
        idempotency_key: str | None = None,
        identity: Identity | None = None,
        idempotency: Runtime | None = None,
        record: IdempotencyRecord | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(id, *args, **kwargs)
        self.deduplicated = deduplicated
        self.idempotency_key = idempotency_key
        self.identity = identity
        self.idempotency = idempotency
        self._record: IdempotencyRecord | None = None
        self._created_at: float | None = None  # of the record this call was handed at publish
        self._ledger_entry: Any = _UNASKED
        self._original_id: str | None = None  # the task id of the record this call was handed
        if record is not None:
            self._handed(record)

    def _handed(self, record: IdempotencyRecord) -> None:
        self._created_at = record.created_at
        self._original_id = record.task_id
        if record.state.settled:
            self._record = record

    def _answers_for_me(self, record: IdempotencyRecord) -> bool:
        """Whether ``record`` holds this handle's outcome, not a later call's under the same key: it
        names this task id, is the record handed at publish, or took this task id's attempt over past
        its lease (the same call, run again in its place while the record lived)."""
        return self.id in (record.task_id, record.previous_task_id) or record.created_at == self._created_at

    def __repr__(self) -> str:
        flag = " deduplicated" if self.deduplicated else ""
        return f"<{type(self).__name__}: {self.id}{flag} key={self.idempotency_key!r}>"

    def _settled_record(self) -> IdempotencyRecord | None:
        if self._record is None and (self.identity is None or self.idempotency is None):
            return None
        record = self._stored_record()
        return record if record is not None and record.state.settled else None

    def _stored_record(self) -> IdempotencyRecord | None:
        """The record in any state (a settled one is kept); None when it is gone."""
        if self._record is not None:
            return self._record
        assert self.identity is not None and self.idempotency is not None
        record = self.idempotency.store.get(self.identity)
        if record is None or not self._answers_for_me(record):
            return None  # gone for this task id: expired, released, forgotten, or another call's now
        if record.state.settled:
            self._record = record
        return record

    def _settled_record_or_none(self) -> IdempotencyRecord | None:
        """The settled record; None when there is none yet, or when the store is down but the
        result backend can still answer."""
        try:
            return self._settled_record()
        except StoreUnavailableError:
            if not self._backend_keeps_results():
                raise
            return None

    def _backend_keeps_results(self) -> bool:
        if self.ignored or isinstance(self.backend, DisabledBackend):
            return False
        # Celery ignores AsyncResult's task_name: the identity names the task of a result built here.
        name = self.name or (self.identity.task_name if self.identity is not None else None)
        task = self.app.tasks.get(name) if name else None
        if task is None:
            return True
        if task.ignore_result:
            return False
        # results="store": a duplicate handed the original's own task id cannot know whether the
        # original was written to the backend (most are not), but the store holds every outcome: it
        # waits on the store. Every other handle knows (``ignored``, above): one its producer kept
        # out of the backend waits on the store; one written there (a chosen task id, a duplicate
        # published anyway under its own id, a call published unprotected while the store was
        # down) waits on both.
        return not (
            self.deduplicated
            and self.id == self._original_id
            and self.idempotency is not None
            and self.idempotency.policy_for(task).results == "store"
        )

    def get(self, timeout: float | None = None, propagate: bool = True, interval: float = 0.5, **kwargs: Any) -> Any:
        """The task's outcome: from the stored record when there is one, else from whichever of the
        result backend and the store answers first.

        Raises:
            celery.exceptions.TimeoutError: no outcome within ``timeout`` seconds.
            RecordGoneError: nothing can answer for this task id: its record is gone (released after
                a retryable failure, expired, forgotten) or holds another call's outcome, and the
                result backend keeps nothing for it.
        """
        record = self._settled_record_or_none()
        if record is None and self.identity is not None and self.idempotency is not None:
            if not self._backend_keeps_results():
                record = self._watch_store(timeout, interval)
            else:
                return self._wait_for_either(timeout, propagate, interval, **kwargs)
        if record is None:
            return super().get(timeout=timeout, propagate=propagate, interval=interval, **kwargs)
        return self._answer(record, propagate)

    def _answer(self, record: IdempotencyRecord, propagate: bool) -> Any:
        self._stop_listening()
        entry = self._overruled(record)
        if entry is not None:  # the ledger wins over a stored failure
            return entry.value(self._accepted_content_types())
        if record.error is not None and not propagate:
            return rebuild_exception(record.error)
        return replay(record, self._accepted_content_types())

    def _wait_for_either(self, timeout: float | None, propagate: bool, interval: float, **kwargs: Any) -> Any:
        """Wait on the backend in slices and look at the store between them, until one answers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        look, gone_since = _FIRST_LOOK, None
        while True:
            # Never a zero slice: Celery's polling backends read timeout=0 as "wait forever".
            wait = look if deadline is None else max(min(look, deadline - time.monotonic()), 0.001)
            look = min(look * 2, _LONGEST_LOOK)
            try:
                return super().get(timeout=wait, propagate=propagate, interval=min(interval, wait), **kwargs)
            except CeleryTimeoutError:
                pass
            try:
                record = self._stored_record()
            except StoreUnavailableError:
                pass  # the backend may still answer; the next look asks the store again
            else:
                if record is not None and record.state.settled:
                    return self._answer(record, propagate)
                if record is not None or self._created_at is None:
                    # Still running; or a call published unprotected (the store was down): no
                    # record was ever this handle's, so only the backend can answer it.
                    gone_since = None
                elif gone_since is None:
                    gone_since = time.monotonic()
                elif time.monotonic() - gone_since >= _BACKEND_GRACE_SECONDS:
                    self._stop_listening()
                    raise self._gone()
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError("The operation timed out.")

    def _stop_listening(self) -> None:
        """Answered without the backend: stop listening for this id, as Celery's own get() does once
        it answers (the Redis backend subscribed to the id's channel at publish; left subscribed, one
        channel leaks per answered handle)."""
        remove = getattr(self.backend, "remove_pending_result", None)
        if remove is not None:
            remove(self)

    def _overruled(self, record: IdempotencyRecord) -> Any:
        """The ledger entry overruling a FAILED record; a known answer is kept, an outage is not
        (the next read asks again), and meanwhile the stored failure stands."""
        if self._ledger_entry is _UNASKED and self.idempotency is not None:
            try:
                entry = self.idempotency.overruled(record)
                # The ledger keeps one row per identity for good: a row committed under another task
                # id is a later call's (this record expired meanwhile), never this handle's answer.
                self._ledger_entry = entry if entry is None or entry.task_id in (self.id, record.task_id) else None
            except Exception as exc:  # noqa: BLE001 - the ledger cannot be asked: the store's outcome stands
                logger.warning(
                    "could not read the ledger for %s: %s; the stored failure stands",
                    telemetry.shown(record.identity),
                    exc,
                )
                return None
        return None if self._ledger_entry is _UNASKED else self._ledger_entry

    def _accepted_content_types(self) -> frozenset[str]:
        if self.idempotency is not None:
            return self.idempotency.accepted_content_types
        return accepted_content_types(self.app.conf, accept_pickle=False)

    def _watch_store(self, timeout: float | None, interval: float) -> IdempotencyRecord:
        """Wait on the store alone: woken by its notices where it sends them (a look a second
        stays, for what sends none: an expiry), else polling with backoff up to ``interval``."""
        assert self.identity is not None and self.idempotency is not None
        store = self.idempotency.store
        deadline = None if timeout is None else time.monotonic() + timeout
        with store.watch(self.identity) as wait:
            pause = _LONGEST_LOOK if wait.notices else 0.01
            while True:
                record = self._stored_record()
                if record is None:
                    raise self._gone()
                if record.state.settled:
                    return record
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CeleryTimeoutError("The operation timed out.")
                wait(pause if left is None else min(pause, left))
                if not wait.notices:
                    pause = min(pause * 2, interval)

    def _gone(self) -> RecordGoneError:
        # The claim is written before the message is published, and a retry keeps it (PENDING):
        # a record that is absent now, or that names another call, was released, forgotten or
        # expired, and no backend keeps this task's result, so nothing can ever answer.
        assert self.identity is not None
        return RecordGoneError(
            f"the record of task {self.id} (idempotency key {self.identity.key!r} of task "
            f"{self.identity.task_name!r}) is gone and the result backend keeps nothing for that id, so "
            "nothing will answer: the call failed with a retryable error (after its last retry), expired, "
            "or was forgotten, and the key may hold a later call's record now. The key is free once its "
            "record is gone: a new call with it runs again",
            key=self.identity.key,
            task_name=self.identity.task_name,
            task_id=self.id,
        )

    @property
    def state(self) -> str:
        # The backend first, as Celery would ask it; the store only where the backend has nothing
        # (no backend, ignore_result, expired), so polling ready() costs no extra store round trip.
        record = self._record
        if record is None and self._backend_keeps_results():
            backend_state = str(super().state)
            if backend_state == states.FAILURE and self.identity is not None:
                # The task raised, but its record may say otherwise: the ledger won on the worker
                # (COMPLETED), or wins now over a FAILED record.
                record = self._settled_record_or_none()
                if record is not None and (record.error is None or self._overruled(record) is not None):
                    return str(states.SUCCESS)
            if backend_state != states.PENDING:
                return backend_state
        if record is None:
            record = self._settled_record_or_none()
        if record is not None:
            failed = record.error is not None and self._overruled(record) is None
            return str(states.FAILURE if failed else states.SUCCESS)
        return str(super().state)

    status = state

    @property
    def result(self) -> Any:
        """The outcome without waiting, as Celery's ``result`` (the exception for a failure; None
        while there is none): the backend first, as for ``state``, the store where the backend has
        nothing (``results="store"``, ``ignore_result``, expired) or the ledger overrules it."""
        if self._record is None and self._backend_keeps_results() and str(super().state) == states.SUCCESS:
            return super().result
        record = self._record if self._record is not None else self._settled_record_or_none()
        if record is not None:
            return self._answer(record, propagate=False)
        return super().result if self._backend_keeps_results() else None

    info = result

    def wait(self, timeout: float | None = None, propagate: bool = True, interval: float = 0.5, **kwargs: Any) -> Any:
        """``get()`` (Celery's ``wait`` is its ``get`` bound before this class overrides it)."""
        return self.get(timeout=timeout, propagate=propagate, interval=interval, **kwargs)

    def ready(self) -> bool:
        return bool(self.state in states.READY_STATES)

    def successful(self) -> bool:
        return bool(self.state == states.SUCCESS)

    def failed(self) -> bool:
        return bool(self.state == states.FAILURE)
