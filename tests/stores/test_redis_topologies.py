"""RedisStore on real topologies: the server clock and real expiry, a 3-master Redis Cluster and a
Sentinel, each started by these tests from the machine's redis-server."""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REDIS_URL, require_server, wipe
from redis_servers import free_port, need_redis_server, wait_until

from celery_idem import ConfigurationError, StoreUnavailableError
from celery_idem.records import Decision, Identity, State
from celery_idem.stores import store_from_url

FP = "c" * 64


def _walk_one_identity(store: Any, identity: Identity) -> None:
    """claim -> duplicate -> acquire -> busy -> complete -> replay, then the index is clean."""
    assert store.claim(identity, FP, "t1", pending_seconds=60, ttl_seconds=60).decision is Decision.NEW
    assert store.claim(identity, FP, "t2", pending_seconds=60, ttl_seconds=60).decision is Decision.DUPLICATE
    taken = store.acquire(identity, FP, "t1", lease_seconds=30, ttl_seconds=60)
    assert taken.decision is Decision.RUN
    assert store.acquire(identity, FP, "t3", lease_seconds=30, ttl_seconds=60).decision is Decision.BUSY
    assert store.renew(identity, taken.record.owner, lease_seconds=30).ok
    assert store.complete(identity, taken.record.owner, b'"done"').ok
    replay = store.claim(identity, FP, "t4", pending_seconds=60, ttl_seconds=60)
    assert replay.decision is Decision.REPLAY and replay.record.result == b'"done"'


# ---- the server clock and real expiry -----------------------------------------------------------


@pytest.fixture
def real_redis(prefix: str) -> Iterator[Any]:
    require_server("redis")
    store = store_from_url(REDIS_URL, key_prefix=prefix)  # no injected clock: Redis TIME decides
    yield store
    wipe(store)


def test_server_clock_lease_expiry_lets_a_new_attempt_take_over(real_redis: Any) -> None:
    identity = Identity("", "shop.charge", "lease")
    first = real_redis.acquire(identity, FP, "t1", lease_seconds=0.3, ttl_seconds=60)
    assert real_redis.acquire(identity, FP, "t2", lease_seconds=0.3, ttl_seconds=60).decision is Decision.BUSY
    time.sleep(0.4)
    second = real_redis.acquire(identity, FP, "t2", lease_seconds=30, ttl_seconds=60)
    assert second.decision is Decision.RUN
    assert real_redis.complete(identity, first.record.owner, b"1").decision is Decision.LOST
    assert [r.key for r in real_redis.expired_leases(limit=10)] == []


def test_settled_record_is_removed_by_redis_expiry(real_redis: Any) -> None:
    identity = Identity("", "shop.charge", "ttl")
    taken = real_redis.acquire(identity, FP, "t1", lease_seconds=30, ttl_seconds=0.3)
    assert real_redis.complete(identity, taken.record.owner, b"1").ok
    record_key, index_key = real_redis.keys_for(identity)
    assert 0 < real_redis.client.pttl(record_key) <= 300
    assert real_redis.client.zscore(index_key, record_key) is None  # settled: out of the lease index
    time.sleep(0.4)
    assert real_redis.client.exists(record_key) == 0
    assert real_redis.get(identity) is None
    assert real_redis.claim(identity, "d" * 64, "t2", pending_seconds=60, ttl_seconds=60).decision is Decision.NEW


def test_expired_leases_drops_index_entries_whose_record_expired(real_redis: Any) -> None:
    # Given an abandoned attempt whose record Redis already expired (lease 0.1 s + ttl 0.1 s)
    gone = Identity("", "shop.charge", "gone")
    real_redis.acquire(gone, FP, "t1", lease_seconds=0.1, ttl_seconds=0.1)
    stale = Identity("", "shop.charge", "stale")
    real_redis.acquire(stale, FP, "t2", lease_seconds=0.1, ttl_seconds=60)
    time.sleep(0.35)
    record_key, index_key = real_redis.keys_for(gone)
    assert real_redis.client.exists(record_key) == 0
    # When the reconciler asks for stale records
    assert [r.key for r in real_redis.expired_leases(limit=10)] == ["stale"]
    # Then the leftover index entry is gone too
    assert real_redis.client.zscore(index_key, record_key) is None


