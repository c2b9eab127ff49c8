"""Eager mode (``task_always_eager``, memory store): what users' own unit tests see.

Every test builds a fresh Celery app and Idempotency extension, and counts executions with a list
the task body appends to: a side effect outside the library.

Tasks are declared with ``shared=False``: Celery's ``@app.task`` otherwise also registers the function
on every app finalized later in the process, so same-named tasks of different tests would collide
(``DuplicateTaskNameWarning``). The tests of shared tasks (``@idempotent_task`` without ``app=``)
use the ``isolated_shared_tasks`` fixture so their tasks do not leak into later tests' apps.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery, Task
from celery import _state as celery_state
from celery.exceptions import Retry
from celery.result import AsyncResult
from celery.utils.imports import gen_task_name
from pydantic import BaseModel

from celery_idem import (
    ConfigurationError,
    DuplicateTaskError,
    Idempotency,
    IdempotencyError,
    IdempotencyPolicy,
    IdempotencyRecord,
    IdempotentResult,
    IdempotentTask,
    InvalidKeyError,
    MemoryStore,
    PayloadMismatchError,
    PermanentError,
    ReplayedFailureError,
    ResultTooLargeError,
    SerializationError,
    State,
    StoreUnavailableError,
    idempotent_task,
)
from celery_idem.records import Identity


class CardDeclined(Exception):
    """A business failure a policy lists as permanent (importable by module and qualname)."""


class Order(BaseModel):
    """The argument of a pydantic=True task (module level: Celery resolves the annotation by name)."""

    order_id: int
    amount: int


def make_app(name: str = "t") -> Celery:
    # set_as_current=False: shared tasks and other tests never resolve to this app by accident.
    app = Celery(name, set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    return app


@pytest.fixture
def app() -> Celery:
    return make_app()


@pytest.fixture
def idem(app: Celery) -> Idempotency:
    return Idempotency(app)


@pytest.fixture
def isolated_shared_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared tasks declared during the test are forgotten by apps created after it."""
    monkeypatch.setattr(celery_state, "_on_app_finalizers", set(celery_state._on_app_finalizers))


@pytest.fixture
def calls() -> list[Any]:
    return []


@pytest.fixture
def charge(app: Celery, idem: Idempotency, calls: list[Any]) -> Task:
    """The DESIGN §1 example task."""

    @app.task(shared=False, base=IdempotentTask, idempotency={"key_args": ["order_id", "amount"], "ttl_seconds": 3600})
    def charge(order_id: int, amount: int) -> dict[str, int]:
        calls.append((order_id, amount))
        return {"order_id": order_id, "charged": amount}

    return charge


def metric(idem: Idempotency, name: str) -> int:
    return idem.metrics()[name]


# --- declaring idempotent tasks --------------------------------------------------------------------


def test_app_task_with_idempotent_base_and_policy_dict(charge: Task, idem: Idempotency) -> None:
    assert isinstance(charge, IdempotentTask)
    assert idem.policy_for(charge).key_args == ["order_id", "amount"]
    assert idem.policy_for(charge).ttl_seconds == 3600


@pytest.mark.usefixtures("isolated_shared_tasks")
def test_bare_decorator_makes_a_shared_idempotent_task(calls: list[Any]) -> None:
    # Given: a bare @idempotent_task (no app: a shared task)
    def send_receipt_bare(order_id: int) -> str:
        calls.append(order_id)
        return f"receipt-{order_id}"

    idempotent_task(send_receipt_bare)

    # When: an app is created afterwards
    later = make_app("later")
    Idempotency(later)
    task = later.tasks[gen_task_name(later, send_receipt_bare.__name__, send_receipt_bare.__module__)]

    # Then: the task is on it, idempotent, and runs once per key
    assert isinstance(task, IdempotentTask)
    first = task.apply_async((42,), idempotency_key="receipt-42")
    second = task.apply_async((42,), idempotency_key="receipt-42")
    assert first.get() == second.get() == "receipt-42"
    assert second.deduplicated is True
    assert calls == [42]


@pytest.mark.usefixtures("isolated_shared_tasks")
def test_decorator_with_policy_keywords_sets_the_policy(calls: list[Any]) -> None:
    @idempotent_task(ttl_seconds=600)
    def send_receipt_ttl(order_id: int) -> None:
        calls.append(order_id)

    later = make_app("later")
    idem = Idempotency(later)
    task = later.tasks[gen_task_name(later, send_receipt_ttl.__name__, send_receipt_ttl.__module__)]

    task.apply_async((42,), idempotency_key="receipt-42").get()
    task.apply_async((42,), idempotency_key="receipt-42").get()

    assert idem.policy_for(task).ttl_seconds == 600
    record = idem.get(task, "receipt-42")
    assert record is not None and record.ttl_seconds == 600
    assert calls == [42]


