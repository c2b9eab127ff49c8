"""Every row of the DESIGN §3 table, on every store (memory, sqlite, redis, postgresql, mariadb, and
the django:// store on PostgreSQL, MariaDB and SQLite).

Time moves through the injected fake clock; no test here sleeps.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import DJANGO_KINDS, STORE_KINDS, make_store, wipe

from celery_idem.records import Decision, ErrorInfo, Identity, State, Transition
from celery_idem.stores import Store


@pytest.fixture(params=(*STORE_KINDS, *DJANGO_KINDS))
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store, and the django:// store (the SQL store on each database of Django's settings)."""
    return str(request.param)


ID = Identity("", "shop.charge", "order-42")
FP, OTHER_FP = "a" * 64, "b" * 64
PENDING_S, LEASE_S, TTL_S = 60.0, 30.0, 600.0
RESULT = b'{"charged":100}'


def claim(store: Store, fp: str = FP, task_id: str = "task-1", identity: Identity = ID) -> Transition:
    return store.claim(identity, fp, task_id, pending_seconds=PENDING_S, ttl_seconds=TTL_S)


def acquire(
    store: Store, fp: str = FP, task_id: str = "task-1", identity: Identity = ID, *, retry: bool = False
) -> Transition:
    return store.acquire(identity, fp, task_id, lease_seconds=LEASE_S, ttl_seconds=TTL_S, retry=retry)


def running(store: Store, fp: str = FP, task_id: str = "task-1") -> str:
    """Claim and acquire; returns the running attempt's owner token."""
    assert claim(store, fp, task_id).decision is Decision.NEW
    taken = acquire(store, fp, task_id)
    assert taken.decision is Decision.RUN and taken.record is not None
    return taken.record.owner


def settle(store: Store, state: State, fp: str = FP) -> None:
    owner = running(store, fp)
    if state is State.COMPLETED:
        assert store.complete(ID, owner, RESULT).ok
    else:
        assert store.fail(ID, owner, ErrorInfo(type="CardDeclined", module="shop", message="no", args=["no"])).ok


def snapshot(store: Store) -> dict[str, object] | None:
    record = store.get(ID)
    return None if record is None else record.model_dump()


# ---- claim ------------------------------------------------------------------------------------


def test_claim_on_nothing_is_new_and_writes_pending_with_pending_lease(store: Store, clock) -> None:
    t = claim(store)
    assert t.decision is Decision.NEW
    assert t.record is not None
    assert t.record.state is State.PENDING
    assert t.record.task_id == "task-1"
    assert t.record.fingerprint == FP
    assert t.record.lease_expires_at == pytest.approx(clock() + PENDING_S, abs=1e-3)
    assert store.get(ID) == t.record


@pytest.mark.parametrize("state", [State.PENDING, State.IN_PROGRESS])
def test_claim_while_live_is_duplicate_with_original_task_id_and_changes_nothing(store: Store, state: State) -> None:
    assert claim(store, task_id="task-1").decision is Decision.NEW
    if state is State.IN_PROGRESS:
        assert acquire(store).decision is Decision.RUN
    before = snapshot(store)
    t = claim(store, task_id="task-2")
    assert t.decision is Decision.DUPLICATE
    assert t.record is not None and t.record.task_id == "task-1"
    assert snapshot(store) == before


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED])
def test_claim_after_outcome_replays_it(store: Store, state: State) -> None:
    settle(store, state)
    t = claim(store, task_id="task-2")
    assert t.decision is Decision.REPLAY
    assert t.record is not None and t.record.state is state and t.record.task_id == "task-1"
    if state is State.COMPLETED:
        assert t.record.result == RESULT
        assert t.record.content_type == "application/json"
    else:
        assert t.record.error is not None and t.record.error.type == "CardDeclined"
        assert t.record.error.args == ["no"]


@pytest.mark.parametrize("state", [State.PENDING, State.IN_PROGRESS, State.COMPLETED, State.FAILED])
def test_claim_with_other_fingerprint_is_mismatch_in_every_state(store: Store, state: State) -> None:
    if state is State.PENDING:
        claim(store)
    elif state is State.IN_PROGRESS:
        running(store)
    else:
        settle(store, state)
    before = snapshot(store)
    assert claim(store, fp=OTHER_FP, task_id="task-2").decision is Decision.MISMATCH
    assert snapshot(store) == before


def test_claim_with_other_fingerprint_is_mismatch_even_past_the_lease(store: Store, clock) -> None:
    claim(store)
    clock.advance(PENDING_S + 1)
    assert claim(store, fp=OTHER_FP, task_id="task-2").decision is Decision.MISMATCH


def test_claim_past_pending_lease_takes_over_with_new_task_id(store: Store, clock) -> None:
    first = claim(store, task_id="task-1")
    assert first.record is not None
    clock.advance(PENDING_S + 1)
    t = claim(store, task_id="task-2")
    assert t.decision is Decision.NEW
    assert t.record is not None and t.record.task_id == "task-2" and t.record.owner != first.record.owner


def test_claim_past_in_progress_lease_takes_over_and_fences_the_old_attempt(store: Store, clock) -> None:
    old_owner = running(store)
    clock.advance(LEASE_S + 1)
    t = claim(store, task_id="task-2")
    assert t.decision is Decision.NEW
    assert store.complete(ID, old_owner, RESULT).decision is Decision.LOST
    record = store.get(ID)
    assert record is not None and record.state is State.PENDING and record.task_id == "task-2"


def test_claim_after_ttl_is_free_for_a_new_payload(store: Store, clock) -> None:
    settle(store, State.COMPLETED)
    clock.advance(TTL_S + 1)
    assert store.get(ID) is None
    t = claim(store, fp=OTHER_FP, task_id="task-9")
    assert t.decision is Decision.NEW
    assert t.record is not None and t.record.result is None and t.record.fingerprint == OTHER_FP


def free_claim(store: Store, fp: str = FP, task_id: str = "task-2") -> Transition:
    """A claim of a mode that keeps no outcome for new calls (``until_done``)."""
    return store.claim(ID, fp, task_id, pending_seconds=PENDING_S, ttl_seconds=TTL_S, settled_is_free=True)


