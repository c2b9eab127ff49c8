"""A reference model of the store state machine (DESIGN §3), and how a real store's answer is held to it.

Plain Python, no store code: one dict of records and a clock that only the test moves. Every public
method is one store operation with the same name and arguments as ``celery_idem.stores.base.Store``
and returns what DESIGN says that operation answers. The rules are written here a second time, on
purpose, from DESIGN and the contract's rules in ``stores/rules.py``; where DESIGN left a choice
open, the model follows the memory store (tests/README.md lists those choices).

Time: the model clock starts at 0 and moves only by :meth:`Model.advance`. A real store's times are
its server's clock, which also moves by itself while the test runs; :class:`Timeline` maps one onto
the other. Tests keep every model duration a multiple of ``QUANTUM`` seconds so that the few seconds
of real time a test takes can never flip a model decision, and an exact boundary (``lease == now``,
which DESIGN counts as expired) still means the same on both sides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from celery_idem.records import Decision, ErrorInfo, Identity, State

QUANTUM = 50.0  # seconds: every model duration and time step is a multiple of this
MINTED = "<a token the store minted>"  # the owner a release to PENDING writes: nobody holds it
UNSETTLED = (State.PENDING, State.IN_PROGRESS)


@dataclass(frozen=True)
class Rec:
    """One record as the model holds it (the fields of ``IdempotencyRecord`` DESIGN fixes, plus ``call``)."""

    identity: Identity
    fingerprint: str
    state: State
    task_id: str
    owner: str
    attempt: int
    lease_expires_at: float | None
    created_at: float
    updated_at: float
    expires_at: float
    ttl_seconds: float
    result: bytes | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    error: ErrorInfo | None = None
    call: bytes | None = None
    # Hidden (no store reads it back): when a BUSY waiter will have looked again by. An outcome
    # is kept at least until then, whatever its TTL ("A waiting duplicate gets its answer").
    linger: float | None = None
    previous_task_id: str | None = None  # the attempt a takeover took over (its body may have run)


@dataclass(frozen=True)
class Answer:
    """What claim/acquire (decision and record) or a fenced write (decision only) answers."""

    decision: Decision
    record: Rec | None = None


OK, LOST = Answer(Decision.OK), Answer(Decision.LOST)


class Model:
    """Every record the store would hold, by identity, including "ghosts": records past their TTL
    (absent to every operation) that a store may still physically hold until something removes them."""

    def __init__(self) -> None:
        self.time = 0.0
        self.records: dict[Identity, Rec] = {}

    def copy(self) -> Model:
        twin = Model()
        twin.time, twin.records = self.time, dict(self.records)  # records are immutable
        return twin

    def key(self) -> tuple[Any, ...]:
        """A hashable snapshot (the linearizability checker memoizes on it)."""
        # ErrorInfo holds a list: the record goes in without it, and the error as its JSON.
        return (
            self.time,
            tuple(
                sorted(
                    (i, dataclasses.replace(r, error=None), r.error.model_dump_json() if r.error else None)
                    for i, r in self.records.items()
                )
            ),
        )

    def now(self) -> float:
        return self.time

    def advance_clock_for_tests(self, seconds: float) -> None:
        self.time += seconds

    def _live(self, identity: Identity) -> Rec | None:
        record = self.records.get(identity)
        return record if record is not None and record.expires_at > self.time else None

    def _write(self, record: Rec, **changes: Any) -> Rec:
        new = dataclasses.replace(record, updated_at=self.time, **changes)
        self.records[record.identity] = new
        return new

    # ---- take: claim and acquire -----------------------------------------------------------------

    def claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        *,
        pending_seconds: float,
        ttl_seconds: float,
        owner: str,
        call: bytes | None = None,
        settled_is_free: bool = False,
    ) -> Answer:
        lease, ttl = pending_seconds, ttl_seconds
        held = self._live(identity)
        if held is not None and settled_is_free and held.state.settled and held.task_id != task_id:
            # kept for its ended run's messages only: a new call of such a mode takes it afresh
            # (under its own task id it is that call again)
            held = None
        if held is not None:
            if held.fingerprint != fingerprint:  # compared first: in every state, an expired lease too
                return Answer(Decision.MISMATCH, held)
            if held.state.settled:
                return Answer(Decision.REPLAY, held)
            assert held.lease_expires_at is not None
            if held.lease_expires_at > self.time:
                return Answer(Decision.DUPLICATE, held)
        # absent, or a lease that ran out: a new claim, written whole (nothing of the old survives
        # but a waiter's mark, since a BUSY duplicate of the old attempt is still owed its answer, and
        # the task id of the attempt it takes over, or the one the claim it takes over kept)
        fresh = Rec(
            identity,
            fingerprint,
            State.PENDING,
            task_id,
            owner,
            0,
            self.time + lease,
            self.time,
            self.time,
            self.time + lease + ttl,
            ttl,
            call=call,
            linger=held.linger if held is not None else None,
            previous_task_id=_taken_over(held),
        )
        self.records[identity] = fresh
        return Answer(Decision.NEW, fresh)

    def acquire(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        *,
        lease_seconds: float,
        ttl_seconds: float,
        owner: str,
        call: bytes | None = None,
        next_look_seconds: float = 0.0,
        retry: bool = False,
    ) -> Answer:
        lease, ttl = lease_seconds, ttl_seconds
        held = self._live(identity)
        if held is None:
            fresh = Rec(
                identity,
                fingerprint,
                State.IN_PROGRESS,
                task_id,
                owner,
                1,
                self.time + lease,
                self.time,
                self.time,
                self.time + lease + ttl,
                ttl,
                call=call,
            )
            self.records[identity] = fresh
            return Answer(Decision.RUN, fresh)
        # A Celery retry under the record's task id is the same attempt chain: it runs with other
        # arguments. Any other message with other arguments (the same task id included) is refused.
        if held.fingerprint != fingerprint and not (retry and held.task_id == task_id and held.attempt > 0):
            return Answer(Decision.MISMATCH, held)
        if held.state.settled:
            return Answer(Decision.REPLAY, held)
        assert held.lease_expires_at is not None
        if held.state is State.IN_PROGRESS and held.lease_expires_at > self.time:
            # BUSY marks the record (nothing a reader sees changes): kept until the waiter's next look.
            look = self.time + next_look_seconds
            self.records[identity] = dataclasses.replace(held, linger=max(held.linger or look, look))
            return Answer(Decision.BUSY, held)
        taken = self._write(
            held,
            state=State.IN_PROGRESS,
            task_id=task_id,
            owner=owner,
            attempt=held.attempt + 1,
            lease_expires_at=self.time + lease,
            expires_at=self.time + lease + ttl,
            ttl_seconds=ttl,
            call=call if call is not None else held.call,
            previous_task_id=_taken_over(held),
        )
        return Answer(Decision.RUN, taken)

    # ---- fenced writes ---------------------------------------------------------------------------

    def _owned(self, identity: Identity, token: str, fence: str = "owner") -> Rec | None:
        held = self._live(identity)
        if held is None or held.state not in UNSETTLED or getattr(held, fence) != token:
            return None
        return held

    def complete(
        self,
        identity: Identity,
        token: str,
        result: bytes,
        *,
        content_type: str = "application/json",
        content_encoding: str = "utf-8",
    ) -> Answer:
        held = self._owned(identity, token)
        if held is None:
            return LOST
        self._write(
            held,
            state=State.COMPLETED,
            result=result,
            content_type=content_type,
            content_encoding=content_encoding,
            lease_expires_at=None,
            call=None,
            expires_at=self._kept(held),
        )
        return OK

    def fail(self, identity: Identity, token: str, error: ErrorInfo) -> Answer:
        held = self._owned(identity, token)
        if held is None:
            return LOST
        self._write(
            held, state=State.FAILED, error=error, lease_expires_at=None, call=None, expires_at=self._kept(held)
        )
        return OK

    def _kept(self, held: Rec) -> float:
        """Until when an outcome settled now lives: its TTL, and never before a BUSY waiter's next look."""
        return max(self.time + held.ttl_seconds, held.linger or 0.0)

    def release(
        self,
        identity: Identity,
        token: str,
        *,
        pending_seconds: float | None = None,
        fence: str = "owner",
        expired_only: bool = False,
    ) -> Answer:
        held = self._owned(identity, token, fence)
        if held is None:
            return LOST
        assert held.lease_expires_at is not None
        live = held.lease_expires_at > self.time
        # By task id only what that delivery may still hold: a claim, or an attempt past its lease.
        if live and (expired_only or (fence == "task_id" and held.state is State.IN_PROGRESS)):
            return LOST
        if pending_seconds is None:
            del self.records[identity]
        else:
            lease = self.time + pending_seconds
            self._write(
                held, state=State.PENDING, owner=MINTED, lease_expires_at=lease, expires_at=lease + held.ttl_seconds
            )
        return OK

    def renew(self, identity: Identity, token: str, *, lease_seconds: float) -> Answer:
        lease = lease_seconds
        held = self._owned(identity, token)
        if held is None or held.state is not State.IN_PROGRESS:
            return LOST
        assert held.lease_expires_at is not None
        end = max(held.lease_expires_at, self.time + lease)  # extends, never shortens
        self._write(held, lease_expires_at=end, expires_at=end + held.ttl_seconds)
        return OK

    # ---- reads and housekeeping ---------------------------------------------------------------

    def get(self, identity: Identity) -> Rec | None:
        return self._live(identity)

    def forget(self, identity: Identity) -> bool:
        live = self._live(identity) is not None
        self.records.pop(identity, None)  # a ghost goes too
        return live

    def expired_leases(self, *, limit: int) -> list[Rec]:
        """Every live unsettled record whose lease has run out, by lease (ties in any order): ALL of
        them, whatever ``limit``; the store answers a prefix of ``limit`` (:meth:`Timeline.due_problems`)."""
        due = [r for r in self.records.values() if r.expires_at > self.time and r.state in UNSETTLED]
        due = [r for r in due if r.lease_expires_at is not None and r.lease_expires_at <= self.time]
        return sorted(due, key=lambda r: (r.lease_expires_at, str(r.identity)))

    def purge_expired(self, *, limit: int) -> int:
        """The most records a purge may delete: the ghosts, up to ``limit``. It changes nothing live."""
        ghosts = [i for i, r in self.records.items() if r.expires_at <= self.time]
        for identity in ghosts[:limit]:
            del self.records[identity]
        return min(len(ghosts), limit)


