"""Variants of Celery's integration tests that fail with celery-idem by design: the same scenario, but
each call differs, so each must run (and the variant must pass).

``integration.py`` copies this file into the extracted sdist as ``t/integration/test_idem_variants.py``
(Celery's integration conftest, fixtures and tasks apply to it) and runs it in the same pytest run,
through the same session worker, as the tests it varies. A variant's node id is its original's with
``test_idem_variants.py`` for the file (same class, same name): ``celery_idem_integration.py`` checks
that every "dedup by design" entry of integration_expected_failures.txt has one.

Each variant is the original's code with the one change its docstring names: the calls that were
identical get distinct idempotency keys (``.set(idempotency_key=...)`` on a signature,
``idempotency_key=`` to apply_async), or distinct arguments where the original's arguments carry no
meaning. On plain Celery (``--baseline``) an idempotency key is an unknown option Celery ignores: the
variants pass there too.
"""

import uuid
from datetime import datetime, timedelta, timezone

import celery
import pytest
from celery import chain, chord, group

from .conftest import get_redis_connection
from .tasks import ExpectedException, add, fail, identity, ids, redis_count, sleeping
from .test_canvas import TIMEOUT, await_redis_count


def keyed(signature, label):
    """``signature`` with an idempotency key of its own: the same call, but a distinct one."""
    return signature.clone().set(idempotency_key=f"{label}-{uuid.uuid4().hex}")


class test_tasks:
    @pytest.mark.timeout(60)
    def test_expired(self, manager):
        """test_expired fills the queue with four identical ``sleeping.delay(2)``, so that the add
        behind them expires before it runs: deduplicated, the four are one call (and in the second
        half, a replay of the first half's), the queue holds no two seconds of work and the add runs.
        Here the sleeping calls have distinct keys."""
        for _ in range(4):
            sleeping.apply_async((2,), idempotency_key=f"fill-{uuid.uuid4().hex}")
        result = add.apply_async((1, 1), expires=1)
        with pytest.raises(celery.exceptions.TaskRevokedError):
            result.get()
        assert result.status == "REVOKED"
        assert result.ready() is True
        assert result.failed() is False
        assert result.successful() is False

        for _ in range(4):
            sleeping.apply_async((2,), idempotency_key=f"fill-{uuid.uuid4().hex}")
        result = add.apply_async((1, 1), expires=datetime.now(timezone.utc) + timedelta(seconds=1))
        with pytest.raises(celery.exceptions.TaskRevokedError):
            result.get()
        assert result.status == "REVOKED"
        assert result.ready() is True
        assert result.failed() is False
        assert result.successful() is False


class test_chain:
    def test_chain_children_with_callbacks(self, manager, subtests):
        """42 chain steps ``identity.si(1337)``, each linked to ``redis_count.si(key)``, and the test
        counts 42 callbacks: identical steps replay the first one's outcome, identical callbacks count
        once. Here every step and every callback has its own key."""
        redis_connection = get_redis_connection()

        redis_key = str(uuid.uuid4())
        callback = redis_count.si(redis_key=redis_key)

        child_task_count = 42
        chain_sig = chain(
            keyed(identity.si(1337), "step").set(link=keyed(callback, "callback")) for _ in range(child_task_count)
        )

        redis_connection.delete(redis_key)
        with subtests.test(msg="Chain executes as expected"):
            res_obj = chain_sig()
            assert res_obj.get(timeout=TIMEOUT) == 1337
        with subtests.test(msg="Chain child task callbacks are called"):
            await_redis_count(child_task_count, redis_key=redis_key)
        redis_connection.delete(redis_key)


