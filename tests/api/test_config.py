"""Policy and settings models (DESIGN §6), and how the Idempotency extension resolves them per app."""

from __future__ import annotations

import logging
import re
import socket
from typing import Any

import pytest
from celery import Celery
from pydantic import ValidationError

from celery_idem import (
    ConfigurationError,
    Idempotency,
    IdempotencyError,
    IdempotencyPolicy,
    IdempotencySettings,
    IdempotentTask,
    MemoryStore,
    StoreUnavailableError,
)

POLICY_DEFAULTS: dict[str, Any] = {
    "key_args": None,
    "require_key": False,
    "ttl_seconds": 86400,
    "lease_seconds": 30,
    "pending_timeout_seconds": 3600,
    "on_duplicate": "return",
    "on_busy": "wait",
    "busy_wait_seconds": 60,
    "retryable": (),
    "permanent": (),
    "default_failure": "retryable",
    "stale_action": "release",
    "results": "both",  # not in DESIGN §6: where an outcome is written (docs/results.md)
    "mode": "idempotent",  # DESIGN §7: when the key is free again (docs/modes.md)
}
SETTINGS_DEFAULTS: dict[str, Any] = {
    **POLICY_DEFAULTS,
    "store": None,
    "key_prefix": "idem",
    "store_timeout_seconds": 2.0,
    "on_store_error": "raise",
    "max_result_bytes": 1_048_576,
    "accept_pickle": False,
    "reconcile_interval_seconds": None,
    "ledger": None,
    "stale_grace_seconds": 3600,
    "inspect_timeout_seconds": 1.0,  # not in DESIGN §6: the reconciler's inspect deadline
    "liveness_seconds": 10,  # not in DESIGN §6: a worker process's liveness record (DESIGN §3 rules)
}
MODELS = [IdempotencyPolicy, IdempotencySettings]

# (field, invalid value): each must be refused by both models, naming the field.
INVALID_VALUES = [
    ("ttl_seconds", 0),
    ("lease_seconds", -1),
    ("on_busy", "sometimes"),
    ("key_args", [""]),
    ("key_args", "order_id"),
    ("mode", "until_lunch"),
]


def eager_app(name: str = "t") -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    return app


def counting_task(app: Celery, calls: list[Any], name: str = "t.charge") -> Any:
    @app.task(shared=False, base=IdempotentTask, name=name)
    def charge(order_id: int, amount: int) -> dict[str, int]:
        calls.append((order_id, amount))
        return {"order_id": order_id, "amount": amount}

    return charge


# --- the models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_model_is_frozen(model: type[IdempotencyPolicy]) -> None:
    instance = model()

    with pytest.raises(ValidationError, match="frozen"):
        instance.ttl_seconds = 5  # type: ignore[misc]
    assert instance.ttl_seconds == 86400


@pytest.mark.parametrize("model", MODELS)
def test_model_refuses_unknown_fields_naming_them(model: type[IdempotencyPolicy]) -> None:
    with pytest.raises(ValidationError) as excinfo:
        model(ttl_secondz=5)  # type: ignore[call-arg]

    assert "ttl_secondz" in str(excinfo.value)
    assert [e["type"] for e in excinfo.value.errors()] == ["extra_forbidden"]


@pytest.mark.parametrize(("field", "expected"), sorted(POLICY_DEFAULTS.items()))
def test_policy_default_matches_the_design(field: str, expected: Any) -> None:
    assert getattr(IdempotencyPolicy(), field) == expected


@pytest.mark.parametrize(("field", "expected"), sorted(SETTINGS_DEFAULTS.items()))
def test_settings_default_matches_the_design(field: str, expected: Any) -> None:
    assert getattr(IdempotencySettings(), field) == expected


def test_defaults_cover_every_field() -> None:
    # A new field must get its DESIGN default pinned here too.
    assert set(IdempotencyPolicy.model_fields) == set(POLICY_DEFAULTS)
    assert set(IdempotencySettings.model_fields) == set(SETTINGS_DEFAULTS)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("field", "value"), INVALID_VALUES)
