"""celery_idem.compat.singleton against celery-singleton 0.3.1 itself: a differential suite.

One app declares every task twice, once on celery-singleton's ``Singleton`` (``peer.*``) and once on
the adapter's (``adapter.*``), with the same options and the same app settings (nothing configures
celery-idem: the adapter finds its store as celery-singleton does, on the Redis result backend). One
in-process worker (threads pool, Redis broker) runs both. Each test runs its scenario on both sides
and compares what a caller sees: task ids, results, errors, and executions, counted by an INCR in the
task bodies (never by either library's records).

They agree everywhere except the intended differences, each a celery-singleton bug the adapter fixes;
each such test asserts both behaviours and is named ``test_intended_difference_...``:

1. a retry: celery-singleton refuses the retry's re-publish as a duplicate of its own call, so the
   retry never runs and the key stays held by a call that will never end (without ``lock_expiry``,
   for good); the adapter's retry runs and then frees the key;
2. ``f(1)`` and ``f(x=1)`` are two calls for celery-singleton (it hashes args and kwargs as given);
   one for the adapter;
3. a chain whose head is a duplicate: celery-singleton drops the rest of the chain; the adapter
   publishes the head anyway and the running call's outcome flows into the chain;
4. ``lock_expiry`` shorter than a run: celery-singleton's lock expires under the running call and a
   second run starts beside it; the adapter's ``lock_expiry`` bounds only the wait in the queue, and a
   running call keeps its key by its lease, which the heartbeat renews.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import celery_singleton
import celery_singleton.backends
import pytest
import redis
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL
from celery import Celery, chain
from celery.contrib.testing.worker import start_worker
from celery.exceptions import TimeoutError as NoResult
from conftest import require_server, wipe
from shop import COUNTER_URL
from workers import wait_for

import celery_idem
from celery_idem import ConfigurationError, Idempotency
from celery_idem.compat import singleton as compat

PEER, ADAPTER = "peer", "adapter"
BASES = {PEER: celery_singleton.Singleton, ADAPTER: compat.Singleton}
GET = 20  # seconds a test waits for a result


def declare(app: Celery, side: str, counter: redis.Redis, prefix: str) -> None:
    """The tasks of one side, on ``BASES[side]``; every body counts its run under ``prefix``."""
    base = BASES[side]

    def effect(task: str, order: str) -> int:
        return int(counter.incr(f"{prefix}:{side}:{task}:{order}"))

    @app.task(shared=False, base=base, name=f"{side}.run")
    def run(order_id: str, hold: float = 0.0, fail: bool = False) -> str:
        effect("run", order_id)
        time.sleep(hold)
        if fail:
            raise ValueError(f"order {order_id} declined")
        return f"done {order_id}"

    @app.task(shared=False, base=base, name=f"{side}.unique", unique_on="order_id")
    def unique(order_id: str, note: str = "", hold: float = 0.0) -> str:
        effect("unique", order_id)
        time.sleep(hold)
        return f"done {order_id} {note}"

    @app.task(shared=False, base=base, name=f"{side}.raising", unique_on=["order_id"], raise_on_duplicate=True)
    def raising(order_id: str, hold: float = 0.0) -> str:
        effect("raising", order_id)
        time.sleep(hold)
        return f"done {order_id}"

    @app.task(shared=False, base=base, bind=True, name=f"{side}.retried")
    def retried(self: Any, order_id: str) -> str:
        effect("retried", order_id)
        if self.request.retries == 0:
            raise self.retry(countdown=1, max_retries=1)
        return f"done {order_id}"

    @app.task(shared=False, base=base, name=f"{side}.expiring", unique_on="order_id", lock_expiry=1)
    def expiring(order_id: str, hold: float = 0.0) -> str:
        effect("expiring", order_id)
        flag = f"{prefix}:{side}:running:{order_id}"
        if hold:  # says while it runs (a short call of the same order leaves it alone)
            counter.set(flag, 1)
            time.sleep(hold)
            counter.delete(flag)
        return f"done {order_id}"


def make_app(prefix: str) -> Celery:
    app = Celery("singletons", broker=REDIS_BROKER_URL, backend=REDIS_BACKEND_URL, set_as_current=False)
    app.conf.update(
        task_default_queue=prefix,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        singleton_key_prefix=f"{prefix}_",  # both sides' namespace: the peer's locks, the adapter's store
    )
    counter = redis.Redis.from_url(COUNTER_URL)
    for side in BASES:
        declare(app, side, counter, prefix)

    @app.task(shared=False, name="tail")
    def tail(value: str, tag: str) -> str:
        counter.incr(f"{prefix}:tail:{tag}")
        return f"after {value}"

    return app


@dataclass
class Side:
    name: str
    app: Celery
    prefix: str
    counter: redis.Redis

    @property
    def idle(self) -> str:
        """A queue no worker consumes: a call sent there stays queued."""
        return f"{self.prefix}.idle"

    def task(self, name: str) -> Any:
        return self.app.tasks[f"{self.name}.{name}"]

    def runs(self, task: str, order: str) -> int:
        return int(self.counter.get(f"{self.prefix}:{self.name}:{task}:{order}") or 0)

    def tails(self, order: str) -> int:
        return int(self.counter.get(f"{self.prefix}:tail:{self.name}:{order}") or 0)

    def running(self, order: str) -> bool:
        return bool(self.counter.exists(f"{self.prefix}:{self.name}:running:{order}"))

    def holds(self, task: str, task_id: str, *args: Any, **kwargs: Any) -> bool:
        """Whether the call ``task_id`` still holds its key: the peer's lock, or the adapter's record."""
        t = self.task(task)
        if self.name == PEER:
            return bool(t.get_existing_task_id(t.generate_lock(t.name, args, kwargs)) == task_id)
        # The adapter's key is held while the call's record is unsettled (a settled one is kept for the
        # ended run's own messages only: a new call takes it)
        store = Idempotency.of(self.app).store
        return any(r.task_id == task_id and not r.state.settled for r in store.records(task_name=t.name, limit=1000))

    def clear_locks(self) -> None:
        (celery_singleton.clear_locks if self.name == PEER else compat.clear_locks)(self.app)

    def status(self, task_id: str) -> str:
        return str(self.app.backend.get_task_meta(task_id)["status"])


@pytest.fixture(scope="module")
def sides() -> Iterator[dict[str, Side]]:
    require_server("redis")
    prefix = f"cs{uuid.uuid4().hex[:10]}"
    celery_singleton.backends._backend = None  # type: ignore[attr-defined]  # celery-singleton caches one per process
    app = make_app(prefix)
    counter = redis.Redis.from_url(COUNTER_URL)
    try:
        with start_worker(app, pool="threads", concurrency=6, perform_ping_check=False, shutdown_timeout=20):
            yield {side: Side(side, app, prefix, counter) for side in BASES}
    finally:
        celery_singleton.clear_locks(app)
        celery_singleton.backends._backend = None  # type: ignore[attr-defined]
        wipe(Idempotency.of(app).store)
        redis.Redis.from_url(REDIS_BROKER_URL).delete(f"{prefix}.idle")
        for key in counter.scan_iter(match=f"{prefix}:*", count=1000):
            counter.delete(key)


def both(sides: dict[str, Side], scenario: Callable[[Side, str], Any]) -> dict[str, Any]:
    """The scenario run on each side in turn, on one order id (each side's tasks, locks and counters are
    its own): what each side showed."""
    order = f"o-{uuid.uuid4().hex[:12]}"
    return {name: scenario(side, order) for name, side in sides.items()}


# ---- where they agree ------------------------------------------------------------------------------


def test_a_duplicate_while_the_call_is_queued_gets_its_id(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order,), countdown=2)  # certainly queued: due in 2 s
        dup = run.apply_async((order,))
        return dup.id == first.id, first.get(timeout=GET), dup.get(timeout=GET), side.runs("run", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][0] and observed[ADAPTER][3] == 1


def test_a_duplicate_while_the_call_runs_gets_its_id_and_its_result(sides: dict[str, Side]) -> None:
    # celery-singleton's own test_singleton "same id on duplicates", in spirit
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order, 1.0))
        wait_for(lambda: side.runs("run", order) == 1, "the call to start")
        dups = [run.apply_async((order, 1.0)) for _ in range(3)]
        same = all(d.id == first.id for d in dups)
        return same, [d.get(timeout=GET) for d in dups], first.get(timeout=GET), side.runs("run", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][0] and observed[ADAPTER][3] == 1


def test_after_success_the_same_call_runs_again_under_a_new_id(sides: dict[str, Side]) -> None:
    # celery-singleton's "new id after success", in spirit
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order,))
        result = first.get(timeout=GET)
        # celery-singleton frees its lock after Celery stored the result (on_success): wait for it
        wait_for(lambda: not side.holds("run", first.id, order), "the key to be free")
        again = run.apply_async((order,))
        return result, again.id != first.id, again.get(timeout=GET), side.runs("run", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][1] and observed[ADAPTER][3] == 2


def test_after_failure_the_same_call_runs_again_under_a_new_id(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order,), {"fail": True})
        with pytest.raises(ValueError, match="declined") as failed:
            first.get(timeout=GET)
        wait_for(lambda: not side.holds("run", first.id, order, fail=True), "the key to be free")
        again = run.apply_async((order,), {"fail": True})
        with pytest.raises(ValueError, match="declined"):
            again.get(timeout=GET)
        return type(failed.value).__name__, again.id != first.id, side.runs("run", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER] == ("ValueError", True, 2)


def test_other_arguments_are_another_call(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order, 0.5))
        other = run.apply_async((f"{order}-b", 0.5))
        outcomes = first.get(timeout=GET), other.get(timeout=GET)
        return other.id != first.id, outcomes, side.runs("run", order), side.runs("run", f"{order}-b")

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][0] and observed[ADAPTER][2:] == (1, 1)


def test_unique_on_keys_the_call_by_the_named_arguments_only(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        unique = side.task("unique")
        first = unique.apply_async((order, "first", 1.0))
        wait_for(lambda: side.runs("unique", order) == 1, "the call to start")
        dup = unique.apply_async((order,), {"note": "second", "hold": 1.0})
        other = unique.apply_async((f"{order}-b", "first"))
        return (
            dup.id == first.id,
            dup.get(timeout=GET),
            other.id != first.id,
            other.get(timeout=GET),
            side.runs("unique", order),
        )

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][0] and observed[ADAPTER][1].endswith("first") and observed[ADAPTER][4] == 1


def test_raise_on_duplicate_raises_duplicate_task_error_with_the_holders_id(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        raising = side.task("raising")
        first = raising.apply_async((order, 1.0))
        with pytest.raises(Exception) as refused:  # noqa: PT011 - each side's own class, checked below
            raising.apply_async((order,), {"hold": 2.0})
        error = refused.value
        first.get(timeout=GET)
        return type(error).__name__, error.task_id == first.id, side.runs("raising", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER] == ("DuplicateTaskError", True, 1)
    # The adapter's class is celery-idem's too: either except clause catches it.
    assert issubclass(compat.DuplicateTaskError, celery_idem.DuplicateTaskError)


def test_a_duplicate_during_a_countdown_gets_the_queued_calls_id_and_the_body_runs_once(
    sides: dict[str, Side],
) -> None:
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order,), countdown=1)
        dup = run.apply_async((order,), countdown=1)
        return dup.id == first.id, first.get(timeout=GET), side.runs("run", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][0] and observed[ADAPTER][2] == 1


def test_lock_expiry_frees_the_key_of_a_call_that_waits_in_the_queue(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        expiring = side.task("expiring")
        started = time.monotonic()
        first = expiring.apply_async((order,), queue=side.idle)  # never consumed: stays queued
        dup = expiring.apply_async((order,))
        # Given lock_expiry=1, a call made once it ran out is a new call (polled, never slept past it)
        again = wait_for(
            lambda: (r := expiring.apply_async((order,))).id != first.id and r, "the key to be free", seconds=10
        )
        waited = time.monotonic() - started
        return dup.id == first.id, waited >= 0.9, again.get(timeout=GET), side.runs("expiring", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][0] and observed[ADAPTER][1] and observed[ADAPTER][3] == 1


def test_clear_locks_frees_every_key(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order,), queue=side.idle)  # never consumed: held until cleared
        dup = run.apply_async((order,))
        side.clear_locks()
        again = run.apply_async((order,))
        return dup.id == first.id, again.id != first.id, again.get(timeout=GET), side.runs("run", order)

    observed = both(sides, scenario)
    assert observed[PEER] == observed[ADAPTER]
    assert observed[ADAPTER][0] and observed[ADAPTER][1] and observed[ADAPTER][3] == 1


# ---- the intended differences: celery-singleton's bugs, fixed ------------------------------------------


def test_intended_difference_1_a_retry_runs_and_keeps_the_key_until_the_call_ends(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        retried = side.task("retried")
        first = retried.apply_async((order,))
        wait_for(lambda: side.status(first.id) == "RETRY", "the first attempt's retry")
        dup = retried.apply_async((order,))  # the call is not over: a duplicate
        try:
            outcome = first.get(timeout=5)  # the retry is due 1 s after the first attempt
        except NoResult:
            outcome = "never"
        return dup.id == first.id, outcome, side.runs("retried", order), side.holds("retried", first.id, order)

    observed = both(sides, scenario)
    # celery-singleton: the retry's re-publish meets its own lock and is dropped as a duplicate; the
    # call never ends, and its key stays held (for good, without lock_expiry)
    assert observed[PEER] == (True, "never", 1, True)
    # The adapter: the retry runs, the call ends, and its key is free
    assert observed[ADAPTER][0] is True and observed[ADAPTER][1].startswith("done o-")
    assert observed[ADAPTER][2:] == (2, False)


def test_intended_difference_2_positional_and_keyword_spellings_are_one_call(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        run = side.task("run")
        first = run.apply_async((order,), {"hold": 1.0})
        wait_for(lambda: side.runs("run", order) == 1, "the call to start")
        spelt = run.apply_async((), {"order_id": order, "hold": 1.0})
        return spelt.id == first.id, spelt.get(timeout=GET), first.get(timeout=GET), side.runs("run", order)

    observed = both(sides, scenario)
    # celery-singleton: f(1) and f(x=1) hash differently: two calls, two runs at once
    assert observed[PEER][0] is False and observed[PEER][3] == 2
    # The adapter: arguments bound to the signature: one call, one run
    assert observed[ADAPTER][0] is True and observed[ADAPTER][3] == 1


def test_intended_difference_3_a_chain_whose_head_is_a_duplicate_still_runs_its_rest(sides: dict[str, Side]) -> None:
    # celery-singleton's own chain test, in spirit, with the head a duplicate of a running call
    def scenario(side: Side, order: str) -> Any:
        run, tail = side.task("run"), side.app.tasks["tail"]
        first = run.apply_async((order, 1.0))
        wait_for(lambda: side.runs("run", order) == 1, "the call to start")
        rest = chain(run.s(order, 1.0), tail.s(f"{side.name}:{order}")).apply_async()
        head = first.get(timeout=GET)
        try:
            outcome = rest.get(timeout=4)
        except NoResult:
            outcome = "never"
        return head, outcome, side.tails(order), side.runs("run", order)

    observed = both(sides, scenario)
    # celery-singleton: the head is handed the running call's result and the rest of the chain is dropped
    peer_head = observed[PEER][0]
    assert observed[PEER] == (peer_head, "never", 0, 1)
    # The adapter: the head is published anyway; the running call's outcome flows into the rest
    adapter_head = observed[ADAPTER][0]
    assert observed[ADAPTER] == (adapter_head, f"after {adapter_head}", 1, 1)


def test_intended_difference_4_a_running_call_keeps_its_key_past_lock_expiry(sides: dict[str, Side]) -> None:
    def scenario(side: Side, order: str) -> Any:
        expiring = side.task("expiring")  # lock_expiry=1
        first = expiring.apply_async((order, 2.5))
        wait_for(lambda: side.running(order), "the call to start")
        handed = set()
        while side.running(order):
            call = expiring.apply_async((order,))
            if side.running(order):  # made while the first call's body certainly ran
                handed.add(call.id)
            time.sleep(0.1)
        first.get(timeout=GET)
        return handed == {first.id}, side.runs("expiring", order)

    observed = both(sides, scenario)
    # celery-singleton: the lock expires 1 s after the call was sent, while it runs: later calls run beside it
    assert observed[PEER][0] is False and observed[PEER][1] >= 2
    # The adapter: the running call keeps its key (its lease, renewed); every call meanwhile is handed its id
    assert observed[ADAPTER] == (True, 1)


# ---- the adapter's settings (no worker needed) ---------------------------------------------------------


def _app(**conf: Any) -> Celery:
    app = Celery(f"settings{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(conf)

    @app.task(shared=False, base=compat.Singleton, name="s.run")
    def run(order_id: str) -> str:
        return order_id

    return app


def test_no_redis_to_use_is_a_configuration_error_naming_what_to_set() -> None:
    app = _app(broker_url="amqp://guest@localhost//", result_backend="rpc://")
    with pytest.raises(ConfigurationError, match=r"neither its result backend \(rpc\) nor its broker \(amqp\)"):
        app.tasks["s.run"].delay("x")


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("singleton_backend_class", "myapp.backends.Custom", "singleton_backend_class"),
        ("singleton_backend_kwargs", {"socket_timeout": 5}, "socket_timeout"),
    ],
)
def test_backend_settings_that_cannot_map_are_refused(setting: str, value: Any, says: str) -> None:
    app = _app(broker_url="redis://127.0.0.1:6379/14", **{setting: value})
    with pytest.raises(ConfigurationError, match=says):
        app.tasks["s.run"].delay("x")


def test_app_settings_map_onto_the_policy_and_the_store() -> None:
    app = _app(
        broker_url="amqp://guest@localhost//",
        result_backend="redis://127.0.0.1:6379/13",
        singleton_backend_class="celery_singleton.backends.redis.RedisBackend",
        singleton_raise_on_duplicate=True,
        singleton_lock_expiry=90,
        singleton_key_prefix="LOCKS_",
    )
    task = app.tasks["s.run"]
    idem = Idempotency.of(app)
    policy = idem.policy_for(task)
    assert (policy.mode, policy.on_duplicate, policy.pending_timeout_seconds) == ("until_done", "raise", 90)
    assert idem.settings.store == "redis://127.0.0.1:6379/13" and idem.settings.key_prefix == "LOCKS_"


def test_an_app_store_of_its_own_is_used_and_a_clashing_key_prefix_refused() -> None:
    app = _app(broker_url="redis://127.0.0.1:6379/14", idempotency_store="memory://", singleton_key_prefix="LOCKS_")
    with pytest.raises(ConfigurationError, match="set idempotency_key_prefix instead"):
        app.tasks["s.run"].delay("x")
    app = _app(broker_url="redis://127.0.0.1:6379/14", idempotency_store="memory://")
    assert Idempotency.of(app.tasks["s.run"].app).settings.store == "memory://"  # the app's, not the broker's


def test_an_idempotency_installed_without_a_store_keeps_its_settings_and_gets_the_zero_configuration_store() -> None:
    app = Celery(f"settings{uuid.uuid4().hex[:6]}", broker="redis://127.0.0.1:6379/14", set_as_current=False)
    Idempotency(app, lease_seconds=12)

    @app.task(shared=False, base=compat.Singleton, name="s.run")
    def run(order_id: str) -> str:
        return order_id

    settings = Idempotency.of(app.tasks["s.run"].app).settings
    assert (settings.store, settings.lease_seconds) == ("redis://127.0.0.1:6379/14", 12)


def test_duplicate_task_error_is_built_as_celery_singleton_builds_it() -> None:
    error = compat.DuplicateTaskError("Attempted to queue a duplicate of task ID abc", "abc")
    assert error.task_id == "abc" and isinstance(error, celery_idem.DuplicateTaskError)


def test_unique_on_on_a_task_whose_typing_is_off_is_refused() -> None:
    # Not drop-in: celery-singleton binds unique_on itself; celery-idem's key_args needs Celery's typing
    app = Celery(f"settings{uuid.uuid4().hex[:6]}", strict_typing=False, set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(shared=False, base=compat.Singleton, name="s.run", unique_on="order_id")
    def run(order_id: str, note: str = "") -> str:
        return order_id

    with pytest.raises(ConfigurationError, match="typing is off"):
        app.tasks["s.run"].delay("x")