@pytest.mark.usefixtures("isolated_shared_tasks")
def test_decorator_without_app_registers_on_apps_created_afterwards() -> None:
    @idempotent_task(name="test_eager.shared_notify")
    def shared_notify(order_id: int) -> int:
        return order_id

    first, second = make_app("first"), make_app("second")

    assert "test_eager.shared_notify" in first.tasks
    assert "test_eager.shared_notify" in second.tasks
    assert isinstance(second.tasks["test_eager.shared_notify"], IdempotentTask)


# Celery 5.x deprecates the ``queue`` task attribute at bind time; it is still the plainest option to
# prove that non-policy keywords reach app.task, so only that one warning is silenced here.
@pytest.mark.filterwarnings(r"ignore:\s*The 'queue' task attribute is deprecated:celery.exceptions.CDeprecationWarning")
def test_decorator_passes_other_options_to_app_task(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @idempotent_task(app=app, shared=False, name="x.y", queue="q", ttl_seconds=600)
    def notify(order_id: int) -> None:
        calls.append(order_id)

    assert notify.name == "x.y"
    assert notify.queue == "q"
    registered = app.tasks["x.y"]  # the app's own task object (``notify`` is Celery's lazy proxy to it)
    assert isinstance(registered, IdempotentTask)
    assert registered.queue == "q"
    assert idem.policy_for(notify).ttl_seconds == 600


def test_decorator_refuses_a_base_that_is_not_an_idempotent_task(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="base"):
        idempotent_task(app=app, base=Task)


def test_decorator_refuses_a_task_instance_as_base(app: Celery) -> None:
    # An instance is not a class: refused with the same error, not a TypeError from issubclass.
    with pytest.raises(ConfigurationError, match="base"):
        idempotent_task(app=app, base=IdempotentTask())


def test_decorator_accepts_a_subclass_of_idempotent_task_as_base(app: Celery, idem: Idempotency) -> None:
    class AuditedTask(IdempotentTask):
        pass

    @idempotent_task(app=app, shared=False, base=AuditedTask)
    def audited(order_id: int) -> int:
        return order_id

    assert isinstance(audited, AuditedTask)
    assert audited.apply_async((1,), idempotency_key="k").get() == 1


def test_decorator_refuses_the_policy_given_twice(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        idempotent_task(app=app, ttl_seconds=600, idempotency={"lease_seconds": 5})


# --- the DESIGN §1 example -------------------------------------------------------------------------


def test_duplicate_call_returns_the_original_without_running_again(charge: Task, calls: list[Any]) -> None:
    r1 = charge.apply_async((42, 100), idempotency_key="order-42-charge")
    r2 = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    assert isinstance(r1, AsyncResult) and isinstance(r2, AsyncResult)
    assert isinstance(r2, IdempotentResult)
    assert r2.id == r1.id
    assert r1.deduplicated is False
    assert r2.deduplicated is True
    assert r2.get() == r1.get() == {"order_id": 42, "charged": 100}
    assert calls == [(42, 100)]


def test_same_key_with_other_arguments_raises_payload_mismatch(charge: Task, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    with pytest.raises(PayloadMismatchError) as excinfo:
        charge.apply_async((42, 999), idempotency_key="order-42-charge")

    assert calls == [(42, 100)]
    assert excinfo.value.key == "order-42-charge"
    assert excinfo.value.task_name == charge.name
    assert excinfo.value.task_id == first.id


def test_idempotency_key_of_a_keyed_call_is_the_key(charge: Task) -> None:
    result = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    assert result.idempotency_key == "order-42-charge"


def test_key_less_call_is_keyed_by_its_fingerprint(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100))
    second = charge.apply_async((42, 100))

    # The fingerprint is a SHA-256 hex digest, usable with get()
    assert len(first.idempotency_key) == 64
    assert int(first.idempotency_key, 16) >= 0
    assert second.idempotency_key == first.idempotency_key
    assert second.deduplicated is True
    assert calls == [(42, 100)]
    record = idem.get(charge, first.idempotency_key)
    assert isinstance(record, IdempotencyRecord)
    assert record.state is State.COMPLETED
    assert record.task_id == first.id
    assert record.fingerprint == first.idempotency_key


def test_positional_keyword_and_default_forms_are_one_call(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def refund(order_id: int, amount: int, currency: str = "EUR") -> str:
        calls.append((order_id, amount, currency))
        return "refunded"

    results = [
        refund.apply_async((42, 100)),
        refund.apply_async(kwargs={"order_id": 42, "amount": 100}),
        refund.apply_async((42,), {"amount": 100}),
        refund.apply_async((42, 100, "EUR")),
        refund.delay(42, amount=100, currency="EUR"),
    ]

    assert calls == [(42, 100, "EUR")]
    assert len({r.idempotency_key for r in results}) == 1
    assert len({r.id for r in results}) == 1
    assert [r.deduplicated for r in results] == [False, True, True, True, True]


def test_same_key_in_keyword_form_is_not_a_mismatch(charge: Task, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42-charge")

    again = charge.apply_async(kwargs={"amount": 100, "order_id": 42}, idempotency_key="order-42-charge")

    assert again.deduplicated is True
    assert calls == [(42, 100)]


def test_bypass_runs_every_time_and_stores_nothing(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    for _ in range(3):
        charge.apply_async((42, 100), idempotency_key="order-42-charge", idempotency=False).get()

    assert calls == [(42, 100)] * 3
    assert idem.get(charge, "order-42-charge") is None
    assert metric(idem, "claims") == 0
    assert len(idem.store) == 0


def test_bypassed_call_does_not_block_a_later_protected_call(charge: Task, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42-charge", idempotency=False)

    result = charge.apply_async((42, 100), idempotency_key="order-42-charge")

    assert result.deduplicated is False
    assert len(calls) == 2


# --- identity inside the body ----------------------------------------------------------------------


@pytest.fixture
def whoami(app: Celery, idem: Idempotency, calls: list[Any]) -> Task:
    @app.task(shared=False, base=IdempotentTask, bind=True)
    def whoami(self: Task, order_id: int) -> list[Any]:
        calls.append(order_id)
        return [self.request.idempotency_key, self.request.idempotency_scope]

    return whoami


def test_body_sees_the_key_of_a_keyed_call(whoami: Task) -> None:
    assert whoami.apply_async((42,), idempotency_key="order-42").get() == ["order-42", None]


def test_body_sees_key_and_scope_of_a_scoped_call(whoami: Task) -> None:
    result = whoami.apply_async((42,), idempotency_key="order-42", idempotency_scope="tenant-a")

    assert result.get() == ["order-42", "tenant-a"]


def test_body_of_a_key_less_call_sees_its_fingerprint(whoami: Task) -> None:
    result = whoami.apply_async((42,))

    key, scope = result.get()
    assert key == result.idempotency_key
    assert len(key) == 64
    assert scope is None


def test_bound_task_fingerprint_ignores_self(whoami: Task, calls: list[Any]) -> None:
    # Positional and keyword forms of a bind=True task are one call: self is not an argument.
    whoami.apply_async((42,))
    whoami.apply_async(kwargs={"order_id": 42})

    assert calls == [42]


# --- scopes ----------------------------------------------------------------------------------------


def test_scopes_separate_identities(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    a = charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-a")
    b = charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-b")
    a_again = charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-a")

    assert calls == [(42, 100), (42, 100)]
    assert a.id != b.id
    assert a_again.id == a.id and a_again.deduplicated is True
    assert idem.get(charge, "order-42", scope="tenant-a").task_id == a.id
    assert idem.get(charge, "order-42", scope="tenant-b").task_id == b.id
    assert idem.get(charge, "order-42") is None  # the unscoped identity is a third one


def test_same_key_with_other_arguments_in_another_scope_is_not_a_mismatch(charge: Task, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope="tenant-a")

    charge.apply_async((42, 999), idempotency_key="order-42", idempotency_scope="tenant-b")

    assert calls == [(42, 100), (42, 999)]


# --- key rules -------------------------------------------------------------------------------------


def test_require_key_refuses_a_key_less_call(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"require_key": True})
    def pay(order_id: int) -> None:
        calls.append(order_id)

    with pytest.raises(InvalidKeyError, match="require"):
        pay.apply_async((42,))

    assert calls == []
    assert metric(idem, "claims") == 0
    assert pay.apply_async((42,), idempotency_key="order-42").deduplicated is False
    assert calls == [42]


@pytest.mark.parametrize(
    ("bad_key", "rule"),
    [
        ("", "empty"),
        ("k" * 300, "300 characters"),
        ("order 42", "whitespace"),
        (42, "int"),
        (b"order-42", "bytes"),
    ],
    ids=["empty", "300-chars", "space", "int", "bytes"],
)
def test_invalid_key_is_refused_before_anything_is_claimed(
    charge: Task, idem: Idempotency, calls: list[Any], bad_key: object, rule: str
) -> None:
    claims_before = metric(idem, "claims")

    with pytest.raises(InvalidKeyError, match=rule):
        charge.apply_async((42, 100), idempotency_key=bad_key)

    assert metric(idem, "claims") == claims_before
    assert calls == []
    assert len(idem.store) == 0


@pytest.mark.parametrize("bad_scope", ["", "tenant a", 7], ids=["empty", "space", "int"])
def test_invalid_scope_is_refused_before_anything_is_claimed(
    charge: Task, idem: Idempotency, calls: list[Any], bad_scope: object
) -> None:
    with pytest.raises(InvalidKeyError, match="scope"):
        charge.apply_async((42, 100), idempotency_key="order-42", idempotency_scope=bad_scope)

    assert metric(idem, "claims") == 0
    assert calls == []


# --- failures --------------------------------------------------------------------------------------


def failing_task(app: Celery, calls: list[Any], exc: BaseException, **policy: Any) -> Task:
    @app.task(shared=False, base=IdempotentTask, idempotency=policy or None)
    def settle(order_id: int) -> None:
        calls.append(order_id)
        raise exc

    return settle


def test_permanent_error_is_stored_and_replayed_without_running(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, PermanentError("card declined"))

    with pytest.raises(PermanentError, match="card declined"):
        settle.apply_async((42,), idempotency_key="order-42")
    # When: the same call comes again
    with pytest.raises(PermanentError, match="card declined") as excinfo:
        settle.apply_async((42,), idempotency_key="order-42").get()

    # Then: it replays the stored failure as the same class, without running the body
    assert type(excinfo.value) is PermanentError
    assert calls == [42]
    record = idem.get(settle, "order-42")
    assert record is not None and record.state is State.FAILED
    assert record.error is not None and record.error.type == "PermanentError"


def test_class_listed_as_permanent_in_the_policy_is_stored_and_replayed(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, CardDeclined("insufficient funds"), permanent=(CardDeclined,))

    with pytest.raises(CardDeclined):
        settle.apply_async((42,), idempotency_key="order-42")
    replayed = settle.apply_async((42,), idempotency_key="order-42")

    assert replayed.deduplicated is True
    with pytest.raises(CardDeclined, match="insufficient funds"):
        replayed.get()
    assert calls == [42]
    assert idem.get(settle, "order-42").state is State.FAILED


def test_unlisted_error_is_retryable_by_default_so_the_next_call_runs(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, ValueError("flaky"))

    for _ in range(2):
        with pytest.raises(ValueError, match="flaky"):
            settle.apply_async((42,), idempotency_key="order-42")

    assert calls == [42, 42]
    assert idem.get(settle, "order-42") is None


def test_unlisted_error_is_stored_when_default_failure_is_permanent(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, ValueError("bad amount"), default_failure="permanent")

    with pytest.raises(ValueError, match="bad amount"):
        settle.apply_async((42,), idempotency_key="order-42")
    with pytest.raises(ValueError, match="bad amount"):
        settle.apply_async((42,), idempotency_key="order-42").get()

    assert calls == [42]
    assert idem.get(settle, "order-42").state is State.FAILED


def test_app_wide_default_failure_applies_to_tasks_without_their_own(calls: list[Any]) -> None:
    app = make_app()
    idem = Idempotency(app, default_failure="permanent")
    settle = failing_task(app, calls, ValueError("bad amount"))

    with pytest.raises(ValueError):
        settle.apply_async((42,), idempotency_key="order-42")

    assert idem.get(settle, "order-42").state is State.FAILED


def test_connection_error_stays_retryable_even_when_default_failure_is_permanent(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    settle = failing_task(app, calls, ConnectionError("provider down"), default_failure="permanent")

    for _ in range(2):
        with pytest.raises(ConnectionError):
            settle.apply_async((42,), idempotency_key="order-42")

    assert calls == [42, 42]
    assert idem.get(settle, "order-42") is None


def test_failure_whose_class_cannot_be_rebuilt_replays_as_replayed_failure_error(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    # Given: a permanent error class defined inside this function (import by module+qualname fails)
    class LocalDeclined(PermanentError):
        pass

    settle = failing_task(app, calls, LocalDeclined("card declined"))
    with pytest.raises(LocalDeclined):
        settle.apply_async((42,), idempotency_key="order-42")

    # When: the stored failure is replayed
    with pytest.raises(ReplayedFailureError) as excinfo:
        settle.apply_async((42,), idempotency_key="order-42").get()

    # Then: the generic error names the original module, type and message
    message = str(excinfo.value)
    assert __name__ in message
    assert "LocalDeclined" in message
    assert "card declined" in message
    assert isinstance(excinfo.value, IdempotencyError)
    assert calls == [42]


# Regression: an exception out of an eager send() used to be released twice, with a stale token.
@pytest.mark.parametrize("exc", [ValueError("flaky"), PermanentError("declined")], ids=["retryable", "permanent"])
def test_ordinary_failure_counts_no_lost_lock(
    app: Celery, idem: Idempotency, calls: list[Any], caplog: pytest.LogCaptureFixture, exc: Exception
) -> None:
    settle = failing_task(app, calls, exc)

    with caplog.at_level(logging.WARNING, logger="celery_idem"), pytest.raises(type(exc)):
        settle.apply_async((42,), idempotency_key="order-42")

    # Nobody took over the record: nothing was lost, and nothing says so.
    assert metric(idem, "lost_locks") == 0
    assert not [r.getMessage() for r in caplog.records if "LOST" in r.getMessage()]


def test_celery_retry_keeps_the_identity_and_the_retry_runs(calls: list[Any]) -> None:
    # Given: eager mode without propagation, so Celery runs the retry in place (as plain Celery does)
    app = make_app()
    app.conf.task_eager_propagates = False
    idem = Idempotency(app)

    @app.task(shared=False, base=IdempotentTask, bind=True, max_retries=3)
    def flaky(self: Task, order_id: int) -> str:
        calls.append(order_id)
        if len(calls) == 1:
            raise self.retry(countdown=0, exc=ConnectionError("provider timeout"))
        return "charged"

    # When: the first attempt asks Celery to retry
    result = flaky.apply_async((42,), idempotency_key="order-42")

    # Then: the retry ran under the same identity (no second claim) and its outcome is stored
    assert result.get() == "charged"
    assert calls == [42, 42]
    assert metric(idem, "claims") == 1
    assert idem.get(flaky, "order-42").state is State.COMPLETED
    assert flaky.apply_async((42,), idempotency_key="order-42").get() == "charged"
    assert calls == [42, 42]


def test_autoretry_for_error_is_retried_then_stored(calls: list[Any]) -> None:
    app = make_app()
    app.conf.task_eager_propagates = False
    idem = Idempotency(app)

    @app.task(shared=False, base=IdempotentTask, autoretry_for=(KeyError,), max_retries=2, default_retry_delay=0)
    def lookup(order_id: int) -> str:
        calls.append(order_id)
        if len(calls) == 1:
            raise KeyError("not yet")
        return "found"

    assert lookup.apply_async((42,), idempotency_key="order-42").get() == "found"
    assert calls == [42, 42]
    assert idem.get(lookup, "order-42").state is State.COMPLETED


# Regression: a propagated eager retry used to leave the key PENDING for the pending timeout.
def test_propagated_celery_retry_in_eager_mode_frees_the_key(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, max_retries=3)
    def flaky(self: Task, order_id: int) -> str:
        calls.append(order_id)
        if len(calls) == 1:
            raise self.retry(countdown=0, exc=ConnectionError("provider timeout"))
        return "charged"

    # Given: eager propagation hands Celery's Retry to the caller; nothing is queued (plain Celery too)
    with pytest.raises(Retry):
        flaky.apply_async((42,), idempotency_key="order-42")

    # When: the caller tries again with the same key
    again = flaky.apply_async((42,), idempotency_key="order-42")

    # Then: it runs, instead of waiting on an attempt that will never come
    assert again.deduplicated is False
    assert calls == [42, 42]
    assert again.get(timeout=1) == "charged"


@pytest.mark.parametrize("exc", [ValueError("flaky"), CardDeclined("retry me")], ids=["value-error", "custom"])
def test_class_listed_as_retryable_beats_default_failure_permanent(
    app: Celery, idem: Idempotency, calls: list[Any], exc: Exception
) -> None:
    settle = failing_task(app, calls, exc, retryable=(type(exc),), default_failure="permanent")

    for _ in range(2):
        with pytest.raises(type(exc)):
            settle.apply_async((42,), idempotency_key="order-42")

    assert calls == [42, 42]
    assert idem.get(settle, "order-42") is None


# --- duplicates ------------------------------------------------------------------------------------


def test_on_duplicate_raise_refuses_the_second_call_with_the_original_task_id(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"on_duplicate": "raise"})
    def ship(order_id: int) -> str:
        calls.append(order_id)
        return "shipped"

    first = ship.apply_async((42,), idempotency_key="order-42")

    with pytest.raises(DuplicateTaskError) as excinfo:
        ship.apply_async((42,), idempotency_key="order-42")

    assert excinfo.value.task_id == first.id
    assert excinfo.value.key == "order-42"
    assert first.id in str(excinfo.value)
    assert calls == [42]


def test_key_in_the_message_header_is_honoured(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100), headers={"idempotency_key": "order-42"})
    second = charge.apply_async((42, 100), idempotency_key="order-42")

    assert first.idempotency_key == "order-42"
    assert second.deduplicated is True and second.id == first.id
    assert calls == [(42, 100)]


def test_duplicate_head_of_a_chain_still_feeds_its_continuation(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def add(x: int, y: int) -> int:
        calls.append((x, y))
        return x + y

    @app.task(shared=False)
    def double(total: int) -> int:
        return total * 2

    first = (add.s(1, 2).set(idempotency_key="sum-1") | double.s()).apply_async()
    # When: the same head is called again inside a new chain
    second = (add.s(1, 2).set(idempotency_key="sum-1") | double.s()).apply_async()

    # Then: the head ran once, and the continuation got its outcome both times
    assert first.get() == second.get() == 6
    assert calls == [(1, 2)]


def test_ignore_result_task_answers_from_the_store(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, ignore_result=True)
    def tally(n: int) -> int:
        calls.append(n)
        return n * 10

    first = tally.apply_async((3,), idempotency_key="tally-3")
    replayed = tally.apply_async((3,), idempotency_key="tally-3")

    assert first.get() == replayed.get() == 30
    assert replayed.state == "SUCCESS"
    assert calls == [3]


# --- serialization ---------------------------------------------------------------------------------


def test_unserializable_argument_is_refused_at_publish_and_nothing_is_claimed(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def store_blob(blob: Any) -> None:
        calls.append(blob)

    with pytest.raises(SerializationError):
        store_blob.apply_async((object(),), idempotency_key="blob-1")

    assert calls == []
    assert metric(idem, "claims") == 0
    assert len(idem.store) == 0


def test_unserializable_argument_is_the_encode_error_plain_celery_raises(app: Celery, idem: Idempotency) -> None:
    # Given code written for plain Celery, which catches kombu's EncodeError around apply_async
    from kombu.exceptions import EncodeError

    @app.task(shared=False, base=IdempotentTask)
    def store_blob(blob: Any) -> None: ...

    # When an argument cannot be encoded, Then that same except clause catches our error
    with pytest.raises(EncodeError) as excinfo:
        store_blob.apply_async((object(),), idempotency_key="blob-1")
    assert isinstance(excinfo.value, SerializationError)
    assert "cannot" in str(excinfo.value)
    assert len(idem.store) == 0


def test_unserializable_result_raises_and_settles_a_permanent_failure(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask)
    def make_handle(order_id: int) -> object:
        calls.append(order_id)
        return object()

    with pytest.raises(SerializationError):
        make_handle.apply_async((42,), idempotency_key="order-42")

    record = idem.get(make_handle, "order-42")
    assert record is not None and record.state is State.FAILED and record.error.type == "SerializationError"
    # The body returned (its effect happened): the next call is told the failure, never run again
    again = make_handle.apply_async((42,), idempotency_key="order-42")
    assert again.deduplicated
    with pytest.raises(SerializationError):
        again.get()
    assert calls == [42]


def test_result_over_max_result_bytes_raises_and_settles_a_permanent_failure(calls: list[Any]) -> None:
    app = make_app()
    idem = Idempotency(app, max_result_bytes=100)

    @app.task(shared=False, base=IdempotentTask)
    def report(order_id: int) -> str:
        calls.append(order_id)
        return "x" * 500

    with pytest.raises(ResultTooLargeError) as excinfo:
        report.apply_async((42,), idempotency_key="order-42")

    assert isinstance(excinfo.value, SerializationError)
    assert "max_result_bytes" in str(excinfo.value)
    record = idem.get(report, "order-42")
    assert record is not None and record.state is State.FAILED and record.error.type == "ResultTooLargeError"
    assert calls == [42]


def test_result_within_max_result_bytes_is_stored(calls: list[Any]) -> None:
    app = make_app()
    idem = Idempotency(app, max_result_bytes=100)

    @app.task(shared=False, base=IdempotentTask)
    def report(order_id: int) -> str:
        calls.append(order_id)
        return "x" * 50

    report.apply_async((42,), idempotency_key="order-42")

    assert idem.get(report, "order-42").state is State.COMPLETED


def test_pickle_serializer_is_refused_at_first_call_by_default(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, serializer="pickle")
    def snapshot(order_id: int) -> set[int]:
        calls.append(order_id)
        return {order_id}

    with pytest.raises(ConfigurationError, match="pickle") as excinfo:
        snapshot.apply_async((42,), idempotency_key="order-42")

    assert isinstance(excinfo.value, IdempotencyError)
    assert "accept_pickle" in str(excinfo.value)
    assert calls == []
    assert len(idem.store) == 0


def test_pickle_serializer_works_when_accept_pickle_is_set(calls: list[Any]) -> None:
    app = make_app()
    Idempotency(app, accept_pickle=True)

    @app.task(shared=False, base=IdempotentTask, serializer="pickle")
    def snapshot(order_id: int) -> set[int]:
        calls.append(order_id)
        return {order_id}

    first = snapshot.apply_async((42,), idempotency_key="order-42")
    replayed = snapshot.apply_async((42,), idempotency_key="order-42")

    assert first.get() == replayed.get() == {42}  # a set survives: the pickle serializer stored it
    assert replayed.deduplicated is True
    assert calls == [42]


# --- configuration errors at first call ------------------------------------------------------------


def test_key_args_naming_a_missing_parameter_fails_at_first_call(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"key_args": ["order_id", "ammount"]})
    def capture(order_id: int, amount: int) -> None:
        calls.append(order_id)

    with pytest.raises(ConfigurationError, match="ammount") as excinfo:
        capture.apply_async((42, 100), idempotency_key="order-42")

    assert "amount" in str(excinfo.value)  # it shows the real signature
    assert calls == []
    assert metric(idem, "claims") == 0


def test_invalid_task_policy_fails_at_first_call_naming_the_field(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"ttl_seconds": 0})
    def capture(order_id: int) -> None:
        calls.append(order_id)

    with pytest.raises(ConfigurationError, match="ttl_seconds"):
        capture.apply_async((42,), idempotency_key="order-42")
    assert calls == []


def test_idempotency_option_of_the_wrong_type_fails_at_first_call(
    app: Celery, idem: Idempotency, calls: list[Any]
) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency="yes please")
    def capture(order_id: int) -> None:
        calls.append(order_id)

    with pytest.raises(ConfigurationError, match="dict or IdempotencyPolicy"):
        capture.apply_async((42,), idempotency_key="order-42")
    assert calls == []


def test_policy_model_as_the_task_option(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency=IdempotencyPolicy(on_duplicate="raise"))
    def capture(order_id: int) -> None:
        calls.append(order_id)

    capture.apply_async((42,), idempotency_key="order-42")
    with pytest.raises(DuplicateTaskError):
        capture.apply_async((42,), idempotency_key="order-42")
    assert calls == [42]


def test_key_args_narrow_the_fingerprint(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, idempotency={"key_args": ["order_id"]})
    def capture(order_id: int, note: str = "") -> None:
        calls.append((order_id, note))

    charge_a = capture.apply_async((42, "first"), idempotency_key="order-42")
    charge_b = capture.apply_async((42, "second"), idempotency_key="order-42")  # not a mismatch

    assert charge_b.deduplicated is True and charge_b.id == charge_a.id
    assert calls == [(42, "first")]


# --- direct calls, get and forget ------------------------------------------------------------------


def test_direct_function_call_just_runs_and_touches_no_store(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    assert charge(1, 2) == {"order_id": 1, "charged": 2}
    assert charge(1, 2) == {"order_id": 1, "charged": 2}

    assert calls == [(1, 2), (1, 2)]
    assert metric(idem, "claims") == 0
    assert len(idem.store) == 0
    # And a later protected call is not a duplicate of the direct ones
    assert charge.apply_async((1, 2)).deduplicated is False


def test_forget_lets_the_same_key_run_again(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    first = charge.apply_async((42, 100), idempotency_key="order-42")

    assert idem.forget(charge, "order-42") is True
    again = charge.apply_async((42, 100), idempotency_key="order-42")

    assert again.deduplicated is False
    assert again.id != first.id
    assert calls == [(42, 100), (42, 100)]


def test_forget_of_an_unknown_key_returns_false(charge: Task, idem: Idempotency) -> None:
    assert idem.forget(charge, "never-used") is False


def test_forget_lets_other_arguments_use_the_key(charge: Task, idem: Idempotency, calls: list[Any]) -> None:
    charge.apply_async((42, 100), idempotency_key="order-42")
    idem.forget(charge.name, "order-42")

    charge.apply_async((42, 999), idempotency_key="order-42")  # no PayloadMismatchError

    assert calls == [(42, 100), (42, 999)]


def test_get_takes_the_task_or_its_name(charge: Task, idem: Idempotency) -> None:
    result = charge.apply_async((42, 100), idempotency_key="order-42")

    by_task = idem.get(charge, "order-42")
    by_name = idem.get(charge.name, "order-42")

    assert by_task == by_name
    assert by_name is not None
    assert (by_name.key, by_name.task_name, by_name.task_id) == ("order-42", charge.name, result.id)
    assert by_name.state is State.COMPLETED


def test_get_of_an_unknown_key_is_none(charge: Task, idem: Idempotency) -> None:
    assert idem.get(charge, "never-used") is None


def test_get_validates_the_key(charge: Task, idem: Idempotency) -> None:
    with pytest.raises(InvalidKeyError):
        idem.get(charge, "has space")


# --- metrics ---------------------------------------------------------------------------------------


def test_metrics_count_claims_replays_and_mismatches(charge: Task, idem: Idempotency) -> None:
    assert idem.metrics()["claims"] == 0

    # NEW: one claim, nothing else
    charge.apply_async((42, 100), idempotency_key="order-42")
    assert (metric(idem, "claims"), metric(idem, "replays"), metric(idem, "mismatches")) == (1, 0, 0)

    # Duplicate of a completed call: in eager mode that is a REPLAY (claims count every claim)
    charge.apply_async((42, 100), idempotency_key="order-42")
    assert (metric(idem, "claims"), metric(idem, "replays"), metric(idem, "mismatches")) == (2, 1, 0)

    # Same key, other arguments: a mismatch
    with pytest.raises(PayloadMismatchError):
        charge.apply_async((42, 999), idempotency_key="order-42")
    assert (metric(idem, "claims"), metric(idem, "replays"), metric(idem, "mismatches")) == (3, 1, 1)
    assert metric(idem, "duplicates") == 0


def test_metrics_is_a_snapshot_with_every_documented_counter(idem: Idempotency) -> None:
    snapshot = idem.metrics()
    snapshot["claims"] = 99

    assert idem.metrics()["claims"] == 0
    assert {
        "claims",
        "duplicates",
        "replays",
        "mismatches",
        "busy_waits",
        "lost_locks",
        "store_errors",
        "reconciled_completed",
        "reconciled_failed",
        "reconciled_released",
    } <= set(snapshot)


def test_a_given_memory_store_holds_the_records(app: Celery, calls: list[Any]) -> None:
    store = MemoryStore()
    idem = Idempotency(app, store=store)

    @app.task(shared=False, base=IdempotentTask)
    def ping(n: int) -> int:
        calls.append(n)
        return n

    ping.apply_async((1,), idempotency_key="p-1")

    assert len(store) == 1
    assert idem.get(ping, "p-1") is not None


def test_a_task_policy_refines_its_base_class_policy(app: Celery, idem: Idempotency) -> None:
    class Payments(IdempotentTask):
        idempotency = {"ttl_seconds": 7200, "permanent": (KeyError,)}

    @app.task(shared=False, base=Payments, idempotency={"lease_seconds": 5})
    def refund(order_id: int) -> None: ...

    policy = idem.policy_for(refund)
    assert (policy.ttl_seconds, policy.lease_seconds, policy.permanent) == (7200, 5, (KeyError,))


# --- pydantic=True tasks ------------------------------------------------------------------------------


def test_pydantic_task_is_fingerprinted_as_celery_sends_it(app: Celery, idem: Idempotency, calls: list[Any]) -> None:
    @app.task(shared=False, base=IdempotentTask, pydantic=True)
    def place(order: Order) -> dict[str, int]:
        calls.append(order)
        return {"order": order.order_id, "amount": order.amount}

    # When: the task is called with a model, an equal model, and the model's dump, under one key
    first = place.apply_async((Order(order_id=1, amount=5),), idempotency_key="order-1")
    again = place.apply_async((Order(order_id=1, amount=5),), idempotency_key="order-1")
    by_dict = place.apply_async(kwargs={"order": {"order_id": 1, "amount": 5}}, idempotency_key="order-1")
    # Then: it is one call (as plain Celery, which dumps the models, would send it), run once
    assert [first.deduplicated, again.deduplicated, by_dict.deduplicated] == [False, True, True]
    assert first.get() == again.get() == by_dict.get() == {"order": 1, "amount": 5}
    assert calls == [Order(order_id=1, amount=5)]
    # And: another model under the key is other arguments; without a key, equal models are one call
    with pytest.raises(PayloadMismatchError):
        place.apply_async((Order(order_id=1, amount=6),), idempotency_key="order-1")
    assert place.delay(Order(order_id=2, amount=7)).get() == place.delay({"order_id": 2, "amount": 7}).get()
    assert len(calls) == 2


# ---- the store down between an eager call's claim and its acquire ---------------------------------


@pytest.mark.parametrize("blips", [1, 1000])
def test_an_eager_call_whose_acquire_fails_tells_the_caller_once_and_leaves_no_claim(
    blips: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No broker keeps an eager call's message, so "back to the broker" would recurse into the call
    # itself (hundreds of nested acquires) and hide the error: the caller is told, as at publish.
    app = Celery("eager-acquire-down", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    store = MemoryStore()
    Idempotency(app, store=store)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def times_ten(x: int) -> int:
        runs.append(x)
        return x * 10

    real, acquires = store._acquire, [0]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        acquires[0] += 1
        if acquires[0] <= blips:
            raise ConnectionError("store down")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "_acquire", flaky)
    with pytest.raises(StoreUnavailableError, match="failed acquire"):
        times_ten.apply_async((4,), idempotency_key="k")
    assert acquires[0] == 1 and runs == []
    record = store.get(Identity("", times_ten.name, "k"))
    assert record is None  # the claim is given back: a new call runs (once the store answers)
    monkeypatch.setattr(store, "_acquire", real)
    assert times_ten.apply_async((4,), idempotency_key="k").get() == 40


def test_an_eager_body_that_calls_its_own_task_as_a_function_runs_it_as_a_plain_call() -> None:
    app = Celery("eager-recursion", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app)
    levels: list[int] = []

    @app.task(base=IdempotentTask, shared=False, idempotency={"busy_wait_seconds": 1})
    def countdown(n: int) -> str:
        levels.append(n)
        return countdown(n - 1) if n > 0 else "done"  # type: ignore[no-any-return]

    # Before, the inner call was taken for a copy of the running message: it waited on its own lease
    assert countdown.apply_async((2,), idempotency_key="k").get() == "done"
    assert levels == [2, 1, 0]
