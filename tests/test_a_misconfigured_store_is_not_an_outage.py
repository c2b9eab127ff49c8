"""Found by an attacker: a store URL that can never work (a typo in the port, a bad option,
redis+cluster:// against a plain Redis) is a ConfigurationError at first use, which fails the task;
it is never taken for an outage, which would send every message back to the broker forever."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from conftest import require_server
from workers import execute_as_worker

from celery_idem import ConfigurationError, Idempotency, IdempotentTask
from celery_idem.handler import Handler
from celery_idem.protocol import OUTAGE_HEADER, SURPRISES_HEADER

URLS = [
    "redis://127.0.0.1:notaport/0",  # typo in the port
    "redis://127.0.0.1:6379/0?index_shards=sixteen",  # bad store option
    "redis+cluster://127.0.0.1:6379",  # plain (non-cluster) Redis; needs a local redis on 6379
]


@pytest.mark.parametrize("url", URLS)
def test_a_misconfigured_store_fails_the_task_instead_of_looping_its_message(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "6379" in url:
        require_server("redis")
    app = Celery("a4-misconf", set_as_current=False, broker="memory://", backend="cache+memory://")
    idem = Idempotency(app, store=url)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    app.finalize()
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(
        Handler, "_republish", lambda self, a, k, *, countdown, headers=None: sent.append(dict(headers or {}))
    )
    # A message that already went back 1000 times (and claims 1000 "surprises"): it should have failed long ago.
    execute_as_worker(app, charge.name, "t-1", idempotency_key="k", **{OUTAGE_HEADER: 1000, SURPRISES_HEADER: 0})
    with pytest.raises(ConfigurationError) as info:
        _ = idem.store
    assert isinstance(info.value, ConfigurationError) and "invalid store URL" in str(info.value)
    assert runs == []
    assert not sent, f"a misconfigured store sent the message back again: {sent} ({info.value})"