def test_key_layout_keeps_a_record_and_its_index_shard_in_one_cluster_slot(real_redis: Any) -> None:
    from redis.cluster import key_slot

    slots = set()
    for n in range(200):
        record_key, index_key = real_redis.keys_for(Identity("tenant", "shop.charge", f"order-{n}"))
        assert key_slot(record_key.encode()) == key_slot(index_key.encode())
        slots.add(key_slot(index_key.encode()))
    # the index is spread over its shards, not piled on one slot
    assert len(slots) == real_redis.index_shards


# ---- the reconciler reads what a run can use ------------------------------------------------------


@pytest.mark.parametrize(("page", "batch"), [(128, 32), (3, 2)])  # the defaults; pages far smaller than a shard
def test_expired_leases_reads_about_its_limit_not_a_limit_per_shard(
    real_redis: Any, monkeypatch: pytest.MonkeyPatch, page: int, batch: int
) -> None:
    import celery_idem.stores.redis.scripts as redis_scripts

    # Given 160 stale records over the 16 shards (about 10 each), each with a kept call of 4 KiB,
    # and leftovers whose records went (settled or forgotten) in the index among them
    identities = [Identity("", "shop.sync", f"job-{n:03d}") for n in range(160)]
    for n, identity in enumerate(identities):
        real_redis.acquire(identity, FP, f"t{n}", lease_seconds=10 + n, ttl_seconds=600, call=b"x" * 4096)
    for identity in identities[:20:3]:
        real_redis.forget(identity)  # the record goes; make its index entry a leftover again
        record_key, index_key = real_redis.keys_for(identity)
        real_redis.client.zadd(index_key, {record_key: 1.0})
    real_redis.advance_clock_for_tests(200)  # every lease past, no record past its expiry
    monkeypatch.setattr(real_redis, "_index_page", page)
    monkeypatch.setattr(real_redis, "_due_batch", batch)
    decoded: list[str] = []
    replies: list[int] = []
    real_record = redis_scripts.record

    def counted(flat: Any) -> Any:
        record = real_record(flat)
        decoded.append(record.key)
        return record

    monkeypatch.setattr(redis_scripts, "record", counted)
    script = real_redis._scripts["due"]

    def due(keys: list[str], args: list[Any]) -> Any:
        replies.append(len(keys) - 1)
        return script(keys=keys, args=args)

    monkeypatch.setitem(real_redis._scripts, "due", due)
    # When a run asks for 10
    found = real_redis.expired_leases(limit=10)
    # Then it gets the 10 oldest leases across every shard...
    live = [i.key for i in identities if i not in identities[:20:3]]
    assert [r.key for r in found] == live[:10]
    # ...having decoded those 10 records only (not 10 per shard: 160), in replies of at most a batch
    assert sorted(decoded) == sorted(live[:10])
    assert max(replies) <= batch and sum(replies) <= 10 + 7  # plus at most the 7 leftovers, dropped
    # And a run that asks for everything still gets everything, in lease order
    decoded.clear()
    assert [r.key for r in real_redis.expired_leases(limit=1000)] == live
    assert len(decoded) == len(live)


# ---- where a record lives depends on nothing an operator can turn ----------------------------------


def test_a_record_key_is_fixed_by_the_prefix_and_the_identity_alone(real_redis: Any) -> None:
    # The layout docs/stores.md and stores/redis/lua/_prelude.lua describe, pinned: a change of it hides
    # every record written before, so it must fail here first.
    identity = Identity("tenant-7", "shop.charge", "order-42-charge")
    record_key, index_key = real_redis.keys_for(identity)
    prefix = real_redis.key_prefix
    assert record_key == f"{{{prefix}:{record_key.split(':')[1][:-1]}}}:r:8:tenant-7:11:shop.charge:order-42-charge"
    assert index_key == record_key.split(":r:")[0] + ":lease"
    default = store_from_url(REDIS_URL)  # prefix "idem": the example on the stores page
    assert default.keys_for(Identity("", "shop.charge", "order-42-charge"))[0] == (
        "{idem:2}:r:0::11:shop.charge:order-42-charge"
    )
    assert default.keys_for(identity)[0] == "{idem:8}:r:8:tenant-7:11:shop.charge:order-42-charge"
    default.close()


