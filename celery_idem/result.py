"""IdempotentResult: the AsyncResult every apply_async of an idempotent task returns.

``.deduplicated`` says whether this call was a duplicate; ``.idempotency_key`` is the key (the
fingerprint for a key-less call). ``.get()`` answers from the store when the result backend cannot:
a replayed outcome at once, and a task that keeps no result in the backend (``ignore_result=True``,
no backend configured) by watching the store.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from celery import states
from celery.backends.base import DisabledBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from .errors import RecordGoneError, StoreUnavailableError
from .outcome import accepted_content_types, rebuild_exception, replay

if TYPE_CHECKING:
    from .extension import Idempotency
    from .records import IdempotencyRecord, Identity

__all__ = ["IdempotentResult"]

logger = logging.getLogger("celery_idem")

_UNASKED = object()


class IdempotentResult(AsyncResult):  # type: ignore[misc]
    """An AsyncResult that knows its idempotency identity and can answer from the store."""

    deduplicated: bool = False
    idempotency_key: str | None = None
    identity: Identity | None = None
    idempotency: Idempotency | None = None

    def __init__(
        self,
        id: str,
        *args: Any,
        deduplicated: bool = False,
        idempotency_key: str | None = None,
        identity: Identity | None = None,
        idempotency: Idempotency | None = None,
        record: IdempotencyRecord | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(id, *args, **kwargs)
        self.deduplicated = deduplicated
        self.idempotency_key = idempotency_key
        self.identity = identity
        self.idempotency = idempotency
        self._record = record
        self._ledger_entry: Any = _UNASKED

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
        if record is not None and record.state.settled:
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
        return not (task is not None and task.ignore_result)

    def get(self, timeout: float | None = None, propagate: bool = True, interval: float = 0.5, **kwargs: Any) -> Any:
        """The task's outcome: from the stored record when there is one, else as Celery gets it.

        Raises:
            celery.exceptions.TimeoutError: no outcome within ``timeout`` seconds.
            RecordGoneError: the task keeps no result in the backend and its record is gone
                (released after a retryable failure, expired, or forgotten): nothing will answer.
        """
        record = self._settled_record_or_none()
        if record is None and self.identity is not None and self.idempotency is not None:
            if not self._backend_keeps_results():
                record = self._watch_store(timeout, interval)
        if record is None:
            return super().get(timeout=timeout, propagate=propagate, interval=interval, **kwargs)
        entry = self._overruled(record)
        if entry is not None:  # the ledger wins over a stored failure
            return entry.value(self._accepted_content_types())
        if record.error is not None and not propagate:
            return rebuild_exception(record.error)
        return replay(record, self._accepted_content_types())

    def _overruled(self, record: IdempotencyRecord) -> Any:
        """The ledger entry overruling a FAILED record; a known answer is kept, an outage is not
        (the next read asks again), and meanwhile the stored failure stands."""
        if self._ledger_entry is _UNASKED and self.idempotency is not None:
            try:
                self._ledger_entry = self.idempotency.overruled(record)
            except Exception as exc:  # noqa: BLE001 - the ledger cannot be asked: the store's outcome stands
                logger.warning("could not read the ledger for %s: %s; the stored failure stands", record.identity, exc)
                return None
        return None if self._ledger_entry is _UNASKED else self._ledger_entry

    def _accepted_content_types(self) -> frozenset[str]:
        if self.idempotency is not None:
            return self.idempotency.accepted_content_types
        return accepted_content_types(self.app.conf, accept_pickle=False)

    def _watch_store(self, timeout: float | None, interval: float) -> IdempotencyRecord:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.01
        while True:
            record = self._stored_record()
            if record is None:
                raise self._gone()
            if record.state.settled:
                return record
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError("The operation timed out.")
            time.sleep(pause)
            pause = min(pause * 2, interval)

    def _gone(self) -> RecordGoneError:
        # The claim is written before the message is published, and a retry keeps it (PENDING):
        # a record that is absent now was released, forgotten or expired, and no backend keeps
        # this task's result, so nothing can ever answer.
        assert self.identity is not None
        return RecordGoneError(
            f"the record of idempotency key {self.identity.key!r} of task {self.identity.task_name!r} is gone "
            f"and task {self.id} keeps no result in the result backend, so nothing will answer: the call "
            "failed with a retryable error (after its last retry), expired, or was forgotten. The key is free: "
            "a new call with it runs again",
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

    def ready(self) -> bool:
        return bool(self.state in states.READY_STATES)

    def successful(self) -> bool:
        return bool(self.state == states.SUCCESS)

    def failed(self) -> bool:
        return bool(self.state == states.FAILURE)
