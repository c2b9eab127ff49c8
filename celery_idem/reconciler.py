"""The reconciler: settle records stuck in PENDING or IN_PROGRESS past their lease (DESIGN §4).

Stale records come from the store's lease-expiry index (cost grows with the stale records, not
with all records). Each is settled against the truth, in order, and only on positive evidence:

1. the ledger: a committed outcome for the identity -> COMPLETED with it;
2. the result backend, for the record's task id: SUCCESS -> COMPLETED; FAILURE -> FAILED if the
   task's policy classes the error permanent, else released; but a FAILURE that says "the body
   may have run" (StoreUnavailableError, LockLostError) is no evidence: left, and counted;
3. worker liveness, read once for all undecided records: the holder processes' liveness records
   in the store (one :meth:`Store.alive` call for every id the owner tokens name,
   :mod:`celery_idem.liveness`) and one ``inspect().query_task`` broadcast. An IN_PROGRESS record
   whose token names a process whose liveness record has expired (or never landed) -> provably
   dead, whatever ``inspect`` says: released, or re-published under the same key and task id
   (``stale_action="requeue"``). A holder whose record is live -> left (it is alive: a deferred
   outcome may still land). For a token that names no process (a claim, an older worker) inspect
   is the evidence: a live worker holds the task id (active, reserved or scheduled) -> left alone;
   the worker named in the token answered without it, or, for a PENDING claim no worker has taken,
   some worker answered -> provably dead; otherwise (no answer, or not from the holder: a busy or
   solo pool answers late) -> unknown. Whatever is left as unknown or alive is released once its
   lease is ``stale_grace_seconds`` past. Silence alone settles nothing.

Every write is a compare-and-set on the owner token the scan saw (a release also requires the lease
to still be expired), so two reconcilers at once never settle one record twice, and a worker that
finishes meanwhile wins.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from celery import states
from celery.backends.base import DisabledBackend
from pydantic import BaseModel, ConfigDict

from .calls import CallRefused, decode_call
from .errors import ConfigurationError, LedgerUnavailableError, ResultTooLargeError, StoreUnavailableError
from .failures import BODY_MAY_HAVE_RUN, classify_failure
from .outcome import encode_result, serializer_of
from .owners import holder_node, holder_process, node_tag
from .protocol import KEY_HEADER, SCOPE_HEADER
from .records import Decision, ErrorInfo, IdempotencyRecord, State
from .runtime import Runtime
from .timing import EXPIRY_GRACE_SECONDS

if TYPE_CHECKING:
    from .config import IdempotencyPolicy

__all__ = ["BEAT_ENTRY", "TASK_NAME", "ReconcileReport", "Reconciler"]

logger = logging.getLogger("celery_idem.reconciler")
TASK_NAME = "celery_idem.reconcile"
BEAT_ENTRY = "celery-idem-reconcile"
DEFAULT_LIMIT = 1000


class Liveness(NamedTuple):
    """What the workers that answered ``inspect`` said."""

    holding: frozenset[str]  # task ids they hold (active, reserved, scheduled)
    answered: frozenset[str]  # their node tags (owners.node_tag of their names)


class Evidence(NamedTuple):
    """What one run knows of the holders of its undecided records."""

    alive: frozenset[str] | None  # the liveness ids with a live record (None: the store did not say)
    inspected: Liveness | None  # what inspect answered (None: no worker answered)


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


class Reconciler:
    """One reconciler run over one app's store."""

    def __init__(self, idem: Runtime, *, dry_run: bool = False) -> None:
        self.idem = idem
        self.app = idem.app
        self.store = idem.store
        self.dry_run = dry_run
        self.counts = dict.fromkeys(("scanned", "completed", "failed", "released", "requeued", "left"), 0)
        self._ledger_down: LedgerUnavailableError | None = None  # once per run: every later read would wait too
        self._may_have_run: set[str] = set()  # task ids whose FAILURE says their body may have run

    @functools.cached_property
    def now(self) -> float:
        """The store server's time, read once per run (not once per record): grace and expiry checks."""
        return self.store.now()

    def run(self, limit: int | None = None) -> ReconcileReport:
        started = time.monotonic()
        stale = self.store.expired_leases(limit=limit or DEFAULT_LIMIT)
        self.counts["scanned"] = len(stale)
        undecided = [record for record in stale if not self._guarded(self._settle_on_evidence, record)]
        if undecided:
            alive = self._alive(undecided)
            # inspect only for what the liveness records do not settle (a live holder, a token naming none)
            asked = [r.task_id for r in undecided if not self._dead_by_liveness(r, alive)]
            evidence = Evidence(alive, self._live_task_ids(asked) if asked else None)
            for record in undecided:
                self._guarded(self._settle_on_liveness, record, evidence)
        purged = 0 if self.dry_run else self.store.purge_expired(limit=limit or DEFAULT_LIMIT)
        report = ReconcileReport(**self.counts, purged=purged, seconds=time.monotonic() - started, dry_run=self.dry_run)
        logger.info("reconciled: %s", report.model_dump_json())
        if not self.dry_run:
            for name in ("completed", "failed", "released"):
                self.idem.count(f"reconciled_{name}", self.counts[name])
        return report

    def _guarded(self, settle: Any, record: IdempotencyRecord, *args: Any) -> bool:
        """``settle(record)``; whatever one record raises is logged and the record left, so one bad
        record never stops the run for every record behind it (a mistake in the setup still does)."""
        try:
            return bool(settle(record, *args))
        except ConfigurationError:
            raise
        except Exception as exc:  # noqa: BLE001 - one record's surprise is that record's alone
            logger.exception("could not settle key=%s task=%s task_id=%s", record.key, record.task_name, record.task_id)
            self._leave(record, f"settling it raised {exc!r}")
            return True

    # ---- evidence --------------------------------------------------------------------------------

    def _task(self, name: str) -> Any:
        return self.app.tasks.get(name)

    def _policy(self, record: IdempotencyRecord) -> IdempotencyPolicy:
        task = self._task(record.task_name)
        return self.idem.policy_for(task) if task is not None else self.idem.settings.policy()

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

    def _live_task_ids(self, task_ids: list[str]) -> Liveness | None:
        """Which task ids the answering workers hold, and who answered; None when no worker answered."""
        timeout = self.idem.settings.inspect_timeout_seconds
        try:
            replies = self.app.control.inspect(timeout=timeout).query_task(*task_ids)
        except Exception as exc:  # noqa: BLE001 - the broker is down: liveness is unknown
            logger.warning("could not ask the workers (%s): liveness unknown", exc)
            return None
        if not replies:
            return None
        return Liveness(
            holding=frozenset(task_id for reply in replies.values() for task_id in (reply or {})),
            answered=frozenset(node_tag(name) for name in replies),
        )

    @staticmethod
    def _holder(record: IdempotencyRecord) -> str | None:
        """The liveness id of the process holding an IN_PROGRESS record (None: a claim, an old token)."""
        return holder_process(record.owner) if record.state is State.IN_PROGRESS else None

    def _dead_by_liveness(self, record: IdempotencyRecord, alive: frozenset[str] | None) -> bool:
        process = self._holder(record)
        return process is not None and alive is not None and process not in alive

    def _alive(self, records: list[IdempotencyRecord]) -> frozenset[str] | None:
        """Which holder processes named by the records' tokens have a live liveness record: one read."""
        processes = {self._holder(record) for record in records}
        try:
            return self.store.alive([process for process in processes if process is not None])
        except StoreUnavailableError as exc:
            logger.warning("could not read the holders' liveness records (%s): liveness unknown", exc)
            return None

    def _settle_on_liveness(self, record: IdempotencyRecord, evidence: Evidence) -> None:
        if self._dead_by_liveness(record, evidence.alive):
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
            logger.warning("requeue of %s failed: %s; retried on a later run", record.identity, exc)

    def _leave(self, record: IdempotencyRecord, why: str) -> None:
        self.counts["left"] += 1
        logger.info(
            "left key=%s task=%s task_id=%s state=%s: %s",
            record.key,
            record.task_name,
            record.task_id,
            record.state.value,
            why,
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
            "%s key=%s task=%s task_id=%s was=%s: %s",
            outcome,
            record.key,
            record.task_name,
            record.task_id,
            record.state.value,
            why,
        )
        return True
