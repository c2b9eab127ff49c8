"""The admin of celery_idem.contrib.django through Django's test client: the store's records listed
(filtered by state and task, searched by key and task id), releasing a stuck record and running the
reconciler on a selection, each behind its permission; the ledger's entries read-only."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402, F401 - configures Django for this module
from celery import Celery, current_app  # noqa: E402
from django.contrib.auth.models import Permission, User  # noqa: E402
from django.test import Client, override_settings  # noqa: E402

from celery_idem import Idempotency, State  # noqa: E402
from celery_idem.errors import StoreUnavailableError  # noqa: E402
from celery_idem.records import Identity  # noqa: E402
from celery_idem.stores import MemoryStore  # noqa: E402

URL = "/admin/celery_idem/record/"
TASK = "djadmin.charge"
FP = "f" * 64


@pytest.fixture(autouse=True)
def _admin_urls() -> Iterator[None]:
    with override_settings(ROOT_URLCONF="contrib_django.admin_urls"):
        yield


@pytest.fixture
def idem() -> Iterator[Idempotency]:
    app = Celery("djadmin", broker="memory://", backend="cache+memory://", set_as_current=False)
    idem = Idempotency(app, store=MemoryStore(), inspect_timeout_seconds=0.1, stale_grace_seconds=0)
    previous = current_app._get_current_object()
    app.set_current()
    yield idem
    previous.set_current()
    idem.disconnect()


def user(*perms: str, csrf: bool = False) -> Client:
    person = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", is_staff=True)
    person.user_permissions.set(Permission.objects.filter(content_type__app_label="celery_idem", codename__in=perms))
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(person)
    return client


def records(idem: Idempotency) -> dict[str, Identity]:
    """A stuck attempt (its lease ran out), a completed call and a running one."""
    store = idem.store
    made = {}
    for key, lease in (("stuck", 0.05), ("done", 60), ("running", 60)):
        identity = Identity("", TASK, f"{key}-{uuid.uuid4().hex[:6]}")
        taken = store.acquire(identity, FP, f"task-{key}", lease_seconds=lease, ttl_seconds=600)
        assert taken.record is not None
        if key == "done":
            store.complete(identity, taken.record.owner, b'{"paid": 5}')
        made[key] = identity
    time.sleep(0.1)
    return made


def selected(*identities: Identity) -> list[str]:
    return [json.dumps(list(identity)) for identity in identities]


def test_the_list_shows_the_records_and_filters_by_state_task_and_search(idem: Idempotency) -> None:
    made = records(idem)
    client = user("view_record")
    page = client.get(URL)
    assert page.status_code == 200
    assert all(identity.key in page.content.decode() for identity in made.values())
    completed = client.get(URL, {"state": "COMPLETED"}).content.decode()
    assert made["done"].key in completed and made["stuck"].key not in completed
    assert made["stuck"].key in client.get(URL, {"task": TASK}).content.decode()
    found = client.get(URL, {"q": made["running"].key[:12]}).content.decode()
    assert made["running"].key in found and made["done"].key not in found
    assert made["stuck"].key in client.get(URL, {"q": "task-stuck"}).content.decode()  # a task id
    # A viewer gets no action to run
    assert 'name="action"' not in page.content.decode()


def test_release_frees_a_stuck_record_and_never_a_settled_one(idem: Idempotency) -> None:
    made = records(idem)
    client = user("view_record", "change_record")
    answer = client.post(URL, {"action": "release", "selected": selected(made["stuck"], made["done"])}, follow=True)
    assert answer.status_code == 200
    text = answer.content.decode()
    assert "Released 1 record(s)." in text and "1 record(s) were not released: settled" in text
    assert idem.store.get(made["stuck"]) is None
    done = idem.store.get(made["done"])
    assert done is not None and done.state is State.COMPLETED


def test_the_reconciler_runs_on_the_selection_and_leaves_a_live_lease_alone(idem: Idempotency) -> None:
    made = records(idem)
    idem.app.backend.store_result("task-stuck", {"paid": 7}, "SUCCESS")  # the evidence of its outcome
    client = user("view_record", "reconcile_record")
    chosen = selected(made["stuck"], made["running"])
    answer = client.post(URL, {"action": "reconcile", "selected": chosen}, follow=True)
    assert "Reconciled 1 of 2 selected" in answer.content.decode()
    stuck = idem.store.get(made["stuck"])
    assert stuck is not None and stuck.state is State.COMPLETED and stuck.result == b'{"paid": 7}'
    running = idem.store.get(made["running"])
    assert running is not None and running.state is State.IN_PROGRESS


@pytest.mark.parametrize(("perms", "action"), [(("view_record",), "release"), (("view_record",), "reconcile")])
def test_each_action_needs_its_permission(idem: Idempotency, perms: tuple[str, ...], action: str) -> None:
    made = records(idem)
    answer = user(*perms).post(URL, {"action": action, "selected": selected(made["stuck"])})
    assert answer.status_code == 403
    assert idem.store.get(made["stuck"]) is not None


def test_a_user_without_the_view_permission_or_login_gets_no_list(idem: Idempotency) -> None:
    assert user().get(URL).status_code == 403
    anonymous = Client().get(URL)
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]


def test_a_forged_selection_is_ignored(idem: Idempotency) -> None:
    client = user("view_record", "change_record")
    answer = client.post(URL, {"action": "release", "selected": ["not json", '["a", "b"]', "[1, 2, 3]"]}, follow=True)
    assert "Select records first." in answer.content.decode()


def test_the_ledger_entries_are_listed_read_only() -> None:
    admin_user = User.objects.create_superuser(f"root-{uuid.uuid4().hex[:6]}", password="x")
    client = Client()
    client.force_login(admin_user)
    assert client.get("/admin/celery_idem/ledgerentry/").status_code == 200
    assert client.get("/admin/celery_idem/ledgerentry/add/").status_code == 403


# ---- the release is one fenced write; the page survives a store that fails --------------------------


def test_admin_release_never_deletes_a_record_that_completed_between_its_read_and_its_delete(
    idem: Idempotency, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The attempt completes between the page's read and its release (a slow store, a GC pause, an
    # operator releasing the 'running' row): the release is fenced, so the COMPLETED outcome stands
    store = idem.store
    identity = Identity("", TASK, f"k-{uuid.uuid4().hex[:6]}")
    taken = store.acquire(identity, FP, "task-1", lease_seconds=60, ttl_seconds=600)
    assert taken.record is not None
    real_get = store.get

    def get_then_the_attempt_completes(ident: Identity) -> Any:
        seen = real_get(ident)
        store.complete(identity, taken.record.owner, b'{"paid": 5}')  # the running attempt lands now
        return seen

    monkeypatch.setattr(store, "get", get_then_the_attempt_completes)
    client = user("view_record", "change_record")
    client.post(URL, {"action": "release", "selected": selected(identity)})
    monkeypatch.undo()
    record = store.get(identity)
    assert record is not None and record.state is State.COMPLETED, (
        f"the admin's release deleted a COMPLETED record ({record}): the next call runs the effect again"
    )


def test_admin_release_with_the_store_down_is_a_message_not_a_server_error(
    idem: Idempotency, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(*_: Any, **__: Any) -> Any:
        raise StoreUnavailableError("connection refused")

    monkeypatch.setattr(idem.store, "get", down)
    monkeypatch.setattr(idem.store, "now", down)
    client = user("view_record", "change_record", "reconcile_record")
    ident = Identity("", TASK, "k")
    for action in ("release", "reconcile"):
        try:
            response = client.post(URL, {"action": action, "selected": selected(ident)})
        except StoreUnavailableError as exc:
            pytest.fail(f"POST action={action} with the store down is a 500: {exc!r}")
        assert response.status_code == 302


def test_admin_list_with_a_store_that_cannot_be_built_shows_the_error() -> None:
    # A store that cannot be built (none configured, not eager) is said on the page, not a 500
    app = Celery("atk2nostore", broker="memory://", set_as_current=False)
    idem = Idempotency(app)  # no store, not eager: ConfigurationError at first use
    previous = current_app._get_current_object()
    app.set_current()
    try:
        client = user("view_record")
        try:
            page = client.get(URL)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"the list page is a 500 when the store cannot be built: {exc!r}")
        assert page.status_code == 200 and "could not be read" in page.content.decode()
    finally:
        previous.set_current()
        idem.disconnect()


def test_admin_actions_need_the_csrf_token(idem: Idempotency) -> None:
    identity = Identity("", TASK, "k-csrf")
    idem.store.acquire(identity, FP, "t", lease_seconds=0.01, ttl_seconds=600)
    client = user("view_record", "change_record", csrf=True)
    response = client.post(URL, {"action": "release", "selected": selected(identity)})
    assert response.status_code == 403 and idem.store.get(identity) is not None


def test_admin_escapes_keys_and_task_names(idem: Idempotency) -> None:
    evil_task = 'atk2.<script>alert("t")</script>'
    identity = Identity("", evil_task, "<img/src=x/onerror=alert(1)>")
    idem.store.acquire(identity, FP, "t", lease_seconds=60, ttl_seconds=600)
    page = user("view_record").get(URL, {"q": '"><svg onload=alert(2)>'}).content.decode()
    page_all = user("view_record").get(URL).content.decode()
    assert "<script>alert" not in page_all and "<img/src=x" not in page_all and "<svg onload" not in page


def test_admin_forged_identities_with_invalid_keys_do_not_crash(idem: Idempotency) -> None:
    client = user("view_record", "change_record", "reconcile_record")
    forged = [json.dumps(["", TASK, "a b"]), json.dumps(["", TASK, ""]), json.dumps(["x" * 300, TASK, "k" * 100000])]
    for action in ("release", "reconcile"):
        response = client.post(URL, {"action": action, "selected": forged})
        assert response.status_code == 302


def test_the_outbox_lists_its_entries_and_gives_dead_ones_back_to_the_relay_with_the_change_permission() -> None:
    from django.db.models.functions import Now

    from celery_idem.contrib.django.models import OutboxEntry

    def entry(dead: bool) -> OutboxEntry:
        task_id = str(uuid.uuid4())
        return OutboxEntry.objects.create(
            task_id=task_id, task_name=TASK, body=b"{}", created_at=Now(), available_at=Now(), attempts=3, dead=dead
        )

    dead, waiting = entry(True), entry(False)
    try:
        viewer = user("view_outboxentry")
        page = viewer.get("/admin/celery_idem/outboxentry/?dead__exact=1")
        text = page.content.decode()  # (Django 4.2 responses have no .text)
        assert page.status_code == 200 and dead.task_id in text and waiting.task_id not in text
        assert viewer.get("/admin/celery_idem/outboxentry/add/").status_code == 403
        action = {"action": "retry", "_selected_action": [dead.pk, waiting.pk]}
        viewer.post("/admin/celery_idem/outboxentry/", action)
        dead.refresh_from_db()
        assert dead.dead  # the action needs the change permission
        user("view_outboxentry", "change_outboxentry").post("/admin/celery_idem/outboxentry/", action)
        dead.refresh_from_db()
        waiting.refresh_from_db()
        assert not dead.dead and dead.attempts == 0 and waiting.attempts == 3
    finally:
        OutboxEntry.objects.filter(pk__in=[dead.pk, waiting.pk]).delete()
