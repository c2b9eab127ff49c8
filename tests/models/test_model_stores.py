"""Every store against the reference model (tests/model.py), on every store: memory, SQLite,
PostgreSQL, Redis and a 3-master Redis Cluster.

1. A hypothesis state machine drives random operations, one at a time, into the model and into the
   store, and holds every answer and every stored record to the model's. Time moves through
   ``Store.advance_clock_for_tests``, which shifts the server's own clock (Redis TIME, the
   database's clock) inside the scripts and statements: the production path, not an injected clock.
2. Threads, and separate processes (each with its own store object on the same data), run random
   operations at once on a store; the recorded history must be linearizable against the model
   (tests/linearizability.py). A deliberately racy store proves the check bites.

Runs are fixed (seeded, no example database) so a failure reproduces; CELERY_IDEM_MODEL_SEED picks
another seed and CELERY_IDEM_MODEL_SCALE=100 runs 100 times as many examples and histories.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import store_url
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, invariant, precondition, rule
from linearizability import Call, linearize, render
from model import MINTED, Model, Rec, Timeline
from model_harness import (
    CALLS,
    ERRORS,
    FINGERPRINTS,
    IDENTITIES,
    KINDS,
    LEASES,
    LIMITS,
    NEXT_LOOKS,
    OWNERS,
    RESULTS,
    SCALE,
    SEED,
    SHRINK,
    STEPS,
    TASK_IDS,
    TTLS,
    Harness,
    Op,
    op,
    perform,
    problems,
    random_op,
)
from model_processes import Processes

from celery_idem.records import Identity
from celery_idem.stores import MemoryStore, Store

EXAMPLES, STEPS_PER_EXAMPLE = 24, 25  # per store: 600 steps each, 4,800 over the eight stores
HISTORIES, THREADS, OPS_PER_THREAD = 40, 3, 4  # per store: 40 histories, 320 over the eight stores
PROCESS_KINDS = ("sqlite", "postgresql", "mariadb", "redis")  # the stores other processes can reach
PROCESS_HISTORIES, PROCESSES = 20, 3  # per store: 60 more histories, each from 3 processes


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest, tmp_path: Any, prefix: str) -> Iterator[Harness]:
    made = Harness.open(str(request.param), prefix, tmp_path, lambda: request.getfixturevalue("redis_cluster_url"))
    print(f"model tests on {made.kind}: seed {SEED} (CELERY_IDEM_MODEL_SEED), scale {SCALE} (CELERY_IDEM_MODEL_SCALE)")
    yield made
    made.close()


def check(harness: Harness, store: Store, model: Model, timeline: Timeline, call: Op) -> Any:
    """Run ``call`` on both; fail with every difference if the store's answer is not the model's."""
    expected = perform(model, call)
    actual = perform(store, call)
    found = problems(call, expected, actual, timeline, harness.purge)
    assert not found, f"{harness.kind}: {call} disagrees with the model:\n  " + "\n  ".join(found)
    return actual


# ---- 1. the state machine ------------------------------------------------------------------------

identities, fingerprints, task_ids = (
    st.sampled_from(IDENTITIES),
    st.sampled_from(FINGERPRINTS),
    st.sampled_from(TASK_IDS),
)
owners, leases, ttls, calls = (
    st.sampled_from(OWNERS),
    st.sampled_from(LEASES),
    st.sampled_from(TTLS),
    st.sampled_from(CALLS),
)
maybe_lease, nth = st.sampled_from((None, *LEASES)), st.integers(0, 2)
WRITES = ("complete", "fail", "renew", "release", "requeue")
CTYPES = ("application/json", "application/x-msgpack")


class StoreMatchesModel(RuleBasedStateMachine):
    """One rule per store operation; after every step, every identity's record agrees with the model."""

    harness: Harness  # set per store by the test

    def __init__(self) -> None:
        super().__init__()
        self.store, self.model, self.timeline = self.harness.fresh()

    def step(self, call: Op) -> None:
        check(self.harness, self.store, self.model, self.timeline, call)

    def holder(self, n: int, fence: str = "owner") -> Rec | None:
        """The ``n``-th (cyclically) unsettled record whose ``fence`` token a caller can hold."""
        held = [r for i in IDENTITIES if (r := self.model.get(i)) is not None and not r.state.settled]
        held = [r for r in held if fence == "task_id" or r.owner != MINTED]
        return held[n % len(held)] if held else None

    @rule(
        i=identities,
        fp=fingerprints,
        task_id=task_ids,
        pending=leases,
        ttl=ttls,
        owner=owners,
        call=calls,
        free=st.booleans(),
    )
    def claim(
        self, i: Identity, fp: str, task_id: str, pending: float, ttl: float, owner: str, call: Any, free: bool
    ) -> None:
        # free: the claim of a mode that keeps no outcome for new calls (settled_is_free)
        options = {"settled_is_free": True} if free else {}
        self.step(
            op("claim", i, fp, task_id, pending_seconds=pending, ttl_seconds=ttl, owner=owner, call=call, **options)
        )

    @rule(
        i=identities,
        fp=fingerprints,
        task_id=task_ids,
        lease=leases,
        ttl=ttls,
        owner=owners,
        call=calls,
        look=st.sampled_from(NEXT_LOOKS),
        retry=st.booleans(),
    )
    def acquire(
        self,
        i: Identity,
        fp: str,
        task_id: str,
        lease: float,
        ttl: float,
        owner: str,
        call: Any,
        look: float,
        retry: bool,
    ) -> None:
        self.step(
            op(
                "acquire",
                i,
                fp,
                task_id,
                lease_seconds=lease,
                ttl_seconds=ttl,
                owner=owner,
                call=call,
                next_look_seconds=look,
                retry=retry,
            )
        )

    # The attempt that holds a record writes under its token: these mostly land (OK).

    @precondition(lambda self: self.holder(0) is not None)
    @rule(n=nth, outcome=st.sampled_from(RESULTS + ERRORS), ctype=st.sampled_from(CTYPES))
    def holder_settles(self, n: int, outcome: Any, ctype: str) -> None:
        """complete (a result) or fail (an error) under the holder's token."""
        record = self.holder(n)
        assert record is not None
        if isinstance(outcome, bytes):
            self.step(op("complete", record.identity, record.owner, outcome, content_type=ctype))
        else:
            self.step(op("fail", record.identity, record.owner, outcome))

    @precondition(lambda self: self.holder(0, "task_id") is not None)
    @rule(n=nth, by_task_id=st.booleans(), pending=maybe_lease, only=st.booleans())
    def holder_releases(self, n: int, by_task_id: bool, pending: float | None, only: bool) -> None:
        """By the owner token, or by the task id (the parent-process hooks, which have no token)."""
        fence = "task_id" if by_task_id else "owner"
        record = self.holder(n, fence)
        if record is not None:
            token = getattr(record, fence)
            self.step(op("release", record.identity, token, pending_seconds=pending, fence=fence, expired_only=only))

    @precondition(lambda self: self.holder(0) is not None)
    @rule(n=nth, lease=leases)
    def holder_renews(self, n: int, lease: float) -> None:
        record = self.holder(n)
        assert record is not None
        self.step(op("renew", record.identity, record.owner, lease_seconds=lease))

    # Anyone else's writes (a stale attempt, a stray hook) must be LOST and change nothing.

    @rule(i=identities, token=st.sampled_from(OWNERS + TASK_IDS), write=st.sampled_from(WRITES))
    def stranger_writes(self, i: Identity, token: str, write: str) -> None:
        fence = "task_id" if token in TASK_IDS else "owner"
        if write == "complete":
            self.step(op("complete", i, token, RESULTS[0]))
        elif write == "fail":
            self.step(op("fail", i, token, ERRORS[0]))
        elif write == "renew":
            self.step(op("renew", i, token, lease_seconds=LEASES[0]))
        else:
            self.step(op("release", i, token, pending_seconds=LEASES[0] if write == "requeue" else None, fence=fence))

    @rule(i=identities)
    def forget(self, i: Identity) -> None:
        self.step(op("forget", i))

    @rule(limit=st.sampled_from((*LIMITS, None)))
    def housekeeping(self, limit: int | None) -> None:
        """The reconciler's query for expired leases (at most ``limit``), or (None) a purge."""
        self.step(op("expired_leases", limit=limit) if limit else op("purge_expired", limit=10))

    @rule(seconds=st.sampled_from(STEPS))
    def time_passes(self, seconds: float) -> None:
        self.step(op("advance_clock_for_tests", seconds))
        self.step(op("now"))

    @invariant()
    def every_record_agrees(self) -> None:
        for identity in IDENTITIES:
            self.step(op("get", identity))


