"""A call across releases (DESIGN §2, "Across releases"): messages sent by one release of an app and
run by a worker of another, as a rolling deploy has them, through real ``celery worker`` processes.

The producer's app is built here with one release of ``deploy.charge`` (tests/releases_app.py); the
worker runs another. A compatible change (a parameter with a default added, a default changed)
never drops a message in flight nor refuses a call that did not change; an incompatible one (a
parameter removed, renamed, a required one added) fails the call that cannot be bound with an error
that says so, and frees its key: never a silent drop. Every execution of the body is counted by an
INCR outside the library.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import REDIS_URL, require_rabbitmq, require_server
from releases_app import NAME, make_app
from shop import COUNTER_URL, effects_key
from shop_worker import BACKEND, BROKERS
from workers import Worker, wait_for

from celery_idem import Idempotency

pytestmark = pytest.mark.slow
GET = 30


@pytest.fixture
def prefix() -> str:
    return f"d{uuid.uuid4().hex[:10]}"


@pytest.fixture
def counter() -> redis.Redis:
    require_server("redis")
    return redis.Redis.from_url(COUNTER_URL)


@pytest.fixture
def deploy(tmp_path: Path, prefix: str) -> Iterator[Callable[..., Any]]:
    """``deploy(release, broker)``: a worker of ``release`` starts on the test's queue."""
    started: list[Worker] = []

    def start(release: str, broker: str = "redis") -> Worker:
        worker = Worker(tmp_path, BROKERS[broker], REDIS_URL, prefix, app="releases_app", env={"RELEASE": release})
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def producer(release: str, prefix: str, broker: str = "redis") -> Any:
    return make_app(release=release, broker=BROKERS[broker], backend=BACKEND, store=REDIS_URL, prefix=prefix)


def effects(counter: redis.Redis, prefix: str, key: str) -> int:
    return int(counter.get(effects_key(prefix, NAME, key)) or 0)


# ---- compatible changes: nothing in flight is lost, nothing unchanged is refused ------------------


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_a_call_queued_by_the_old_release_runs_once_on_the_new_one_and_both_releases_get_its_answer(
    deploy, prefix, counter, broker, keyed
) -> None:
    # Given a call of v1 waiting in the queue while the deploy adds `currency="EUR"` to the task
    if broker == "rabbitmq":
        require_rabbitmq()
    old, new = producer("v1", prefix, broker), producer("optional_added", prefix, broker)
    options = {"idempotency_key": f"k-{uuid.uuid4().hex}"} if keyed else {}
    first = old.tasks[NAME].apply_async((42, 100), **options)
    # When a worker of the new release takes it
    deploy("optional_added", broker)
    # Then it runs, once, and a retry from either release is handed that call and its answer
    assert first.get(timeout=GET) == {"order": 42, "charged": 100, "currency": "EUR", "release": "optional_added"}
    for app in (new, old):
        again = app.tasks[NAME].apply_async((42, 100), **options)
        assert again.deduplicated and again.id == first.id
        assert again.get(timeout=GET)["charged"] == 100
    by_keyword = new.tasks[NAME].apply_async((42,), {"amount": 100, "currency": "EUR"}, **options)
    assert by_keyword.deduplicated and by_keyword.id == first.id
    assert effects(counter, prefix, first.idempotency_key) == 1


def test_a_call_of_the_new_release_runs_once_on_a_worker_of_the_old_one(deploy, prefix, counter) -> None:
    # A rolling deploy the other way round: new producers while old workers still consume.
    old, new = producer("v1", prefix), producer("optional_added", prefix)
    key = f"k-{uuid.uuid4().hex}"
    first = new.tasks[NAME].apply_async((42, 100), idempotency_key=key)
    deploy("v1")
    assert first.get(timeout=GET)["release"] == "v1"
    again = old.tasks[NAME].apply_async((42, 100), idempotency_key=key)
    assert again.deduplicated and again.id == first.id
    assert effects(counter, prefix, key) == 1


def test_a_call_in_flight_across_a_changed_default_runs_and_is_answered(deploy, prefix, counter) -> None:
    # v2 names its default currency explicitly... and the next release makes "USD" the default: the
    # message in flight (bound by the old release to another fingerprint) is still its record's call.
    old, new = producer("optional_added", prefix), producer("default_changed", prefix)
    key = f"k-{uuid.uuid4().hex}"
    first = old.tasks[NAME].apply_async((42, 100), {"currency": "USD"}, idempotency_key=key)
    deploy("default_changed")
    assert first.get(timeout=GET)["currency"] == "USD"
    # The same call from the new release, spelled with or without its now-default value.
    for kwargs in ({"currency": "USD"}, {}):
        again = new.tasks[NAME].apply_async((42, 100), kwargs, idempotency_key=key)
        assert again.deduplicated and again.id == first.id
    assert effects(counter, prefix, key) == 1