def _taken_over(held: Rec | None) -> str | None:
    """What a claim or acquire taking ``held`` over keeps: an attempt's task id, or a claim's own."""
    if held is None:
        return None
    return held.task_id if held.state is State.IN_PROGRESS else held.previous_task_id


# ---- holding a real store's answers to the model ------------------------------------------------

_FIELDS = (
    "fingerprint",
    "state",
    "task_id",
    "attempt",
    "ttl_seconds",
    "result",
    "content_type",
    "content_encoding",
    "error",
    "previous_task_id",
)
_TIMES = ("lease_expires_at", "created_at", "updated_at", "expires_at")


@dataclass(frozen=True)
class Timeline:
    """Maps model time onto a store's clock: ``base`` is the store's time when the model clock read 0.

    A time the store wrote at model time ``t`` reads ``base + t + drift``, where the drift (the real
    time elapsed since ``base``) is below ``QUANTUM``; model times differ by whole quanta, so each
    store time matches exactly one model time.
    """

    base: float
    tokens: frozenset[str]  # every owner token the test handed out (MINTED matches none of them)

    def same_time(self, model: float | None, real: float | None) -> bool:
        if model is None or real is None:
            return model is None and real is None
        return -0.01 <= real - self.base - model < QUANTUM - 1

    def record_problems(self, model: Rec | None, real: Any) -> list[str]:
        """How ``real`` (an ``IdempotencyRecord`` or None) differs from the model's record."""
        if model is None or real is None:
            return [] if model is None and real is None else [f"record: model {model!r}, store {real!r}"]
        found = [
            f"{name}: model {getattr(model, name)!r}, store {getattr(real, name)!r}"
            for name in _FIELDS
            if getattr(model, name) != getattr(real, name)
        ]
        found += [
            f"{name}: model {getattr(model, name)!r} (+base), store {getattr(real, name)!r} "
            f"(= base {self.base:.3f} + {(getattr(real, name) or 0) - self.base:.3f})"
            for name in _TIMES
            if not self.same_time(getattr(model, name), getattr(real, name))
        ]
        if real.identity != model.identity:
            found.append(f"identity: model {model.identity}, store {real.identity}")
        if real.call != model.call:
            found.append(f"call: model {model.call!r}, store {real.call!r}")
        if model.owner == MINTED:
            owner_ok = real.owner not in self.tokens
        else:
            # A settled record may keep only its owner's digest (the Redis store's packed record)
            owner_ok = real.owner == model.owner or (model.state not in UNSETTLED and real.held_by(model.owner))
        if not owner_ok:
            found.append(f"owner: model {model.owner!r}, store {real.owner!r}")
        return found

    def answer_problems(self, model: Answer, real: Any) -> list[str]:
        """How a real ``Transition`` differs from the model's answer (its decision, and the record)."""
        if model.decision is not real.decision:
            return [f"decision: model {model.decision.value}, store {real.decision.value}"]
        if model.record is None:
            return []
        return self.record_problems(model.record, real.record)

    def due_problems(self, model: list[Rec], real: list[Any], limit: int) -> list[str]:
        """``expired_leases(limit=limit)`` answers the first ``limit`` due records by lease; records
        whose leases tie in model time may come in any order (the store's clock tells them apart)."""
        if len(real) != min(limit, len(model)):
            return [
                f"expired_leases: model {[str(r.identity) for r in model]} (limit {limit}), "
                f"store {[str(r.identity) for r in real]}"
            ]
        by_identity = {r.identity: r for r in model}
        found: list[str] = []
        for n, record in enumerate(real):
            want = by_identity.get(record.identity)
            if want is None:
                return [f"expired_leases: {record.identity} is not due in the model"]
            found += [f"expired_leases[{n}] {p}" for p in self.record_problems(want, record)]
        cut = model[len(real) - 1].lease_expires_at if real else None
        chosen = {r.identity for r in real}
        for want in model:  # a prefix by lease: everything due strictly before the cut is in it
            if cut is not None and want.lease_expires_at is not None and want.lease_expires_at < cut:
                if want.identity not in chosen:
                    found.append(f"expired_leases skipped {want.identity} (lease {want.lease_expires_at})")
        leases = [by_identity[r.identity].lease_expires_at or 0.0 for r in real]
        if leases != sorted(leases):
            found.append(f"expired_leases not oldest lease first: {leases}")
        return found
