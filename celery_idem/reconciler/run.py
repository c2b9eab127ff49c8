"""A reconciler run: the stale records, each settled on the evidence in the order of
:mod:`celery_idem.reconciler` (an outcome in the ledger or the result backend first, then its
holder's liveness), and the report of what was done. The writes are in ``writes``, the holders'
liveness in ``holders``."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend
from pydantic import BaseModel, ConfigDict

from .. import telemetry
from ..errors import ConfigurationError, LedgerUnavailableError
from ..failures import BODY_MAY_HAVE_RUN, classify_failure
from ..outcome import encode_result, serializer_of
from ..owners import holder_node
from ..records import ErrorInfo, IdempotencyRecord, Identity, State
from ..runtime import Runtime
from .holders import Evidence, dead_by_liveness, live_holders, live_task_ids
from .writes import LeftRecord, ReconcilerWrites

__all__ = ["BEAT_ENTRY", "DEFAULT_LIMIT", "TASK_NAME", "ReconcileReport", "Reconciler"]

logger = logging.getLogger("celery_idem.reconciler")
TASK_NAME = "celery_idem.reconcile"
BEAT_ENTRY = "celery-idem-reconcile"
DEFAULT_LIMIT = 1000


class ReconcileReport(BaseModel):
    """What one reconciler run did (or, with ``dry_run``, would do)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scanned: int = 0
    completed: int = 0
    failed: int = 0
    released: int = 0
    requeued: int = 0
    left: int = 0
    purged: int = 0  # records past their TTL whose space was freed (SQL store)
    seconds: float = 0.0
    dry_run: bool = False
    # Each record counted in ``left``, with why. Keys included: for the operator who ran it (the CLI),
    # never in the run's log line or the beat task's result (those print or keep the counts).
    left_records: tuple[LeftRecord, ...] = ()


