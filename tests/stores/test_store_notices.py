"""A store's notices (``Store.watch``), on every store: a waiter is woken when the record it waits
on settles, is freed or is removed, where the store sends notices (Redis: a PUBLISH from the
scripts; memory: a condition); where it cannot (the SQL stores), ``wait`` sleeps its whole time and
the waiter polls. A notice is only a hint: the waiter reads the record again after every wait.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from celery_idem.records import ErrorInfo, Identity
from celery_idem.stores import Store

TOKEN = "owner-token"
NOTIFIED_WAIT, POLLED_WAIT = 30.0, 0.5  # seconds a wait may take without a notice
NOTIFYING = ("memory", "redis")  # the stores whose watches wake their waiters; the SQL stores poll


def _end(store: Store, identity: Identity, ending: str) -> None:
    if ending == "complete":
        store.complete(identity, TOKEN, b"1")
    elif ending == "fail":
        store.fail(identity, TOKEN, ErrorInfo(type="E", module="m", message="no"))
    elif ending == "release":
        store.release(identity, TOKEN)
    else:
        store.forget(identity)


@pytest.mark.parametrize("ending", ["complete", "fail", "release", "forget"])
def test_a_watcher_is_woken_when_the_record_settles_or_is_freed(store: Store, store_kind: str, ending: str) -> None:
    notifies = store_kind in NOTIFYING
    # Given a running attempt, and a waiter watching its record
    identity = Identity("", "notices.task", f"w-{uuid.uuid4().hex[:8]}")
    store.claim(identity, "fp", "tid", pending_seconds=60, ttl_seconds=60)
    store.acquire(identity, "fp", "tid", lease_seconds=60, ttl_seconds=60, owner=TOKEN)
    ended = threading.Event()

    def end_it() -> None:
        time.sleep(0.2)  # the waiter is in its wait by then (or sees the write counted when it enters)
        _end(store, identity, ending)
        ended.set()

    with store.watch(identity) as wait:
        writer = threading.Thread(target=end_it)
        writer.start()
        started = time.monotonic()
        # When the attempt ends while the waiter waits
        assert wait.notices is notifies
        wait(NOTIFIED_WAIT if notifies else POLLED_WAIT)
        waited = time.monotonic() - started
        writer.join()
    if notifies:
        # Then the notice wakes it, long before the wait's own end (a generous bound: it tells a
        # wake-up from a 30 s sleep, nothing about speed)
        assert ended.is_set() and waited < NOTIFIED_WAIT / 2, waited
    else:
        # Or, on a store that cannot notify, the wait is a plain sleep
        assert waited >= POLLED_WAIT, waited


def test_a_watch_with_nothing_to_wait_for_sleeps_its_time_and_never_fails(store: Store) -> None:
    identity = Identity("", "notices.task", f"none-{uuid.uuid4().hex[:8]}")
    with store.watch(identity) as wait:
        started = time.monotonic()
        wait(0.3)
        wait(0.3)
        assert time.monotonic() - started >= 0.55


def test_waiting_handles_never_take_the_connections_a_bounded_redis_pool_keeps_for_claims(tmp_path: Any) -> None:
    # Given a Redis store whose pool holds 4 connections, and 4 handles waiting on records at once
    from contextlib import ExitStack

    from conftest import REDIS_URL, make_store, wipe  # noqa: F401 - make_store checks the server

    from celery_idem.stores import store_from_url

    make_store("redis", tmp_path, "probe").close()
    store = store_from_url(f"{REDIS_URL}?max_connections=4", key_prefix=f"pool{uuid.uuid4().hex[:8]}")
    try:
        with ExitStack() as watching:
            waits = [watching.enter_context(store.watch(Identity("", "notices.task", f"w{n}"))) for n in range(4)]
            for wait in waits:
                wait(0.01)
            # Then the store still claims: the waits subscribed on at most half of the pool
            claimed = store.claim(Identity("", "notices.task", "fresh"), "fp", "t", pending_seconds=60, ttl_seconds=60)
            assert claimed.decision.value == "NEW"
    finally:
        wipe(store)


class _Interrupted(BaseException):
    """What gevent.Timeout, eventlet.Timeout and KeyboardInterrupt are: not an Exception."""


def test_a_watch_interrupted_while_it_subscribes_gives_its_slot_back(tmp_path: Any) -> None:
    from conftest import make_store, wipe

    from celery_idem.stores.redis.notices import WATCHES

    store: Any = make_store("redis", tmp_path, f"slots{uuid.uuid4().hex[:8]}")
    real = store.client.pubsub

    class Interrupting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real(*args, **kwargs)

        def subscribe(self, *channels: Any) -> None:
            raise _Interrupted

        def close(self) -> None:
            self.inner.close()

    try:
        # Given more interrupted subscriptions than there are slots
        store.client.pubsub = Interrupting
        for n in range(WATCHES + 1):
            with pytest.raises(_Interrupted), store.watch(Identity("", "notices.task", f"i{n}")):
                pass
        store.client.pubsub = real
        # Then a watch still subscribes: every slot came back
        with store.watch(Identity("", "notices.task", "after")) as wait:
            assert wait.notices
    finally:
        store.client.pubsub = real
        wipe(store)


def test_a_watch_without_a_slot_says_so_and_its_waiter_backs_off(tmp_path: Any) -> None:
    from conftest import REDIS_URL, make_store, wipe

    from celery_idem.stores import store_from_url

    make_store("redis", tmp_path, "probe").close()
    store = store_from_url(f"{REDIS_URL}?max_connections=2", key_prefix=f"one{uuid.uuid4().hex[:8]}")
    try:
        # Given a pool of 2 (one slot for watches), taken by a first waiter
        with store.watch(Identity("", "notices.task", "first")) as first:
            assert first.notices
            # Then a second waiter's watch says no notice will end its waits (it polls from 10 ms up)
            with store.watch(Identity("", "notices.task", "second")) as second:
                assert not second.notices
    finally:
        wipe(store)
