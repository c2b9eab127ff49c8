"""The transactional outbox on the Django ORM, on every database (SQLite, PostgreSQL, MariaDB),
migrated with ``migrate``, with real ``celery worker`` processes of the example project: a
rolled-back ``transaction.atomic()`` publishes and claims nothing; a committed one is published at
its commit, or by the relay (``manage.py celery_idem_relay``) when the process died before; a relay
SIGKILLed after publishing and before deleting its row is followed by one that publishes again, and
the payment is made once. Payments are counted in the database, outside the library."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from addresses import REDIS_BROKER_URL

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module
from conftest import REDIS_URL, require_server, wipe  # noqa: E402
from django.contrib.auth.models import Permission, User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import transaction  # noqa: E402
from django.db.models import F  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from django_project import require_alias, shop_env  # noqa: E402
from faults import Fault, Injector, Plan  # noqa: E402
from storefront.models import Payment  # noqa: E402
from workers import BACKEND, TESTS, Worker  # noqa: E402

from celery_idem import Idempotency, store_from_url  # noqa: E402
from celery_idem.contrib.django.ledger import DjangoLedger  # noqa: E402
from celery_idem.contrib.django.models import LedgerEntry, OutboxEntry  # noqa: E402
from celery_idem.contrib.django.outbox import DjangoOutbox  # noqa: E402

BROKER = REDIS_BROKER_URL
GET = 30
TASK = "djworker.pay"


class Boom(Exception):
    pass


@pytest.fixture(params=django_project.ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    require_alias(request.param)
    require_server("redis")
    return str(request.param)


@pytest.fixture
def prefix(alias: str) -> Iterator[str]:
    name = f"dj{uuid.uuid4().hex[:10]}"
    yield name
    wipe(store_from_url(REDIS_URL, key_prefix=name))
    LedgerEntry.objects.using(alias).filter(namespace=name).delete()
    OutboxEntry.objects.using(alias).all().delete()


@pytest.fixture
def producer(prefix: str, alias: str) -> Any:
    from contrib_django.django_worker import make_app

    return make_app(prefix, BROKER, BACKEND, REDIS_URL, DjangoLedger(alias, namespace=prefix))


def child_env(alias: str, prefix: str, **more: str) -> dict[str, str]:
    env = shop_env(alias)
    env["PYTHONPATH"] = os.pathsep.join([str(django_project.EXAMPLE), str(TESTS), env["PYTHONPATH"]])
    env.update(SHOP_BROKER=BROKER, SHOP_BACKEND=BACKEND, SHOP_STORE=REDIS_URL, SHOP_PREFIX=prefix, SHOP_QUEUE=prefix)
    return {**env, **more}


@pytest.fixture
def workers(tmp_path: Path, prefix: str, alias: str) -> Iterator[Callable[[], Worker]]:
    started: list[Worker] = []

    def start() -> Worker:
        env = child_env(alias, prefix)
        worker = Worker(tmp_path, BROKER, REDIS_URL, prefix, app="contrib_django.django_worker", env=env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def dead_relay(alias: str, prefix: str, dies: str) -> None:
    """One relay pass in a process of its own, SIGKILLed ``after_publish`` or ``before_claim``."""
    died = subprocess.run(
        [sys.executable, str(TESTS / "contrib_django" / "django_relay.py")],
        env=child_env(alias, prefix, SHOP_RELAY_DIES=dies, SHOP_RELAY_LEASE="300"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert died.returncode == -9, died.stderr


def a_ttl_later(producer: Any, alias: str, handle: Any) -> None:
    """As a TTL later: the call's record expired (forgotten here), and the relay that died took the
    row more than a TTL ago (its mark moved back); the row is due."""
    Idempotency.of(producer).store.forget(handle.identity)
    ttl = producer.tasks[TASK].idempotency_handler.policy.ttl_seconds
    OutboxEntry.objects.using(alias).update(
        available_at=datetime(2000, 1, 1, tzinfo=timezone.utc), taken_at=F("taken_at") - timedelta(seconds=ttl + 1)
    )


def bodies(prefix: str, order: int) -> int:
    """How many times the task's body ran for ``order`` (counted in Redis by the body itself)."""
    import redis
    from contrib_django.django_worker import COUNTER_URL

    return int(redis.Redis.from_url(COUNTER_URL).get(f"djworker:{prefix}:body:o-{order}") or 0)