def test_a_renamed_parameter_passed_by_position_runs_the_call_in_flight(deploy, prefix, counter) -> None:
    old = producer("v1", prefix)
    key = f"k-{uuid.uuid4().hex}"
    first = old.tasks[NAME].apply_async((42, 100), idempotency_key=key)
    deploy("renamed")
    assert first.get(timeout=GET)["charged"] == 100
    assert effects(counter, prefix, key) == 1


def test_a_call_in_flight_across_the_upgrade_of_celery_idem_itself_runs_once(deploy, prefix, counter) -> None:
    # Given a call queued by a producer on celery-idem before 0.2: its record holds the fingerprint
    # with the default in, and its message carries no claim token
    from celery import Task as CeleryTask

    from celery_idem.records import Identity

    new = producer("optional_added", prefix)
    task, idem = new.tasks[NAME], Idempotency.of(new)
    key, task_id = f"k-{uuid.uuid4().hex}", str(uuid.uuid4())
    earlier = task.idempotency_handler.fingerprint((42, 100), {}, keep_defaults=True)
    idem.store.claim(Identity("", NAME, key), earlier, task_id, pending_seconds=60, ttl_seconds=60)
    CeleryTask.apply_async(task, (42, 100), task_id=task_id, headers={"idempotency_key": key})
    # When a worker of the upgraded library takes it, then the same call comes from an upgraded producer
    deploy("optional_added")
    assert new.AsyncResult(task_id).get(timeout=GET)["charged"] == 100
    again = task.apply_async((42, 100), idempotency_key=key)
    # Then it ran once, and the new call is its duplicate
    assert again.deduplicated and again.id == task_id
    assert effects(counter, prefix, key) == 1


def test_a_call_the_outbox_relay_sends_again_runs_on_a_worker_of_the_next_release(
    deploy, prefix, counter, tmp_path
) -> None:
    # Given a staged call whose relay made its claim and died before publishing (the record PENDING
    # under that relay's token), and a deploy that renamed `amount` under way
    import sqlalchemy as sa
    from sqlalchemy import orm

    from celery_idem.outbox import SQLOutbox
    from celery_idem.records import Identity

    app = producer("v1", prefix)
    task, idem = app.tasks[NAME], Idempotency.of(app)
    outbox = SQLOutbox(sa.create_engine(f"sqlite:///{tmp_path}/orders.db", poolclass=sa.pool.NullPool))
    outbox.create_schema()
    outbox.publish_on_commit = False
    key = f"k-{uuid.uuid4().hex}"
    with orm.Session(outbox.engine) as session, session.begin():
        handle = outbox.apply_async(session, task, (42, 100), idempotency_key=key)
    fp = task.idempotency_handler.fingerprint((42, 100), {})
    idem.store.claim(Identity("", NAME, key), fp, handle.id, pending_seconds=300, ttl_seconds=3600, owner="dead-relay")
    # When the next relay sends the call again and a worker of the new release takes it
    assert len(outbox.relay(app).published) == 1
    deploy("renamed")
    # Then the message carries the token its record is held under: it runs, once
    assert app.AsyncResult(handle.id).get(timeout=GET)["charged"] == 100
    assert effects(counter, prefix, key) == 1


# ---- incompatible changes: the call that cannot be bound fails, says why, and frees its key ------


@pytest.mark.parametrize(
    ("release", "args", "kwargs", "says"),
    [
        ("removed", (42, 100), {}, "too many positional arguments"),
        ("required_added", (42, 100), {}, "missing a required argument: 'currency'"),
        ("renamed", (42,), {"amount": 100}, "missing a required argument: 'total'"),
    ],
)
def test_a_message_the_new_release_cannot_bind_fails_saying_so_and_frees_its_key(
    deploy, prefix, counter, release, args, kwargs, says
) -> None:
    old = producer("v1", prefix)
    idem = Idempotency.of(old)
    key = f"k-{uuid.uuid4().hex}"
    first = old.tasks[NAME].apply_async(args, kwargs, idempotency_key=key)
    worker = deploy(release)
    with pytest.raises(TypeError) as raised:
        first.get(timeout=GET)
    message = str(raised.value)
    assert says in message and NAME in message and "another release" in message, message
    assert effects(counter, prefix, key) == 0
    # Never a key held for an hour by a message that is gone: the next call of the key runs.
    wait_for(lambda: idem.get(NAME, key) is None, "the key freed", 10)
    assert "cannot take the arguments" in worker.output()