@pytest.mark.parametrize("fp", [FP, OTHER_FP])
@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED])
def test_a_claim_to_which_settled_is_free_takes_a_settled_record_whatever_its_arguments(
    store: Store, clock, state: State, fp: str
) -> None:
    # Given a settled record (kept for its run's own messages)
    settle(store, state)
    # When a new call's claim of a mode that keeps no outcome comes
    t = free_claim(store, fp=fp)
    # Then it takes the key: a fresh PENDING record of its own, nothing of the ended run's outcome
    assert t.decision is Decision.NEW
    assert t.record is not None and t.record.task_id == "task-2" and t.record.fingerprint == fp
    record = store.get(ID)
    assert record is not None and record.state is State.PENDING and record.task_id == "task-2"
    assert record.result is None and record.error is None and record.attempt == 0
    assert record.lease_expires_at == pytest.approx(clock() + PENDING_S, abs=1e-3)
    # and a later claim of the same kind is a duplicate of it while it is live
    assert free_claim(store, task_id="task-3").decision is (Decision.DUPLICATE if fp == FP else Decision.MISMATCH)


@pytest.mark.parametrize("state", [State.PENDING, State.IN_PROGRESS])
def test_a_claim_to_which_settled_is_free_still_meets_a_live_record(store: Store, state: State) -> None:
    if state is State.PENDING:
        claim(store)
    else:
        running(store)
    before = snapshot(store)
    assert free_claim(store).decision is Decision.DUPLICATE
    assert free_claim(store, fp=OTHER_FP).decision is Decision.MISMATCH
    assert snapshot(store) == before


# ---- acquire ----------------------------------------------------------------------------------


def test_acquire_on_nothing_runs(store: Store, clock) -> None:
    # Given a message sent by name (no claim at publish)
    t = acquire(store, task_id="sent-by-name")
    assert t.decision is Decision.RUN
    assert t.record is not None
    assert t.record.state is State.IN_PROGRESS and t.record.attempt == 1
    assert t.record.lease_expires_at == pytest.approx(clock() + LEASE_S, abs=1e-3)


def test_acquire_on_pending_runs_under_a_fresh_owner(store: Store) -> None:
    claimed = claim(store)
    t = acquire(store)
    assert t.decision is Decision.RUN
    assert t.record is not None and claimed.record is not None
    assert t.record.owner != claimed.record.owner and t.record.attempt == 1


def test_acquire_on_pending_of_another_task_id_runs_and_records_the_runner(store: Store) -> None:
    # Given the claim's message is still queued when a send_task duplicate reaches a worker
    claim(store, task_id="task-1")
    t = acquire(store, task_id="task-by-name")
    assert t.decision is Decision.RUN
    assert t.record is not None and t.record.task_id == "task-by-name"


def test_acquire_while_lease_is_live_is_busy(store: Store) -> None:
    running(store)
    before = snapshot(store)
    t = acquire(store, task_id="redelivered")
    assert t.decision is Decision.BUSY
    assert snapshot(store) == before


def test_a_busy_answer_keeps_the_outcome_until_the_waiters_next_look(store: Store, clock) -> None:
    # Given an attempt running under a 5 s TTL
    short = 5.0
    taken = store.acquire(ID, FP, "task-1", lease_seconds=LEASE_S, ttl_seconds=short)
    assert taken.decision is Decision.RUN and taken.record is not None
    before = snapshot(store)
    # When a duplicate is told BUSY and says it looks again within 100 s (and another within 10 s)
    for look in (100.0, 10.0):
        busy = store.acquire(ID, FP, "task-2", lease_seconds=LEASE_S, ttl_seconds=short, next_look_seconds=look)
        assert busy.decision is Decision.BUSY
    assert snapshot(store) == before  # nothing a reader sees changed
    clock.advance(10)
    assert store.complete(ID, taken.record.owner, RESULT).ok
    # Then the outcome lives until the latest promised look, past its TTL, and then goes
    record = store.get(ID)
    assert record is not None and record.expires_at == pytest.approx(clock() + 90, abs=0.01)
    clock.advance(89)
    again = store.acquire(ID, FP, "task-2", lease_seconds=LEASE_S, ttl_seconds=short)
    assert again.decision is Decision.REPLAY
    clock.advance(2)
    assert store.get(ID) is None


def test_a_waiters_mark_outlives_a_takeover_but_not_the_record(store: Store, clock) -> None:
    short = 5.0
    first = store.acquire(ID, FP, "task-1", lease_seconds=LEASE_S, ttl_seconds=short)
    assert first.decision is Decision.RUN
    busy = store.acquire(ID, FP, "task-2", lease_seconds=LEASE_S, ttl_seconds=short, next_look_seconds=200)
    assert busy.decision is Decision.BUSY
    # Given the attempt's lease ran out and another attempt took the record over and settled it
    clock.advance(LEASE_S + 1)
    takeover = store.acquire(ID, FP, "task-3", lease_seconds=LEASE_S, ttl_seconds=short)
    assert takeover.decision is Decision.RUN and takeover.record is not None
    assert store.complete(ID, takeover.record.owner, RESULT).ok
    # Then the waiter's mark still holds the outcome for its look
    record = store.get(ID)
    assert record is not None and record.expires_at == pytest.approx(clock() + 200 - LEASE_S - 1, abs=0.01)
    # And a record that went (forgotten) comes back without it: its outcome lives its TTL
    assert store.forget(ID)
    fresh = store.acquire(ID, FP, "task-4", lease_seconds=LEASE_S, ttl_seconds=short)
    assert fresh.decision is Decision.RUN and fresh.record is not None
    assert store.complete(ID, fresh.record.owner, RESULT).ok
    record = store.get(ID)
    assert record is not None and record.expires_at == pytest.approx(clock() + short, abs=0.01)


def test_acquire_refuses_a_next_look_that_is_negative_or_infinite(store: Store) -> None:
    for look in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="next_look_seconds"):
            store.acquire(ID, FP, "task-1", lease_seconds=LEASE_S, ttl_seconds=TTL_S, next_look_seconds=look)
    assert store.get(ID) is None


def test_acquire_past_the_lease_runs_again_and_counts_the_attempt(store: Store, clock) -> None:
    old_owner = running(store)
    clock.advance(LEASE_S + 1)
    t = acquire(store, task_id="task-1")
    assert t.decision is Decision.RUN
    assert t.record is not None and t.record.attempt == 2 and t.record.owner != old_owner


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED])
def test_acquire_after_outcome_replays(store: Store, state: State) -> None:
    settle(store, state)
    t = acquire(store, task_id="redelivered")
    assert t.decision is Decision.REPLAY
    assert t.record is not None and t.record.state is state


@pytest.mark.parametrize("state", [State.PENDING, State.IN_PROGRESS, State.COMPLETED])
def test_acquire_with_other_fingerprint_and_task_id_is_mismatch_and_untouched(store: Store, state: State) -> None:
    if state is State.PENDING:
        claim(store)
    elif state is State.IN_PROGRESS:
        running(store)
    else:
        settle(store, state)
    before = snapshot(store)
    assert acquire(store, fp=OTHER_FP, task_id="task-2").decision is Decision.MISMATCH
    assert snapshot(store) == before


