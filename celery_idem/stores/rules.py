"""The store contract's rules, in one place: what every store decides about one record per identity.

The rules every store follows (the memory store states them most plainly):

- A record whose ``expires_at`` has passed is absent, whatever is still physically stored.
- claim: absent -> NEW (PENDING); other fingerprint -> MISMATCH; settled -> REPLAY;
  lease expired -> NEW (the new claim takes over); else DUPLICATE.
- acquire: absent -> RUN (IN_PROGRESS); other fingerprint and other task id -> MISMATCH;
  settled -> REPLAY; IN_PROGRESS with a live lease -> BUSY; else RUN. The same task id is the same
  attempt chain (a Celery retry), so it may run with changed arguments; the record keeps the
  fingerprint of the caller's call.
- hand_over: IN_PROGRESS under the token -> the same record under the new token, its lease set to
  exactly the given length (not only extended); otherwise LOST.
- complete/fail/release/renew: only while the record is PENDING or IN_PROGRESS (renew:
  IN_PROGRESS) and its owner token still holds the caller's value; otherwise LOST and nothing is
  written.
- release fenced by the task id (the parent-process signal hooks, which have no owner token): only
  what that delivery may still hold, a PENDING record or an IN_PROGRESS one whose lease has run
  out. A live IN_PROGRESS record under the same task id is a copy of the task running elsewhere
  (or the task itself): LOST.
- Liveness (DESIGN "Death is a fact"): a worker process keeps a record of its own, named by an id it
  mints, under a token of its own, for ``seconds`` of the server's clock. keep_alive creates it
  (``create``: absent or expired -> OK; live under the same token -> OK, a retried create) or renews
  it (live under the same token -> OK); anything else is LOST, and an expired record is never
  revived by a renewal: a process once seen dead stays dead under that id. alive() reads many ids at
  once and answers the ones whose record is live.
- A claim or acquire that takes over an unsettled record keeps ``previous_task_id``: the task id of
  an IN_PROGRESS record it takes (an attempt past its lease, whose body may have run), else the
  previous_task_id of the PENDING record it takes; None on an absent record.
- Times: ``lease_expires_at`` while unsettled; ``expires_at`` = lease + ttl while unsettled (a dead
  attempt's record is still collected), now + ttl once settled, but never before a BUSY waiter's
  next look (below).
- A waiting duplicate gets its answer: an acquire that answers BUSY records, in the same atomic
  step and by the server's clock, that the record must live until now + ``next_look_seconds`` (a
  hidden field, never part of the record read back; it only grows). complete/fail set ``expires_at``
  to the later of now + ttl and that time, so a short TTL never lets an outcome vanish between a
  waiter's looks. The mark stays with the record while it lives (takeovers keep it); a record
  that is absent (never claimed, deleted, past its expiry) starts without one.

:func:`classify` is the decision table these rules make for a record an operation may not take, and
:func:`taken_over` what a takeover keeps; :mod:`celery_idem.stores.base` holds the operations that
follow them.
"""

from __future__ import annotations

from ..records import Decision, IdempotencyRecord, State, Transition

__all__ = ["LOST", "OK", "UNSETTLED", "classify", "taken_over"]

UNSETTLED = (State.PENDING, State.IN_PROGRESS)


def classify(
    record: IdempotencyRecord, fingerprint: str, *, claiming: bool, task_id: str, retry: bool = False
) -> Decision:
    """The decision table: what claim (``claiming``) or acquire decides about a live record it may
    not take (DESIGN §3). Other arguments are a MISMATCH (but for a Celery retry or a replacement
    under the record's own task id once an attempt ran: the same attempt chain), a settled record is
    a REPLAY, an unsettled one a DUPLICATE (claim) or BUSY (acquire).

    The one source of these rules: the memory store asks it before taking a record, the SQL store
    names the outcome of an upsert that declined with it, and the Redis Lua scripts, which must
    restate it, are held to it by the model tests (tests/models/test_model_stores.py).
    """
    same_chain = not claiming and retry and record.task_id == task_id and record.attempt > 0
    if record.fingerprint != fingerprint and not same_chain:
        return Decision.MISMATCH
    if record.state.settled:
        return Decision.REPLAY
    return Decision.DUPLICATE if claiming else Decision.BUSY


def taken_over(record: IdempotencyRecord | None) -> str | None:
    """The previous_task_id a claim or acquire that takes ``record`` over writes (see the rules above)."""
    if record is None:
        return None
    return record.task_id if record.state is State.IN_PROGRESS else record.previous_task_id


LOST = Transition(Decision.LOST)
OK = Transition(Decision.OK)
