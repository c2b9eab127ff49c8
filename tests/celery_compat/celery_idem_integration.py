"""pytest plugin: run Celery's own integration tests through a real worker with celery-idem installed.

Loaded with ``-p celery_idem_integration`` (this folder on PYTHONPATH) from the root of an extracted
Celery sdist, by ``integration.py``, together with ``-p celery.contrib.pytest`` (the fixtures
``t/integration/conftest.py`` builds on; Celery's CI gets them from pytest-celery's entry point).
Celery's conftest starts one embedded worker for the whole session (``celery_session_worker``:
celery.contrib.testing, prefork pool, one child) on ``TEST_BROKER`` / ``TEST_BACKEND``, and every
test publishes through an app of its own (``celery_app``). This plugin, in each pytest process
(each pytest-xdist worker runs its own session worker):

- starts a private ``redis-server`` (:class:`PrivateRedis`) and points Celery's tests at it before
  their conftest reads the environment: db 0 is the broker, 1 the result backend, 2 the celery-idem
  store, and Celery's test tasks keep their counters and pub/sub channels there too, so parallel
  processes share nothing;
- checks that ``celery`` is the installed package, not the sdist's source tree;
- unless ``--idem-baseline``: makes :class:`celery_idem.IdempotentTask` the default task class of
  every ``Celery`` app and installs ``Idempotency(app, store=<db 2>, key_prefix=--idem-key-prefix)``
  on it, so the worker's app and each test's app share one store; the extension of a test's own
  app is disconnected when the test is over;
- starts each test with no settled record in that store (see :func:`_forget_settled_records`);
- after a test that failed, stops whatever it left on the worker (:func:`_clean_up_after_failure`);
- makes the teardown wait of Celery's ``manager`` fixture return once the one session worker has
  answered (see :func:`_wait_until_idle`): it saves about a second per test;
- holds the run to ``integration_expected_failures.txt`` (its header explains the categories).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import celery
import pytest
import redis
from celery import Celery
from celery.contrib.testing.manager import Manager
from celery_idem_compat import parse_expected_failures
from kombu.exceptions import ContentDisallowed

HERE = Path(__file__).resolve().parent
EXPECTED_FAILURES = HERE / "integration_expected_failures.txt"

# What each category of the list does to its tests (README.md beside this file).
XFAIL = ("dedup by design", "documented difference", "pending fix (bug)")  # must fail with celery-idem
PLAIN_FAILS = "fails on plain Celery too"  # not run with celery-idem; must fail on plain Celery
CATEGORIES = (*XFAIL, PLAIN_FAILS)
# Tags before the category: "slow" (not run unless --idem-slow; without a category it must pass) and
# "flaky" (a pending bug whose failure depends on a race: either outcome is accepted).
SLOW, FLAKY = "slow", "flaky"
# A test the list expects to fail gets this long instead of the 120 s default: most of them fail by
# a count that stays short of what Celery's helpers poll 60 s for, and on plain Celery they take 3 s
# at most, so a fix that makes one pass still passes well within it.
XFAIL_TIMEOUT_SECONDS = 10
VARIANTS = "t/integration/test_idem_variants.py"  # the variant of t/integration/test_X.py::C::t is VARIANTS::C::t

BROKER_DB, BACKEND_DB, STORE_DB = 0, 1, 2


class Entry:
    """One line of the list: ``node id -- [slow, ][flaky, ]category: why`` (or ``slow: why``)."""

    def __init__(self, node_id: str, reason: str) -> None:
        self.reason = reason
        tags = [tag.strip() for tag in reason.partition(":")[0].split(",")]
        self.slow, self.flaky = SLOW in tags, FLAKY in tags
        others = [tag for tag in tags if tag not in (SLOW, FLAKY)]
        if len(others) > 1 or any(tag not in CATEGORIES for tag in others) or (not others and tags != [SLOW]):
            raise pytest.UsageError(
                f"{EXPECTED_FAILURES.name}: {node_id}: the reason must open with a category, optionally after "
                f"the tags 'slow' and 'flaky', or with 'slow' alone, then a colon; categories: "
                f"{', '.join(CATEGORIES)}; got {reason!r}"
            )
        self.category = others[0] if others else None  # None: slow, and passes on both


_entries = pytest.StashKey[dict[str, Entry]]()
_redis = pytest.StashKey["PrivateRedis"]()
_janitor = pytest.StashKey[Any]()  # a store object over the same records as the apps'
_failed = pytest.StashKey[bool]()  # a report of this test failed (before the list turned it xfailed)
_installed: list[Any] = []  # the Idempotency instances of the apps built since the last teardown
_session_apps: list[Celery] = []  # the app the session worker runs: its extension lives on


class PrivateRedis:
    """A ``redis-server`` of this pytest process on a free loopback port, without persistence."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise pytest.UsageError("redis-server is not on PATH: install Redis (apt-get install redis-server)")
        self.directory = tempfile.mkdtemp(prefix="celery-compat-redis-")
        self.port = _free_port()
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        command += ["--dir", self.directory, "--logfile", os.path.join(self.directory, "redis.log")]
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise pytest.UsageError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-idem integration")
    group.addoption("--idem-baseline", action="store_true", help="plain Celery: do not install celery-idem")
    group.addoption("--idem-key-prefix", metavar="PREFIX", default="celery-compat", help="the store's key prefix")
    group.addoption("--idem-slow", action="store_true", help="run the tests the list marks slow too")
    group.addoption(
        "--idem-no-stale",
        action="store_true",
        help=f"fail if {EXPECTED_FAILURES.name} lists a test that was not collected (full runs)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before t/integration/conftest.py is imported: it reads TEST_BROKER and TEST_BACKEND then. An
    # xdist controller runs no test, so it starts no server; its workers and a run without -n do.
    if not os.environ.get("PYTEST_XDIST_WORKER") and getattr(early_config.known_args_namespace, "numprocesses", None):
        return
    server = PrivateRedis()
    early_config.stash[_redis] = server
    early_config.add_cleanup(server.stop)
    os.environ.update(
        TEST_BROKER=server.url(BROKER_DB),
        TEST_BACKEND=server.url(BACKEND_DB),
        # Celery's test tasks and tests reach Redis themselves (tasks.get_redis_connection: db 0).
        REDIS_HOST="127.0.0.1",
        REDIS_PORT=str(server.port),
    )


def pytest_configure(config: pytest.Config) -> None:
    installed = Path(celery.__file__).resolve()
    if Path.cwd().resolve() in installed.parents:
        raise pytest.UsageError(f"celery is imported from {installed}, the sdist's source tree, not the installed one")
    config.stash[_entries] = {
        node_id: Entry(node_id, reason)
        for node_id, reason in parse_expected_failures(
            EXPECTED_FAILURES.read_text(), celery.__version__, EXPECTED_FAILURES.name
        ).items()
    }
    original_wait = Manager.wait_until_idle
    Manager.wait_until_idle = _wait_until_idle  # type: ignore[method-assign]
    config.add_cleanup(functools.partial(setattr, Manager, "wait_until_idle", original_wait))
    server = config.stash.get(_redis, None)
    if config.getoption("--idem-baseline") or server is None:
        return
    key_prefix = config.getoption("--idem-key-prefix")
    _install_celery_idem(config, server.url(STORE_DB), key_prefix)
    from celery_idem.stores import store_from_url

    config.stash[_janitor] = store_from_url(server.url(STORE_DB), key_prefix=key_prefix)
    config.add_cleanup(config.stash[_janitor].close)


def _install_celery_idem(config: pytest.Config, store: str, key_prefix: str) -> None:
    from celery_idem import Idempotency, IdempotentTask

    original = Celery.__init__

    @functools.wraps(original)
    def __init__(self: Celery, *args: Any, task_cls: Any = None, **kwargs: Any) -> None:  # noqa: N807
        # An app that names its task class, or an app subclass that sets one, keeps it.
        if task_cls is None and type(self).task_cls == Celery.task_cls:
            task_cls = IdempotentTask
        original(self, *args, task_cls=task_cls, **kwargs)
        _installed.append(Idempotency(self, store=store, key_prefix=key_prefix))

    Celery.__init__ = __init__  # type: ignore[method-assign]
    config.add_cleanup(functools.partial(setattr, Celery, "__init__", original))


def _wait_until_idle(self: Manager) -> None:
    """``Manager.wait_until_idle`` of celery/contrib/testing/manager.py (5.7.0), which every test's
    ``manager`` fixture runs at teardown, with one change: ``inspect(limit=1)``. The only worker on
    the test's broker is its session worker, so its reply is every reply there will be; without the
    limit each look waits out the broadcast's full one-second timeout."""
    control = self.app.control
    with self.app.connection() as connection:
        while control.purge(connection=connection):  # the tasks a test left queued
            pass
        inspect = control.inspect(limit=1)
        inspect.connection = connection
        while True:
            try:
                active = inspect.active()
            except ContentDisallowed:  # as the original: test_security_task_done may cause this
                break
            if active is not None and sum(len(tasks) for tasks in active.values()) == 0:
                break


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = config.stash[_entries]
    if config.getoption("--idem-no-stale"):
        collected = {item.nodeid for item in items}
        stale = sorted(set(entries) - collected)
        if stale:
            raise pytest.UsageError(
                f"{EXPECTED_FAILURES.name} lists tests that celery {celery.__version__} does not have "
                f"(renamed or removed? delete or rename the entries): {', '.join(stale)}"
            )
        unvaried = sorted(
            node_id
            for node_id, entry in entries.items()
            if entry.category == "dedup by design" and _variant_of(node_id) not in collected
        )
        if unvaried:
            raise pytest.UsageError(
                f"every 'dedup by design' entry of {EXPECTED_FAILURES.name} needs a variant whose calls differ, "
                f"with the same class and name in integration_variants.py; missing: {', '.join(unvaried)}"
            )
    baseline, slow = config.getoption("--idem-baseline"), config.getoption("--idem-slow")
    kept, deselected = [], []
    for item in items:
        entry = entries.get(item.nodeid)
        skip = entry is not None and ((entry.slow and not slow) or (entry.category == PLAIN_FAILS and not baseline))
        (deselected if skip else kept).append(item)
        if not skip and _expected_to_fail(config, item.nodeid) is not None:
            # Before Celery's own marker; the test function only: the cleanup after it must not be cut short.
            item.add_marker(pytest.mark.timeout(XFAIL_TIMEOUT_SECONDS, func_only=True), append=False)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def _variant_of(node_id: str) -> str:
    return VARIANTS + "::" + node_id.partition("::")[2]


def _expected_to_fail(config: pytest.Config, nodeid: str) -> Entry | None:
    entry = config.stash[_entries].get(nodeid)
    wanted = (PLAIN_FAILS,) if config.getoption("--idem-baseline") else XFAIL
    return entry if entry is not None and entry.category in wanted else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:  # in any phase, or a subtest (pytest's subtests report through this hook too)
        item.stash[_failed] = True
    entry = _expected_to_fail(item.config, item.nodeid)
    if entry is None:
        return
    if report.failed:
        report.outcome = "skipped"
        report.wasxfail = entry.reason
    elif report.when == "teardown" and not item.stash.get(_failed, False) and not entry.flaky:
        report.outcome = "failed"
        report.longrepr = (
            f"[XPASS(strict)] listed in {EXPECTED_FAILURES.name} for celery {celery.__version__} "
            f"({entry.reason}) but passed: delete its entry"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, Any, None]:
    outcome = yield
    if fixturedef.argname == "celery_session_app" and outcome.excinfo is None:
        _session_apps.append(outcome.get_result())


def _forget_settled_records(store: Any) -> None:
    """Forget every COMPLETED and FAILED record, as an operator's ``celery idem forget`` would.

    Celery's tests are independent scenarios that reuse the same few calls (``add(1, 2)``,
    ``identity.si(42)``, ``ids.si(i=1)``...). Without this, a call repeating one from an earlier test
    is answered with that test's outcome and task id (deduplicated by design, a day's TTL), and which
    tests fail would depend on which ran before, and on which xdist process: the list could not be
    strict. A call repeated within one test is what the list is about. Records still PENDING or
    IN_PROGRESS are left alone: forgetting one would fence out an attempt that may still be running.
    """
    from celery_idem import State

    for state in (State.COMPLETED, State.FAILED):
        while records := store.records(state=state, limit=1000):
            for record in records:
                store.forget(record.identity)


def _clean_up_after_failure(app: Celery, janitor: Any) -> None:
    """A test that failed may leave its work on the session worker: a hung canvas, duplicates waiting
    on it, retries scheduled for later. Left there, they run into the next tests (whichever tests this
    xdist process runs next) and fail them or hold their teardown. So, before Celery's own teardown
    waits for the worker to be idle: purge the queue, revoke every task the worker runs (killing its
    process), holds or has scheduled (those go when they come due), wait until it runs and holds
    nothing, then forget every record."""
    control = app.control
    inspect = control.inspect(limit=1, timeout=2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        control.purge()
        running = [task["id"] for tasks in (inspect.active() or {}).values() for task in tasks]
        running += [task["id"] for tasks in (inspect.reserved() or {}).values() for task in tasks]
        later = [entry["request"]["id"] for entries in (inspect.scheduled() or {}).values() for entry in entries]
        if running or later:
            control.revoke(running + later, terminate=True, signal="SIGKILL")
        if not running:
            break
        time.sleep(0.2)
    if janitor is not None:
        for record in janitor.records(limit=100_000):
            janitor.forget(record.identity)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _installed.clear()  # apps built before this test (at import, by an earlier test) are not its own
    janitor = item.config.stash.get(_janitor, None)
    if janitor is not None:
        _forget_settled_records(janitor)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, None]:
    if item.stash.get(_failed, False) and _session_apps:
        _clean_up_after_failure(_session_apps[0], item.config.stash.get(_janitor, None))
    yield
    # The test's fixtures are gone: shut celery-idem down on the apps the test built, as an app's
    # owner does when the app goes; the session worker's app keeps its extension to the end.
    while _installed:
        idem = _installed.pop()
        if idem.app not in _session_apps:
            idem.disconnect()