def test_acquire_of_a_retry_with_changed_arguments_runs_and_keeps_the_callers_fingerprint(store: Store) -> None:
    # Given the first attempt released its claim for a Celery retry (same task id)
    owner = running(store, task_id="task-1")
    assert store.release(ID, owner, pending_seconds=PENDING_S).ok
    # When the retry arrives with other arguments
    t = acquire(store, fp=OTHER_FP, task_id="task-1", retry=True)
    # Then it runs, and the record still answers to the caller's call
    assert t.decision is Decision.RUN
    assert t.record is not None and t.record.fingerprint == FP and t.record.attempt == 2


@pytest.mark.parametrize("state", ["pending", "running", "released", "completed"])
def test_acquire_under_the_records_task_id_with_other_arguments_is_a_mismatch_unless_a_retry(
    store: Store, state: str
) -> None:
    # Given a record under task-1 (claimed, running, released for a retry, or settled)
    if state == "pending":
        assert store.claim(ID, FP, "task-1", pending_seconds=PENDING_S, ttl_seconds=TTL_S).decision is Decision.NEW
    else:
        owner = running(store, task_id="task-1")
        if state == "released":
            assert store.release(ID, owner, pending_seconds=PENDING_S).ok
        elif state == "completed":
            assert store.complete(ID, owner, RESULT).ok
    before = snapshot(store)
    # When a message under task-1 with other arguments comes that is no Celery retry (a send_task
    # with a chosen task id, a forged copy)
    t = acquire(store, fp=OTHER_FP, task_id="task-1")
    # Then it is refused and the record is untouched: only a retry is the same attempt chain
    assert t.decision is Decision.MISMATCH
    assert snapshot(store) == before


def test_a_retry_before_any_attempt_ran_is_no_attempt_chain(store: Store) -> None:
    # Given a call only claimed (its message still queued): no attempt ran, so no retry can exist
    assert store.claim(ID, FP, "task-1", pending_seconds=PENDING_S, ttl_seconds=TTL_S).decision is Decision.NEW
    before = snapshot(store)
    # When a message under its task id with other arguments says it is a retry (retries=1 is a field
    # any producer can set)
    t = acquire(store, fp=OTHER_FP, task_id="task-1", retry=True)
    # Then it is refused, and the record is untouched
    assert t.decision is Decision.MISMATCH
    assert snapshot(store) == before


# ---- complete / fail --------------------------------------------------------------------------


def test_complete_with_my_token_stores_the_result_with_ttl_from_now(store: Store, clock) -> None:
    owner = running(store)
    clock.advance(5)
    assert store.complete(ID, owner, RESULT, content_type="application/json", content_encoding="utf-8").ok
    record = store.get(ID)
    assert record is not None
    assert record.state is State.COMPLETED and record.result == RESULT
    assert record.lease_expires_at is None
    assert record.expires_at == pytest.approx(clock() + TTL_S, abs=1e-3)


@pytest.mark.parametrize(
    ("content_type", "content_encoding"),
    [("application/json", "utf-8"), ("", ""), ("application/x-msgpack", "binary"), ("application/json", "")],
)
def test_a_result_reads_back_with_exactly_the_content_type_and_encoding_it_was_stored_with(
    store: Store, content_type: str, content_encoding: str
) -> None:
    # A store that keeps the common ones short must still tell them from every other (an empty
    # content type is refused by the safe decoder; read as JSON, it would be decoded)
    owner = running(store)
    assert store.complete(ID, owner, b"", content_type=content_type, content_encoding=content_encoding).ok
    record = store.get(ID)
    assert record is not None and record.result == b""
    assert (record.content_type, record.content_encoding) == (content_type, content_encoding)


def test_fail_with_my_token_stores_the_error(store: Store) -> None:
    owner = running(store)
    error = ErrorInfo(type="CardDeclined", module="shop.errors", message="card declined", args=["card declined", 402])
    assert store.fail(ID, owner, error).ok
    record = store.get(ID)
    assert record is not None and record.state is State.FAILED and record.error == error and record.result is None


def test_complete_and_fail_with_a_wrong_token_are_lost_and_change_nothing(store: Store) -> None:
    running(store)
    before = snapshot(store)
    assert store.complete(ID, "not-my-token", RESULT).decision is Decision.LOST
    assert store.fail(ID, "not-my-token", ErrorInfo(type="E", module="m", message="")).decision is Decision.LOST
    assert snapshot(store) == before


def test_complete_after_settled_or_absent_is_lost(store: Store) -> None:
    assert store.complete(ID, "anyone", RESULT).decision is Decision.LOST
    owner = running(store)
    assert store.complete(ID, owner, RESULT).ok
    assert store.complete(ID, owner, b'"second"').decision is Decision.LOST
    record = store.get(ID)
    assert record is not None and record.result == RESULT


def test_complete_and_fail_are_fenced_by_the_owner_token_alone(store: Store) -> None:
    # Only the attempt that acquired may store an outcome: the task id (which every copy of the
    # task carries) is not a fence for complete or fail.
    owner = running(store, task_id="task-1")
    assert store.complete(ID, "task-1", RESULT).decision is Decision.LOST
    assert store.fail(ID, "task-1", ErrorInfo(type="X", module="m", message="", args=[])).decision is Decision.LOST
    assert store.complete(ID, owner, RESULT).ok


def test_complete_after_lease_expiry_still_wins_when_nobody_took_over(store: Store, clock) -> None:
    # The token is the fence, not the clock: no other attempt ran, so the outcome is good.
    owner = running(store)
    clock.advance(LEASE_S + 1)
    assert store.complete(ID, owner, RESULT).ok


# ---- release / renew --------------------------------------------------------------------------


def test_release_to_pending_keeps_the_identity_for_the_queued_retry(store: Store, clock) -> None:
    owner = running(store)
    assert store.release(ID, owner, pending_seconds=PENDING_S).ok
    record = store.get(ID)
    assert record is not None
    assert record.state is State.PENDING and record.owner != owner and record.task_id == "task-1"
    assert record.lease_expires_at == pytest.approx(clock() + PENDING_S, abs=1e-3)
    # the released attempt can no longer write
    assert store.complete(ID, owner, RESULT).decision is Decision.LOST


def test_release_without_retry_deletes_the_record(store: Store) -> None:
    owner = running(store)
    assert store.release(ID, owner).ok
    assert store.get(ID) is None
    assert claim(store, fp=OTHER_FP, task_id="task-2").decision is Decision.NEW


def test_release_of_a_pending_claim_by_its_claimant(store: Store) -> None:
    # A failed publish gives the claim back before re-raising the broker's error.
    t = claim(store)
    assert t.record is not None
    assert store.release(ID, t.record.owner).ok
    assert store.get(ID) is None


