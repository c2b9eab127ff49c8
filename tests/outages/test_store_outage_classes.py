"""Store errors that are outages are classed as outages, wherever they come from (found by an
attacker): a message is kept however long an outage lasts, a store that cannot be built at first use
(a Redis Cluster that is down) is an outage too, and an eager call whose acquire fails frees its claim.

A Redis outage reported as:

- ``MISCONF ...``: Redis refuses every write while it cannot persist (disk full, failed BGSAVE with
  stop-writes-on-bgsave-error yes): redis-py leaves it a plain ResponseError.
- ``RedisClusterException("Redis Cluster cannot be connected...")``: what RedisCluster raises when
  every node is down (its ConnectionError handler calls nodes_manager.initialize(), which raises
  this and replaces the ConnectionError), and "All slots are not covered" during a failover.
- ``SlotNotCoveredError`` (a RedisClusterException, not a ConnectionError): a failover in progress.
- ``ClusterError("TTL exhausted.")``: redirections during resharding / failover exhausted.

And the other way round: a ``RedisClusterException`` that reports a mistake (keys in two slots, a node
not in cluster mode, a db other than 0) is a surprise, not an outage, so a worker fails the message
after the surprise limit instead of sending it back forever.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery
from celery import Task as CeleryTask
from celery.exceptions import TimeoutError as CeleryTimeoutError
from redis.exceptions import RedisClusterException
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, MemoryStore
from celery_idem.errors import StoreUnavailableError
from celery_idem.protocol import OUTAGE_HEADER, SURPRISES_HEADER
from celery_idem.records import Identity
from celery_idem.stores.redis import RedisStore

OUTAGES = [
    redis.exceptions.ResponseError(
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk. "
        "Commands that may modify the data set are disabled"
    ),
    redis.exceptions.RedisClusterException(
        "Redis Cluster cannot be connected. Please provide at least one reachable node: Error 111 connecting"
    ),
    redis.exceptions.SlotNotCoveredError('Slot "1234" is not covered by the cluster.'),
    redis.exceptions.ClusterError("TTL exhausted."),
]
IDS = ["misconf", "cluster-unreachable", "slot-not-covered", "cluster-ttl-exhausted"]


def _store() -> RedisStore:
    # Nothing listens on port 1; the client never connects (the primitive is replaced below).
    return RedisStore(redis.Redis(host="127.0.0.1", port=1, socket_timeout=0.2, socket_connect_timeout=0.2))


@pytest.mark.parametrize("error", OUTAGES, ids=IDS)
def test_outage_error_is_classed_as_outage(error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()

    def down(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(store, "_acquire", down)
    with pytest.raises(StoreUnavailableError) as caught:
        store.acquire(Identity("", "t", "k"), "f" * 64, "tid", lease_seconds=30, ttl_seconds=60)
    assert caught.value.unexpected is False, f"{type(error).__name__} during an outage is classed unexpected"


@pytest.mark.parametrize("error", OUTAGES, ids=IDS)
def test_message_is_kept_through_a_long_outage(error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    app = Celery("a3-outage", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=store)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    def down(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(store, "_acquire", down)
    republished: list[Any] = []
    monkeypatch.setattr(CeleryTask, "apply_async", lambda task, *a, **k: republished.append(k.get("headers")))
    app.finalize()
    # The outage has lasted 8 trips back to the broker (~90 s), all of them taken for surprises if
    # the error were misclassified, and still goes on.
    headers = {OUTAGE_HEADER: 8, SURPRISES_HEADER: 8}
    execute_as_worker(app, charge.name, "t-8", idempotency_key="k", **headers)
    meta = app.backend.get_task_meta("t-8")
    assert runs == []
    assert len(republished) == 1, f"message dropped as {meta['status']}: {meta['result']!r}"


# ---- a Redis Cluster down when the store is first built ----

DOWN = "redis+cluster://127.0.0.1:1/0"  # nothing listens: every node refused


def test_worker_keeps_the_message_when_the_cluster_is_down_at_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery("a3-cluster", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=DOWN, store_timeout_seconds=0.3)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    republished: list[Any] = []
    monkeypatch.setattr(CeleryTask, "apply_async", lambda task, *a, **k: republished.append(k.get("headers")))
    app.finalize()
    execute_as_worker(app, charge.name, "t-1", idempotency_key="k")
    meta = app.backend.get_task_meta("t-1")
    assert runs == []
    assert len(republished) == 1, f"message consumed as {meta['status']}: {meta['result']!r}"


def test_producer_fails_closed_with_store_unavailable() -> None:
    app = Celery("a3-cluster-p", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=DOWN, store_timeout_seconds=0.3)

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        return x

    app.finalize()
    with pytest.raises(StoreUnavailableError):
        charge.apply_async((1,), idempotency_key="k")


def test_producer_proceeds_when_told_to() -> None:
    app = Celery("a3-cluster-q", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=DOWN, store_timeout_seconds=0.3, on_store_error="proceed")
    sent: list[Any] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        return x

    app.finalize()
    charge._send = lambda args, kwargs, options: sent.append(options) or type("R", (), {})()  # type: ignore[method-assign]
    charge.apply_async((1,), idempotency_key="k")
    assert len(sent) == 1


# ---- an eager call whose acquire fails ----


def test_eager_acquire_outage_frees_the_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    app = Celery("a3-eager", set_as_current=False, backend="cache+memory://")
    app.conf.task_always_eager = True  # task_eager_propagates stays False (Celery's default)
    Idempotency(app, store=store)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    app.finalize()
    real_acquire = store._acquire

    def down(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("store blip")

    monkeypatch.setattr(store, "_is_outage", lambda exc: isinstance(exc, ConnectionError))
    monkeypatch.setattr(store, "_acquire", down)
    first = charge.apply_async((1,), idempotency_key="k")
    assert runs == [] and first.state == "FAILURE"
    monkeypatch.setattr(store, "_acquire", real_acquire)  # the store is back
    second = charge.apply_async((1,), idempotency_key="k")
    try:
        value = second.get(timeout=2)
    except CeleryTimeoutError:
        pytest.fail(
            f"the body never ran, yet the retry was deduplicated={second.deduplicated} onto "
            f"{second.id} (the failed call's id) and waits forever"
        )
    assert value == 1 and runs == [1]


# ---- mistakes reported as RedisClusterException are not outages ----

# Found by an attacker: redis-py raises RedisClusterException for mistakes too (keys in two slots, a
# node not in cluster mode, a db other than 0). Those are not outages: a worker fails the message after
# the 8-surprise limit instead of sending it back forever; only "every node down" is an outage.
PERMANENT = [
    "EVALSHA - all keys must map to the same key slot",
    "Cluster mode is not enabled on this node",
    "Argument 'db' is not possible to use in cluster mode",
    "Invalid args in command: ('EVALSHA',)",
]


@pytest.mark.parametrize("text", PERMANENT)
def test_permanent_cluster_errors_are_outages(text: str) -> None:
    store = RedisStore(redis.Redis(), key_prefix="a4")
    with pytest.raises(StoreUnavailableError) as info:
        with store._guard("acquire", Identity("", "t", "k")):
            raise RedisClusterException(text)
    assert info.value.unexpected, f"{text!r} is treated as a real outage: the message loops forever"
