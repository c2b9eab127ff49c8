"""celery_idem.compat.once against celery-once 3.0.1 itself: a differential conformance suite.

Every scenario runs twice, through a real worker (threads pool, Redis broker): once with celery-once's
own ``QueueOnce`` and once with the adapter, each app configured the same celery-once way
(``app.conf.ONCE``, ``once={...}``), only the import differs. The two must agree, except for the
intended differences (docs/migration.md, "From celery-once"), each a celery-once bug the adapter
fixes: those tests assert both behaviours and name the difference. Effects are counted by an INCR in
the body (and a running gauge for overlaps), never by either library's records.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from conftest import REDIS_URL, require_server
from once_shop import ONCE, VARIANTS, Declined, once_app
from shop import COUNTER_URL
from shop_worker import BROKERS, GET
from workers import Worker, wait_for

from celery_idem import ConfigurationError, DuplicateTaskError
from celery_idem.compat import once as adapter


@dataclass
class Once:
    variant: str
    app: Celery
    prefix: str
    counter: redis.Redis

    @property
    def AlreadyQueued(self) -> type[Exception]:  # noqa: N802 - the variant's class, as an app imports it
        return VARIANTS[self.variant].AlreadyQueued  # type: ignore[no-any-return]

    def task(self, name: str) -> Any:
        return self.app.tasks[f"{self.prefix}.{name}"]

    def runs(self, order: str) -> int:
        return int(self.counter.get(f"{self.prefix}:runs:{order}") or 0)

    def overlapped(self, order: str) -> bool:
        return bool(self.counter.get(f"{self.prefix}:overlap:{order}"))

    def after_the_end(self, name: str, *args: Any, **options: Any) -> Any:
        """Call ``name`` once the call before it ended: celery-once frees its lock in ``after_return``,
        a moment after Celery stored the result ``get()`` answered, so a call made at once may still
        meet it. Bounded: a lock still held a few seconds after the end fails the test."""
        deadline = time.monotonic() + 5
        while True:
            try:
                return self.task(name).apply_async(args, **options)
            except self.AlreadyQueued:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def refused(self, name: str, *args: Any, **options: Any) -> Any:
        with pytest.raises(self.AlreadyQueued) as refused:
            self.task(name).apply_async(args, **options)
        return refused.value


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def once(request: pytest.FixtureRequest) -> Iterator[Once]:
    """A worker for each variant, on a queue, task names and counters of its own."""
    require_server("redis")
    prefix = f"once{uuid.uuid4().hex[:8]}-{request.param}"
    app = once_app(str(request.param), prefix)
    counter = redis.Redis.from_url(COUNTER_URL)
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=20):
            yield Once(str(request.param), app, prefix, counter)
    finally:
        locks = redis.Redis.from_url(REDIS_URL)  # celery-once's locks a test left behind on purpose
        for name in locks.scan_iter(f"qo_{prefix}.*"):
            locks.delete(name)
        for name in counter.scan_iter(f"{prefix}:*"):
            counter.delete(name)


@pytest.fixture
def order() -> str:
    return f"o-{uuid.uuid4().hex[:12]}"


# ---- where both agree ------------------------------------------------------------------------------


def test_a_duplicate_while_the_call_waits_is_refused_with_the_seconds_left_on_its_lock(once: Once, order: str) -> None:
    # Given a call that waits in the queue for its countdown
    first = once.task("hold").apply_async((order,), countdown=1)
    # When the same call is made again, Then AlreadyQueued says how long the lock has left; nothing is sent
    refused = once.refused("hold", order)
    assert 3590 < refused.countdown <= 3601
    assert refused.message.startswith("Expires in ")
    assert first.get(timeout=GET) == 1 and once.runs(order) == 1
    # And the adapter's refusal is a DuplicateTaskError too
    assert isinstance(refused, DuplicateTaskError) is (once.variant == "adapter")


def test_a_duplicate_while_the_call_runs_is_refused_and_the_body_runs_once(once: Once, order: str) -> None:
    first = once.task("hold").apply_async((order, 1.0))
    wait_for(lambda: once.runs(order) == 1, "the call to start")
    once.refused("hold", order, 1.0)
    assert first.get(timeout=GET) == 1
    assert once.runs(order) == 1


def test_after_a_success_or_a_failure_the_next_call_runs(once: Once, order: str) -> None:
    hold = once.task("hold")
    assert hold.apply_async((order,)).get(timeout=GET) == 1
    failed = once.after_the_end("hold", order, kwargs={"fail": True})
    with pytest.raises(Declined):
        failed.get(timeout=GET)
    assert once.after_the_end("hold", order).get(timeout=GET) == 3


def test_other_arguments_are_another_call(once: Once, order: str) -> None:
    hold = once.task("hold")
    first, other = hold.apply_async((order, 0.5)), hold.apply_async((order + "-b", 0.5))
    assert (first.get(timeout=GET), other.get(timeout=GET)) == (1, 1)


def test_a_retry_keeps_the_lock_until_its_last_attempt_ends(once: Once, order: str) -> None:
    first = once.task("retried").apply_async((order,))
    # While the retry waits out its countdown, the call is still there
    time.sleep(0.3)
    once.refused("retried", order)
    assert first.get(timeout=GET) == 1
    assert once.after_the_end("retried", order).get(timeout=GET) == 2


def test_graceful_per_task_and_per_call_returns_a_rejected_result(once: Once, order: str) -> None:
    graceful, hold = once.task("graceful"), once.task("hold")
    firsts = graceful.apply_async((order, 1.0)), hold.apply_async((order + "-h", 1.0))
    # A duplicate of a graceful task, or with graceful in the call: EagerResult(None, None, REJECTED)
    for again in (graceful.apply_async((order, 1.0)), hold.apply_async((order + "-h", 1.0), once={"graceful": True})):
        assert (again.state, again.result) == ("REJECTED", None)
    # And the call's own graceful=False wins over the task's
    with pytest.raises(once.AlreadyQueued):
        graceful.apply_async((order, 1.0), once={"graceful": False})
    assert [first.get(timeout=GET) for first in firsts] == [1, 1]
    assert once.runs(order) == once.runs(order + "-h") == 1


def test_keys_pick_the_arguments_that_make_a_call_and_no_keys_make_one_call_of_the_task(once: Once, order: str) -> None:
    first = once.task("keyed").apply_async((order, "first", 1.0))
    once.refused("keyed", order, "another note")  # keys=["order"]: the note is not the call
    whole = once.task("whole").apply_async((order, 1.0))
    once.refused("whole", order + "-b")  # keys=[]: one call of the task, whatever its arguments
    assert first.get(timeout=GET) == 1 and whole.get(timeout=GET) >= 1


def test_a_queued_call_holds_its_lock_for_its_timeout(once: Once, order: str) -> None:
    # Given a call (timeout 2 s) that no worker takes
    nobody = f"{once.prefix}-nobody"
    once.task("short").apply_async((order,), queue=nobody)
    refused = once.refused("short", order, queue=nobody)
    assert 0 < refused.countdown <= 2
    # When its timeout has passed, Then the same call is sent again
    time.sleep(2.3)
    once.task("short").apply_async((order,), queue=nobody)
    with once.app.connection_for_write() as connection:
        connection.default_channel.queue_purge(nobody)


# ---- the intended differences: celery-once bugs the adapter fixes (docs/migration.md) --------------


def test_difference_default_arguments_left_out_of_the_key(once: Once, order: str) -> None:
    hold = once.task("hold")
    first = hold.apply_async((order, 1.0))
    wait_for(lambda: once.runs(order) == 1, "the call to start")
    # When the same call is made spelling out a default (fail=False)
    if once.variant == "celery_once":
        # celery-once keys the arguments as given: another key, sent while the first runs; the body runs twice
        again = hold.apply_async((order, 1.0, False))
        assert again.get(timeout=GET) == 2
    else:
        # the adapter binds the call to the signature, defaults applied: the same call, refused
        once.refused("hold", order, 1.0, False)
    assert first.get(timeout=GET) == 1


def test_difference_the_key_recomputed_from_retry_arguments(once: Once, order: str) -> None:
    retried = once.task("retried")
    # Given a call whose retry carries other arguments (step=1), and that ended
    assert retried.apply_async((order,), {"move": True}).get(timeout=GET) == 1
    # When the same call is made again
    if once.variant == "celery_once":
        # celery-once freed the key of the retry's arguments, not the call's: its lock is stuck for
        # its whole timeout (and the lock of another call with those arguments would have been freed)
        assert once.refused("retried", order, kwargs={"move": True}).countdown > 3500
    else:
        # the adapter frees the call's key, whatever the retry carried: the next call runs
        assert retried.apply_async((order,), {"move": True}).get(timeout=GET) == 2


def test_difference_a_lock_that_expires_under_a_running_call_and_a_release_without_an_owner_check(
    once: Once, order: str
) -> None:
    short = once.task("short")  # timeout 2 s
    started = time.monotonic()
    first = short.apply_async((order, 3.0))
    wait_for(lambda: once.runs(order) == 1, "the call to start")
    time.sleep(max(0.0, started + 2.4 - time.monotonic()))
    # When the same call is made past the timeout, while the first still runs
    if once.variant == "celery_once":
        second = short.apply_async((order, 3.0))  # celery-once: its lock expired under the run
    else:
        once.refused("short", order, 3.0)  # the adapter: the running call's lease holds the key
    assert first.get(timeout=GET) == 1
    # And once the first ended, while celery-once's second call runs (its lock has 1 s left)
    third = short.apply_async((order, 0.2))
    if once.variant == "celery_once":
        # the first's release deleted the second's lock (no owner check): a third runs beside it
        assert third.get(timeout=GET) == 3 and second.get(timeout=GET) == 2
    else:
        assert third.get(timeout=GET) == 2
    assert once.overlapped(order) is (once.variant == "celery_once")


def test_difference_a_timeout_counts_from_when_the_call_is_due(once: Once, order: str) -> None:
    short = once.task("short")  # timeout 2 s
    # Given a call due in 3 s
    first = short.apply_async((order,), countdown=3)
    time.sleep(2.3)
    if once.variant == "celery_once":
        # celery-once's lock expired before the call even ran: the same call is sent again
        again = short.apply_async((order,))
        assert sorted([again.get(timeout=GET), first.get(timeout=GET)]) == [1, 2]
    else:
        # the adapter's claim waits timeout seconds past the countdown: still held
        assert 0 < once.refused("short", order).countdown <= 3
        assert first.get(timeout=GET) == 1


LEASE = 3.0  # celery-idem's lease_seconds in the crash test (a setting celery-once does not have)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_difference_a_call_whose_worker_process_died_is_not_locked_for_its_timeout(
    variant: str, tmp_path: Path, order: str
) -> None:
    # Given a call running in a prefork worker's child (a `celery worker` subprocess)
    require_server("redis")
    prefix = f"once{uuid.uuid4().hex[:8]}-crash-{variant}"
    once = Once(variant, once_app(variant, prefix, LEASE), prefix, redis.Redis.from_url(COUNTER_URL))
    worker = Worker(
        tmp_path,
        BROKERS["redis"],
        REDIS_URL,
        prefix,
        app="once_shop",
        concurrency=1,
        env={"ONCE_VARIANT": variant, "ONCE_LEASE_SECONDS": str(LEASE)},
    )
    try:
        once.task("keyed").apply_async((order, "first", 30.0))  # keys=["order"]
        pid = wait_for(lambda: once.counter.get(f"{prefix}:pid:{order}"), "the call to start")
        # When the child is SIGKILLed mid-run (its parent sees it die: WorkerLostError)
        os.kill(int(pid), signal.SIGKILL)
        wait_for(lambda: "WorkerLostError" in worker.output(), "the parent to see its child die")
        if variant == "celery_once":
            # celery-once's lock outlives the run it guarded: the call is refused for its whole timeout
            time.sleep(0.5)
            assert once.refused("keyed", order, "again").countdown > 3500
        else:
            # the adapter's key is held by the run's lease, which no one renews now: it is free as the
            # lease runs out (lease_seconds: 30 s by default, 3 s here), and the same call runs again
            again = wait_for(lambda: _sent(once, "keyed", order, "again"), "the key to be free", 4 * LEASE)
            assert again.get(timeout=GET) == 2
    finally:
        worker.kill()  # nothing of its own to finish: a warm shutdown would only take longer
        for name in once.counter.scan_iter(f"{prefix}:*"):
            once.counter.delete(name)
        locks = redis.Redis.from_url(REDIS_URL)
        for name in locks.scan_iter(f"qo_{prefix}.*"):
            locks.delete(name)


def _sent(once: Once, name: str, *args: Any) -> Any:
    try:
        return once.task(name).apply_async(args)
    except once.AlreadyQueued:
        return None


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_eager_calls_one_after_another_each_run(variant: str) -> None:
    # Given an eager app (as a test suite runs celery-once tasks): each call ends before the next
    require_server("redis")
    app = Celery(f"eager-{variant}", set_as_current=False)
    app.conf.update(ONCE=ONCE, task_always_eager=True)
    runs: list[int] = []

    @app.task(shared=False, base=VARIANTS[variant].QueueOnce, name=f"once{uuid.uuid4().hex[:8]}.eager")
    def eager(n: int) -> int:
        runs.append(n)
        return n

    # Then the same call made again at once runs again: its lock went with the run
    assert [eager.delay(1).get() for _ in range(50)] == [1] * 50 and len(runs) == 50


# ---- what the adapter refuses ---------------------------------------------------------------------


def declared(once: dict[str, Any], config: dict[str, Any] = ONCE) -> Any:
    app = Celery("refusals", set_as_current=False)
    app.conf.ONCE = config

    @app.task(shared=False, base=adapter.QueueOnce, once=once)
    def noop(order: str) -> None: ...

    return noop.name and noop  # binding the task reads the once options and app.conf.ONCE


def test_unlock_before_run_is_the_mode_until_started_which_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="until_started"):
        declared({"unlock_before_run": True})


def test_a_backend_other_than_celery_once_redis_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="celery_once.backends.Redis"):
        declared({}, {"backend": "celery_once.backends.File", "settings": {"location": "/tmp"}})


def test_a_per_call_timeout_other_than_the_tasks_is_refused() -> None:
    noop = declared({"timeout": 60})
    with pytest.raises(ConfigurationError, match="per-call"):
        noop.apply_async(("o",), once={"timeout": 5})


def test_already_queued_is_celery_onces_and_a_duplicate_task_error_and_travels_as_one() -> None:
    refused = adapter.AlreadyQueued(12.5, key="k", task_name="t", task_id="i")
    assert (refused.countdown, refused.args, refused.message) == (12.5, (12.5,), "Expires in 12.5 seconds")
    assert isinstance(refused, DuplicateTaskError)
    # As Celery ships an exception (its type and args) and as a prefork pipe does (pickle)
    for copy in (type(refused)(*refused.args), pickle.loads(pickle.dumps(refused))):
        assert isinstance(copy, adapter.AlreadyQueued) and copy.countdown == 12.5
