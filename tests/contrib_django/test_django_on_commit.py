"""delay_on_commit / apply_async_on_commit on idempotent tasks: the claim is made when the caller's
Django transaction commits, so a rolled-back transaction leaves no claim and runs nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402, F401 - configures Django for this module
from celery import Celery  # noqa: E402
from django.db import transaction  # noqa: E402

from celery_idem import Idempotency, IdempotentTask, InvalidKeyError  # noqa: E402
from celery_idem.contrib.django.tasks import IdempotentDjangoTask  # noqa: E402
from celery_idem.records import Identity  # noqa: E402


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
        assert charge.apply_async_on_commit((42,), idempotency_key="order-42") is None
        # Not yet: the call waits for the commit
        assert not claimed(idem, "order-42") and charged == []
    assert claimed(idem, "order-42") and charged == [42]


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
