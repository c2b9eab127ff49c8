"""Found by an attacker: deferred outcome writes starve the renewals of live leases (same thread, serial calls).

Heartbeat._run renews the leases due, then tries every settlement due, one after the other, with
no renewal in between; each try of a settlement whose store does not answer costs up to the store's
timeout (2 s by default: a black-holed node, the connect timeout). Settlements are due again
SETTLE_RETRY_SECONDS (1 s) after each try, so as soon as the timeout is longer than the retry period
the settlements bunch up into one batch per pass, and a pass lasts about K * timeout: a live lease
is renewed at most once per pass. When the node that does not answer is not the one a live lease is
on (redis+cluster with one master down and the other shards up, which is exactly when outcomes are
deferred while other attempts keep running), a live attempt's lease runs out while its body still
runs: a redelivered copy or a new message with its key is told RUN and the side effect happens twice.
It lasts as long as the partial outage (a settlement is retried for the record's whole TTL).

Scaled 4x down, same ratios: store timeout 0.5 s (2 s), retry period 0.25 s (1 s), lease 1.5 s
(a beat every 0.5 s; 6 s real), 8 deferred outcomes. At real scale, lease 30 s: ~15 deferred
outcomes in one process (a threads/gevent pool) are enough.
"""

from __future__ import annotations

import time
import uuid

import pytest

import celery_idem.heartbeat as heartbeat_module
from celery_idem.errors import StoreUnavailableError
from celery_idem.heartbeat import Heartbeat
from celery_idem.records import Identity
from celery_idem.stores.base import Transition
from celery_idem.stores.memory import MemoryStore

FP = "f" * 64
LEASE = 1.5
STORE_TIMEOUT = 0.5


def test_deferred_writes_do_not_starve_live_renewals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat_module, "SETTLE_RETRY_SECONDS", 0.25)
    store = MemoryStore()  # the healthy shard the live attempt's record is on
    heartbeat = Heartbeat()

    def dead_shard() -> Transition:  # outcomes of attempts whose records are on the dead shard
        time.sleep(STORE_TIMEOUT)
        raise StoreUnavailableError("node down: timed out")

    for _ in range(8):
        heartbeat.defer(Identity("", "t", f"dead-{uuid.uuid4().hex}"), dead_shard, lambda: False, seconds=600)
        time.sleep(0.01)
    live = Identity("", "t", "live")
    taken = store.acquire(live, FP, "task-1", lease_seconds=LEASE, ttl_seconds=600)
    assert taken.decision.value == "RUN" and taken.record is not None
    lease = heartbeat.add(store, live, taken.record.owner, LEASE)
    try:
        deadline = time.monotonic() + 4.5  # the body runs on, 3 leases long; the heartbeat should hold it
        while time.monotonic() < deadline:
            other = store.acquire(live, FP, f"copy-{uuid.uuid4().hex}", lease_seconds=LEASE, ttl_seconds=600)
            assert other.decision.value == "BUSY", (
                "a live attempt's lease ran out while its heartbeat was busy retrying deferred outcomes: "
                f"another attempt was told {other.decision.value}"
            )
            time.sleep(0.05)
    finally:
        heartbeat.remove(lease)
