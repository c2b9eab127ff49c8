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

The package, by concern: ``run`` (:class:`Reconciler`: the run, its decisions in the order above,
and :class:`ReconcileReport`), ``holders`` (step 3's evidence: the holders' liveness records and what
``inspect`` answers) and ``writes`` (the compare-and-set writes and the counts). The
``celery_idem.reconcile`` task that beat runs is registered by :mod:`celery_idem.extension`.
"""

from __future__ import annotations

from .run import BEAT_ENTRY, DEFAULT_LIMIT, TASK_NAME, Reconciler, ReconcileReport
from .writes import LeftRecord

__all__ = ["BEAT_ENTRY", "DEFAULT_LIMIT", "TASK_NAME", "LeftRecord", "ReconcileReport", "Reconciler"]
