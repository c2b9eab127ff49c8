"""A replacement takes the record over from the attempt that replaced itself, as a worker's pool runs
the message (tests/workers.py's execute_as_worker; memory broker and store, no worker): an attempt that
lost its lease sends no replacement; the record is held for the replacement's whole wait from before it
is sent; a handover whose reply was lost is taken back by the message the worker kept. Through a real
worker: tests/worker/test_worker_control_flow.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, signals
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, LockLostError, State, StoreUnavailableError


def _replacing_app(name: str) -> tuple[Celery, Idempotency, list[str]]:
    """An app on the memory broker and store whose task ``move`` replaces itself with ``other``; the
    names of the messages it publishes."""
    app = Celery(name, set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store="memory://", lease_seconds=5, pending_timeout_seconds=100)
    sent: list[str] = []

    @app.task(shared=False, name="other")
    def other(x: int) -> int:
        return x

    def publishing(sender: Any = None, **_: Any) -> None:
        sent.append(sender)

    signals.before_task_publish.connect(publishing, weak=False)
    app.__dict__["_test_publishing"] = publishing
    return app, idem, sent


def test_an_attempt_that_lost_its_lease_sends_no_replacement() -> None:
    # Given an attempt whose record another attempt took while it ran (here: forgotten under it)
    app, idem, sent = _replacing_app("lost-replace")

    @app.task(base=IdempotentTask, shared=False, bind=True, name="move")
    def move(self: Any, x: int) -> Any:
        idem.forget("move", "k")
        raise self.replace(app.tasks["other"].si(x))

    try:
        # When it replaces itself
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k")
        # Then nothing is sent (the attempt that holds the record sends its own), and it ends with
        # LockLostError (before: the replacement was sent anyway, and ran twice)
        assert sent == []
        assert app.AsyncResult("t-1").state == "FAILURE"
        assert isinstance(app.AsyncResult("t-1").result, LockLostError)
    finally:
        signals.before_task_publish.disconnect(app.__dict__["_test_publishing"])
        idem.disconnect()


def test_a_replacement_holds_the_record_for_its_whole_wait_from_before_it_is_sent() -> None:
    # Given a task that replaces itself with another call, and a look at its record as the
    # replacement is being sent
    app, idem, sent = _replacing_app("lease-replace")
    seen: list[float] = []

    @app.task(base=IdempotentTask, shared=False, bind=True, name="move")
    def move(self: Any, x: int) -> Any:
        raise self.replace(app.tasks["other"].si(x))

    def look(sender: Any = None, **_: Any) -> None:
        if sender == "other":
            record = idem.get("move", "k")
            seen.append(record.lease_expires_at - idem.store.now())

    signals.before_task_publish.connect(look, weak=False)
    try:
        # When it runs
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k")
        # Then the token held the record for the replacement's whole wait (100 s + a lease) before
        # the replacement went out: a process killed right after the publish leaves nothing a copy
        # may take while the replacement waits (with one lease until a renewal after the publish, an
        # attacker's kill in between freed it, and the call ran twice)
        assert sent == ["other"]
        assert seen[0] > 100
        record = idem.get("move", "k")
        assert record.state is State.IN_PROGRESS
    finally:
        signals.before_task_publish.disconnect(look)
        signals.before_task_publish.disconnect(app.__dict__["_test_publishing"])
        idem.disconnect()


def test_a_handover_whose_reply_was_lost_is_taken_back_by_the_kept_message_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a task that replaces itself, and a store that hands the record over but whose reply is
    # lost (the first time)
    from celery_idem.handler import Handler

    app, idem, sent = _replacing_app("lost-handover")
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, bind=True, name="move")
    def move(self: Any, x: int) -> Any:
        runs.append(x)
        raise self.replace(app.tasks["other"].si(x))

    store = idem.store
    original = store.hand_over
    lost: list[bool] = []

    def hand_over(*args: Any, **kwargs: Any) -> Any:
        answer = original(*args, **kwargs)
        if not lost:
            lost.append(True)
            raise StoreUnavailableError("the reply was lost")
        return answer

    kept: list[dict[str, Any]] = []
    monkeypatch.setattr(store, "hand_over", hand_over)
    monkeypatch.setattr(
        Handler, "republish", lambda self, a, k, *, countdown, headers=None: kept.append(dict(headers or {}))
    )
    try:
        # When it runs, and its kept message comes back from the broker
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k")
        assert sent == [] and len(kept) == 1
        execute_as_worker(app, "move", "t-1", args=(1,), idempotency_key="k", **kept[0])
        # Then the copy took the record back by the token it carries and ran at once (before: it met
        # a record held for the replacement's whole wait, which nothing would ever send, and waited
        # it out), and the replacement was sent once
        assert runs == [1, 1]
        assert sent == ["other"]
    finally:
        signals.before_task_publish.disconnect(app.__dict__["_test_publishing"])
        idem.disconnect()


def test_a_chain_step_handed_a_record_that_settled_since_is_published_on_a_store_that_keeps_a_digest(
    tmp_path: Any,
) -> None:
    # Given a record handed to a chain step's token, settled under that token since (the reconciler
    # settles it with the owner it holds), on the Redis store, which keeps only the owner's digest
    from conftest import make_store, wipe

    from celery_idem.protocol import HANDOVER_HEADER, KEY_HEADER
    from celery_idem.records import Identity

    store = make_store("redis", tmp_path, "handed-digest")
    app = Celery("handed-digest", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=store)

    @app.task(shared=False, base=IdempotentTask, name="poll")
    def poll(n: int) -> int:
        return n

    identity, token, task_id = Identity("", "poll", "job-1"), "handover-token-1", "6f1c2e8a-1111-4222-8333-444455556666"
    fp = poll.idempotency_handler.fingerprint((1,), {})
    store.claim(identity, fp, task_id, pending_seconds=60, ttl_seconds=600)
    store.acquire(identity, fp, task_id, lease_seconds=60, ttl_seconds=600, owner=token)
    assert store.complete(identity, token, b"1").ok
    try:
        # When the step before it publishes the step, with other arguments (a poll one try later)
        result = poll.apply_async((2,), task_id=task_id, headers={HANDOVER_HEADER: token, KEY_HEADER: "job-1"})
        # Then it is the same attempt chain: published (the worker replays the outcome), not refused
        assert result.id == task_id and result.deduplicated
    finally:
        wipe(store)
