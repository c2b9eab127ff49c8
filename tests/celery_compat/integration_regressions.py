"""The real breaks that Celery's integration tests found in celery-idem, cut down to what each needs.

``integration.py`` copies this file into the extracted sdist as
``t/integration/test_idem_regressions.py`` and runs it with the rest, through the same session
worker (prefork, one child). Each test is what plain Celery does, and each must pass: a break found
and not yet fixed is listed in integration_expected_failures.txt as "pending fix (bug)" until the
fix lands (the job then fails with XPASS and the entry goes). On plain Celery (``--baseline``) they
pass too.
"""

import time
import uuid

from celery import group

from .conftest import get_active_redis_channels
from .tasks import add, add_to_all
from .test_canvas import TIMEOUT


def wait_for_success(result, seconds=TIMEOUT):
    """Until the result backend holds SUCCESS for ``result``, read without subscribing to anything."""
    deadline = time.monotonic() + seconds
    while result.backend.get_task_meta(result.id, cache=False)["status"] != "SUCCESS":
        assert time.monotonic() < deadline, f"task {result.id} did not succeed within {seconds}s"
        time.sleep(0.05)


class test_idem_regressions:
    def test_get_of_a_finished_task_cancels_its_subscription(self, manager):
        """Celery's test_asyncresult_get_cancels_subscription, made deterministic: get() is called once
        the task has finished. Plain Celery unsubscribes from the result's pub/sub channel when get()
        answers. celery-idem's IdempotentResult.get() answers from the store's settled record without
        asking the backend, and the channel Celery subscribed at publish stays subscribed (and the
        result stays in the backend's pending results): one leaked subscription per such get().
        Fixed: a handle answered from the store stops listening for its id."""
        channels_before_test = get_active_redis_channels()
        result = add.apply_async((20, 22), idempotency_key=f"leak-{uuid.uuid4().hex}")
        wait_for_success(result)

        assert result.get(timeout=3) == 42

        new_channels = [channel for channel in get_active_redis_channels() if channel not in channels_before_test]
        assert new_channels == []

    def test_a_group_holding_one_self_replacing_call_twice(self, manager):
        """Celery's test_task_replace_with_group_preserves_group_order, cut down to two members. The
        first ``add_to_all`` replaces itself with a group of two ``add`` and hands its record to it:
        IN_PROGRESS until those run. The second member is the same call (a group member, so published
        anyway): it finds the record busy and, by ``on_busy="wait"``, waits for it in the worker's
        only process slot for ``busy_wait_seconds`` (60), while the adds it waits for are queued behind
        it; only then does it go back to the broker (30 s countdown) and let them run. Plain Celery
        answers in well under a second. Fixed: replace() hands the record to a token that names no
        process, and a duplicate that meets such a record waits through the broker, not in its slot."""
        res = group(add_to_all.s([2, 1], 1), add_to_all.s([2, 1], 1)).delay()
        assert res.get(timeout=5) == [[3, 2], [3, 2]]