def test_invalid_value_is_refused_naming_the_field(model: type[IdempotencyPolicy], field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as excinfo:
        model(**{field: value})

    assert [e["loc"] for e in excinfo.value.errors()] == [(field,)]
    assert field in str(excinfo.value)


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), 1.0])
def test_a_liveness_lifetime_that_cannot_work_is_refused(value: float) -> None:
    # 1.0 is under the default store timeout (2 s): one slow beat would pass for a death
    with pytest.raises(ValidationError, match="liveness_seconds"):
        IdempotencySettings(liveness_seconds=value)


def test_the_liveness_lifetime_follows_a_long_store_timeout_unless_it_is_set() -> None:
    # A long store deadline alone is valid: the unset lifetime is twice the deadline (10 s at least)
    assert IdempotencySettings().liveness_seconds == 10
    assert IdempotencySettings(store_timeout_seconds=3600).liveness_seconds == 7200
    assert IdempotencySettings(store_timeout_seconds=3600, liveness_seconds=3600).liveness_seconds == 3600
    with pytest.raises(ValidationError, match=r"liveness_seconds \(100\) must be at least store_timeout_seconds"):
        IdempotencySettings(store_timeout_seconds=3600, liveness_seconds=100)


def test_key_args_list_of_names_is_accepted() -> None:
    assert IdempotencyPolicy(key_args=["order_id", "amount"]).key_args == ["order_id", "amount"]


def test_key_args_empty_keys_on_no_argument_so_every_call_of_the_task_is_one_call() -> None:
    # celery-once's keys=[]: one lock for the task, whatever the arguments (never a mismatch)
    app, calls = eager_app(), []

    @app.task(shared=False, base=IdempotentTask, name="t.charge", idempotency={"key_args": []})
    def charge(order_id: int, amount: int) -> int:
        calls.append((order_id, amount))
        return order_id

    first, other = charge.delay(1, 10), charge.delay(2, 20)

    assert other.deduplicated and other.id == first.id and other.get() == 1
    assert calls == [(1, 10)]


# --- IdempotencySettings.policy(overrides) --------------------------------------------------------


def test_policy_without_overrides_is_the_app_defaults() -> None:
    settings = IdempotencySettings(ttl_seconds=10, on_busy="retry")

    policy = settings.policy()

    assert isinstance(policy, IdempotencyPolicy)
    assert (policy.ttl_seconds, policy.on_busy, policy.lease_seconds) == (10, "retry", 30)


def test_policy_dict_overrides_app_defaults_field_by_field() -> None:
    settings = IdempotencySettings(ttl_seconds=10, lease_seconds=5)

    policy = settings.policy({"lease_seconds": 7, "require_key": True})

    assert (policy.ttl_seconds, policy.lease_seconds, policy.require_key) == (10, 7, True)


def test_policy_model_overrides_only_fields_it_set_explicitly() -> None:
    # Given: app defaults that differ from the model defaults
    settings = IdempotencySettings(ttl_seconds=10, lease_seconds=5, on_duplicate="raise")

    # When: a task policy sets ttl_seconds explicitly (to the model default) and nothing else
    policy = settings.policy(IdempotencyPolicy(ttl_seconds=86400))

    # Then: the explicit field wins even though it equals the default; the others stay the app's
    assert policy.ttl_seconds == 86400
    assert policy.lease_seconds == 5
    assert policy.on_duplicate == "raise"