def test_every_store_answers_as_the_model_does(harness: Harness) -> None:
    machine = type(f"StoreMatchesModel_{harness.kind}", (StoreMatchesModel,), {"harness": harness})
    # Shrinking a failure replays it thousands of times against the server (minutes): opt in.
    phases = list(Phase) if SHRINK else [Phase.explicit, Phase.generate]
    run = get_state_machine_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES * SCALE,
            stateful_step_count=STEPS_PER_EXAMPLE,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            phases=phases,
        ),
    )
    seed(SEED)(run)
    run()


# ---- 2. concurrent histories, linearizable against the model ----------------------------------


def run_threads(store: Store, plans: list[list[Op]]) -> list[Call]:
    """Run each plan on its own thread, all released at once; every call with its times and answer."""
    history: list[Call] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(len(plans))

    def worker(thread: int, plan: list[Op]) -> None:
        gate.wait()
        for call in plan:
            start = time.monotonic()
            try:
                answer = perform(store, call)
            except BaseException as exc:  # noqa: BLE001 - reported below, with the history
                errors.append(exc)
                return
            history.append(Call(thread, call, start, time.monotonic(), answer))

    threads = [threading.Thread(target=worker, args=(n, plan)) for n, plan in enumerate(plans)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, f"a store call raised: {errors[0]!r}\n{render(history, short)}"
    return history


def short(answer: Any) -> str:
    record = getattr(answer, "record", None)
    decision = getattr(answer, "decision", None)
    if decision is not None:
        return decision.value + (f" {record.state.value} task={record.task_id} owner={record.owner}" if record else "")
    if isinstance(answer, list):
        return "[" + ", ".join(str(r.identity) for r in answer) + "]"
    if hasattr(answer, "state"):
        return f"{answer.state.value} task={answer.task_id} owner={answer.owner} attempt={answer.attempt}"
    return repr(answer)


def concurrent_history(store: Store, plans: list[list[Op]], identities: tuple[Identity, ...]) -> list[Call]:
    """The threads' calls, then (after all of them) a read of every identity: lost writes show there."""
    return read_back(store, run_threads(store, plans), identities)


def read_back(store: Store, history: list[Call], identities: tuple[Identity, ...]) -> list[Call]:
    """``history`` and, after every call in it, a read of each identity (as "thread" -1)."""
    for identity in identities:
        start = time.monotonic()
        history.append(Call(-1, op("get", identity), start, time.monotonic(), store.get(identity)))
    return history


def assert_linearizable(harness: Harness, model: Model, timeline: Timeline, history: list[Call], setup: str) -> None:
    def agree(call: Op, expected: Any, actual: Any) -> bool:
        return not problems(call, expected, actual, timeline, harness.purge)

    if linearize(history, model, perform, agree) is None:  # type: ignore[arg-type]
        pytest.fail(
            f"{harness.kind}: no sequential order explains this history\nafter {setup}\n{render(history, short)}"
        )


def test_concurrent_histories_are_linearizable(harness: Harness) -> None:
    rng = random.Random(f"{SEED}-{harness.kind}")
    for _ in range(HISTORIES * SCALE):
        store, model, timeline = harness.fresh()
        identities = IDENTITIES[: rng.choice((1, 2))]  # few identities: the threads collide
        # Given a random past, one call at a time (time moves only here: a shift is not atomic with
        # the calls in flight), each answer already held to the model
        setup = [random_op(rng, identities, with_time=True) for _ in range(rng.randint(0, 8))]
        for call in setup:
            check(harness, store, model, timeline, call)
        # When threads run random calls at once, Then one sequential order explains every answer
        plans = [[random_op(rng, identities, with_time=False) for _ in range(OPS_PER_THREAD)] for _ in range(THREADS)]
        history = concurrent_history(store, plans, identities)
        assert_linearizable(harness, model, timeline, history, " ; ".join(map(str, setup)) or "nothing")


@pytest.fixture(scope="module")
def processes() -> Iterator[Processes]:
    """PROCESSES spawned processes, started once for every store (tests/model_processes.py)."""
    started = Processes(PROCESSES)
    yield started
    started.close()


@pytest.mark.parametrize("kind", PROCESS_KINDS)
def test_concurrent_histories_from_processes_are_linearizable(
    kind: str, processes: Processes, tmp_path: Any, prefix: str
) -> None:
    harness = Harness.open(kind, prefix, tmp_path, lambda: "")
    rng = random.Random(f"{SEED}-{kind}-processes")
    shift = 0.0  # the test store's total clock shift: each process shifts its own store as much
    try:
        for _ in range(PROCESS_HISTORIES * SCALE):
            store, model, timeline = harness.fresh()
            identities = IDENTITIES[: rng.choice((1, 2))]
            setup = [random_op(rng, identities, with_time=True) for _ in range(rng.randint(0, 8))]
            for call in setup:
                check(harness, store, model, timeline, call)
                shift += call.args[0] if call.name == "advance_clock_for_tests" else 0.0
            # When separate processes, each with its own store object, run random calls at once
            plans = [
                [random_op(rng, identities, with_time=False) for _ in range(OPS_PER_THREAD)] for _ in range(PROCESSES)
            ]
            history, errors = processes.run(store_url(kind, tmp_path), prefix, shift, plans)
            assert not errors, f"a store call raised: {errors}\n{render(history, short)}"
            # Then one sequential order explains every answer, and what each identity holds after them
            history = read_back(store, history, identities)
            assert_linearizable(harness, model, timeline, history, " ; ".join(map(str, setup)) or "nothing")
    finally:
        harness.close()


# ---- the checker catches what it must -------------------------------------------------------------


class CheckThenSetClaims(MemoryStore):
    """A broken store: claim reads, sleeps, then writes (two racers both see "absent")."""

    def _claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        settled_is_free: bool,
    ) -> Any:
        if self.get(identity) is None:
            time.sleep(0.05)
            with self._lock:
                self._by_identity.pop(identity, None)
        return super()._claim(identity, fingerprint, task_id, owner, lease, ttl, call, settled_is_free)


