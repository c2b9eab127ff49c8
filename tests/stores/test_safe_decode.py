"""Safe decode (DESIGN §3): a stored outcome is decoded only from a content type the settings accept.

A record claiming pickle is planted straight through each store (as anyone who can write to the store,
or an earlier ``accept_pickle=True`` deployment, could leave it); unpickling it would create a
directory. With ``accept_pickle=False`` no reader decodes it: each fails with SerializationError.
The worker's replay is in tests/worker/test_worker_outcomes.py, the CLI's in tests/api/test_cli.py, the
ledger's in tests/recovery/test_ledger_once.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from conftest import PICKLE, plant_pickle

from celery_idem import Idempotency, IdempotentTask, ReplayedFailureError, SerializationError
from celery_idem.records import ErrorInfo, Identity
from celery_idem.stores import Store


def eager_app(store: Store, **settings: Any) -> tuple[Celery, Any]:
    app = Celery("safe", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    Idempotency(app, store=store, **settings)
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, name="safe.charge")
    def charge(order_id: int) -> dict[str, int]:
        calls.append(order_id)
        return {"charged": order_id}

    charge.calls = calls
    return app, charge


def planted(store: Store, charge: Any, tmp_path: Path, key: str = "order-1") -> Path:
    flag = tmp_path / "unpickled"
    fp = charge.idempotency_handler.fingerprint((1,), {})
    plant_pickle(store, Identity("", charge.name, key), fp, str(flag))
    return flag


def test_get_never_unpickles_a_record_claiming_pickle_without_accept_pickle(store: Store, tmp_path: Path) -> None:
    _, charge = eager_app(store)
    flag = planted(store, charge, tmp_path)
    # When a caller's duplicate call is answered from the planted record
    result = charge.apply_async((1,), idempotency_key="order-1")
    assert result.deduplicated is True
    # Then get() refuses it clearly, naming the content type and the fix, and nothing was unpickled
    with pytest.raises(SerializationError, match="content type 'application/x-python-serialize'") as raised:
        result.get()
    assert "accept_pickle" in str(raised.value) and "forget" in str(raised.value)
    assert raised.value.key == "order-1" and raised.value.task_name == "safe.charge"
    assert not flag.exists()
    assert charge.calls == []


def test_a_worker_replay_never_unpickles_a_record_claiming_pickle(store: Store, tmp_path: Path) -> None:
    _, charge = eager_app(store)
    flag = planted(store, charge, tmp_path)
    # A duplicate under a caller-chosen id is published anyway: the worker side replays it (eager: inline)
    with pytest.raises(SerializationError, match="does not accept"):
        charge.apply_async((1,), idempotency_key="order-1", task_id="chosen-id").get()
    assert not flag.exists()
    assert charge.calls == []


def test_pickle_in_accept_content_alone_does_not_let_a_record_be_unpickled(store: Store, tmp_path: Path) -> None:
    app, charge = eager_app(store)
    app.conf.accept_content = ["json", "pickle"]
    app.conf.result_accept_content = ["pickle"]
    flag = planted(store, charge, tmp_path)
    assert PICKLE not in Idempotency.of(app).accepted_content_types
    with pytest.raises(SerializationError):
        charge.apply_async((1,), idempotency_key="order-1").get()
    assert not flag.exists()


def test_accept_pickle_true_decodes_a_pickle_record(store: Store, tmp_path: Path) -> None:
    _, charge = eager_app(store, accept_pickle=True)
    flag = planted(store, charge, tmp_path)
    assert charge.apply_async((1,), idempotency_key="order-1").get() is None  # os.makedirs returned None
    assert flag.exists()


def test_a_result_in_an_accepted_serializer_other_than_json_still_replays(store: Store) -> None:
    app, charge = eager_app(store)
    app.conf.accept_content = ["json", "yaml"]
    charge.serializer = "yaml"
    first = charge.apply_async((3,), idempotency_key="order-3")
    second = charge.apply_async((3,), idempotency_key="order-3")
    assert first.get() == second.get() == {"charged": 3}
    assert charge.calls == [3]


def test_a_stored_failure_never_imports_a_module_the_process_has_not_imported(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an installed module whose import has a side effect, which nothing has imported yet
    flag = tmp_path / "imported"
    (tmp_path / "sideeffect_errors.py").write_text(
        f"import pathlib\npathlib.Path({str(flag)!r}).mkdir()\nclass Boom(Exception):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _, charge = eager_app(store)
    identity = Identity("", charge.name, "order-1")
    fp = charge.idempotency_handler.fingerprint((1,), {})
    run = store.acquire(identity, fp, "task-1", lease_seconds=30, ttl_seconds=60)
    assert run.record is not None
    store.fail(identity, run.record.owner, ErrorInfo(type="Boom", module="sideeffect_errors", message="boom"))
    # When a duplicate is answered with that stored failure
    with pytest.raises(ReplayedFailureError, match="sideeffect_errors.Boom: boom"):
        charge.apply_async((1,), idempotency_key="order-1").get()
    # Then the module was never imported, and so never ran
    assert not flag.exists()
    assert "sideeffect_errors" not in sys.modules
    assert charge.calls == []


class Declined(Exception):
    """An exception whose __init__ takes more than the message it passes up (args == (message,))."""

    def __init__(self, order_id: int, reason: str) -> None:
        super().__init__(f"order {order_id} declined: {reason}")
        self.order_id = order_id


def test_an_exception_whose_init_wants_other_arguments_rebuilds_as_its_class() -> None:
    from celery_idem.outcome import rebuild_exception
    from celery_idem.records import ErrorInfo

    rebuilt = rebuild_exception(ErrorInfo.from_exception(Declined(42, "no funds")))
    assert type(rebuilt) is Declined and str(rebuilt) == "order 42 declined: no funds"


def test_sqlalchemy_errors_rebuild_where_their_text_needs_no_init_and_are_replayed_failures_where_it_does() -> None:
    import sqlite3

    from sqlalchemy import exc as sa_exc

    from celery_idem.outcome import rebuild_exception
    from celery_idem.records import ErrorInfo

    no_row = rebuild_exception(ErrorInfo.from_exception(sa_exc.NoResultFound("No row was found")))
    assert type(no_row) is sa_exc.NoResultFound and str(no_row) == "No row was found"
    integrity = sa_exc.IntegrityError("INSERT ...", {}, sqlite3.IntegrityError("UNIQUE constraint failed"))
    replayed = rebuild_exception(ErrorInfo.from_exception(integrity))
    assert type(replayed) is ReplayedFailureError
    assert "sqlalchemy.exc.IntegrityError" in str(replayed) and "UNIQUE constraint failed" in str(replayed)


@pytest.mark.parametrize(
    ("module", "name"),
    [("builtins", "SystemExit"), ("builtins", "KeyboardInterrupt"), ("celery.exceptions", "Retry")],
)
def test_a_stored_failure_never_rebuilds_what_no_outcome_can_be(store: Store, module: str, name: str) -> None:
    # Given a record that claims a failure no attempt ever stores (written by someone else)
    _, charge = eager_app(store)
    identity = Identity("", charge.name, "order-1")
    fp = charge.idempotency_handler.fingerprint((1,), {})
    run = store.acquire(identity, fp, "task-1", lease_seconds=30, ttl_seconds=60)
    assert run.record is not None
    store.fail(identity, run.record.owner, ErrorInfo(type=name, module=module, message="forged"))
    # When a duplicate is answered with it, Then it is a ReplayedFailureError, never the real thing
    with pytest.raises(ReplayedFailureError, match=f"{module}.{name}: forged"):
        charge.apply_async((1,), idempotency_key="order-1").get()
    assert charge.calls == []
