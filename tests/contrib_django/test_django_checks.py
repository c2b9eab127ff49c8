"""celery_idem.contrib.django's system checks, through Django's check framework (``manage.py check``)
on a Celery app configured the Django way (Celery's ``CELERY_`` namespace)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

django = pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402, F401 - configures Django for this module
from celery import Celery  # noqa: E402
from celery._state import _set_current_app, get_current_app  # noqa: E402
from django.core import checks  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.core.management.base import SystemCheckError  # noqa: E402
from django.test.utils import override_settings  # noqa: E402


@pytest.fixture
def project() -> Iterator[Any]:
    """Makes a project's Celery app from CELERY_* settings, current as a Django project's is."""
    before = get_current_app()

    def make(**celery_settings: Any) -> Celery:
        app = Celery("djshop", set_as_current=True)
        named = {f"CELERY_{name}": value for name, value in celery_settings.items()}  # as in settings.py
        app.config_from_object(SimpleNamespace(**named), namespace="CELERY")
        return app

    yield make
    _set_current_app(before)


def ids() -> list[str]:
    return [message.id for message in checks.run_checks(tags=["celery_idem"]) if message.id]


def test_the_app_installs_with_its_label_and_registers_its_checks() -> None:
    from django.apps import apps

    config = apps.get_app_config("celery_idem")
    assert config.name == "celery_idem.contrib.django" and config.default_auto_field == "django.db.models.BigAutoField"
    assert "celery_idem" in checks.registry.registry.tags_available()


def test_a_sound_configuration_passes(project: Any) -> None:
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", BROKER_URL="amqp://localhost//")
    assert ids() == []


def test_a_misspelt_setting_is_an_error_that_names_the_setting_meant(project: Any) -> None:
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", IDEMPOTENCY_LEASE_SECOND=30)
    [message] = checks.run_checks(tags=["celery_idem"])
    assert message.id == "celery_idem.E001"
    assert "idempotency_lease_second (did you mean idempotency_lease_seconds?)" in message.msg


def test_an_invalid_value_is_an_error(project: Any) -> None:
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", IDEMPOTENCY_TTL_SECONDS=-1)
    [message] = checks.run_checks(tags=["celery_idem"])
    assert message.id == "celery_idem.E001" and "ttl_seconds" in message.msg


def test_no_store_is_an_error_outside_eager_mode(project: Any) -> None:
    project()
    assert ids() == ["celery_idem.E002"]
    project(TASK_ALWAYS_EAGER=True)
    assert ids() == []


@pytest.mark.parametrize("store", ["memory://", "MEMORY://", " memory://x", "instance"])
def test_a_memory_store_outside_eager_mode_is_a_warning(project: Any, store: str) -> None:
    from celery_idem.stores import MemoryStore

    project(IDEMPOTENCY_STORE=MemoryStore() if store == "instance" else store)
    assert ids() == ["celery_idem.W003"]


@pytest.mark.parametrize("serializer", ["pickle", "PICKLE", "application/x-python-serialize"])
def test_the_pickle_task_serializer_without_accept_pickle_is_an_error(project: Any, serializer: str) -> None:
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", TASK_SERIALIZER=serializer)
    assert ids() == ["celery_idem.E004"]
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", IDEMPOTENCY_ACCEPT_PICKLE=True, TASK_SERIALIZER=serializer)
    assert ids() == []


@pytest.mark.parametrize("accepted", [["json", "pickle"], ["json", "application/x-python-serialize"]])
def test_pickle_accepted_but_not_sent_is_a_warning(project: Any, accepted: list[str]) -> None:
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", ACCEPT_CONTENT=accepted)
    assert ids() == ["celery_idem.W005"]
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", IDEMPOTENCY_ACCEPT_PICKLE=True, ACCEPT_CONTENT=accepted)
    assert ids() == []


def test_a_setting_not_all_upper_case_is_a_warning(project: Any, tmp_path: Any, monkeypatch: Any) -> None:
    # Django loads only upper-case names from the settings module: this one never reaches Celery
    (tmp_path / "lowercase_settings.py").write_text(
        "CELERY_IDEMPOTENCY_STORE = 'redis://x'\nCELERY_idempotency_ttl_seconds = 5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2")
    with override_settings(SETTINGS_MODULE="lowercase_settings"):
        [message] = checks.run_checks(tags=["celery_idem"])
    assert message.id == "celery_idem.W006" and message.msg.startswith("CELERY_idempotency_ttl_seconds is not all")


def _noop() -> None: ...


def test_retries_that_can_outlast_the_ttl_are_a_warning(project: Any) -> None:
    from celery_idem import Idempotency, IdempotentTask

    app = project(IDEMPOTENCY_STORE="redis://localhost:6379/2", IDEMPOTENCY_TTL_SECONDS=600)
    Idempotency(app)
    app.task(name="djshop.slow", base=IdempotentTask, max_retries=5, default_retry_delay=300, shared=False)(_noop)
    app.task(name="djshop.quick", base=IdempotentTask, max_retries=5, default_retry_delay=60, shared=False)(_noop)
    app.task(
        name="djshop.backoff",
        base=IdempotentTask,
        autoretry_for=(OSError,),
        retry_backoff=60,
        max_retries=4,  # 60 + 120 + 240 + 480 = 900 s
        shared=False,
    )(_noop)
    app.task(
        name="djshop.long_ttl",
        base=IdempotentTask,
        max_retries=5,
        default_retry_delay=300,
        idempotency={"ttl_seconds": 3600},
        shared=False,
    )(_noop)
    app.task(name="djshop.forever", base=IdempotentTask, max_retries=None, shared=False)(_noop)
    messages = checks.run_checks(tags=["celery_idem"])
    assert {m.id for m in messages} == {"celery_idem.W012"}
    assert sorted(m.msg.split("'")[1] for m in messages) == ["djshop.backoff", "djshop.slow"]
    assert "can retry for 1500 s, longer than its idempotency TTL (600 s)" in " ".join(m.msg for m in messages)


def test_acks_late_without_a_redelivery_of_lost_tasks_is_a_warning(project: Any) -> None:
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", TASK_ACKS_LATE=True)
    assert ids() == ["celery_idem.W010"]
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", TASK_ACKS_LATE=True, TASK_REJECT_ON_WORKER_LOST=True)
    assert ids() == []


def test_a_redis_visibility_timeout_shorter_than_the_lease_is_a_warning(project: Any) -> None:
    store = "redis://localhost:6379/2"
    project(IDEMPOTENCY_STORE=store, BROKER_URL="redis://localhost:6379/0", IDEMPOTENCY_LEASE_SECONDS=600)
    assert ids() == []  # the default visibility_timeout, an hour
    short = {"visibility_timeout": 300}
    project(
        IDEMPOTENCY_STORE=store,
        BROKER_URL="redis://localhost:6379/0",
        BROKER_TRANSPORT_OPTIONS=short,
        IDEMPOTENCY_LEASE_SECONDS=600,
    )
    [message] = checks.run_checks(tags=["celery_idem"])
    assert message.id == "celery_idem.W011" and "(300 s) is shorter than the lease (600 s)" in message.msg


@pytest.mark.parametrize(
    "broker", [["redis://a:6379/0", "redis://b:6379/0"], "redis://a:6379/0;redis://b:6379/0", "REDIS://a:6379/0"]
)
def test_a_short_visibility_timeout_is_found_on_a_failover_list_too(project: Any, broker: Any) -> None:
    project(
        IDEMPOTENCY_STORE="redis://localhost:6379/2",
        BROKER_URL=broker,
        BROKER_TRANSPORT_OPTIONS={"visibility_timeout": 60},
        IDEMPOTENCY_LEASE_SECONDS=600,
    )
    assert ids() == ["celery_idem.W011"]


@pytest.mark.parametrize(
    "odd",
    [
        {"BROKER_URL": None},
        {"BROKER_URL": ["redis://a:6379/0", "redis://b:6379/0"]},
        {"BROKER_URL": "amqp://a//;redis://b:6379/0"},
        {"BROKER_URL": "redis://localhost:6379/0", "BROKER_TRANSPORT_OPTIONS": None},
        {"BROKER_URL": "redis://localhost:6379/0", "BROKER_TRANSPORT_OPTIONS": {"visibility_timeout": "soon"}},
        {"ACCEPT_CONTENT": None},
        {"ACCEPT_CONTENT": ("json",)},
    ],
)
def test_an_odd_but_legal_celery_setting_never_crashes_the_checks(project: Any, odd: dict[str, Any]) -> None:
    # A check that raises breaks manage.py check for the whole project: worse than a missed warning
    project(IDEMPOTENCY_STORE="redis://localhost:6379/2", **odd)
    assert isinstance(checks.run_checks(tags=["celery_idem"]), list)


def test_manage_py_check_reads_the_django_settings_through_celerys_namespace(project: Any) -> None:
    # Given a project whose Celery app reads Django's settings, as Celery's Django guide sets it up
    def django_app() -> Celery:
        app = Celery("djshop", set_as_current=True)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        return app

    # When a setting is misspelt, then manage.py check fails and names it
    with override_settings(CELERY_IDEMPOTENCY_STORE="redis://localhost:6379/2", CELERY_IDEMPOTENCY_LEASE_SECOND=30):
        django_app()
        with pytest.raises(SystemCheckError, match="celery_idem.E001"):
            call_command("check")
    # And spelt right, it passes
    with override_settings(CELERY_IDEMPOTENCY_STORE="redis://localhost:6379/2", CELERY_IDEMPOTENCY_LEASE_SECONDS=30):
        django_app()
        call_command("check")


def test_checks_survive_a_task_with_many_backoff_retries(project: Any) -> None:
    from celery_idem import Idempotency, IdempotentTask

    # max_retries=1100 with retry_backoff: doubling past 2**1023 would overflow a float
    app = project(IDEMPOTENCY_STORE="redis://localhost:6379/2")
    Idempotency(app)
    app.task(
        name="djshop.patient",
        base=IdempotentTask,
        autoretry_for=(OSError,),
        retry_backoff=True,
        max_retries=1100,
        shared=False,
    )(_noop)
    try:
        found = [m.id for m in checks.run_checks(tags=["celery_idem"])]
    except OverflowError as exc:
        pytest.fail(f"manage.py check crashed: {exc!r}")
    assert "celery_idem.W012" in found


# Found by the attack on issue 28 (modes): fails on the current code.
def test_an_until_done_task_with_celerys_default_retries_is_no_warning(project: Any) -> None:
    from celery_idem import Idempotency, IdempotentTask

    app = project(IDEMPOTENCY_STORE="redis://localhost:6379/2")
    Idempotency(app)
    # Celery's defaults: max_retries=3, default_retry_delay=180. In until_done a retry keeps the key
    # (PENDING while it is queued) and no TTL applies to it: raising ttl_seconds changes nothing.
    app.task(name="djshop.single", base=IdempotentTask, idempotency={"mode": "until_done"}, shared=False)(_noop)
    assert [m.msg for m in checks.run_checks(tags=["celery_idem"])] == []