@pytest.mark.parametrize("shards", ["8", "32", "1"])
def test_another_index_shard_count_is_refused_not_a_store_that_hides_every_record(real_redis: Any, shards: str) -> None:
    # Given live records: one settled, one running, one stale (its lease ran out)
    done, running, stale = (Identity("", "shop.charge", name) for name in ("done", "running", "stale"))
    taken = real_redis.acquire(done, FP, "t1", lease_seconds=30, ttl_seconds=600)
    assert real_redis.complete(done, taken.record.owner, b'"paid"').ok
    real_redis.acquire(running, FP, "t2", lease_seconds=600, ttl_seconds=600)
    real_redis.acquire(stale, FP, "t3", lease_seconds=1, ttl_seconds=600)
    # When a deploy sets another shard count, Then it is a mistake named at configuration...
    url = f"{REDIS_URL}?index_shards={shards}"
    with pytest.raises(ConfigurationError, match="index_shards is fixed at 16"):
        store_from_url(url, key_prefix=real_redis.key_prefix)
    # ...while the shard count the layout has is accepted, and finds every record where it was
    again = store_from_url(f"{REDIS_URL}?index_shards=16", key_prefix=real_redis.key_prefix)
    record = again.get(done)
    assert record is not None and record.result == b'"paid"'
    assert again.claim(done, FP, "t4", pending_seconds=60, ttl_seconds=600).decision is Decision.REPLAY
    assert again.acquire(running, FP, "t5", lease_seconds=30, ttl_seconds=600).decision is Decision.BUSY
    again.advance_clock_for_tests(5)
    assert [r.key for r in again.expired_leases(limit=10)] == ["stale"]
    again.close()


# ---- Redis Cluster ------------------------------------------------------------------------------


def test_redis_cluster_runs_every_transition_across_nodes(redis_cluster_url: str, prefix: str) -> None:
    store = store_from_url(redis_cluster_url, key_prefix=prefix)
    identities = [Identity("", "shop.charge", f"order-{n}") for n in range(40)]
    for identity in identities:
        _walk_one_identity(store, identity)
    # stale records come back from every shard, on every node
    stale = [Identity("", "shop.sync", f"job-{n}") for n in range(20)]
    for identity in stale:
        store.acquire(identity, FP, "t", lease_seconds=0.05, ttl_seconds=60)
    time.sleep(0.2)
    assert sorted(r.key for r in store.expired_leases(limit=100)) == sorted(i.key for i in stale)
    nodes_used = {store.client.get_node_from_key(store.keys_for(i)[0]).port for i in identities}
    assert len(nodes_used) == 3, "records should spread over all three masters"
    # the operators' scan reads settled records (strings) and unsettled ones (hashes) on every node
    assert {r.key for r in store.records(limit=1000)} == {i.key for i in identities + stale}
    assert store.forget(identities[0]) is True
    # every worker process's liveness record is read in one script: one slot, whatever the ids
    processes = [f"{n:016x}" for n in range(50)]
    for process in processes[::2]:
        assert store.keep_alive(process, "tok", seconds=30, create=True).ok
    assert store.alive(processes) == set(processes[::2])
    store.close()