def payments(alias: str, order: int) -> int:
    return Payment.objects.using(alias).filter(order_id=order).count()


def new_order() -> int:
    return uuid.uuid4().int % 2_000_000_000


def test_a_rolled_back_transaction_publishes_nothing_and_leaves_no_claim(producer: Any, alias: str) -> None:
    outbox = DjangoOutbox(alias)
    handle = None
    with pytest.raises(Boom), transaction.atomic(using=alias):
        handle = outbox.apply_async(producer.tasks[TASK], (new_order(), 100), idempotency_key="order-1")
        raise Boom
    assert handle is not None
    assert not OutboxEntry.objects.using(alias).exists()
    assert Idempotency.of(producer).store.get(handle.identity) is None
    assert outbox.relay(producer).published == []


def test_a_committed_call_is_published_at_its_commit_and_pays_once(
    producer: Any, alias: str, workers: Callable[[], Worker]
) -> None:
    workers()
    order = new_order()
    with transaction.atomic(using=alias):
        handle = DjangoOutbox(alias).apply_async(producer.tasks[TASK], (order, 100), idempotency_key=f"o-{order}")
        assert OutboxEntry.objects.using(alias).filter(task_id=handle.id).exists()  # not published yet
    assert handle.get(timeout=GET) == {"paid": 100, "order": order}
    assert payments(alias, order) == 1
    assert not OutboxEntry.objects.using(alias).exists()


def test_the_relay_command_publishes_what_a_dead_process_did_not(
    producer: Any, alias: str, workers: Callable[[], Worker]
) -> None:
    order = new_order()
    with transaction.atomic(using=alias):  # committed, and its process "died" before publishing
        handle = DjangoOutbox(alias, publish_on_commit=False).apply_async(
            producer.tasks[TASK], (order, 300), idempotency_key=f"o-{order}"
        )
    assert OutboxEntry.objects.using(alias).count() == 1
    out = io.StringIO()
    from celery import current_app

    previous = current_app._get_current_object()
    producer.set_current()
    try:
        call_command("celery_idem_relay", "--once", database=alias, stdout=out)
    finally:
        previous.set_current()
    assert "published 1, put off 0, dead 0" in out.getvalue()
    workers()
    assert handle.get(timeout=GET) == {"paid": 300, "order": order}
    assert payments(alias, order) == 1 and not OutboxEntry.objects.using(alias).exists()