def test_the_checker_rejects_a_check_then_set_claim() -> None:
    identity = IDENTITIES[0]
    for _ in range(5):  # the race needs the racers to read before any writes: nearly always at once
        store = CheckThenSetClaims()
        timeline = Timeline(store.now(), frozenset(OWNERS))
        # Given racers that each claimed the same free identity
        history = concurrent_history(store, racing_claims(identity), (identity,))
        if sum(c.answer.decision.value == "NEW" for c in history if c.thread >= 0) < 2:
            continue
        # When the history is checked, Then it is not linearizable (two claims both won)
        with pytest.raises(pytest.fail.Exception, match="no sequential order explains"):
            assert_linearizable(Harness("memory", store), Model(), timeline, history, "nothing")
        return
    pytest.fail("the racers never overlapped in 5 tries")


def test_the_checker_accepts_the_atomic_claim() -> None:
    identity = IDENTITIES[0]
    store = MemoryStore()
    history = concurrent_history(store, racing_claims(identity), (identity,))
    assert sum(c.answer.decision.value == "NEW" for c in history if c.thread >= 0) == 1
    assert_linearizable(Harness("memory", store), Model(), Timeline(store.now(), frozenset(OWNERS)), history, "-")


def racing_claims(identity: Identity) -> list[list[Op]]:
    return [
        [op("claim", identity, "fp-a", TASK_IDS[n], pending_seconds=LEASES[0], ttl_seconds=TTLS[0], owner=OWNERS[n])]
        for n in range(THREADS)
    ]


def test_the_checker_keeps_real_time_order() -> None:
    # Given a claim that returned NEW, and a read invoked only after it returned that saw nothing
    identity = IDENTITIES[0]
    timeline = Timeline(0.0, frozenset(OWNERS))
    claimed = Model()
    answer = claimed.claim(identity, "fp-a", "task-1", pending_seconds=LEASES[0], ttl_seconds=TTLS[0], owner="owner-1")
    history = [
        Call(
            0,
            op("claim", identity, "fp-a", "task-1", pending_seconds=LEASES[0], ttl_seconds=TTLS[0], owner="owner-1"),
            0.0,
            1.0,
            answer,
        ),
        Call(1, op("get", identity), 2.0, 3.0, None),
    ]

    def agree(call: Op, expected: Any, actual: Any) -> bool:
        return not problems(call, expected, actual, timeline, "exact")

    # Then no order explains it; yet had the read overlapped the claim, reading first would
    assert linearize(history, Model(), perform, agree) is None  # type: ignore[arg-type]
    history[1].start = 0.5
    assert [c.op.name for c in linearize(history, Model(), perform, agree) or []] == ["get", "claim"]  # type: ignore[arg-type]
