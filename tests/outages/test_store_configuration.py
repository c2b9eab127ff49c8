"""Mistakes are not outages (DESIGN): a store configuration that can never work is a
ConfigurationError at first use, naming the URL (password redacted) and the fix. It fails the task
once; it is never taken for an outage, which would send every message back to the broker forever
and tell a producer to run unprotected (on_store_error='proceed').

Also: every limit a setting accepts works on every store, or the setting refuses it with the reason.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from addresses import REDIS_BROKER_URL, REDIS_URL
from celery import Celery
from conftest import MARIADB_URL, POSTGRES_URL, make_store, require_server, wipe
from shop import COUNTER_URL, effects_key
from workers import BACKEND, Worker, execute_as_worker, wait_for

from celery_idem import ConfigurationError, Idempotency, IdempotentTask
from celery_idem.config import MAX_RESULT_BYTES, MAX_SECONDS, MAX_STORE_TIMEOUT_SECONDS, MIN_STORE_TIMEOUT_SECONDS
from celery_idem.handler import Handler
from celery_idem.protocol import OUTAGE_HEADER, SURPRISES_HEADER
from celery_idem.records import Decision, Identity, State
from celery_idem.stores import Store, store_from_url

_PG = POSTGRES_URL.rpartition("/")[0]
_PG_WITH_PASSWORD = _PG.replace("postgres@", "postgres:s3cret-pw@", 1) if "postgres@" in _PG else _PG

# (URL, the server it needs, what the error must say)
MISTAKES = [
    ("redis://127.0.0.1:notaport/0", None, "notaport"),  # typo in the port
    ("redis://127.0.0.1:6379/0?index_shards=sixteen", None, "index_shards"),  # bad store option
    ("redis+cluster://127.0.0.1:6379", "redis", "Cluster mode is not enabled"),  # plain Redis, not a cluster
    ("redis://127.0.0.1:6379/99", "redis", "databases"),  # a database the server does not have
    ("redis://127.0.0.1:6379/abc", None, "database number"),  # not silently database 0
    ("sqlite://relative.db", None, "sqlite:///relative/path"),  # two slashes: not a SQLite URL
    ("redis+cluster://127.0.0.1:7100/3", None, "database 0 only"),  # a cluster has no database 3
    # A fixed name: pytest-xdist's processes must collect the same test ids (nothing creates this database).
    (f"{_PG_WITH_PASSWORD}/idem_no_such_db", "postgresql", "CREATE DATABASE"),
    (f"{_PG.replace('postgres@', 'idem_no_such_role@', 1)}/test", "postgresql", "CREATE ROLE"),
    (f"{MARIADB_URL.rpartition('/')[0]}/idem_no_such_db", "mariadb", "CREATE DATABASE"),
]


def _app(url: str) -> tuple[Celery, Idempotency, Any, list[int]]:
    app = Celery("misconfigured", set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store=url)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    app.finalize()
    return app, idem, charge, runs


def _check_names_url_and_fix(error: BaseException, url: str, says: str) -> None:
    text = str(error)
    assert isinstance(error, ConfigurationError), f"{type(error).__name__}: {error}"
    assert "s3cret-pw" not in text, f"the password leaked: {text}"
    assert url.replace("s3cret-pw", "***") in text, f"the URL is not named: {text}"
    assert says in text, text
    assert "on_store_error" not in text and "proceed" not in text, f"a producer is nudged to run unprotected: {text}"


@pytest.mark.parametrize(("url", "server", "says"), MISTAKES, ids=[m[0].split("@")[-1] for m in MISTAKES])
def test_a_misconfigured_store_fails_the_task_instead_of_looping_its_message(
    url: str, server: str | None, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if server:
        require_server(server)
    app, idem, charge, runs = _app(url)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(
        Handler, "republish", lambda self, a, k, *, countdown, headers=None: sent.append(dict(headers or {}))
    )
    # A message that already went back 1000 times (and claims 0 "surprises"): it should have failed long ago.
    execute_as_worker(app, charge.name, "t-1", idempotency_key="k", **{OUTAGE_HEADER: 1000, SURPRISES_HEADER: 0})
    assert runs == []
    assert not sent, f"a misconfigured store sent the message back again: {sent}"
    result = app.AsyncResult("t-1")
    assert result.state == "FAILURE", result.state
    _check_names_url_and_fix(result.result, url, says)
    # A fresh message of its own (no outage history) fails once the same way
    sent.clear()
    execute_as_worker(app, charge.name, "t-2", idempotency_key="k2")
    assert not sent and app.AsyncResult("t-2").state == "FAILURE"


@pytest.mark.parametrize(("url", "server", "says"), MISTAKES, ids=[m[0].split("@")[-1] for m in MISTAKES])
def test_a_misconfigured_store_is_a_configuration_error_for_the_producer(
    url: str, server: str | None, says: str
) -> None:
    if server:
        require_server(server)
    app, idem, charge, runs = _app(url)
    with pytest.raises(ConfigurationError) as info:
        charge.apply_async((1,), idempotency_key="k")
    _check_names_url_and_fix(info.value, url, says)
    with pytest.raises(ConfigurationError):
        idem.get(charge, "k")


def test_a_worker_fails_a_message_of_a_misconfigured_store_once(tmp_path: Path) -> None:
    # Given a real worker (a Redis broker) whose store names a database the server does not have
    require_server("redis")
    prefix = f"c{uuid.uuid4().hex[:10]}"
    url = "redis://127.0.0.1:6379/99"
    worker = Worker(tmp_path, REDIS_BROKER_URL, url, prefix, pool="solo", concurrency=1)
    try:
        producer = Celery("plain", broker=REDIS_BROKER_URL, backend=BACKEND, set_as_current=False)
        # When a service that does not import the task sends it keyed
        task_id = f"cfg-{uuid.uuid4().hex}"
        result = producer.send_task(
            "shop.charge", (42, 100), task_id=task_id, queue=prefix, headers={"idempotency_key": "order-42"}
        )
        # Then the message fails once with the ConfigurationError naming the URL and the fix
        wait_for(lambda: result.state == "FAILURE", "the task to fail", 60)
        assert "ConfigurationError" in repr(type(result.result)) or "ConfigurationError" in str(result.traceback)
        assert url in str(result.result) and "databases" in str(result.result)
        # And it is not sent back to the broker: one delivery, then nothing, and the body never ran
        time.sleep(3)
        assert worker.output().count(f"Task shop.charge[{task_id}] received") == 1, worker.output()[-3000:]
        counter = redis.Redis.from_url(COUNTER_URL)
        assert counter.get(effects_key(prefix, "shop.charge", "order-42")) is None
        producer.close()
    finally:
        worker.stop()


def test_a_redis_url_error_names_the_url_with_its_password_redacted() -> None:
    with pytest.raises(ConfigurationError) as info:
        store_from_url("redis://user:s3cret-pw@127.0.0.1:6379/abc")
    assert "s3cret-pw" not in str(info.value) and "redis://user:***@127.0.0.1:6379/abc" in str(info.value)


def test_a_unix_socket_url_keeps_its_path_and_database() -> None:
    store = store_from_url("unix:///tmp/no-such-redis.sock?db=3&index_shards=16")
    assert store.client.connection_pool.connection_kwargs["path"] == "/tmp/no-such-redis.sock"
    assert store.client.connection_pool.connection_kwargs["db"] == 3
    store.close()


def test_a_sentinel_without_a_port_is_on_26379() -> None:
    store = store_from_url("redis+sentinel://127.0.0.1,sentinel-2:26400/mymaster/3")
    manager = store.client.connection_pool.sentinel_manager
    assert [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in manager.sentinels
    ] == [("127.0.0.1", 26379), ("sentinel-2", 26400)]
    assert store.client.connection_pool.connection_kwargs["db"] == 3
    store.close()


# ---- every limit a setting accepts works on every store -------------------------------------------

DURATIONS = [
    "ttl_seconds",
    "lease_seconds",
    "pending_timeout_seconds",
    "busy_wait_seconds",
    "stale_grace_seconds",
    "reconcile_interval_seconds",
    "store_timeout_seconds",
    "inspect_timeout_seconds",
]


@pytest.mark.parametrize("name", DURATIONS)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), MAX_SECONDS * 2.0, -1.0])
def test_a_duration_no_store_can_hold_is_refused_at_configuration_with_the_reason(name: str, value: float) -> None:
    app = Celery("limits", set_as_current=False, broker="memory://")
    with pytest.raises(ConfigurationError, match=name) as info:
        Idempotency(app, store="memory://", **{name: value})
    if value != -1.0:
        assert "finite number of seconds" in str(info.value) or "greater than" in str(info.value)


def test_a_result_limit_past_what_redis_takes_is_refused_at_configuration() -> None:
    app = Celery("limits", set_as_current=False, broker="memory://")
    with pytest.raises(ConfigurationError, match="max_result_bytes"):
        Idempotency(app, store="memory://", max_result_bytes=MAX_RESULT_BYTES + 1)
    assert Idempotency(app, store="memory://", max_result_bytes=MAX_RESULT_BYTES).settings.max_result_bytes > 0


@pytest.mark.parametrize("name", DURATIONS)
def test_the_longest_duration_a_setting_takes_is_accepted(name: str) -> None:
    most = MAX_STORE_TIMEOUT_SECONDS if "timeout" in name else float(MAX_SECONDS)
    app = Celery("limits", set_as_current=False, broker="memory://")
    assert getattr(Idempotency(app, store="memory://", **{name: most}).settings, name) == most


def test_a_task_whose_policy_keeps_forever_fails_once_instead_of_looping_its_message(
    monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    # Given a task that asks to keep its outcome forever, on Redis (whose PEXPIRE refuses inf)
    require_server("redis")
    app = Celery("forever", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=REDIS_URL, key_prefix=prefix)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, idempotency={"ttl_seconds": float("inf")})
    def keep(x: int) -> int:
        runs.append(x)
        return x

    app.finalize()
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(
        Handler, "republish", lambda self, a, k, *, countdown, headers=None: sent.append(dict(headers or {}))
    )
    # When a worker runs its message, Then it fails once with the reason, and is not sent back
    execute_as_worker(app, keep.name, "t-forever", idempotency_key="k")
    result = app.AsyncResult("t-forever")
    assert (result.state, runs, sent) == ("FAILURE", [], [])
    assert isinstance(result.result, ConfigurationError) and "ttl_seconds" in str(result.result)
    assert "100 years" in str(result.result)
    # And the producer is told the same, before anything is claimed
    with pytest.raises(ConfigurationError, match="ttl_seconds"):
        keep.apply_async((1,), idempotency_key="k2")


def test_every_store_holds_the_longest_durations(store: Store, clock: Any) -> None:
    identity = Identity("", "shop.keep", "forever-ish")
    fp = "e" * 64
    most = float(MAX_SECONDS)
    claimed = store.claim(identity, fp, "t1", pending_seconds=most, ttl_seconds=most)
    assert claimed.decision is Decision.NEW
    assert store.claim(identity, fp, "t2", pending_seconds=most, ttl_seconds=most).decision is Decision.DUPLICATE
    taken = store.acquire(identity, fp, "t1", lease_seconds=most, ttl_seconds=most)
    assert taken.decision is Decision.RUN
    assert store.renew(identity, taken.record.owner, lease_seconds=most).ok
    assert store.release(identity, taken.record.owner, pending_seconds=most).ok
    again = store.acquire(identity, fp, "t1", lease_seconds=most, ttl_seconds=most)
    assert again.decision is Decision.RUN
    clock.advance(most / 2)  # half a century later the lease still holds
    assert store.acquire(identity, fp, "t3", lease_seconds=30, ttl_seconds=60).decision is Decision.BUSY
    assert store.expired_leases(limit=10) == []
    assert store.complete(identity, again.record.owner, b'"kept"').ok
    clock.advance(most * 0.99)  # and its outcome outlives almost a century more
    record = store.get(identity)
    assert record is not None and record.state is State.COMPLETED and record.result == b'"kept"'
    assert store.claim(identity, fp, "t4", pending_seconds=60, ttl_seconds=60).decision is Decision.REPLAY


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "redis", "mariadb"])
@pytest.mark.parametrize("seconds", [MIN_STORE_TIMEOUT_SECONDS, MAX_STORE_TIMEOUT_SECONDS])
def test_every_store_takes_the_store_timeout_limits(kind: str, seconds: float, tmp_path: Path, prefix: str) -> None:
    store = make_store(kind, tmp_path, prefix, timeout_seconds=seconds)
    if kind == "postgresql":
        with store.engine.connect() as connection:  # type: ignore[attr-defined]
            shown = connection.exec_driver_sql("SHOW statement_timeout").scalar()
        assert shown == ("1ms" if seconds < 1 else "1h"), shown  # never 0, which means "no timeout"
    if kind == "mariadb":
        with store.engine.connect() as connection:  # type: ignore[attr-defined]
            shown = connection.exec_driver_sql("SELECT @@max_statement_time, @@innodb_lock_wait_timeout").one()
        assert tuple(shown) == ((0.001, 1) if seconds < 1 else (3600.0, 3600)), shown  # never 0: "no timeout"
    if seconds == MAX_STORE_TIMEOUT_SECONDS:
        identity = Identity("", "shop.charge", "timeout-limits")
        assert store.claim(identity, "f" * 64, "t", pending_seconds=60, ttl_seconds=60).decision is Decision.NEW
        wipe(store)
    else:
        store.close()  # a millisecond is honoured: most calls then time out (an outage), nothing is written
    with pytest.raises(ConfigurationError, match="timeout_seconds"):
        make_store(kind, tmp_path, prefix, timeout_seconds=seconds * 2 if seconds > 1 else seconds / 2)