def test_release_with_wrong_token_or_settled_is_lost(store: Store) -> None:
    owner = running(store)
    assert store.release(ID, "not-mine").decision is Decision.LOST
    assert store.complete(ID, owner, RESULT).ok
    assert store.release(ID, owner).decision is Decision.LOST
    assert store.get(ID) is not None


def test_release_expired_only_spares_a_live_lease(store: Store, clock) -> None:
    owner = running(store)
    assert store.release(ID, owner, expired_only=True).decision is Decision.LOST
    clock.advance(LEASE_S + 1)
    assert store.release(ID, owner, expired_only=True).ok
    assert store.get(ID) is None


def test_release_by_task_id_frees_a_pending_claim_of_that_task_only(store: Store) -> None:
    # The parent-process hooks (revoke, hard kill) have no owner token, only the task id.
    claim(store, task_id="task-1")
    assert store.release(ID, "task-other", fence="task_id").decision is Decision.LOST
    assert store.release(ID, "task-1", fence="task_id").ok
    assert store.get(ID) is None


def test_release_by_task_id_never_frees_a_live_attempt_of_that_task(store: Store, clock) -> None:
    # Given task-1 running with a live lease (a copy of it may be revoked or expire elsewhere)
    owner = running(store, task_id="task-1")
    before = snapshot(store)
    # When a release fenced by the task id comes in, Then it is LOST and the attempt keeps its record
    assert store.release(ID, "task-1", fence="task_id").decision is Decision.LOST
    assert store.release(ID, "task-1", fence="task_id", pending_seconds=PENDING_S).decision is Decision.LOST
    assert snapshot(store) == before
    assert store.complete(ID, owner, RESULT).ok


def test_release_by_task_id_frees_an_attempt_once_its_lease_ran_out(store: Store, clock) -> None:
    running(store, task_id="task-1")
    clock.advance(LEASE_S + 1)  # its process died: no heartbeat renewed it
    assert store.release(ID, "task-1", fence="task_id").ok
    assert store.get(ID) is None


def test_renew_extends_the_lease(store: Store, clock) -> None:
    owner = running(store)
    clock.advance(LEASE_S - 1)
    assert store.renew(ID, owner, lease_seconds=LEASE_S).ok
    clock.advance(LEASE_S - 1)
    # still ours: a second worker finds it busy
    assert acquire(store, task_id="redelivered").decision is Decision.BUSY
    record = store.get(ID)
    assert record is not None and record.lease_expires_at == pytest.approx(clock() + 1, abs=1e-3)


def test_renew_never_shortens_a_lease(store: Store, clock) -> None:
    # Given an attempt that stretched its lease to an hour (as replace() does)
    owner = running(store)
    assert store.renew(ID, owner, lease_seconds=3600).ok
    # When a heartbeat beat that was already in flight lands late with the usual lease
    assert store.renew(ID, owner, lease_seconds=LEASE_S).ok
    # Then the hour stands: past the short lease the record is still busy
    clock.advance(LEASE_S + 1)
    assert acquire(store, task_id="redelivered").decision is Decision.BUSY
    record = store.get(ID)
    assert record is not None and record.lease_expires_at == pytest.approx(clock() - LEASE_S - 1 + 3600, abs=1e-3)


def test_renew_of_a_pending_claim_or_wrong_token_is_lost(store: Store) -> None:
    t = claim(store)
    assert t.record is not None
    assert store.renew(ID, t.record.owner, lease_seconds=LEASE_S).decision is Decision.LOST
    acquire(store)
    assert store.renew(ID, "not-mine", lease_seconds=LEASE_S).decision is Decision.LOST


def test_hand_over_passes_the_record_to_the_new_token_with_exactly_its_lease(store: Store, clock) -> None:
    # Given a running attempt, handed over (as replace() does) with an hour for its replacement
    owner = running(store)
    assert store.hand_over(ID, owner, "handover", lease_seconds=3600).ok
    record = store.get(ID)
    assert record is not None and record.state is State.IN_PROGRESS and record.owner == "handover"
    assert record.task_id == "task-1" and record.lease_expires_at == pytest.approx(clock() + 3600, abs=1e-3)
    # Then the old token can write nothing, and a copy of the task id without the token is busy
    assert store.renew(ID, owner, lease_seconds=LEASE_S).decision is Decision.LOST
    assert store.complete(ID, owner, RESULT).decision is Decision.LOST
    assert store.hand_over(ID, owner, "again", lease_seconds=LEASE_S).decision is Decision.LOST
    assert acquire(store).decision is Decision.BUSY
    # When the replacement takes it under its own token, its lease is its own (shorter) one
    assert store.hand_over(ID, "handover", "replacement", lease_seconds=LEASE_S).ok
    record = store.get(ID)
    assert record is not None and record.owner == "replacement"
    assert record.lease_expires_at == pytest.approx(clock() + LEASE_S, abs=1e-3)
    # and a second copy of the replacement's message, with the same token, is LOST
    assert store.hand_over(ID, "handover", "copy", lease_seconds=LEASE_S).decision is Decision.LOST
    assert store.complete(ID, "replacement", RESULT).ok


def test_hand_over_of_a_claim_or_a_settled_record_is_lost(store: Store) -> None:
    t = claim(store)
    assert t.record is not None
    assert store.hand_over(ID, t.record.owner, "x", lease_seconds=LEASE_S).decision is Decision.LOST
    owner = acquire(store).record.owner  # type: ignore[union-attr]
    assert store.complete(ID, owner, RESULT).ok
    assert store.hand_over(ID, owner, "x", lease_seconds=LEASE_S).decision is Decision.LOST


# ---- fencing after a takeover -----------------------------------------------------------------


def test_a_stale_owner_after_takeover_can_write_nothing(store: Store, clock) -> None:
    # Given attempt A ran past its lease and attempt B took over
    stale = running(store)
    clock.advance(LEASE_S + 1)
    fresh = acquire(store)
    assert fresh.decision is Decision.RUN and fresh.record is not None
    before = snapshot(store)
    # When A comes back, every write it tries is LOST
    assert store.complete(ID, stale, RESULT).decision is Decision.LOST
    assert store.fail(ID, stale, ErrorInfo(type="E", module="m", message="")).decision is Decision.LOST
    assert store.release(ID, stale).decision is Decision.LOST
    assert store.release(ID, stale, pending_seconds=PENDING_S).decision is Decision.LOST
    assert store.renew(ID, stale, lease_seconds=LEASE_S).decision is Decision.LOST
    # Then nothing changed, and B still owns the record
    assert snapshot(store) == before
    assert store.complete(ID, fresh.record.owner, RESULT).ok


