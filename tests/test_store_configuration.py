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
from celery import Celery
from conftest import POSTGRES_URL, require_server
from shop import COUNTER_URL, effects_key
from workers import BACKEND, Worker, execute_as_worker, wait_for

from celery_idem import ConfigurationError, Idempotency, IdempotentTask
from celery_idem.handler import Handler
from celery_idem.protocol import OUTAGE_HEADER, SURPRISES_HEADER
from celery_idem.stores import store_from_url

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
    (f"{_PG_WITH_PASSWORD}/idem_no_such_db_{uuid.uuid4().hex[:6]}", "postgresql", "CREATE DATABASE"),
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
        Handler, "_republish", lambda self, a, k, *, countdown, headers=None: sent.append(dict(headers or {}))
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
    worker = Worker(tmp_path, "redis://127.0.0.1:6379/14", url, prefix, pool="solo", concurrency=1)
    try:
        producer = Celery("plain", broker="redis://127.0.0.1:6379/14", backend=BACKEND, set_as_current=False)
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


def test_a_sentinel_without_a_port_is_on_26379() -> None:
    store = store_from_url("redis+sentinel://127.0.0.1,sentinel-2:26400/mymaster/3")
    manager = store.client.connection_pool.sentinel_manager
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in manager.sentinels] == [("127.0.0.1", 26379), ("sentinel-2", 26400)]  # fmt: skip
    assert store.client.connection_pool.connection_kwargs["db"] == 3
    store.close()
