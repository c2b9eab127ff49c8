"""delay_on_commit / apply_async_on_commit on idempotent tasks: the claim is made when the caller's
Django transaction commits, so a rolled-back transaction leaves no claim and runs nothing; a call
refused at commit is that call's alone (the transaction's other on-commit work still runs)."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402, F401 - configures Django for this module
import redis  # noqa: E402
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL, REDIS_COUNTER_URL  # noqa: E402
from celery import Celery  # noqa: E402
from celery.contrib.testing.worker import start_worker  # noqa: E402
from conftest import REDIS_URL, require_server  # noqa: E402
from django.db import transaction  # noqa: E402
from faults import Fault, Injector, Plan  # noqa: E402

from celery_idem import (  # noqa: E402
    DuplicateTaskError,
    Idempotency,
    IdempotencyError,
    IdempotentTask,
    InvalidKeyError,
    PayloadMismatchError,
    StoreUnavailableError,
)
from celery_idem.contrib.django.tasks import IdempotentDjangoTask  # noqa: E402
from celery_idem.records import Identity  # noqa: E402
from celery_idem.stores import RedisStore  # noqa: E402
from celery_idem.telemetry import key_hash  # noqa: E402


@pytest.fixture
def shop() -> Iterator[Any]:
    app = Celery("djshop", set_as_current=False)
    app.conf.task_always_eager = True  # the publish at commit runs the task here: executions are counted
    idem = Idempotency(app, store="memory://")
    charged: list[int] = []

    @app.task(base=IdempotentTask, name="djshop.charge", shared=False)
    def charge(order: int) -> int:
        charged.append(order)
        return order

    yield charge, idem, charged
    idem.disconnect()


def claimed(idem: Idempotency, key: str) -> bool:
    return idem.store.get(Identity("", "djshop.charge", key)) is not None


def test_the_claim_is_made_when_the_transaction_commits(shop: Any) -> None:
    charge, idem, charged = shop
    with transaction.atomic():
        handle = charge.apply_async_on_commit((42,), idempotency_key="order-42")
        # Not yet: the call waits for the commit, and its handle has no task id
        assert not claimed(idem, "order-42") and charged == [] and handle.id is None
    assert claimed(idem, "order-42") and charged == [42]
    # The handle is the published call's: the task id the record names, and its outcome
    record = idem.store.get(Identity("", "djshop.charge", "order-42"))
    assert handle.id == record.task_id and handle.get() == 42 and handle.error is None


def test_a_rolled_back_transaction_leaves_no_claim_and_runs_nothing(shop: Any) -> None:
    charge, idem, charged = shop
    with pytest.raises(RuntimeError), transaction.atomic():
        charge.delay_on_commit(42)
        charge.apply_async_on_commit((43,), idempotency_key="order-43")
        raise RuntimeError("the view failed")
    assert not claimed(idem, "order-43") and charged == []


def test_the_same_key_committed_twice_runs_once(shop: Any) -> None:
    charge, idem, charged = shop
    for _ in range(2):
        with transaction.atomic():
            charge.apply_async_on_commit((42,), idempotency_key="order-42")
    assert charged == [42]


def test_a_bad_key_is_refused_at_the_call_inside_the_transaction(shop: Any) -> None:
    charge, idem, charged = shop
    with pytest.raises(InvalidKeyError), transaction.atomic():
        charge.apply_async_on_commit((42,), idempotency_key="has whitespace")
    assert charged == []


def test_outside_a_transaction_the_call_is_published_at_once(shop: Any) -> None:
    charge, idem, charged = shop
    charge.delay_on_commit(7)
    assert charged == [7]


def test_the_django_task_class_is_celerys_django_task_too() -> None:
    celery_django = pytest.importorskip("celery.contrib.django.task", reason="Celery 5.4+ has DjangoTask")
    assert issubclass(IdempotentDjangoTask, IdempotentTask)
    assert issubclass(IdempotentDjangoTask, celery_django.DjangoTask)
    assert IdempotentDjangoTask.delay_on_commit is IdempotentTask.delay_on_commit  # ours come first


def test_a_call_in_a_rolled_back_savepoint_is_dropped_while_the_outer_transaction_commits(shop: Any) -> None:
    charge, idem, charged = shop
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():
            charge.apply_async_on_commit((1,), idempotency_key="inner")
            raise RuntimeError("the inner step failed")
        charge.apply_async_on_commit((2,), idempotency_key="outer")
    assert charged == [2]
    assert not claimed(idem, "inner") and claimed(idem, "outer")


def test_a_reused_headers_dict_changes_nothing_of_a_call_already_made(shop: Any) -> None:
    charge, idem, charged = shop
    headers: dict[str, Any] = {}
    with transaction.atomic():
        for order in (4, 5, 6):
            headers["idempotency_key"] = f"order-{order}"
            charge.apply_async_on_commit((order,), headers=headers)
    assert charged == [4, 5, 6]
    assert all(claimed(idem, f"order-{order}") for order in (4, 5, 6))


def test_the_transaction_of_the_database_named_by_using_decides(shop: Any) -> None:
    charge, idem, charged = shop
    # A rollback on the database named by using= drops the call, whatever the default one does
    with pytest.raises(RuntimeError), transaction.atomic(using="sqlite"):
        charge.apply_async_on_commit((44,), idempotency_key="order-44", using="sqlite")
        raise RuntimeError("the order's transaction failed")
    assert not claimed(idem, "order-44") and charged == []
    # And a transaction open on another database does not hold it back
    with transaction.atomic():
        charge.apply_async_on_commit((45,), idempotency_key="order-45", using="sqlite")
        assert claimed(idem, "order-45") and charged == [45]


def test_outside_a_transaction_a_refused_call_raises_at_once(shop: Any) -> None:
    # Nothing else is deferred with it: the caller gets the error from the call, as from apply_async
    charge, idem, charged = shop
    charge.apply_async_on_commit((1,), idempotency_key="order-1")
    with pytest.raises(PayloadMismatchError):
        charge.apply_async_on_commit((2,), idempotency_key="order-1")
    assert charged == [1]


# ---- a call refused at commit is that call's alone ------------------------------------------------


@pytest.fixture(scope="module")
def committed() -> Iterator[Any]:
    """A real worker (threads pool, Redis broker and backend) behind a Redis store the test can cut:
    ``charge`` and ``refund`` (idempotent, ``refund`` raising on duplicates) and ``notify``, a plain
    Celery task. Each body counts its run in Redis, outside the library."""
    require_server("redis")
    prefix = f"oc{uuid.uuid4().hex[:10]}"
    app = Celery("djcommit", set_as_current=False)
    app.conf.update(broker_url=REDIS_BROKER_URL, result_backend=REDIS_BACKEND_URL, task_default_queue=prefix)
    store = RedisStore.from_url(REDIS_URL, key_prefix=prefix)
    injector = Injector(store)
    Idempotency(app, store=store)
    counter = redis.Redis.from_url(REDIS_COUNTER_URL)

    def ran(name: str, order: int) -> None:
        counter.incr(f"{prefix}:{name}:{order}")

    @app.task(base=IdempotentTask, name="djcommit.charge", shared=False)
    def charge(order: int) -> int:
        ran("charge", order)
        return order

    @app.task(base=IdempotentTask, name="djcommit.refund", shared=False, idempotency={"on_duplicate": "raise"})
    def refund(order: int) -> int:
        ran("refund", order)
        return order

    @app.task(name="djcommit.notify", shared=False)
    def notify(order: int) -> None:
        ran("notify", order)

    def runs(name: str, order: int) -> int:
        return int(counter.get(f"{prefix}:{name}:{order}") or 0)

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=20):
        yield app, injector, runs
    keys = list(counter.scan_iter(match=f"{prefix}:*")) + list(store.client.scan_iter(match=f"{{{prefix}:*"))
    if keys:
        counter.delete(*keys)
    store.close()


def eventually(check: Any, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("refusal", ["mismatch", "duplicate", "store_outage"])
def test_a_call_refused_at_commit_drops_none_of_the_transactions_other_on_commit_calls(
    committed: Any, refusal: str, caplog: pytest.LogCaptureFixture
) -> None:
    app, injector, runs = committed
    charge, refund, notify = (app.tasks[f"djcommit.{name}"] for name in ("charge", "refund", "notify"))
    base = uuid.uuid4().int % 1_000_000_000
    first, refused, last = base, base + 1, base + 2
    key = f"refused-{base}"
    # Given: what makes the middle call refused when the transaction commits
    if refusal == "mismatch":  # the key was used for other arguments
        charge.apply_async((refused + 100,), idempotency_key=key).get(timeout=15)
        task, expected = charge, PayloadMismatchError
    elif refusal == "duplicate":  # on_duplicate="raise", and the key's call is done
        refund.apply_async((refused,), idempotency_key=key).get(timeout=15)
        task, expected = refund, DuplicateTaskError
    else:  # the store is cut for that call's claim
        injector.arm(Plan("claim", Fault.REFUSED, key=key))
        task, expected = charge, StoreUnavailableError
    done_before = runs(task.name.split(".")[1], refused)
    # When: one transaction defers three calls, the refused one in the middle, a plain Celery task last
    caplog.set_level(logging.ERROR, logger="celery_idem")
    with transaction.atomic():
        handles = [
            charge.apply_async_on_commit((first,), idempotency_key=f"first-{base}"),
            task.apply_async_on_commit((refused,), idempotency_key=key),
        ]
        transaction.on_commit(functools.partial(notify.delay, last))
        assert all(handle.id is None and handle.error is None for handle in handles)  # nothing published yet
    # Then: the two others were published and ran once
    assert eventually(lambda: runs("charge", first) == 1 and runs("notify", last) == 1), (
        f"charge ran {runs('charge', first)} time(s), the plain task {runs('notify', last)}"
    )
    assert handles[0].error is None and handles[0].get(timeout=15) == first
    # And the refusal is the middle call's: on its handle, and in an ERROR line with its key's hash
    assert isinstance(handles[1].error, expected) and handles[1].id is None
    with pytest.raises(expected):
        handles[1].get(timeout=1)
    hashed = key_hash(Identity("", task.name, key))
    line = [r for r in caplog.records if r.levelno == logging.ERROR and hashed in r.getMessage()]
    assert len(line) == 1 and expected.__name__ in line[0].getMessage(), [r.getMessage() for r in caplog.records]
    time.sleep(0.2)
    assert runs(task.name.split(".")[1], refused) == done_before  # the refused call ran nothing


def test_a_handle_of_a_rolled_back_transaction_says_it_was_never_published(shop: Any) -> None:
    charge, idem, charged = shop
    with pytest.raises(RuntimeError), transaction.atomic():
        handle = charge.apply_async_on_commit((42,), idempotency_key="order-42")
        raise RuntimeError("the view failed")
    with pytest.raises(IdempotencyError, match="not published"):
        handle.get()
    assert handle.id is None and handle.error is None and charged == []


# ---- what a deferred call will be answered, known before the commit -------------------------------


def test_prior_call_answers_now_what_the_claim_after_the_commit_will(shop: Any) -> None:
    charge, idem, charged = shop
    # Nothing known of a key: None, and nothing written (a transaction that rolls back leaves it free)
    with pytest.raises(RuntimeError), transaction.atomic():
        assert charge.prior_call((42,), idempotency_key="order-42") is None
        raise RuntimeError("the view failed")
    assert not claimed(idem, "order-42")
    with transaction.atomic():
        first = charge.apply_async_on_commit((42,), idempotency_key="order-42")
    # A repeat: the original call's handle (a settled one: its outcome); other arguments: refused now
    again = charge.prior_call(args=(42,), idempotency_key="order-42")
    assert again.id == first.id and again.deduplicated and again.get() == 42
    with pytest.raises(PayloadMismatchError):
        charge.prior_call((43,), idempotency_key="order-42")
    assert charged == [42]
    # A claim not settled yet: its task id while its lease lives; past it, None (a claim takes it over)
    identity = Identity("", "djshop.charge", "order-44")
    fp = charge.idempotency_handler.fingerprint((44,), {})
    idem.store.claim(identity, fp, "pending-44", pending_seconds=10, ttl_seconds=60)
    assert charge.prior_call((44,), idempotency_key="order-44").id == "pending-44"
    idem.store.advance_clock_for_tests(11)
    assert charge.prior_call((44,), idempotency_key="order-44") is None
    assert charge.prior_call((44,), idempotency_key="order-44", idempotency=False) is None


def test_prior_call_of_an_until_done_task_after_its_run_ended_knows_nothing_as_its_claim_takes_the_key() -> None:
    app = Celery("djsingle", set_as_current=False)
    app.conf.task_always_eager = True
    idem = Idempotency(app, store="memory://")
    charged: list[int] = []

    @app.task(base=IdempotentTask, name="djsingle.charge", shared=False, idempotency={"mode": "until_done"})
    def charge(order: int) -> int:
        charged.append(order)
        return order

    try:
        # Given a call of an until_done task whose run ended
        with transaction.atomic():
            charge.apply_async_on_commit((42,), idempotency_key="order-42")
        assert charged == [42]
        # Then what prior_call answers is what the claim after the commit does (it takes the ended
        # run's record as if absent, whatever the arguments): nothing is repeated, nothing refused
        assert charge.prior_call((42,), idempotency_key="order-42") is None
        assert charge.prior_call((43,), idempotency_key="order-42") is None
        with transaction.atomic():
            charge.apply_async_on_commit((42,), idempotency_key="order-42")
        assert charged == [42, 42]
    finally:
        idem.disconnect()


def test_prior_call_with_the_store_down_knows_nothing_and_the_claim_at_commit_still_decides(committed: Any) -> None:
    # Given a key used for other arguments, and the store cut for the read at request time
    app, injector, runs = committed
    charge = app.tasks["djcommit.charge"]
    order = uuid.uuid4().int % 1_000_000_000
    key = f"down-{order}"
    charge.apply_async((order + 100,), idempotency_key=key).get(timeout=15)
    cut = Plan("get", Fault.REFUSED, key=key)
    injector.arm(cut)
    try:
        # When: the read fails, it answers None (nothing known), not an error
        with transaction.atomic():
            assert charge.prior_call((order,), idempotency_key=key) is None
            handle = charge.apply_async_on_commit((order,), idempotency_key=key)
    finally:
        injector.clear()
    assert cut.fired == 1
    # Then the claim at commit refuses the call: fail closed there, and the body never ran for it
    assert isinstance(handle.error, PayloadMismatchError)
    assert runs("charge", order) == 0 and runs("charge", order + 100) == 1