# ---- get / forget / TTL ------------------------------------------------------------------------


@pytest.mark.parametrize("state", [State.PENDING, State.IN_PROGRESS, State.COMPLETED, State.FAILED])
def test_forget_removes_the_record_in_any_state(store: Store, state: State) -> None:
    if state is State.PENDING:
        claim(store)
    elif state is State.IN_PROGRESS:
        running(store)
    else:
        settle(store, state)
    assert store.forget(ID) is True
    assert store.get(ID) is None
    assert store.forget(ID) is False


def test_forget_fences_out_a_running_attempt(store: Store) -> None:
    owner = running(store)
    store.forget(ID)
    assert store.complete(ID, owner, RESULT).decision is Decision.LOST
    assert store.get(ID) is None


def test_settled_record_expires_after_its_ttl(store: Store, clock) -> None:
    settle(store, State.COMPLETED)
    clock.advance(TTL_S - 1)
    assert store.get(ID) is not None
    clock.advance(2)
    assert store.get(ID) is None
    assert store.forget(ID) is False


def test_abandoned_attempt_is_collected_ttl_after_its_lease(store: Store, clock) -> None:
    running(store)
    clock.advance(LEASE_S + TTL_S - 1)
    assert store.get(ID) is not None
    clock.advance(2)
    assert store.get(ID) is None


def test_identity_parts_are_separate_records(store: Store) -> None:
    # Scope, task name and key each make a different identity, even where a naive join would collide.
    identities = [
        Identity("", "a", "b:c"),
        Identity("", "a:b", "c"),
        Identity("a", "b", "c"),
        Identity("tenant-1", "shop.charge", "order-42"),
        Identity("tenant-2", "shop.charge", "order-42"),
    ]
    for n, identity in enumerate(identities):
        assert claim(store, task_id=f"task-{n}", identity=identity).decision is Decision.NEW
    for n, identity in enumerate(identities):
        record = store.get(identity)
        assert record is not None and record.task_id == f"task-{n}" and record.identity == identity


# ---- the reconciler's query --------------------------------------------------------------------


def test_expired_leases_lists_only_stale_unsettled_records_oldest_first(store: Store, clock) -> None:
    ids = [Identity("", "shop.charge", f"order-{n}") for n in range(6)]
    # order-0: claimed first, so its pending lease runs out first
    store.claim(ids[0], FP, "t0", pending_seconds=10, ttl_seconds=TTL_S)
    store.claim(ids[1], FP, "t1", pending_seconds=20, ttl_seconds=TTL_S)
    store.acquire(ids[2], FP, "t2", lease_seconds=15, ttl_seconds=TTL_S)  # running, lease 15
    store.claim(ids[3], FP, "t3", pending_seconds=1000, ttl_seconds=TTL_S)  # live
    done = store.acquire(ids[4], FP, "t4", lease_seconds=5, ttl_seconds=TTL_S)
    assert done.record is not None
    store.complete(ids[4], done.record.owner, RESULT)  # settled: never stale
    store.acquire(ids[5], FP, "t5", lease_seconds=5, ttl_seconds=TTL_S)
    store.forget(ids[5])  # forgotten: never listed
    clock.advance(25)
    stale = store.expired_leases(limit=10)
    assert [r.key for r in stale] == ["order-0", "order-2", "order-1"]
    assert [r.key for r in store.expired_leases(limit=2)] == ["order-0", "order-2"]