@pytest.mark.parametrize("model", MODELS)
def test_a_mode_that_keeps_no_outcome_with_results_in_the_store_only_is_refused(
    model: type[IdempotencyPolicy],
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        model(mode="until_done", results="store")
    assert "in mode 'until_done' the next call takes the key's record over" in str(excinfo.value)
    assert "use results='both'" in str(excinfo.value)


def test_a_task_in_a_mode_that_keeps_no_outcome_keeps_its_records_ttl_for_its_runs_own_messages() -> None:
    # until_done hands no outcome to new calls, but keeps a settled record ttl_seconds for the ended
    # run's copies, its duplicates carrying a continuation, its waiters and the reconciler
    app = eager_app()
    idem = Idempotency(app, store=MemoryStore(), ttl_seconds=600)

    @app.task(shared=False, base=IdempotentTask, name="t.single", idempotency={"mode": "until_done"})
    def single() -> None: ...

    assert idem.policy_for(single).ttl_seconds == 600
    assert idem.mode_for(single).keeps_outcome is False


def test_policy_with_an_invalid_override_is_refused() -> None:
    with pytest.raises(ValidationError, match="ttl_seconds"):
        IdempotencySettings().policy({"ttl_seconds": 0})


# --- resolution on the extension: keyword > app.conf > default ------------------------------------


def test_settings_default_when_nothing_is_configured() -> None:
    idem = Idempotency(eager_app())

    assert idem.settings.ttl_seconds == 86400
    assert idem.settings.key_prefix == "idem"


def test_app_conf_overrides_the_default() -> None:
    app = eager_app()
    app.conf.idempotency_ttl_seconds = 10
    app.conf.idempotency_key_prefix = "shop"

    idem = Idempotency(app)

    assert idem.settings.ttl_seconds == 10
    assert idem.settings.key_prefix == "shop"


def test_keyword_overrides_app_conf() -> None:
    app = eager_app()
    app.conf.idempotency_ttl_seconds = 10
    app.conf.idempotency_lease_seconds = 7

    idem = Idempotency(app, ttl_seconds=20)

    assert idem.settings.ttl_seconds == 20  # keyword beats app.conf
    assert idem.settings.lease_seconds == 7  # app.conf still beats the default


def test_app_wide_policy_default_reaches_a_task_without_its_own_policy() -> None:
    app = eager_app()
    app.conf.idempotency_ttl_seconds = 10
    idem = Idempotency(app)
    charge = counting_task(app, [])

    assert idem.policy_for(charge).ttl_seconds == 10


def test_unknown_keyword_raises_naming_it_and_listing_valid_settings() -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        Idempotency(eager_app(), nonsense=1)

    message = str(excinfo.value)
    assert "nonsense" in message
    for valid in ("store", "ttl_seconds", "key_prefix", "max_result_bytes"):
        assert valid in message


def test_invalid_keyword_value_raises_configuration_error_naming_the_field() -> None:
    with pytest.raises(ConfigurationError, match="ttl_seconds"):
        Idempotency(eager_app(), ttl_seconds=0)


def test_invalid_app_conf_value_raises_configuration_error_at_first_use() -> None:
    # Given: a bad value in app.conf, which the extension only reads when first needed
    app = eager_app()
    app.conf.idempotency_lease_seconds = -1
    calls: list[Any] = []
    charge = counting_task(app, calls)
    Idempotency(app)  # construction reads nothing yet

    # When / Then: the first call names the field, as a ConfigurationError (an IdempotencyError)
    with pytest.raises(ConfigurationError, match="lease_seconds") as excinfo:
        charge.apply_async((42, 100), idempotency_key="order-42")
    assert isinstance(excinfo.value, IdempotencyError)
    assert calls == []


# --- Idempotency.of and replacement ---------------------------------------------------------------


def test_of_returns_the_installed_instance() -> None:
    app = eager_app()
    idem = Idempotency(app)

    assert Idempotency.of(app) is idem


def test_of_installs_one_when_none_is_installed() -> None:
    app = eager_app()

    installed = Idempotency.of(app)

    assert isinstance(installed, Idempotency)
    assert installed.app is app
    assert Idempotency.of(app) is installed


def test_second_instance_replaces_the_first() -> None:
    # Given: a task already used through a first extension
    app = eager_app()
    first = Idempotency(app)
    calls: list[Any] = []
    charge = counting_task(app, calls)
    charge.apply_async((42, 100), idempotency_key="order-42").get()

    # When: a second extension is installed with its own store
    second = Idempotency(app, store=MemoryStore())

    # Then: it is the installed one, and the task now uses its (empty) store
    assert Idempotency.of(app) is second
    assert second is not first
    charge.apply_async((42, 100), idempotency_key="order-42").get()
    assert len(calls) == 2
    assert second.get(charge, "order-42") is not None
    assert second.metrics()["claims"] == 1


def test_two_apps_have_independent_extensions_stores_and_counters() -> None:
    # Given: two eager apps in one process, each with a task of the same name on a memory store
    app_a, app_b = eager_app("a"), eager_app("b")
    idem_a = Idempotency(app_a, store="memory://")
    idem_b = Idempotency(app_b, store="memory://")
    calls_a: list[Any] = []
    calls_b: list[Any] = []
    charge_a = counting_task(app_a, calls_a, name="shop.charge")
    charge_b = counting_task(app_b, calls_b, name="shop.charge")

    # When: the same key is used twice on app a and once on app b
    charge_a.apply_async((42, 100), idempotency_key="order-42").get()
    charge_a.apply_async((42, 100), idempotency_key="order-42").get()
    charge_b.apply_async((42, 100), idempotency_key="order-42").get()

    # Then: each app ran the call once, in its own store, counted by its own extension
    assert Idempotency.of(app_a) is idem_a
    assert Idempotency.of(app_b) is idem_b
    assert idem_a.store is not idem_b.store
    assert len(calls_a) == 1
    assert len(calls_b) == 1
    assert (idem_a.metrics()["claims"], idem_a.metrics()["replays"]) == (2, 1)
    assert (idem_b.metrics()["claims"], idem_b.metrics()["replays"]) == (1, 0)
    assert idem_a.get("shop.charge", "order-42").task_id != idem_b.get("shop.charge", "order-42").task_id


def test_forgetting_on_one_app_does_not_touch_the_other() -> None:
    app_a, app_b = eager_app("a"), eager_app("b")
    idem_a, idem_b = Idempotency(app_a), Idempotency(app_b)
    charge_a = counting_task(app_a, [], name="shop.charge")
    charge_b = counting_task(app_b, [], name="shop.charge")
    charge_a.apply_async((1, 2), idempotency_key="k").get()
    charge_b.apply_async((1, 2), idempotency_key="k").get()

    assert idem_a.forget("shop.charge", "k") is True

    assert idem_a.get("shop.charge", "k") is None
    assert idem_b.get("shop.charge", "k") is not None


# --- the store setting ----------------------------------------------------------------------------


def test_non_eager_app_without_a_store_raises_when_the_store_is_first_needed() -> None:
    app = Celery("t", set_as_current=False)
    charge = counting_task(app, [])
    idem = Idempotency(app)  # no store yet, and no error yet

    with pytest.raises(ConfigurationError, match="idempotency_store"):
        charge.apply_async((42, 100), idempotency_key="order-42")
    with pytest.raises(ConfigurationError, match="idempotency_store"):
        idem.get(charge, "order-42")


def test_eager_app_defaults_to_a_memory_store() -> None:
    idem = Idempotency(eager_app())

    assert isinstance(idem.store, MemoryStore)


def test_store_url_from_app_conf_is_used() -> None:
    app = Celery("t", set_as_current=False)
    app.conf.idempotency_store = "memory://"

    assert isinstance(Idempotency(app).store, MemoryStore)


def test_store_instance_is_used_as_given() -> None:
    store = MemoryStore(key_prefix="given")
    app = Celery("t", set_as_current=False)

    idem = Idempotency(app, store=store)

    assert idem.store is store


def test_store_is_built_once_per_extension() -> None:
    idem = Idempotency(eager_app())

    assert idem.store is idem.store


def test_construction_does_no_network_io_and_first_use_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a Redis URL on a closed port, and a guard recording every socket connect
    connects: list[Any] = []
    real_connect = socket.socket.connect

    def recording_connect(self: socket.socket, address: Any) -> Any:
        connects.append(address)
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    app = Celery("t", set_as_current=False)
    charge = counting_task(app, [])

    # When: the extension is built
    idem = Idempotency(app, store="redis://127.0.0.1:1/0", store_timeout_seconds=0.5)

    # Then: nothing was connected; only the first use reaches the store, and fails closed
    assert connects == []
    with pytest.raises(StoreUnavailableError):
        charge.apply_async((42, 100), idempotency_key="order-42")
    assert connects, "the first use should have tried the store"
    # Two store calls failed: the claim, and the give-back of a claim that may have run with its
    # reply lost (tests/outages/test_faults.py)
    assert idem.metrics()["store_errors"] == 2


def test_a_misspelt_app_conf_setting_is_refused_with_a_suggestion() -> None:
    app = Celery("typo", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_ttl = 600  # meant idempotency_ttl_seconds
    with pytest.raises(ConfigurationError, match=r"idempotency_ttl \(did you mean idempotency_ttl_seconds\?\)"):
        Idempotency(app).settings  # noqa: B018


def test_a_misspelt_setting_under_a_namespace_is_refused_too() -> None:
    # Django's way: config_from_object(..., namespace="CELERY") lists its keys as written in settings.py
    from types import SimpleNamespace

    app = Celery("typo-ns", set_as_current=False)
    project_settings = SimpleNamespace(
        CELERY_TASK_ALWAYS_EAGER=True, CELERY_IDEMPOTENCY_STORE="memory://", CELERY_IDEMPOTENCY_LEASE_SECOND=30
    )
    app.config_from_object(project_settings, namespace="CELERY")
    match = r"idempotency_lease_second \(did you mean idempotency_lease_seconds\?\)"
    with pytest.raises(ConfigurationError, match=match):
        Idempotency(app).settings  # noqa: B018


def test_a_project_setting_outside_the_namespace_is_not_taken_for_a_celery_idem_setting() -> None:
    # A Django project's own IDEMPOTENCY_HEADER is none of Celery's settings (no CELERY_ prefix)
    from types import SimpleNamespace

    app = Celery("own-setting", set_as_current=False)
    project_settings = SimpleNamespace(
        CELERY_TASK_ALWAYS_EAGER=True, CELERY_IDEMPOTENCY_LEASE_SECONDS=30, IDEMPOTENCY_HEADER="Idempotency-Key"
    )
    app.config_from_object(project_settings, namespace="CELERY")
    assert Idempotency(app).settings.lease_seconds == 30


def test_a_misspelt_setting_given_in_code_on_a_namespaced_app_is_refused() -> None:
    from types import SimpleNamespace

    app = Celery("typo-code", set_as_current=False)
    app.config_from_object(SimpleNamespace(CELERY_TASK_ALWAYS_EAGER=True), namespace="CELERY")
    app.conf.idempotency_ttl = 600  # meant idempotency_ttl_seconds
    with pytest.raises(ConfigurationError, match=r"idempotency_ttl \(did you mean idempotency_ttl_seconds\?\)"):
        Idempotency(app).settings  # noqa: B018


@pytest.mark.parametrize(
    ("namespace", "key", "reads"),
    [
        (None, "IDEMPOTENCY_LEASE_SECONDS", "celery-idem reads idempotency_lease_seconds, in lower case"),
        (None, "CELERY_IDEMPOTENCY_LEASE_SECOND", "celery-idem reads idempotency_lease_seconds, in lower case"),
        ("CELERY", "celery_idempotency_ttl_seconds", "in upper case: CELERY_IDEMPOTENCY_TTL_SECONDS"),
    ],
)
def test_a_setting_written_in_a_case_or_prefix_the_app_never_reads_is_refused(
    namespace: str | None, key: str, reads: str
) -> None:
    # Celery reads a namespaced app's settings in upper case only, and an app without a namespace's in
    # lower case: any other spelling of one of ours was silently ignored.
    from types import SimpleNamespace

    app = Celery("case", set_as_current=False)
    app.config_from_object(SimpleNamespace(**{key: 30}), namespace=namespace)
    with pytest.raises(ConfigurationError, match=re.escape(f"it never reads: {key} (") + ".*" + re.escape(reads)):
        Idempotency(app).settings  # noqa: B018


@pytest.mark.parametrize("key", ["IDEMPOTENCY_LEASE_SECONDS", "IDEMPOTENCY_LEASE_SECOND"])
def test_a_setting_of_ours_without_the_namespace_is_warned_of_as_it_may_be_the_projects_own(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Under Django's namespace app.conf holds every project setting: IDEMPOTENCY_LEASE_SECONDS may be
    # one of the project's own, so it is a warning, not a refusal to start.
    from types import SimpleNamespace

    app = Celery("no-prefix", set_as_current=False)
    app.config_from_object(SimpleNamespace(**{key: 5, "CELERY_TASK_ALWAYS_EAGER": True}), namespace="CELERY")
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        assert Idempotency(app).settings.lease_seconds == 30  # not read
    (warned,) = [r.getMessage() for r in caplog.records if "never reads" in r.getMessage()]
    assert f"{key} (the app reads its settings under namespace 'CELERY' in upper case: " in warned
    assert warned.endswith("CELERY_IDEMPOTENCY_LEASE_SECONDS)")


def test_installing_the_extension_does_not_configure_the_app_before_its_on_after_configure_handlers() -> None:
    # Celery's documented way to add periodic tasks connects on_after_configure after the app is
    # built; Idempotency(app, ...) with settings must not finalize app.conf before that.
    app = Celery("late-config", set_as_current=False)
    Idempotency(app, store="memory://", ttl_seconds=60)
    assert not app.configured
    fired: list[Any] = []

    @app.on_after_configure.connect
    def setup_periodic_tasks(sender: Any, **kwargs: Any) -> None:
        fired.append(sender)

    assert app.conf.task_serializer == "json"  # the app configures itself at first use
    assert fired == [app]
    assert Idempotency.of(app).settings.ttl_seconds == 60


def test_a_misspelt_setting_under_a_namespace_with_its_underscore_is_refused() -> None:
    from types import SimpleNamespace

    app = Celery("typo-ns_", set_as_current=False)
    app.config_from_object(
        SimpleNamespace(CELERY_TASK_ALWAYS_EAGER=True, CELERY_IDEMPOTENCY_LEASE_SECOND=30), namespace="CELERY_"
    )
    with pytest.raises(ConfigurationError, match=r"did you mean idempotency_lease_seconds"):
        Idempotency(app).settings  # noqa: B018


# ---- found by review (h-attack): spellings Celery reads, refused; spellings it never reads, ignored -----


def test_a_lower_case_namespace_reads_lower_case_settings_which_are_not_refused() -> None:
    # Shows: Celery matches a namespace's case (celery.utils.text.match_case): under namespace="celery"
    # it reads celery_idempotency_ttl_seconds, as app.conf.get("idempotency_ttl_seconds") answers. The
    # check upper-cased the namespace and refused this working setting ("reads ... in upper case"),
    # stopping the deployment at first use.
    app = Celery("lower-ns", set_as_current=False, namespace="celery")
    app.conf.update({"celery_idempotency_ttl_seconds": 7})
    assert app.conf.get("idempotency_ttl_seconds") == 7  # what Celery itself reads
    assert Idempotency(app).settings.ttl_seconds == 7


def test_an_upper_case_setting_under_a_lower_case_namespace_is_not_silently_ignored() -> None:
    # Shows: the converse. Under namespace="celery" Celery never reads CELERY_IDEMPOTENCY_TTL_SECONDS,
    # and the check took it for the read spelling: the TTL silently stayed the default.
    app = Celery("lower-ns-upper-key", set_as_current=False, namespace="celery")
    app.conf.update({"CELERY_IDEMPOTENCY_TTL_SECONDS": 7})
    assert app.conf.get("idempotency_ttl_seconds") is None  # Celery does not read it
    with pytest.raises(ConfigurationError, match="CELERY_IDEMPOTENCY_TTL_SECONDS"):
        Idempotency(app).settings  # noqa: B018


def test_a_projects_own_setting_that_only_resembles_ours_does_not_stop_an_app_without_a_namespace() -> None:
    # Shows: a Django project configured the pre-namespace way (config_from_object("django.conf:settings"))
    # has every project setting in app.conf, as under a namespace. Its own IDEMPOTENCY_STORAGE (say an
    # HTTP idempotency middleware's cache alias) is "close" to our `store` and was refused outright, so
    # the worker could not start; under namespace="CELERY" the same key is only a warning.
    from types import SimpleNamespace

    app = Celery("django-old-style", set_as_current=False)
    app.config_from_object(SimpleNamespace(IDEMPOTENCY_STORAGE="default", CELERY_ALWAYS_EAGER=True))
    assert Idempotency(app).settings.ttl_seconds == 86400
