"""This process's liveness record: positive evidence, in the store, that a holder is alive.

DESIGN "Death is a fact, not a silence". Every process that runs attempts keeps a record of its own
in the store, named by a liveness id it mints (16 hex digits, fresh per process and never reused),
under a token of its own, for ``liveness_seconds`` of the store server's clock. The heartbeat
thread that renews the process's leases beats it every ``liveness_seconds / 3``, from its first
attempt until the thread stops, idle or not: a process between attempts still holds deferred
outcomes, or will mint a token naming its id in the next instant, and one beat every few seconds
per process costs less than a record whose holder cannot be judged.

Each attempt's owner token names the id (:func:`celery_idem.owners.worker_token`), so the
reconciler reads every holder's record in one call (:meth:`Store.alive`) and takes an expired one
for death, whatever ``inspect`` answers. A process is judged by its own record: in a prefork pool
each child keeps one (its heartbeat thread beats it), so a child killed alone (the OOM killer's
usual pick) is seen dead while its main process lives, and a child orphaned by a killed main
process, still running its task, is seen alive. The main process holds no attempts, so it keeps no
record (the brief's "the main process's for its children" would vouch for a child it cannot see).

A beat answered LOST means the record expired (the process was frozen, or the store unreachable,
past its lifetime): the process was taken for dead, and stays dead under that id. It mints a new
id for the attempts it starts from then on; those it holds keep their leases, and once a lease is
past as well the reconciler settles that record, and the attempt's own writes are LOST (a zombie).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from .owners import PROCESS_ID_LENGTH
from .stores.base import Store

__all__ = ["ProcessLiveness"]

logger = logging.getLogger("celery_idem.liveness")


def _fresh_id() -> str:
    return uuid.uuid4().hex[:PROCESS_ID_LENGTH]


@dataclass(eq=False)
class ProcessLiveness:
    """One process's liveness record, as the heartbeat thread keeps it."""

    seconds: float
    id: str = field(default_factory=_fresh_id)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: bool = False  # whether a first beat is known to have landed
    due: float = 0.0  # monotonic time of the next beat (0: at once)

    def beat(self, store: Store, now: float | None = None) -> ProcessLiveness:
        """Create or renew the record in ``store``; the record to keep (a new one if this was lost).
        ``now`` is the heartbeat's monotonic clock (default: ``time.monotonic()``).

        Raises:
            StoreUnavailableError: the store did not answer (a missed beat, tried again at the next).
        """
        self.due = (time.monotonic() if now is None else now) + self.seconds / 3
        answer = store.keep_alive(self.id, self.token, seconds=self.seconds, create=not self.created)
        if answer.ok:
            self.created = True
            return self
        logger.warning(
            "liveness record %s expired: this process was taken for dead; its attempts past "
            "their leases are settled without it, and new attempts name a new record",
            self.id,
        )
        return ProcessLiveness(self.seconds)