def test_a_cluster_url_with_several_seeds_starts_past_a_dead_first_seed(redis_cluster_url: str, prefix: str) -> None:
    # Given seeds h1:p1,h2:p2 whose first node is down (nothing listens on its port)
    live = redis_cluster_url.partition("://")[2]
    url = f"redis+cluster://127.0.0.1:{free_port()},{live}"
    # When the store is opened, Then the client finds the cluster through the next seed
    store = store_from_url(url, key_prefix=prefix)
    _walk_one_identity(store, Identity("", "shop.charge", "past-a-dead-seed"))
    assert len(store.client.get_primaries()) == 3
    store.close()
    # And every seed down is an outage, not a mistake in the URL
    with pytest.raises(StoreUnavailableError):
        store_from_url(f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", key_prefix=prefix)


# ---- Sentinel -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = need_redis_server()
    require_server("redis")
    from urllib.parse import urlsplit

    main = urlsplit(REDIS_URL)
    root: Path = tmp_path_factory.mktemp("sentinel")
    port = free_port()
    config = root / "sentinel.conf"
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {root}\n"
        f"sentinel monitor idemtest {main.hostname} {main.port or 6379} 1\n"
        "sentinel down-after-milliseconds idemtest 60000\n"
    )
    node = subprocess.Popen([binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        wait_until(lambda: redis.Redis(port=port).execute_command("SENTINEL MASTERS"), "sentinel")
        yield f"redis+sentinel://127.0.0.1:{port}/idemtest{main.path or '/0'}"
    finally:
        node.terminate()
        node.wait(timeout=10)


def test_sentinel_url_finds_the_master_and_runs_every_transition(sentinel: str, prefix: str) -> None:
    store = store_from_url(sentinel, key_prefix=prefix)
    _walk_one_identity(store, Identity("", "shop.charge", "via-sentinel"))
    record = store.get(Identity("", "shop.charge", "via-sentinel"))
    assert record is not None and record.state is State.COMPLETED
    wipe(store)


# ---- Valkey --------------------------------------------------------------------------------------
# Valkey speaks the Redis protocol (scripts, TIME, cluster slots, Sentinel), so its URLs name the same
# clients. CI has no Valkey server (not in Debian 12 nor on PyPI): these run the valkey schemes on
# Redis, which is what tells the URL apart from the server.


def test_a_valkey_url_is_the_same_store_as_its_redis_url(prefix: str) -> None:
    require_server("redis")
    valkey = store_from_url(REDIS_URL.replace("redis://", "valkey://", 1), key_prefix=prefix)
    identity = Identity("", "shop.charge", "via-valkey")
    _walk_one_identity(valkey, identity)
    same = store_from_url(REDIS_URL, key_prefix=prefix)
    record = same.get(identity)
    assert record is not None and record.state is State.COMPLETED
    assert valkey.url is not None and valkey.url.startswith("valkey://")
    wipe(same)
    valkey.close()
    same.close()


def test_valkey_cluster_and_sentinel_urls_open_their_topologies(
    redis_cluster_url: str, sentinel: str, prefix: str
) -> None:
    for url in (
        redis_cluster_url.replace("redis+cluster://", "valkey+cluster://", 1),
        sentinel.replace("redis+sentinel://", "valkey+sentinel://", 1),
    ):
        store = store_from_url(url, key_prefix=prefix)
        _walk_one_identity(store, Identity("", "shop.charge", f"via-{url.partition(':')[0]}"))
        wipe(store)
        store.close()


def test_a_valkeys_url_speaks_tls_and_a_bad_valkey_path_is_refused() -> None:
    tls = store_from_url("valkeys://127.0.0.1:1/0", timeout_seconds=0.5)
    assert tls.client.connection_pool.connection_class.__name__ == "SSLConnection"  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="the path of a Redis URL is a database number"):
        store_from_url("valkey://127.0.0.1:6379/orders")


# ---- a full Redis ---------------------------------------------------------------------------------


def test_a_full_redis_is_store_unavailable_not_a_raw_error(tmp_path: Path, prefix: str) -> None:
    # Given a Redis with no memory left and no eviction
    binary = need_redis_server()
    port = free_port()
    node = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            "2mb",
            "--maxmemory-policy",
            "noeviction",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        wait_until(client.ping, "redis")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for n in range(10_000):
                client.set(f"filler:{n}", "x" * 10_000)
        store = store_from_url(f"redis://127.0.0.1:{port}/0", key_prefix=prefix)
        identity = Identity("", "shop.charge", "full")
        # When a script's first write must add data (a new record's HSET, a renewal; by Redis's rules
        # a script that already wrote may finish past the limit), Then Redis refuses it, and the
        # store says StoreUnavailableError, so on_store_error applies
        with pytest.raises(StoreUnavailableError, match="maxmemory"):
            taken = store.acquire(identity, FP, "t1", lease_seconds=60, ttl_seconds=60)
            for _ in range(20):
                store.renew(identity, taken.record.owner, lease_seconds=60)
                with contextlib.suppress(redis.exceptions.OutOfMemoryError):
                    client.set(f"more:{uuid.uuid4()}", "x" * 10_000)
        store.close()
    finally:
        node.terminate()
        node.wait(timeout=10)


# ---- the connection a transition runs on ----------------------------------------------------------


def test_a_flushed_script_cache_is_loaded_again(real_redis: Any) -> None:
    """A restart, a failover or SCRIPT FLUSH empties the server's scripts: the next transition loads
    its script again and answers (the store calls scripts by SHA on its pool's connections)."""
    walked = Identity("", "shop.charge", "before")
    _walk_one_identity(real_redis, walked)
    real_redis.client.script_flush()
    _walk_one_identity(real_redis, Identity("", "shop.charge", "after"))


def test_a_reply_that_came_too_late_is_never_read_as_the_next_ones(prefix: str) -> None:
    """A transition whose reply outlived the store's timeout fails; the reply that arrives later is
    never taken for the next transition's (its connection is not handed back with it unread)."""
    require_server("redis")
    from proxy import Proxy

    proxy = Proxy(6379)
    store = store_from_url(proxy.url(15), key_prefix=prefix, timeout_seconds=0.3)
    try:
        held, waiting = Identity("", "shop.charge", "held"), Identity("", "shop.charge", "waiting")
        assert store.claim(waiting, FP, "t-w", pending_seconds=60, ttl_seconds=60).decision is Decision.NEW
        proxy.hold(1.0)
        with pytest.raises(StoreUnavailableError):
            store.claim(held, FP, "t-h", pending_seconds=60, ttl_seconds=60)  # carried out late
        time.sleep(1.2)
        again = store.claim(waiting, FP, "t-w2", pending_seconds=60, ttl_seconds=60)
        assert again.decision is Decision.DUPLICATE and again.record is not None
        assert again.record.key == "waiting" and again.record.task_id == "t-w"
        late = store.claim(held, FP, "t-h2", pending_seconds=60, ttl_seconds=60)
        assert late.decision is Decision.DUPLICATE and late.record is not None and late.record.task_id == "t-h"
    finally:
        proxy.close()
        wipe(store)


def test_a_sentinel_masters_late_reply_is_never_read_as_the_next_ones(tmp_path: Path, prefix: str) -> None:
    """As above, through Sentinel, whose connections do not drop themselves when a read fails (found by
    an attack: the next claim of a claimed key read the timed-out claim's late reply and answered NEW)."""
    import redis

    binary = need_redis_server()
    main_port, sentinel_port = free_port(), free_port()
    main = subprocess.Popen(
        [binary, "--port", str(main_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    config = tmp_path / "sentinel.conf"
    config.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor late 127.0.0.1 {main_port} 1\nsentinel down-after-milliseconds late 60000\n"
    )
    node = subprocess.Popen([binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: redis.Redis(port=sentinel_port).execute_command("SENTINEL MASTERS"), "sentinel")
        store = store_from_url(
            f"redis+sentinel://127.0.0.1:{sentinel_port}/late/0", key_prefix=prefix, timeout_seconds=0.3
        )
        held, waiting = Identity("", "shop.charge", "held"), Identity("", "shop.charge", "waiting")
        assert store.claim(waiting, FP, "t-w", pending_seconds=60, ttl_seconds=60).decision is Decision.NEW
        redis.Redis(port=main_port).execute_command("CLIENT", "PAUSE", "800", "ALL")  # the server stalls
        with pytest.raises(StoreUnavailableError):
            store.claim(held, FP, "t-h", pending_seconds=60, ttl_seconds=60)  # carried out late
        time.sleep(1.0)
        again = store.claim(waiting, FP, "t-w2", pending_seconds=60, ttl_seconds=60)
        assert again.decision is Decision.DUPLICATE and again.record is not None
        assert again.record.key == "waiting" and again.record.task_id == "t-w"
    finally:
        for process in (node, main):
            process.terminate()
            process.wait(timeout=10)