class test_group:
    def test_parent_ids(self, manager):
        """``ids.si(i=1) | ids.si(i=2) | group(ids.si(i=i) for i in range(2, 50))``: the group's first
        member is the chain's second step again, so it replays that step's (root id, parent id, 2)
        and its parent id is not the group's parent. Here the group's members have their own keys."""
        g = ids.si(i=1) | ids.si(i=2) | group(keyed(ids.si(i=i), "member") for i in range(2, 50))
        res = g()
        expected_root_id = res.parent.parent.id
        expected_parent_id = res.parent.id
        values = res.get(timeout=TIMEOUT)

        for i, r in enumerate(values):
            root_id, parent_id, value = r
            assert root_id == expected_root_id
            assert parent_id == expected_parent_id
            assert value == i + 2

    def test_errback_called_by_group_fail_multiple(self, manager, subtests):
        """A group of 24 ``identity.si(42)`` and 42 ``fail.s()`` with ``link_error(redis_count.si(key))``,
        and the test counts 42 errbacks: the 42 errback calls are one call. Here each member carries its
        own copy of the errback with its own key (what ``group.link_error`` does, one errback per
        member), and the members have their own keys too."""
        redis_connection = get_redis_connection()

        expected_errback_count = 42
        redis_key = str(uuid.uuid4())
        errback = redis_count.si(redis_key=redis_key)

        group_sig = group(
            *(keyed(identity.si(42), "pass") for _ in range(24)),
            *(keyed(fail.s(), "fail").on_error(keyed(errback, "errback")) for _ in range(expected_errback_count)),
        )

        redis_connection.delete(redis_key)
        with subtests.test(msg="Error propagates from group"):
            res = group_sig.delay()
            with pytest.raises(ExpectedException):
                res.get(timeout=TIMEOUT)
        with subtests.test(msg="Errback is called after group task fails"):
            await_redis_count(expected_errback_count, redis_key=redis_key)
        redis_connection.delete(redis_key)

    def test_group_children_with_callbacks(self, manager, subtests):
        """42 group members ``identity.si(1337)`` linked to ``redis_count.si(key)``: the callbacks are
        one call. Here every member and every callback has its own key."""
        redis_connection = get_redis_connection()

        redis_key = str(uuid.uuid4())
        callback = redis_count.si(redis_key=redis_key)

        child_task_count = 42
        group_sig = group(
            keyed(identity.si(1337), "member").set(link=keyed(callback, "callback")) for _ in range(child_task_count)
        )

        redis_connection.delete(redis_key)
        with subtests.test(msg="Chain executes as expected"):
            res_obj = group_sig()
            assert res_obj.get(timeout=TIMEOUT) == [1337] * child_task_count
        with subtests.test(msg="Chain child task callbacks are called"):
            await_redis_count(child_task_count, redis_key=redis_key)
        redis_connection.delete(redis_key)

    def test_group_children_with_errbacks(self, manager, subtests):
        """42 group members ``fail.si()`` with ``link_error(redis_count.si(key))``: the errbacks are
        one call. Here every member and every errback has its own key."""
        redis_connection = get_redis_connection()

        redis_key = str(uuid.uuid4())
        errback = redis_count.si(redis_key=redis_key)

        child_task_count = 42
        group_sig = group(
            keyed(fail.si(), "member").on_error(keyed(errback, "errback")) for _ in range(child_task_count)
        )

        redis_connection.delete(redis_key)
        with subtests.test(msg="Chain fails due to a child task dying"):
            res_obj = group_sig()
            with pytest.raises(ExpectedException):
                res_obj.get(timeout=TIMEOUT)
        with subtests.test(msg="Chain child task errbacks are called"):
            await_redis_count(child_task_count, redis_key=redis_key)
        redis_connection.delete(redis_key)


class test_chord:
    def test_reapplying_frozen_chord_dispatches_body_again(self, manager):
        """A frozen chord applied twice: the second application sends every call again under the same
        task ids, which celery-idem answers as copies of settled calls (one run, one continuation per
        call), so the body's count stays 1. Here the second application's calls (header members and
        body) get new keys first: the same frozen ids, but new calls."""
        redis_connection = get_redis_connection()
        redis_key = f"frozen-chord-{uuid.uuid4().hex}"
        redis_connection.delete(redis_key)
        task = chord(
            group(add.s(1, 2), add.s(3, 4)),
            redis_count.si(redis_key),
        )
        task.freeze()

        try:
            first = task.apply_async()
            first.get(timeout=TIMEOUT)
            await_redis_count(1, redis_key=redis_key)

            for signature in (*task.tasks.tasks, task.body):
                signature.set(idempotency_key=f"again-{uuid.uuid4().hex}")
            second = task.apply_async()
            second.get(timeout=TIMEOUT)
            await_redis_count(2, redis_key=redis_key)
        finally:
            redis_connection.delete(redis_key)

    def test_immutable_errback_called_by_chord_from_group_fail_multiple(self, manager, subtests):
        """A chord whose body is a group of 24 ``identity.si(42)`` and 42 ``fail.s()``, with
        ``link_error(redis_count.si(key))``: the test counts one errback per failing body member, and
        those are one call. Here each failing member carries its own keyed copy of the errback (what
        ``link_error`` on a group body does: one per member) and the members have their own keys."""
        redis_connection = get_redis_connection()

        fail_task_count = 42
        redis_key = str(uuid.uuid4())
        errback = redis_count.si(redis_key=redis_key)
        child_sig = group(
            *(keyed(identity.si(42), "pass") for _ in range(24)),
            *(keyed(fail.s(), "fail") for _ in range(fail_task_count)),
        )

        chord_sig = chord((child_sig,), identity.s())
        chord_sig.link_error(errback)
        redis_connection.delete(redis_key)
        with subtests.test(msg="Error propagates from header group"):
            redis_connection.delete(redis_key)
            res = chord_sig.delay()
            with pytest.raises(ExpectedException):
                res.get(timeout=TIMEOUT)
        with subtests.test(msg="Errback is called after header group fails"):
            await_redis_count(1, redis_key=redis_key)

        body = group(
            *(keyed(identity.si(42), "pass") for _ in range(24)),
            *(keyed(fail.s(), "fail").on_error(keyed(errback, "errback")) for _ in range(fail_task_count)),
        )
        chord_sig = chord((identity.si(42),), body)
        redis_connection.delete(redis_key)
        with subtests.test(msg="Error propagates from body group"):
            res = chord_sig.delay()
            with pytest.raises(ExpectedException):
                res.get(timeout=TIMEOUT)
        with subtests.test(msg="Errback is called after body group fails"):
            await_redis_count(fail_task_count, redis_key=redis_key)
        redis_connection.delete(redis_key)