def test_a_relay_killed_after_publishing_is_followed_by_a_resend_and_the_payment_is_made_once(
    producer: Any, alias: str, prefix: str, workers: Callable[[], Worker]
) -> None:
    order = new_order()
    with transaction.atomic(using=alias):
        handle = DjangoOutbox(alias, publish_on_commit=False).apply_async(
            producer.tasks[TASK], (order, 400), idempotency_key=f"o-{order}"
        )
    died = subprocess.run(
        [sys.executable, str(TESTS / "contrib_django" / "django_relay.py")],
        env=child_env(alias, prefix, SHOP_RELAY_DIES="after_publish", SHOP_RELAY_LEASE="300"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert died.returncode == -9, died.stderr
    assert OutboxEntry.objects.using(alias).count() == 1  # its DELETE never committed
    outbox = DjangoOutbox(alias)
    assert outbox.relay(producer).published == []  # leased by the dead relay
    OutboxEntry.objects.using(alias).update(available_at=datetime(2000, 1, 1, tzinfo=timezone.utc))  # lease ran out
    assert len(outbox.relay(producer).published) == 1  # a copy of the same task id
    workers()
    assert handle.get(timeout=GET) == {"paid": 400, "order": order}
    assert payments(alias, order) == 1 and not OutboxEntry.objects.using(alias).exists()


def test_a_call_that_can_never_be_published_goes_to_the_dead_letter_and_can_be_retried(
    producer: Any, alias: str
) -> None:
    outbox = DjangoOutbox(alias, publish_on_commit=False)
    order = new_order()
    producer.tasks[TASK].apply_async((order, 1), idempotency_key=f"o-{order}")  # another call took the key
    with transaction.atomic(using=alias):
        outbox.apply_async(producer.tasks[TASK], (order, 500), idempotency_key=f"o-{order}")
    assert len(outbox.relay(producer).dead) == 1
    (entry,) = OutboxEntry.objects.using(alias).all()
    assert entry.dead and entry.attempts == 1 and (entry.last_error or "").startswith("PayloadMismatchError")
    assert outbox.relay(producer).dead == []  # never tried again by itself
    assert outbox.retry_dead() == 1
    entry.refresh_from_db()
    assert not entry.dead and entry.attempts == 0


@pytest.mark.parametrize("alias", ["sqlite", "postgresql"], indirect=True)
def test_a_pass_that_failed_at_the_orphan_check_keeps_the_dead_relays_mark_and_the_body_runs_once(
    producer: Any, alias: str, prefix: str, workers: Callable[[], Worker]
) -> None:
    order = new_order()
    with transaction.atomic(using=alias):
        handle = DjangoOutbox(alias, publish_on_commit=False).apply_async(
            producer.tasks[TASK], (order, 600), idempotency_key=f"o-{order}"
        )
    dead_relay(alias, prefix, "after_publish")
    workers()
    assert handle.get(timeout=GET) == {"paid": 600, "order": order}
    a_ttl_later(producer, alias, handle)
    outbox = DjangoOutbox(alias)
    injector = Injector(Idempotency.of(producer).store)
    plan = injector.arm(Plan("get", Fault.TIMEOUT, key=f"o-{order}"))
    report = outbox.relay(producer)  # the orphan check's store read times out
    injector.clear()
    assert plan.fired == 1 and report.published == [] and len(report.failed) == 1
    OutboxEntry.objects.using(alias).update(available_at=datetime(2000, 1, 1, tzinfo=timezone.utc))  # backoff over
    report = outbox.relay(producer)
    assert report.published == [] and len(report.dead) == 1  # refused, not published blind
    (entry,) = OutboxEntry.objects.using(alias).all()
    assert entry.dead and (entry.last_error or "").startswith("AmbiguousRelay") and entry.taken_at is not None
    assert bodies(prefix, order) == 1 and payments(alias, order) == 1


class _OutboxOn:
    """Routes celery_idem's models (the outbox's entries) to one alias, so the admin acts there."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model._meta.app_label == "celery_idem" else None

    db_for_write = db_for_read


def give_back_in_the_admin(alias: str) -> None:
    """An operator with the change permission selects the dead entries and gives them back."""
    person = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", is_staff=True)
    codenames = ("view_outboxentry", "change_outboxentry")
    allowed = Permission.objects.filter(content_type__app_label="celery_idem", codename__in=codenames)
    person.user_permissions.set(allowed)
    client = Client()
    client.force_login(person)
    dead = list(OutboxEntry.objects.using(alias).filter(dead=True).values_list("pk", flat=True))
    with override_settings(DATABASE_ROUTERS=[_OutboxOn(alias)]):
        page = client.post(
            "/admin/celery_idem/outboxentry/", {"action": "retry", "_selected_action": dead}, follow=True
        )
    assert page.status_code == 200 and "may have published them" in page.content.decode()  # what it risks


@pytest.mark.parametrize("how", ["retry_dead", "admin"])
@pytest.mark.parametrize("alias", ["sqlite", "postgresql"], indirect=True)
def test_a_row_refused_as_ambiguous_then_given_back_is_sent_on_the_next_pass_and_runs_once(
    producer: Any, alias: str, prefix: str, workers: Callable[[], Worker], how: str
) -> None:
    order = new_order()
    with transaction.atomic(using=alias):
        handle = DjangoOutbox(alias, publish_on_commit=False).apply_async(
            producer.tasks[TASK], (order, 700), idempotency_key=f"o-{order}"
        )
    dead_relay(alias, prefix, "before_claim")  # it never ran: the operator will find that out
    a_ttl_later(producer, alias, handle)
    outbox = DjangoOutbox(alias)
    assert len(outbox.relay(producer).dead) == 1
    (entry,) = OutboxEntry.objects.using(alias).all()
    assert (entry.last_error or "").startswith("AmbiguousRelay")
    if how == "retry_dead":
        assert outbox.retry_dead() == 1
    else:
        give_back_in_the_admin(alias)
    entry.refresh_from_db()
    assert not entry.dead and entry.attempts == 0 and entry.taken_at is None
    assert len(outbox.relay(producer).published) == 1
    workers()
    assert handle.get(timeout=GET) == {"paid": 700, "order": order}
    assert bodies(prefix, order) == 1 and payments(alias, order) == 1
    assert not OutboxEntry.objects.using(alias).exists()


# ---- on django://, the claim is written in the caller's transaction -------------------------------


@pytest.mark.parametrize("alias", ["sqlite", "postgresql"], indirect=True)
def test_on_a_django_store_the_claim_commits_and_rolls_back_with_the_staged_call(
    tmp_path: Path, prefix: str, alias: str
) -> None:
    import threading

    from contrib_django.django_worker import make_app

    from celery_idem import PayloadMismatchError

    producer = make_app(prefix, BROKER, BACKEND, f"django://{alias}", DjangoLedger(alias, namespace=prefix))
    pay, idem, outbox = producer.tasks[TASK], Idempotency.of(producer), DjangoOutbox(alias)
    env = child_env(alias, prefix, SHOP_STORE="django://")
    worker = Worker(tmp_path, BROKER, "django://", prefix, app="contrib_django.django_worker", env=env)
    try:
        # A transaction that rolls back takes its claim with it: the key is free
        order = new_order()
        key = f"o-{order}"  # the body counts its runs under its key
        with pytest.raises(Boom), transaction.atomic(using=alias):
            outbox.apply_async(pay, (order, 100), idempotency_key=key)
            raise Boom
        assert idem.get(TASK, key) is None
        # One that commits: its claim is the staged call's, seen by no one before the commit
        staged, waiting, done = threading.Event(), threading.Event(), threading.Event()
        first: list[Any] = []

        def checkout() -> None:
            with transaction.atomic(using=alias):
                transaction.on_commit(done.set, using=alias)  # first of its on-commit work: at its commit
                first.append(outbox.apply_async(pay, (order, 500), idempotency_key=key))
                staged.set()
                waiting.wait(10)

        thread = threading.Thread(target=checkout)
        thread.start()
        assert staged.wait(10)
        assert idem.get(TASK, key) is None  # not committed yet
        # A second request with the key, while the first's transaction is open, waits for it, then
        # is answered: other arguments refused, the same ones handed the first call's task id
        threading.Timer(0.5, waiting.set).start()
        with pytest.raises(PayloadMismatchError), transaction.atomic(using=alias):
            outbox.apply_async(pay, (order, 700), idempotency_key=key)
        assert done.is_set()  # it waited for the first to commit
        with transaction.atomic(using=alias):
            again = outbox.apply_async(pay, (order, 500), idempotency_key=key)
        thread.join(10)
        record = idem.get(TASK, key)
        assert record is not None and record.task_id == first[0].id == again.id and again.deduplicated
        assert first[0].get(timeout=GET) == {"paid": 500, "order": order}
        assert payments(alias, order) == 1 and bodies(prefix, order) == 1
        assert not OutboxEntry.objects.using(alias).exists()  # one row staged, published, deleted
    finally:
        worker.stop()


@pytest.mark.parametrize("alias", ["postgresql"], indirect=True)
def test_a_claim_in_the_callers_transaction_is_bounded_and_leaves_its_timeouts_as_they_were(
    prefix: str, alias: str
) -> None:
    import threading
    import time

    from contrib_django.django_worker import make_app
    from django.db import connections

    from celery_idem import StoreUnavailableError

    producer = make_app(prefix, BROKER, BACKEND, f"django://{alias}", DjangoLedger(alias, namespace=prefix))
    pay, outbox = producer.tasks[TASK], DjangoOutbox(alias)
    order = new_order()
    key = f"o-{order}"

    def timeouts() -> tuple[str, str]:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT current_setting('lock_timeout'), current_setting('statement_timeout')")
            return tuple(cursor.fetchone())

    # The claim runs on the caller's connection, in its transaction: the caller's timeouts after it are its own
    with transaction.atomic(using=alias):
        before = timeouts()
        outbox.apply_async(pay, (order, 100), idempotency_key=key)
        assert timeouts() == before
        transaction.set_rollback(True, using=alias)
    # A claim that waits on another open transaction's row lock ends within the store's deadline
    holding, release = threading.Event(), threading.Event()

    def first_request() -> None:
        with transaction.atomic(using=alias):
            outbox.apply_async(pay, (order, 100), idempotency_key=key)
            holding.set()
            release.wait(30)
            transaction.set_rollback(True, using=alias)
        connections[alias].close()

    thread = threading.Thread(target=first_request)
    thread.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError), transaction.atomic(using=alias):
            outbox.apply_async(pay, (order, 100), idempotency_key=key)
        assert time.monotonic() - started < 10  # the store's deadline (2 s), never the other's transaction
    finally:
        release.set()
        thread.join(10)


@pytest.mark.parametrize("alias", ["sqlite", "postgresql"], indirect=True)
def test_on_a_django_store_a_staged_call_of_an_until_done_task_after_its_run_ended_is_staged(
    prefix: str, alias: str
) -> None:
    from celery import Celery

    from celery_idem import IdempotentTask
    from celery_idem.records import Decision, Identity

    app = Celery("djsingle", broker=BROKER, set_as_current=False)
    idem = Idempotency(app, store=f"django://{alias}", key_prefix=prefix)

    @app.task(base=IdempotentTask, name="djsingle.pay", shared=False, idempotency={"mode": "until_done"})
    def pay(order: int) -> int:
        return order

    order = new_order()
    key = f"o-{order}"
    store = idem.store
    try:
        # Given a call of an until_done task whose run ended (its record settled, kept for its messages)
        identity = Identity("", "djsingle.pay", key)
        fp = pay.idempotency_handler.fingerprint((order,), {})
        assert store.claim(identity, fp, "ended", pending_seconds=60, ttl_seconds=600).decision is Decision.NEW
        taken = store.acquire(identity, fp, "ended", lease_seconds=60, ttl_seconds=600)
        assert store.complete(identity, taken.record.owner, b"1").ok
        # When the same call is staged in a transaction (its claim written in it, on this database)
        with transaction.atomic(using=alias):
            handle = DjangoOutbox(alias, publish_on_commit=False).apply_async(pay, (order,), idempotency_key=key)
        # Then it is a new call, as apply_async makes it: staged under its own id, not the ended call's
        assert not getattr(handle, "deduplicated", False) and handle.id != "ended"
        assert OutboxEntry.objects.using(alias).filter(task_id=handle.id).exists()  # left to the relay
    finally:
        wipe(store)
        idem.disconnect()