def test_expired_leases_rejects_a_zero_limit(store: Store) -> None:
    with pytest.raises(ValueError, match="limit must be at least 1"):
        store.expired_leases(limit=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.claim(ID, FP, "t", pending_seconds=0, ttl_seconds=TTL_S), "pending_seconds must be a positive"),
        (lambda s: s.claim(ID, FP, "t", pending_seconds=PENDING_S, ttl_seconds=-1), "ttl_seconds must be a positive"),
        (lambda s: s.acquire(ID, FP, "t", lease_seconds=0, ttl_seconds=TTL_S), "lease_seconds must be a positive"),
        (lambda s: s.renew(ID, "o", lease_seconds=float("nan")), "lease_seconds must be a positive"),
        # "forever" is not a duration: Redis refused it only once the script ran (an "unexpected" outage)
        (lambda s: s.claim(ID, FP, "t", pending_seconds=PENDING_S, ttl_seconds=float("inf")), "ttl_seconds must be"),
        (lambda s: s.claim(ID, FP, "t", pending_seconds=float("inf"), ttl_seconds=TTL_S), "pending_seconds must be"),
        (lambda s: s.acquire(ID, FP, "t", lease_seconds=float("inf"), ttl_seconds=TTL_S), "lease_seconds must be"),
    ],
)
def test_non_positive_durations_are_refused_before_touching_the_store(store: Store, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(store)
    assert store.get(ID) is None


# ---- the kept call, and the operators' queries ---------------------------------------------------


def test_a_kept_call_survives_acquire_and_is_dropped_by_nothing_but_a_new_call(store: Store) -> None:
    call = b'{"args":[42,100],"kwargs":{}}'
    claimed = store.claim(ID, FP, "task-1", pending_seconds=PENDING_S, ttl_seconds=TTL_S, call=call)
    assert claimed.decision is Decision.NEW
    assert store.get(ID).call == call
    store.acquire(ID, FP, "task-1", lease_seconds=LEASE_S, ttl_seconds=TTL_S)  # no call given: the claim's stays
    assert store.get(ID).call == call
    other = Identity("", "shop.charge", "other")
    store.acquire(other, FP, "task-2", lease_seconds=LEASE_S, ttl_seconds=TTL_S, call=b"[1]")
    assert store.get(other).call == b"[1]"
    assert store.get(Identity("", "shop.charge", "none")) is None


def test_acquire_answers_the_record_as_stored_including_the_claims_kept_call(store: Store) -> None:
    # Found by the model test (tests/models/test_model_stores.py): Redis and SQL answered a run with the
    # call they were sent (None), while the record they stored kept the claim's call.
    call = b'{"args":[42,100],"kwargs":{}}'
    store.claim(ID, FP, "task-1", pending_seconds=PENDING_S, ttl_seconds=TTL_S, call=call)
    taken = store.acquire(ID, FP, "task-1", lease_seconds=LEASE_S, ttl_seconds=TTL_S)
    assert taken.decision is Decision.RUN and taken.record is not None
    assert taken.record.call == call
    assert taken.record == store.get(ID)


def test_records_filters_by_state_and_task_newest_first(store: Store, clock) -> None:
    for n in range(3):
        store.claim(Identity("", "shop.charge", f"p{n}"), FP, f"t{n}", pending_seconds=PENDING_S, ttl_seconds=TTL_S)
        clock.advance(1)
    running_record = store.acquire(
        Identity("", "shop.refund", "r0"), FP, "t9", lease_seconds=LEASE_S, ttl_seconds=TTL_S
    )
    assert running_record.record is not None
    pending = store.records(state=State.PENDING)
    assert [r.key for r in pending] == ["p2", "p1", "p0"]
    assert [r.key for r in store.records(task_name="shop.refund")] == ["r0"]
    assert len(store.records(limit=2)) == 2
    assert store.records(state=State.COMPLETED) == []
    with pytest.raises(ValueError, match="limit must be at least 1"):
        store.records(limit=0)


def test_count_by_state_counts_live_records(store: Store, clock) -> None:
    claim(store)
    settle_id = Identity("", "shop.charge", "done")
    t = store.acquire(settle_id, FP, "t2", lease_seconds=LEASE_S, ttl_seconds=5)
    assert t.record is not None
    store.complete(settle_id, t.record.owner, RESULT)
    assert store.count_by_state() == {State.PENDING: 1, State.IN_PROGRESS: 0, State.COMPLETED: 1, State.FAILED: 0}
    clock.advance(6)  # the completed record's ttl ran out
    assert store.count_by_state()[State.COMPLETED] == 0


def test_count_by_task_counts_live_records_of_each_task_in_each_state(store: Store, clock) -> None:
    claim(store)  # shop.charge, PENDING
    other = Identity("", "shop.refund", "r1")
    t = store.acquire(other, FP, "t2", lease_seconds=LEASE_S, ttl_seconds=5)
    assert t.record is not None
    store.complete(other, t.record.owner, RESULT)
    assert store.count_by_task() == {
        "shop.charge": {State.PENDING: 1, State.IN_PROGRESS: 0, State.COMPLETED: 0, State.FAILED: 0},
        "shop.refund": {State.PENDING: 0, State.IN_PROGRESS: 0, State.COMPLETED: 1, State.FAILED: 0},
    }
    clock.advance(6)  # the completed record's ttl ran out
    assert list(store.count_by_task()) == ["shop.charge"]


def test_purge_expired_frees_records_past_their_ttl_and_nothing_else(store: Store, clock) -> None:
    settle(store, State.COMPLETED)  # ttl TTL_S from now
    live = Identity("", "shop.charge", "live")
    store.claim(live, FP, "t2", pending_seconds=PENDING_S, ttl_seconds=TTL_S * 10)
    clock.advance(TTL_S + 1)
    purged = store.purge_expired(limit=10)
    # Redis expires keys itself; the other stores delete what is past its TTL.
    assert purged == (0 if type(store).__name__ == "RedisStore" else 1)
    assert store.get(ID) is None and store.get(live) is not None
    assert store.purge_expired(limit=10) == 0
    with pytest.raises(ValueError, match="limit must be at least 1"):
        store.purge_expired(limit=0)


# ---- the server's clock, and what each app sees ----------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "redis", "postgresql", "mariadb"])
def test_a_client_clock_a_lease_ahead_never_takes_over_a_live_lease(kind: str, tmp_path, prefix: str) -> None:
    # Given a store on its server's clock (no injected clock) and an attempt running with a live lease
    store = make_store(kind, tmp_path, prefix)
    ahead = make_store(kind, tmp_path, prefix)
    try:
        owner = running(store)
        # When a worker whose own clock runs an hour ahead asks (the clock the store would read)
        ahead.clock = lambda: time.time() + 3600
        # Then every lease decision is the server's: BUSY, DUPLICATE, nothing stale, nothing freed
        assert acquire(ahead, task_id="task-2").decision is Decision.BUSY
        assert claim(ahead, task_id="task-3").decision is Decision.DUPLICATE
        assert ahead.release(ID, "task-1", fence="task_id").decision is Decision.LOST
        assert ahead.expired_leases() == []
        assert ahead.now() == pytest.approx(time.time(), abs=60)
        fresh = ahead.claim(Identity("", "shop.charge", "fresh"), FP, "t", pending_seconds=PENDING_S, ttl_seconds=TTL_S)
        assert fresh.record is not None and fresh.record.lease_expires_at == pytest.approx(
            time.time() + PENDING_S, abs=60
        )
        assert store.complete(ID, owner, RESULT).ok
    finally:
        wipe(ahead)
        wipe(store)


def test_each_redis_app_sees_exactly_its_own_records(tmp_path, prefix: str) -> None:
    # Prefixes that extend one another, or hold glob characters, must not see each other's records.
    prefixes = [prefix, f"{prefix}:billing", f"{prefix}:7", f"{prefix}*", f"{prefix}?x", f"{prefix}[ab]"]
    stores = [make_store("redis", tmp_path, p) for p in prefixes]
    try:
        for n, store in enumerate(stores):
            for k in range(n + 1):
                claim(store, identity=Identity("", "shop.charge", f"{n}-{k}"), task_id=f"t{n}")
        for n, store in enumerate(stores):
            assert sorted(r.key for r in store.records()) == [f"{n}-{k}" for k in range(n + 1)], prefixes[n]
            assert store.count_by_state()[State.PENDING] == n + 1, prefixes[n]
    finally:
        for n, store in enumerate(stores):
            for k in range(n + 1):
                store.forget(Identity("", "shop.charge", f"{n}-{k}"))
            store.close()


def test_a_claim_landing_right_after_the_stale_index_check_keeps_its_index_entry(
    tmp_path, prefix: str, clock, monkeypatch
) -> None:
    # Given a Redis record past its TTL whose lease-index entry is still there
    store = make_store("redis", tmp_path, prefix, clock=clock)
    try:
        claim(store)
        clock.advance(PENDING_S + TTL_S + 1)
        landed: list[Transition] = []

        def claim_once() -> None:
            if not landed:
                landed.append(claim(store, task_id="task-2"))

        # When a claim lands right after whatever read judged that entry stale (with the old
        # two-step design: between the read of the record and the removal of its index entry)
        judge = store._live
        monkeypatch.setattr(store, "_live", lambda flat: (claim_once(), judge(flat))[1])
        assert store.expired_leases() == []
        claim_once()
        assert landed[0].decision is Decision.NEW
        # Then the new claim is still indexed: once its lease runs out, the reconciler finds it
        clock.advance(PENDING_S + 1)
        assert [r.task_id for r in store.expired_leases()] == ["task-2"]
    finally:
        wipe(store)


def test_acquire_of_an_expired_record_never_inherits_its_call(store: Store, clock) -> None:
    # Given a claim that kept its call for requeue and then lived past its TTL (absent, maybe still stored)
    store.claim(ID, OTHER_FP, "task-old", pending_seconds=5, ttl_seconds=5, call=b'{"args":[666]}')
    clock.advance(100)
    # When another call acquires the identity without a call of its own
    taken = store.acquire(ID, FP, "task-new", lease_seconds=LEASE_S, ttl_seconds=60, call=None)
    # Then the new record is that call's alone: no other call's arguments to requeue
    assert taken.decision is Decision.RUN
    record = store.get(ID)
    assert record is not None and record.fingerprint == FP and record.call is None


def test_acquire_takes_a_record_that_went_back_to_pending_while_it_looked(store: Store) -> None:
    # Given an attempt holding the record
    held = acquire(store).record
    assert held is not None
    # (On MySQL/MariaDB the SQL store judges BUSY in the transaction that declined, the row locked:
    # a release cannot land between the two, so there it lands before, as on the other stores.)
    sql = type(store).__name__ in ("SQLStore", "DjangoStore")
    if sql and store.engine.dialect.name not in ("mysql", "mariadb"):  # type: ignore[attr-defined]
        # the SQL store decides BUSY in a statement after its upsert declined: the attempt releases
        # to PENDING (a Celery retry queued) exactly between the two
        run = store._run  # type: ignore[attr-defined]

        def released_meanwhile(statement: Any, params: Any, fetch: Any) -> object:
            if statement is store._busy_sql:  # type: ignore[attr-defined]
                store.release(ID, held.owner, pending_seconds=LEASE_S)
                store._run = run  # type: ignore[attr-defined]
            return run(statement, params, fetch)

        store._run = released_meanwhile  # type: ignore[attr-defined]
    else:
        store.release(ID, held.owner, pending_seconds=LEASE_S)
    # When the retry's message acquires, Then it runs: a PENDING record is free to acquire
    assert acquire(store, task_id="task-1").decision is Decision.RUN


@pytest.mark.parametrize("kind", ["mariadb", "django-mariadb"])
def test_on_mysql_a_declined_acquire_is_judged_on_the_row_it_declined_still_locked(kind: str, tmp_path, prefix) -> None:
    # Given an attempt holding the record on MySQL/MariaDB, where acquire is one locked transaction
    import threading

    import sqlalchemy as sa

    store = make_store(kind, tmp_path, prefix, timeout_seconds=10)
    try:
        held = acquire(store).record
        assert held is not None
        me, released, others = threading.current_thread(), [], []

        def release_while_judging(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if threading.current_thread() is me and "SET linger_until" in statement:  # the BUSY mark
                # When the holder releases (a Celery retry queued) just as a second message's acquire,
                # which declined to take the record, marks it BUSY
                other = threading.Thread(
                    target=lambda: released.append(store.release(ID, held.owner, pending_seconds=1))
                )
                other.start()
                others.append(other)
                time.sleep(0.3)  # long enough for the release to reach the row lock and wait on it

        sa.event.listen(store.engine, "before_cursor_execute", release_while_judging)  # type: ignore[attr-defined]
        try:
            busy = acquire(store, task_id="task-2")
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", release_while_judging)  # type: ignore[attr-defined]
            for other in others:
                other.join(timeout=20)
        # Then the acquire is judged on the row it declined, still the holder's (BUSY, never "changed
        # hands" and tried again), and the release lands after it, on that same row
        assert busy.decision is Decision.BUSY and busy.record is not None and busy.record.owner == held.owner
        assert len(released) == 1 and released[0].ok
        assert acquire(store, task_id="task-1").decision is Decision.RUN
    finally:
        wipe(store)


def test_on_mysql_every_write_of_one_record_reaches_it_by_its_primary_key(tmp_path, prefix) -> None:
    # Given MariaDB's optimizer, which reaches a row of a small table through the expiry index
    # when a one-table UPDATE or DELETE lets it (locking that index's entry before the row: a
    # deadlock against a transaction that holds the row and then needs the entry)
    import sqlalchemy as sa

    store = make_store("mariadb", tmp_path, prefix)
    seen: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("UPDATE", "DELETE")):
            seen.append((statement, parameters))

    try:
        store.create_schema()  # type: ignore[attr-defined]
        sa.event.listen(store.engine, "before_cursor_execute", record)  # type: ignore[attr-defined]
        # When every transition that writes one record runs
        owner = running(store)
        assert acquire(store, task_id="task-2").decision is Decision.BUSY
        assert store.renew(ID, owner, lease_seconds=LEASE_S).ok
        assert store.release(ID, owner, pending_seconds=LEASE_S).ok
        owner = acquire(store).record.owner  # type: ignore[union-attr]
        assert store.complete(ID, owner, RESULT).ok
        other = Identity("", "shop.charge", "order-43")
        owner = acquire(store, identity=other).record.owner  # type: ignore[union-attr]
        assert store.release(other, owner).ok  # a release that frees the key: a DELETE
        assert store.forget(ID)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", record)  # type: ignore[attr-defined]
    # Then each reaches its row by the primary key alone
    try:
        assert len(seen) >= 7, seen
        with store.engine.connect() as connection:  # type: ignore[attr-defined]
            for statement, parameters in seen:
                plan = connection.exec_driver_sql(f"EXPLAIN {statement}", parameters).mappings().one()
                assert plan["key"] == "PRIMARY", (statement, dict(plan))
    finally:
        wipe(store)


# ---- liveness (DESIGN "Death is a fact, not a silence") -----------------------------------------


def test_a_process_is_alive_from_its_first_beat_until_its_record_expires(store: Store, clock) -> None:
    assert store.alive(["p1", "p2"]) == frozenset()
    assert store.keep_alive("p1", "tok-1", seconds=10, create=True).ok
    assert store.keep_alive("p2", "tok-2", seconds=30, create=True).ok
    assert store.alive(["p1", "p2", "p3"]) == {"p1", "p2"}
    clock.advance(10)  # p1's lifetime is over to the instant (expiry is inclusive, as for leases)
    assert store.alive(["p1", "p2", "p3"]) == {"p2"}
    assert store.alive([]) == frozenset()


def test_a_renewal_extends_the_liveness_record_and_never_shortens_it(store: Store, clock) -> None:
    assert store.keep_alive("p1", "tok", seconds=10, create=True).ok
    clock.advance(8)
    assert store.keep_alive("p1", "tok", seconds=10).ok
    clock.advance(8)
    assert store.alive(["p1"]) == {"p1"}
    assert store.keep_alive("p1", "tok", seconds=1).ok  # a short beat leaves the longer lifetime
    clock.advance(1.5)
    assert store.alive(["p1"]) == {"p1"}


def test_liveness_is_fenced_by_the_process_token_and_a_dead_process_stays_dead(store: Store, clock) -> None:
    assert store.keep_alive("p1", "tok", seconds=10, create=True).ok
    assert store.keep_alive("p1", "tok", seconds=10, create=True).ok  # a retried first beat
    assert not store.keep_alive("p1", "other", seconds=10).ok
    assert not store.keep_alive("p1", "other", seconds=10, create=True).ok
    assert not store.keep_alive("p2", "tok", seconds=10).ok  # never created: a renewal creates nothing
    assert store.alive(["p2"]) == frozenset()
    clock.advance(11)  # frozen past its lifetime: taken for dead
    assert not store.keep_alive("p1", "tok", seconds=10).ok
    assert store.alive(["p1"]) == frozenset()


def test_liveness_is_per_store_prefix(store: Store, store_kind: str, tmp_path, clock) -> None:
    other = make_store(store_kind, tmp_path, f"{store.key_prefix}x", clock=clock)
    try:
        assert store.keep_alive("p1", "tok", seconds=10, create=True).ok
        assert other.alive(["p1"]) == frozenset()
    finally:
        wipe(other)


def test_many_holders_are_read_in_one_call(store: Store) -> None:
    ids = [f"p{i}" for i in range(300)]
    for process in ids[::3]:
        assert store.keep_alive(process, "tok", seconds=10, create=True).ok
    assert store.alive(ids) == set(ids[::3])


def test_purge_expired_drops_dead_liveness_records_only(store: Store, clock) -> None:
    assert store.keep_alive("dead", "tok", seconds=5, create=True).ok
    assert store.keep_alive("live", "tok", seconds=50, create=True).ok
    clock.advance(10)
    store.purge_expired()
    assert store.alive(["dead", "live"]) == {"live"}
    assert not store.keep_alive("dead", "tok", seconds=10).ok


# ---- a takeover keeps the task id of the attempt it took over ---------------------------------------


def test_a_takeover_past_the_lease_keeps_the_earlier_attempts_task_id(store: Store, clock) -> None:
    # Given an attempt whose lease ran out (its body may have run; its outcome never landed)
    running(store, task_id="task-1")
    assert acquire(store, task_id="task-1").decision is Decision.BUSY
    clock.advance(LEASE_S + 1)
    # When a new call claims the key, and its worker acquires it
    claimed = claim(store, task_id="task-2")
    taken = acquire(store, task_id="task-2")
    # Then both keep the earlier attempt's task id, for the worker to read its evidence first
    assert claimed.decision is Decision.NEW and claimed.record.previous_task_id == "task-1"
    assert taken.decision is Decision.RUN and taken.record.previous_task_id == "task-1"
    assert store.get(ID).previous_task_id == "task-1"
    # And an acquire that takes over the second attempt names the second
    clock.advance(LEASE_S + 1)
    assert acquire(store, task_id="task-3").record.previous_task_id == "task-2"


def test_a_fresh_record_or_a_takeover_of_a_bare_claim_names_no_earlier_attempt(store: Store, clock) -> None:
    assert claim(store).record.previous_task_id is None
    assert acquire(store).record.previous_task_id is None
    other = Identity("", "shop.charge", "order-43")
    assert claim(store, identity=other).record.previous_task_id is None
    clock.advance(PENDING_S + 1)  # a claim whose message never ran
    assert claim(store, task_id="task-2", identity=other).record.previous_task_id is None


def test_a_free_claim_over_a_settled_takeover_names_no_earlier_attempt(store: Store, clock) -> None:
    # Given a run that took over an attempt past its lease (it names that attempt), and settled
    running(store, task_id="task-1")
    clock.advance(LEASE_S + 1)
    taken = acquire(store, task_id="task-2")
    assert taken.decision is Decision.RUN and taken.record.previous_task_id == "task-1"
    assert store.complete(ID, taken.record.owner, RESULT).ok
    # When a new call of a mode that keeps no outcome claims the key (taken as if absent)
    claimed = free_claim(store, task_id="task-3")
    # Then its record is a fresh one: it names no earlier attempt, whose evidence (task-1's
    # SUCCESS, a committed ledger entry) would answer this new call without running its body
    assert claimed.decision is Decision.NEW and claimed.record.previous_task_id is None
    assert store.get(ID).previous_task_id is None
    assert acquire(store, task_id="task-3").record.previous_task_id is None


def test_a_free_claim_over_a_settled_record_starts_without_the_ended_runs_waiter_mark(store: Store, clock) -> None:
    # Given a run a waiter was promised an answer from until its next look (200 s), which settled
    owner = running(store, task_id="task-1")
    busy = store.acquire(ID, FP, "task-2", lease_seconds=LEASE_S, ttl_seconds=TTL_S, next_look_seconds=200)
    assert busy.decision is Decision.BUSY
    assert store.complete(ID, owner, RESULT).ok
    # When a new call of a mode that keeps no outcome takes the key (as if absent), with a short TTL,
    # and its run settles
    short = 5.0
    assert (
        store.claim(ID, FP, "task-3", pending_seconds=PENDING_S, ttl_seconds=short, settled_is_free=True).decision
        is Decision.NEW
    )
    taken = store.acquire(ID, FP, "task-3", lease_seconds=LEASE_S, ttl_seconds=short)
    assert taken.decision is Decision.RUN
    assert store.complete(ID, taken.record.owner, RESULT).ok
    # Then its record lives its own TTL: the mark was the ended run's (an absent record has none;
    # tests/model.py takes it with the record)
    assert store.get(ID).expires_at == pytest.approx(clock() + short, abs=1e-3)


def test_a_store_of_ones_own_needs_only_the_atomic_operations_and_the_reconcilers() -> None:
    # Given a store that implements the primitives Store requires, and none of the optional
    # operator queries (here each one is a MemoryStore's)
    from celery_idem.stores import MemoryStore

    backend = MemoryStore()
    required = ("_claim", "_acquire", "_settle", "_release", "_renew", "_hand_over", "_get", "_forget")
    required += ("_expired_leases", "_keep_alive", "_alive")
    Minimal = type("Minimal", (Store,), {name: staticmethod(getattr(backend, name)) for name in required})
    store = Minimal()
    # When it is used
    assert claim(store).decision is Decision.NEW
    store.ping()  # a read of a record nobody writes, by default
    # Then the calls work, and an operator query it lacks says so (not an outage)
    with pytest.raises(NotImplementedError, match="Minimal does not list its records"):
        store.records()
    with pytest.raises(NotImplementedError, match="Minimal does not count its records"):
        store.count_by_state()
    with pytest.raises(NotImplementedError, match="Minimal does not count its records by task"):
        store.count_by_task()
