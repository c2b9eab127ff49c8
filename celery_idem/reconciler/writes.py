"""The reconciler's writes, each a compare-and-set on the owner token the scan saw (a release also
requires the lease to still be expired: see :mod:`celery_idem.reconciler`), and the counts its report
gives; a dry run counts what it would write and writes nothing."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from .. import telemetry
from ..calls import CallRefused, decode_call
from ..errors import ResultTooLargeError, StoreUnavailableError
from ..protocol import KEY_HEADER, SCOPE_HEADER
from ..records import Decision, ErrorInfo, IdempotencyRecord
from ..runtime import Runtime
from ..timing import EXPIRY_GRACE_SECONDS

if TYPE_CHECKING:
    from ..config import IdempotencyPolicy

__all__ = ["LeftRecord", "ReconcilerWrites"]

logger = logging.getLogger("celery_idem.reconciler")


class LeftRecord(BaseModel):
    """A record a reconciler run left as it was, and why (the evidence it lacked, or what failed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_name: str
    scope: str
    key: str
    task_id: str
    state: str
    why: str


class ReconcilerWrites:
    """One reconciler run's store, counts and writes (what :class:`~celery_idem.reconciler.Reconciler`
    decides is written here)."""

    def __init__(self, idem: Runtime, *, dry_run: bool = False) -> None:
        self.idem = idem
        self.app = idem.app
        self.store = idem.store
        self.dry_run = dry_run
        self.counts = dict.fromkeys(("scanned", "completed", "failed", "released", "requeued", "left"), 0)
        self.left_records: list[LeftRecord] = []

    @functools.cached_property
    def now(self) -> float:
        """The store server's time, read once per run (not once per record): grace and expiry checks."""
        return self.store.now()

    def _task(self, name: str) -> Any:
        return self.app.tasks.get(name)

    def _policy(self, record: IdempotencyRecord) -> IdempotencyPolicy:
        task = self._task(record.task_name)
        return self.idem.policy_for(task) if task is not None else self.idem.settings.policy()

    # ---- writes (compare-and-set on the owner token) -------------------------------------------

    def _complete(
        self, record: IdempotencyRecord, payload: bytes, content_type: str, encoding: str | None, why: str
    ) -> None:
        if len(payload) > self.store.max_result_bytes:
            # As a worker stores it: the effect happened, so the key is never freed; the error says why.
            error = ResultTooLargeError(
                f"the {why}'s result of {record.identity} is {len(payload)} bytes, over max_result_bytes "
                f"({self.store.max_result_bytes})",
                key=record.key,
                task_name=record.task_name,
                task_id=record.task_id,
            )
            info = ErrorInfo.from_exception(error)
            self._write(
                record,
                "failed",
                f"{why}: result too large",
                lambda: self.store.fail(record.identity, record.owner, info),
            )
            return
        self._write(
            record,
            "completed",
            why,
            lambda: self.store.complete(
                record.identity, record.owner, payload, content_type=content_type, content_encoding=encoding or "utf-8"
            ),
        )

    def _release(self, record: IdempotencyRecord, why: str) -> None:
        self._write(
            record, "released", why, lambda: self.store.release(record.identity, record.owner, expired_only=True)
        )

    def _requeue(self, record: IdempotencyRecord) -> None:
        """Deliver the kept call again, as it was sent (routing, continuations, limits, retries),
        under the same key and task id. Not claimed again: the release below is the claim, and the
        message carries the key."""
        assert record.call is not None
        try:
            call = decode_call(record.call)
        except CallRefused as exc:
            self._release(record, f"provably dead, not requeued: {exc}")
            return
        expires_at = call.expires_at()
        if expires_at is not None and expires_at <= self.now:
            self._release(record, "provably dead, not requeued: its message has expired")
            return
        pending = self._policy(record).pending_timeout_seconds
        if expires_at is not None:  # a claim never outlives its message
            pending = min(pending, expires_at - self.now + EXPIRY_GRACE_SECONDS)
        written = self._write(
            record,
            "requeued",
            "provably dead: requeued",
            lambda: self.store.release(record.identity, record.owner, pending_seconds=pending, expired_only=True),
        )
        if not written or self.dry_run:
            return
        headers = {name: value for name, value in (call.options.get("headers") or {}).items() if name != SCOPE_HEADER}
        headers.update({KEY_HEADER: record.key, **({SCOPE_HEADER: record.scope} if record.scope else {})})
        options = {**call.options, "headers": headers, "task_id": record.task_id}
        try:
            self.app.send_task(record.task_name, call.args, call.kwargs, **options)
        except Exception as exc:  # noqa: BLE001 - the record stays PENDING until its lease runs out again
            logger.warning("requeue of %s failed: %s; retried on a later run", telemetry.shown(record.identity), exc)

    def _leave(self, record: IdempotencyRecord, why: str) -> None:
        self.counts["left"] += 1
        self.left_records.append(
            LeftRecord(
                task_name=record.task_name,
                scope=record.scope,
                key=record.key,
                task_id=record.task_id,
                state=record.state.value,
                why=why,
            )
        )
        logger.info(
            "left %s task_id=%s state=%s: %s",
            telemetry.shown(record.identity),
            record.task_id,
            record.state.value,
            why,
            extra=telemetry.fields(
                record.identity, outcome="left", side="reconciler", task_id=record.task_id, state=record.state.value
            ),
        )

    def _write(self, record: IdempotencyRecord, outcome: str, why: str, write: Any) -> bool:
        if not self.dry_run:
            try:
                answer = write()
            except StoreUnavailableError as exc:
                # One record the store would not write (or whose reply was lost) stays for the next
                # run; the rest of this run goes on, so a failing record never blocks the others.
                self._leave(record, f"the store failed the write ({why}): {exc}")
                return False
            if answer.decision is not Decision.OK:
                # Someone moved the record after our scan (a worker finished, another reconciler):
                # they win, and we touch nothing.
                self._leave(record, f"changed since the scan ({why})")
                return False
        self.counts[outcome] += 1
        logger.info(
            "%s %s task_id=%s was=%s: %s",
            outcome,
            telemetry.shown(record.identity),
            record.task_id,
            record.state.value,
            why,
            extra=telemetry.fields(
                record.identity, outcome=outcome, side="reconciler", task_id=record.task_id, state=record.state.value
            ),
        )
        return True
