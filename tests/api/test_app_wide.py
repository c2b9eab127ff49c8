"""``Celery(task_cls=IdempotentTask)``: every task of the app is idempotent, and nothing of ours breaks.

Users adopt celery-idem app-wide by changing the app's default task class. The parts of celery-idem
that are themselves tasks must stay plain Celery tasks then.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from celery_idem import Idempotency, IdempotentTask
from celery_idem.reconciler import TASK_NAME


def make_app() -> Celery:
    app = Celery("t", set_as_current=False, task_cls=IdempotentTask)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    return app


def test_the_reconciler_task_runs_every_time_beat_sends_it_under_an_idempotent_task_cls(monkeypatch: Any) -> None:
    # Given an app whose default task class is IdempotentTask, and a reconciler whose runs we count
    app = make_app()
    idem = Idempotency(app)
    runs: list[int] = []
    monkeypatch.setattr(type(idem), "reconcile", lambda self, limit=None, dry_run=False: runs.append(1) or _report())

    # When beat sends the reconciler task three times with the same (empty) arguments
    results = [app.tasks[TASK_NAME].apply_async() for _ in range(3)]

    # Then it ran three times: the reconciler is never deduplicated
    assert len(runs) == 3
    assert not any(getattr(r, "deduplicated", False) for r in results)
    assert not isinstance(app.tasks[TASK_NAME], IdempotentTask)


def test_celery_idems_own_tasks_are_plain_tasks_under_an_idempotent_task_cls() -> None:
    app = make_app()
    Idempotency(app)
    ours = [name for name in app.tasks if name.startswith("celery_idem.")]
    assert len(ours) >= 3  # the reconciler and the two callbacks replace() links
    assert [name for name in ours if isinstance(app.tasks[name], IdempotentTask)] == []


def test_a_task_opts_out_of_an_app_wide_task_cls_with_base_task() -> None:
    app = make_app()
    Idempotency(app)
    runs: list[int] = []

    @app.task(shared=False, base=Task)
    def ping(n: int) -> int:
        runs.append(n)
        return n

    @app.task(shared=False)
    def pong(n: int) -> int:
        runs.append(-n)
        return n

    for _ in range(2):
        ping.delay(1)
        pong.delay(1)
    assert runs == [1, -1, 1]  # ping is plain Celery; pong (task_cls) is deduplicated by its arguments


def _report() -> Any:
    from celery_idem.reconciler import ReconcileReport

    return ReconcileReport()


def test_installing_the_extension_twice_on_one_app_registers_no_task_twice() -> None:
    # filterwarnings=error turns Celery's DuplicateTaskNameWarning into a failure here
    app = make_app()
    Idempotency(app)
    Idempotency(app, ttl_seconds=60)
    assert "celery_idem.replaced" in app.tasks


def test_threads_that_first_use_a_fresh_app_at_once_all_get_through() -> None:
    # A threaded web server's first requests: several threads publish through an app nobody has
    # used yet. Celery loads the app's configuration under its lock and calls the extension back
    # (its beat entry reads the settings); the extension's settings read app.conf. With a lock held
    # around the settings' first computation (functools.cached_property on Python 3.11), the two
    # locks were taken in opposite orders and the threads deadlocked.
    import threading

    for attempt in range(20):
        app = Celery(f"fresh{attempt}", broker="memory://", backend="cache+memory://", set_as_current=False)
        Idempotency(app, store="memory://")

        @app.task(base=IdempotentTask, name="fresh.charge", shared=False)
        def charge(order: int) -> int:
            return order

        start = threading.Barrier(4)
        done: list[int] = []

        def call(n: int, task: Any = charge, start: Any = start, done: list[int] = done) -> None:
            start.wait()
            task.apply_async((n,), idempotency_key=f"k{n}")
            done.append(n)

        threads = [threading.Thread(target=call, args=(n,), daemon=True) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert sorted(done) == [0, 1, 2, 3], f"attempt {attempt}: threads stuck in a fresh app's first use"