class Reconciler(ReconcilerWrites):
    """One reconciler run over one app's store."""

    def __init__(self, idem: Runtime, *, dry_run: bool = False) -> None:
        super().__init__(idem, dry_run=dry_run)
        self._ledger_down: LedgerUnavailableError | None = None  # once per run: every later read would wait too
        self._may_have_run: set[str] = set()  # task ids whose FAILURE says their body may have run

    def run(self, limit: int | None = None, identities: Collection[Identity] | None = None) -> ReconcileReport:
        started = time.monotonic()
        stale = (
            self.store.expired_leases(limit=limit or DEFAULT_LIMIT) if identities is None else self._stale(identities)
        )
        self.counts["scanned"] = len(stale)
        undecided = [record for record in stale if not self._guarded(self._settle_on_evidence, record)]
        if undecided:
            alive = live_holders(self.store, undecided)
            # inspect only for what the liveness records do not settle (a live holder, a token naming none)
            asked = [r.task_id for r in undecided if not dead_by_liveness(r, alive)]
            timeout = self.idem.settings.inspect_timeout_seconds
            evidence = Evidence(alive, live_task_ids(self.app, asked, timeout) if asked else None)
            for record in undecided:
                self._guarded(self._settle_on_liveness, record, evidence)
        purged = 0 if self.dry_run or identities is not None else self.store.purge_expired(limit=limit or DEFAULT_LIMIT)
        report = ReconcileReport(
            **self.counts,
            purged=purged,
            seconds=time.monotonic() - started,
            dry_run=self.dry_run,
            left_records=tuple(self.left_records),
        )
        logger.info("reconciled: %s", report.model_dump_json(exclude={"left_records"}))
        if not self.dry_run:
            for name in ("completed", "failed", "released"):
                self.idem.count(f"reconciled_{name}", self.counts[name])
        return report

    def _stale(self, identities: Collection[Identity]) -> list[IdempotencyRecord]:
        """The records of ``identities`` whose lease has run out by the store's clock (an operator's
        selection: a record with a live lease is someone's running attempt, and is left alone)."""
        now = self.store.now()
        records = (self.store.get(identity) for identity in dict.fromkeys(identities))
        return [
            record
            for record in records
            if record is not None
            and not record.state.settled
            and record.lease_expires_at is not None
            and record.lease_expires_at <= now
        ]

    def _guarded(self, settle: Any, record: IdempotencyRecord, *args: Any) -> bool:
        """``settle(record)``; whatever one record raises is logged and the record left, so one bad
        record never stops the run for every record behind it (a mistake in the setup still does)."""
        try:
            return bool(settle(record, *args))
        except ConfigurationError:
            raise
        except Exception as exc:  # noqa: BLE001 - one record's surprise is that record's alone
            logger.exception("could not settle %s task_id=%s", telemetry.shown(record.identity), record.task_id)
            self._leave(record, f"settling it raised {exc!r}")
            return True

    def _settle_on_evidence(self, record: IdempotencyRecord) -> bool:
        """Settle from the ledger or the result backend; False when neither knows the outcome."""
        try:
            if self._ledger_down is not None:
                raise self._ledger_down
            entry = self.idem.committed(record.identity, record.fingerprint)
        except LedgerUnavailableError as exc:
            self._ledger_down = exc
            # It may hold the effect committed: no other evidence may settle the record before it
            # answers. (Any other ledger error, a missing table say, is a mistake and is raised.)
            self._leave(record, str(exc))
            return True
        if entry is not None:
            payload = entry.result or b"null"
            self._complete(record, payload, entry.content_type or "application/json", entry.content_encoding, "ledger")
            return True
        backend = self.app.backend
        if isinstance(backend, DisabledBackend):
            return False
        meta = backend.get_task_meta(record.task_id)
        status = meta.get("status")
        if status == states.SUCCESS:
            task = self._task(record.task_name)
            serializer = serializer_of(task, self.app.conf)
            payload, content_type, encoding = encode_result(meta.get("result"), serializer)
            self._complete(record, payload, content_type, encoding, "result backend")
            return True
        if status == states.FAILURE:
            error = meta.get("result")
            if isinstance(error, BODY_MAY_HAVE_RUN):
                # The store failed around the body (or another attempt took the lease): the body may
                # have run, and its holder may still land its outcome (a deferred write). Only the
                # holder's death settles it, as any dead holder's record (_settle_on_liveness).
                self._may_have_run.add(record.task_id)
                return False
            if isinstance(error, BaseException) and self._permanent(record, error):
                info = ErrorInfo.from_exception(error)
                self._write(
                    record,
                    "failed",
                    "result backend: permanent failure",
                    lambda: self.store.fail(record.identity, record.owner, info),
                )
            else:
                self._release(record, "result backend: retryable failure")
            return True
        return False

    def _permanent(self, record: IdempotencyRecord, error: BaseException) -> bool:
        autoretry = getattr(self._task(record.task_name), "autoretry_for", ()) or ()
        return classify_failure(error, self._policy(record), autoretry) == "permanent"

    def _settle_on_liveness(self, record: IdempotencyRecord, evidence: Evidence) -> None:
        if dead_by_liveness(record, evidence.alive):
            # The holder's own record answers for it: no reply, a late one, another node's, all moot.
            dead, why, unknown = True, "its holder's liveness record has expired", ""
        elif record.task_id in self._may_have_run:
            # Its attempt ended, but its outcome may still land (a live holder's deferred write): only
            # its holder's death or the grace period settles it; inspect would find the task over.
            dead, why, unknown = False, "", "its body may have run and its holder may still store the outcome"
        elif evidence.inspected is not None and record.task_id in evidence.inspected.holding:
            self._leave(record, "a live worker holds its task")
            return
        else:
            # Absence is evidence only from the worker that would hold the task: one that did not
            # answer in time may be busy (a solo pool answers between tasks), not dead. A PENDING
            # claim has no holder yet; an IN_PROGRESS record whose token names no worker (an older
            # token) has an unknown one, and waits for the grace period.
            liveness = evidence.inspected
            dead = liveness is not None and (
                record.state is State.PENDING or holder_node(record.owner) in liveness.answered
            )
            why = "provably dead"
            unknown = "no worker answered" if liveness is None else "not the worker that holds it answered"
        if not dead:
            grace = self.idem.settings.stale_grace_seconds
            overdue = self.now - (record.lease_expires_at or 0)
            if overdue < grace:
                self._leave(record, f"{unknown}; {overdue:.0f}s past its lease, grace {grace:g}s")
                return
        if self._policy(record).stale_action == "requeue" and record.call is not None:
            self._requeue(record)
        else:
            self._release(record, why if dead else "dead past the grace period")
