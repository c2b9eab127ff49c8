"""The reconciler's and the operators' side of a store: the liveness of worker processes, the
records whose lease ran out, purging records past their TTL, and listing and counting records.

The rules of liveness are with the others in :mod:`celery_idem.stores.rules`; the atomic operations
on a record are in :mod:`celery_idem.stores.base`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection

from ..records import IdempotencyRecord, State, Transition
from .core import StoreCore, positive

__all__ = ["PROCESS_MAX_LENGTH", "StoreUpkeep"]

PROCESS_MAX_LENGTH = 64


def _check_process(process: str) -> None:
    if not (isinstance(process, str) and 0 < len(process) <= PROCESS_MAX_LENGTH and process.isprintable()):
        raise ValueError(f"a liveness id must be 1-{PROCESS_MAX_LENGTH} printable characters; got {process!r}")


class StoreUpkeep(StoreCore, ABC):
    """The operations of a store that its workers' reconciler and its operators ask for."""

    def keep_alive(self, process: str, token: str, *, seconds: float, create: bool = False) -> Transition:
        """Liveness: keep the record of the worker process ``process`` live for ``seconds`` more.

        Args:
            process: The process's liveness id (fresh per process, never reused).
            token: The process's own token: a renewal under another token, or of a record that has
                expired, is LOST (the process was taken for dead; it mints a new id).
            seconds: How long the record lives without another beat (the server's clock).
            create: The first beat: an absent record is written.
        """
        _check_process(process)
        lifetime = positive("seconds", seconds)
        with self._guard("keep_alive"):
            return self._keep_alive(process, token, lifetime, create)

    def alive(self, processes: Collection[str]) -> frozenset[str]:
        """Which of ``processes`` (liveness ids) have a live record now, in one round trip."""
        wanted = sorted(set(processes))
        for process in wanted:
            _check_process(process)
        if not wanted:
            return frozenset()
        with self._guard("alive"):
            return frozenset(self._alive(wanted))

    def expired_leases(self, *, limit: int = 100) -> list[IdempotencyRecord]:
        """Unsettled records whose lease has expired, oldest lease first, at most ``limit``.

        Found through an index ordered by lease expiry: the cost grows with the number returned,
        not with the number of records stored.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit!r}")
        with self._guard("expired_leases"):
            return self._expired_leases(limit)

    def purge_expired(self, *, limit: int = 1000) -> int:
        """Delete up to ``limit`` records past their TTL; how many went.

        Records past their TTL are already absent to every operation; this only frees their space.
        Redis expires keys itself (0); the SQL store deletes rows; the reconciler calls this.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit!r}")
        with self._guard("purge_expired"):
            return self._purge_expired(limit)

    def _purge_expired(self, limit: int) -> int:
        return 0

    def records(
        self, *, state: State | None = None, task_name: str | None = None, limit: int = 100
    ) -> list[IdempotencyRecord]:
        """Live records, optionally of one state and one task, at most ``limit`` (for operators).

        Not for hot paths: on Redis it scans the key space.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit!r}")
        with self._guard("records"):
            return self._records(state, task_name, limit)

    def count_by_state(self) -> dict[State, int]:
        """How many live records each state holds (for operators; scans on Redis)."""
        with self._guard("count_by_state"):
            counts = dict.fromkeys(State, 0)
            for record_state, n in self._count_by_state().items():
                counts[record_state] += n
            return counts

    def count_by_task(self) -> dict[str, dict[State, int]]:
        """How many live records each task holds in each state (for operators; scans on Redis)."""
        with self._guard("count_by_task"):
            counts: dict[str, dict[State, int]] = {}
            for (task_name, record_state), n in self._count_by_task().items():
                counts.setdefault(task_name, dict.fromkeys(State, 0))[record_state] += n
            return dict(sorted(counts.items()))

    # ---- the reconciler's: stale records and worker liveness --------------------------------------

    @abstractmethod
    def _expired_leases(self, limit: int) -> list[IdempotencyRecord]: ...

    @abstractmethod
    def _keep_alive(self, process: str, token: str, seconds: float, create: bool) -> Transition: ...

    @abstractmethod
    def _alive(self, processes: list[str]) -> set[str]: ...

    # ---- operator queries (the CLI's list and count): optional ---------------------------------------

    def _records(self, state: State | None, task_name: str | None, limit: int) -> list[IdempotencyRecord]:
        raise NotImplementedError(f"{type(self).__name__} does not list its records (celery idem list needs it)")

    def _count_by_state(self) -> dict[State, int]:
        raise NotImplementedError(f"{type(self).__name__} does not count its records (celery idem count needs it)")

    def _count_by_task(self) -> dict[tuple[str, State], int]:
        raise NotImplementedError(f"{type(self).__name__} does not count its records by task")
