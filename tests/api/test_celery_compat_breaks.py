"""Plain Celery behaviour that IdempotentTask must keep (issue 11: Celery's own t/unit/tasks suite
run with IdempotentTask as the default task class). Eager mode and units; the worker side of the
same cases is in tests/worker/test_worker_outcomes.py (returned result objects and retries),
test_worker_duplicates.py (typing=False) and test_worker_control_flow.py (self-replacement).

Each task counts its executions in a list the body appends to: a side effect outside the library.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from celery import Celery, Task, group
from celery.app.trace import build_tracer
from celery.backends.base import BaseBackend
from celery.result import AsyncResult, allow_join_result, result_from_tuple

from celery_idem import ConfigurationError, Idempotency, IdempotentTask, MemoryStore, State
from celery_idem.outcome import prepare_value


def make_app(name: str = "compat", **options: Any) -> Celery:
    app = Celery(name, set_as_current=False, **options)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    return app


# ---- a returned result object is stored as the result backend stores it ------------------------


@pytest.mark.parametrize("serializer", ["json", "pickle", "msgpack", "yaml"])
def test_results_are_prepared_by_the_result_backends_own_rule(serializer: str) -> None:
    # outcome.prepare_value restates BaseBackend.prepare_value: held here against Celery's own.
    app = make_app()
    backend = BaseBackend(app, serializer=serializer)
    chained = AsyncResult("child", parent=AsyncResult("parent"))
    grouped = app.GroupResult("g", [AsyncResult("a"), AsyncResult("b")], parent=AsyncResult("p"))
    for value in (chained, grouped, AsyncResult("alone"), {"plain": [1, 2]}, None):
        assert prepare_value(value, serializer) == backend.prepare_value(value)


def test_a_task_returning_a_result_object_is_stored_and_duplicates_get_its_backend_form() -> None:
    app = make_app()
    idem = Idempotency(app)
    runs: list[int] = []

    @app.task(shared=False, base=IdempotentTask)
    def child(x: int) -> int:
        return x + 1

    @app.task(shared=False, base=IdempotentTask)
    def parent(x: int) -> Any:
        runs.append(x)
        return child.delay(x)

    # Given a body that returns its child's result (eager: Celery hands the object back as it is)
    first = parent.apply_async((1,), idempotency_key="p-1")
    child_result = first.get()
    assert child_result.get() == 2
    # Then the record is COMPLETED with the backend's form, which every duplicate gets
    record = idem.get(parent, "p-1")
    assert record is not None and record.state is State.COMPLETED
    again = parent.apply_async((1,), idempotency_key="p-1")
    assert again.deduplicated and again.get() == [[child_result.id, None], None]
    assert result_from_tuple(again.get(), app).id == child_result.id
    assert runs == [1]


def test_a_returned_group_result_is_stored_in_its_tuple_form() -> None:
    app = make_app()
    idem = Idempotency(app)

    @app.task(shared=False, base=IdempotentTask)
    def double(x: int) -> int:
        return 2 * x

    @app.task(shared=False, base=IdempotentTask)
    def fan_out(n: int) -> Any:
        return group(double.s(i) for i in range(n)).apply_async()

    fan_out.apply_async((2,), idempotency_key="fan-2")
    replayed = fan_out.apply_async((2,), idempotency_key="fan-2").get()
    rebuilt = result_from_tuple(replayed, app)
    assert len(rebuilt.results) == 2
    assert idem.get(fan_out, "fan-2").state is State.COMPLETED


# ---- a returned Retry is a raised one ----------------------------------------------------------


@pytest.mark.parametrize("propagate", [True, False], ids=["propagate", "no-propagate"])
def test_a_returned_retry_runs_the_retry_in_eager_mode_as_plain_celery_does(propagate: bool) -> None:
    app = make_app()
    app.conf.task_eager_propagates = propagate
    idem = Idempotency(app)
    runs: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, max_retries=3)
    def rebill(self: Task, amount: int) -> dict[str, int]:
        runs.append(self.request.retries)
        if self.request.retries == 0:
            return self.retry(countdown=0, throw=False)  # type: ignore[no-any-return]
        return {"amount": amount, "retries": self.request.retries}

    # When the first attempt returns Celery's Retry instead of raising it
    result = rebill.apply_async((5,), idempotency_key="rebill-5")
    # Then Celery's apply runs the retry inline, which takes the record over and completes it
    assert result.get() == {"amount": 5, "retries": 1}
    assert runs == [0, 1]
    record = idem.get(rebill, "rebill-5")
    assert record is not None and record.state is State.COMPLETED
    assert rebill.apply_async((5,), idempotency_key="rebill-5").get() == {"amount": 5, "retries": 1}
    assert runs == [0, 1]


# ---- typing=False: the call is not checked against the signature ------------------------------------


@pytest.mark.parametrize("where", ["task", "app"])
def test_typing_off_publishes_a_call_that_does_not_fit_the_signature(where: str) -> None:
    # Given typing turned off on the task, or app-wide (Celery(strict_typing=False))
    app = make_app(strict_typing=where == "task")
    app.conf.task_eager_propagates = False
    Idempotency(app)
    runs: list[Any] = []

    @app.task(shared=False, base=IdempotentTask, **({"typing": False} if where == "task" else {}))
    def add(*args: Any, **kwargs: Any) -> int:
        runs.append((args, kwargs))
        return sum(args) + sum(kwargs.values())

    @app.task(shared=False, base=IdempotentTask, **({"typing": False} if where == "task" else {}))
    def strict(x: int, y: int) -> int:
        runs.append((x, y))
        return x + y

    # When a call does not fit the signature, Celery publishes it and the body's call fails (eager:
    # a FAILURE result), as for plain Celery; a call that fits runs once per call as given
    failed = strict.apply_async((1, 2), {"extra": 3})
    assert failed.state == "FAILURE" and isinstance(failed.result, TypeError)
    assert strict.delay(1, 2).get() == 3 and strict.delay(1, 2).deduplicated
    assert add.delay(1, 2, extra=3).get() == 6
    assert add.delay(1, 2, extra=3).deduplicated
    assert not add.delay(1, 2, extra=4).deduplicated
    assert runs == [(1, 2), ((1, 2), {"extra": 3}), ((1, 2), {"extra": 4})]


def test_typing_off_with_key_args_is_a_configuration_error_saying_what_to_do() -> None:
    app = make_app()
    Idempotency(app)

    @app.task(shared=False, base=IdempotentTask, typing=False, idempotency={"key_args": ["order_id"]})
    def charge(order_id: int, amount: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"sets key_args.*typing is off.*remove key_args") as raised:
        charge.apply_async((1, 2), idempotency_key="k")
    assert repr(charge.name) in str(raised.value)


# ---- one heartbeat thread per extension, stopped by disconnect() ------------------------------------


def _heartbeat_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "celery-idem-heartbeat" and t.is_alive()}


def test_disconnect_stops_the_heartbeat_thread_of_every_app() -> None:
    before = _heartbeat_threads()  # other tests' extensions may still run theirs
    extensions = []
    for n in range(5):
        # Given several apps, each with the extension, each having run a task
        app = make_app(f"hb{n}")
        idem = Idempotency(app)

        @app.task(shared=False, base=IdempotentTask, name=f"hb{n}.ping")
        def ping() -> str:
            return "pong"

        assert ping.delay().get() == "pong"
        assert idem.heartbeat.running
        extensions.append(idem)
    assert len(_heartbeat_threads() - before) == 5
    # When each is disconnected
    for idem in extensions:
        idem.disconnect()
    # Then no heartbeat thread of theirs is left
    assert _heartbeat_threads() - before == set()
    assert not any(idem.heartbeat.running for idem in extensions)


# ---- a tracer called without a task id --------------------------------------------------------------


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "worker-tracer"])
def test_a_tracer_without_a_task_id_runs_the_body_unprotected_and_warns_once(
    eager: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a tracer built by hand and called with a request that has no id (Celery's own unit
    # tests do this; a worker's message always has one)
    app = make_app()
    idem = Idempotency(app)
    seen: list[Any] = []

    @app.task(shared=False, base=IdempotentTask, bind=True)
    def double(self: Task, x: int) -> int:
        seen.append((self.request.id, self.request.args))
        return 2 * x

    tracer = build_tracer(double.name, double, eager=eager, propagate=True, app=app)
    # When it runs the task twice
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        assert tracer("id-1", (2,), {}, {}).retval == 4
        assert tracer("id-2", (2,), {}, None).retval == 4
    # Then the body runs each time in the tracer's request, as plain Celery's task.run does, with
    # nothing to fence: no record is written, and one warning names the task and says why
    assert seen == [(None, (2,)), (None, (2,))]
    assert idem.get(double, double.idempotency_handler.fingerprint((2,), {})) is None
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("celery_idem")]
    assert len(warned) == 1 and repr(double.name) in warned[0] and "no task id" in warned[0]


# ---- headers that are not a dict ------------------------------------------------------------------


def test_headers_that_are_not_a_dict_carry_no_key_and_break_nothing() -> None:
    # Celery never checks the type of headers (its own tests pass headers=123 as a marker).
    app = make_app()
    Idempotency(app)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def add(x: int, y: int) -> int:
        runs.append(1)
        return x + y

    assert add.apply((1, 2), headers=123).get() == 3
    assert add.apply((1, 2), headers=123).get() == 3  # keyed by its fingerprint: deduplicated
    assert runs == [1]


# The worker tracer cannot store a failure under no task id either, and says so in a warning.
@pytest.mark.filterwarnings("ignore:Exception raised outside body:RuntimeWarning")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "worker-tracer"])
def test_a_keyed_message_without_a_task_id_is_refused_never_run_unprotected(eager: bool) -> None:
    # A hand-built message (protocol 1, or a null id) that asks for deduplication: run unprotected,
    # every copy of it would run
    app = make_app()
    Idempotency(app)
    runs: list[int] = []

    @app.task(shared=False, base=IdempotentTask)
    def double(x: int) -> int:
        runs.append(x)
        return 2 * x

    tracer = build_tracer(double.name, double, eager=eager, propagate=True, app=app)
    with pytest.raises(ConfigurationError, match="carries an idempotency_key but no task id"):
        tracer(None, (2,), {}, {"headers": {"idempotency_key": "k"}})
    assert runs == []


# ---- eager self-replacement -------------------------------------------------------------------------

# Eager self-replacement (``return self.replace(self.s(n - 1))``) runs as in plain Celery: the
# in-body recursion mark (same task name and id) must not take the inline replacement for a direct
# call of the task from its body.


def _app(idem: bool) -> tuple[Any, list[Any]]:
    app = Celery("a4-replace", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.task_always_eager = True
    if idem:
        Idempotency(app, store=MemoryStore())
    seen: list[Any] = []

    @app.task(bind=True, base=IdempotentTask if idem else Task, shared=False)
    def countdown(self: Any, n: int) -> str:
        seen.append((n, self.request.id, self.request.is_eager))
        if n == 0:
            return "done"
        with allow_join_result():  # Celery's own eager replace calls .get() inside the task
            return self.replace(self.s(n - 1))

    app.finalize()
    return countdown, seen


def test_plain_celery_reference() -> None:
    countdown, seen = _app(idem=False)
    assert countdown.delay(2).get() == "done"
    assert all(eager for _, _, eager in seen) and len({i for _, i, _ in seen}) == 1


def test_idempotent_eager_self_replace() -> None:
    countdown, seen = _app(idem=True)
    result = countdown.delay(2)
    print(seen)
    assert all(eager for _, _, eager in seen), f"an inner replacement body saw a non-eager/blank request: {seen}"
    assert result.get() == "done"
