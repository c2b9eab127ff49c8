"""What the reconciler knows of the holders of the records it could not settle from an outcome: their
liveness records in the store (one read for every holder) and what the workers answer ``inspect``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import StoreUnavailableError
from ..owners import holder_process, node_tag
from ..records import IdempotencyRecord, State

if TYPE_CHECKING:
    from ..stores import Store

__all__ = ["Evidence", "Liveness", "dead_by_liveness", "holder", "live_holders", "live_task_ids"]

logger = logging.getLogger("celery_idem.reconciler")


class Liveness(NamedTuple):
    """What the workers that answered ``inspect`` said."""

    holding: frozenset[str]  # task ids they hold (active, reserved, scheduled)
    answered: frozenset[str]  # their node tags (owners.node_tag of their names)


class Evidence(NamedTuple):
    """What one run knows of the holders of its undecided records."""

    alive: frozenset[str] | None  # the liveness ids with a live record (None: the store did not say)
    inspected: Liveness | None  # what inspect answered (None: no worker answered)


def holder(record: IdempotencyRecord) -> str | None:
    """The liveness id of the process holding an IN_PROGRESS record (None: a claim, an old token)."""
    return holder_process(record.owner) if record.state is State.IN_PROGRESS else None


def dead_by_liveness(record: IdempotencyRecord, alive: frozenset[str] | None) -> bool:
    """Whether the record's holder is a process whose liveness record has expired (or never landed)."""
    process = holder(record)
    return process is not None and alive is not None and process not in alive


def live_holders(store: Store, records: list[IdempotencyRecord]) -> frozenset[str] | None:
    """Which holder processes named by the records' tokens have a live liveness record: one read."""
    processes = {holder(record) for record in records}
    try:
        return store.alive([process for process in processes if process is not None])
    except StoreUnavailableError as exc:
        logger.warning("could not read the holders' liveness records (%s): liveness unknown", exc)
        return None


def live_task_ids(app: Any, task_ids: list[str], timeout: float) -> Liveness | None:
    """Which task ids the answering workers hold, and who answered; None when no worker answered."""
    try:
        replies = app.control.inspect(timeout=timeout).query_task(*task_ids)
    except Exception as exc:  # noqa: BLE001 - the broker is down: liveness is unknown
        logger.warning("could not ask the workers (%s): liveness unknown", exc)
        return None
    if not replies:
        return None
    return Liveness(
        holding=frozenset(task_id for reply in replies.values() for task_id in (reply or {})),
        answered=frozenset(node_tag(name) for name in replies),
    )
