"""pytest plugin: run Celery's own unit tests with celery-idem on every app they build.

Loaded with ``-p celery_idem_compat`` (this folder on PYTHONPATH) from the root of an extracted Celery
sdist (see ``run.py``). It does three things:

- checks that ``celery`` is the installed package, not the sdist's source tree;
- unless ``--idem-baseline``: makes :class:`celery_idem.IdempotentTask` the default task class of
  every ``Celery`` app and installs ``Idempotency(app, store="memory://")`` on it;
- holds the run to ``expected_failures.txt``: a listed test that fails is reported as xfailed, a
  listed test that passes fails the run (strict), an unlisted failure fails the run as usual.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import Celery

HERE = Path(__file__).resolve().parent
EXPECTED_FAILURES = HERE / "expected_failures.txt"
_SECTION = re.compile(r"^\[(?P<version>\d+\.\d+\.\d+)(?P<title>.*)\]$")
_expected = pytest.StashKey[dict[str, str]]()
_installed: list[Any] = []  # the Idempotency instances of the apps built since the last teardown
_failed = pytest.StashKey[bool]()


def parse_expected_failures(text: str, version: str, name: str = EXPECTED_FAILURES.name) -> dict[str, str]:
    """The entries of the sections of ``version``: ``{node id: reason}``.

    A section opens with ``[X.Y.Z]`` or ``[X.Y.Z anything]``; an entry is ``node id -- reason``;
    ``#`` starts a comment line. An entry without a reason, or listed twice, is an error (``name``,
    the list's file name, is what the error names).
    """
    entries: dict[str, str] = {}
    section: str | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        header = _SECTION.match(line)
        if header:
            section = header["version"]
            continue
        node_id, separator, reason = line.partition(" -- ")
        if not separator or not reason.strip() or " " in node_id:
            raise pytest.UsageError(f"{name}:{number}: want 'node id -- reason'; got {line!r}")
        if section is None:
            raise pytest.UsageError(f"{name}:{number}: entry before any [X.Y.Z] section")
        if section != version:
            continue
        if node_id in entries:
            raise pytest.UsageError(f"{name}:{number}: {node_id} is listed twice")
        entries[node_id] = reason.strip()
    return entries


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-idem compatibility")
    group.addoption(
        "--idem-baseline",
        action="store_true",
        help="plain Celery: do not install celery-idem, do not apply expected_failures.txt",
    )
    group.addoption(
        "--idem-no-stale",
        action="store_true",
        help="fail if expected_failures.txt lists a test that was not collected (run.py's full runs)",
    )


def pytest_configure(config: pytest.Config) -> None:
    installed = Path(celery.__file__).resolve()
    if Path.cwd().resolve() in installed.parents:
        raise pytest.UsageError(
            f"celery is imported from {installed}, the sdist's source tree: the compatibility run must "
            "test the installed package (extract the sdist without its celery/ folder)"
        )
    if config.getoption("--idem-baseline"):
        return
    config.stash[_expected] = parse_expected_failures(EXPECTED_FAILURES.read_text(), celery.__version__)
    _install_celery_idem(config)


def _install_celery_idem(config: pytest.Config) -> None:
    from celery_idem import Idempotency, IdempotentTask

    original = Celery.__init__

    @functools.wraps(original)
    def __init__(self: Celery, *args: Any, task_cls: Any = None, **kwargs: Any) -> None:  # noqa: N807
        # A test that names its task class, or an app subclass that sets one, keeps it.
        if task_cls is None and type(self).task_cls == Celery.task_cls:
            task_cls = IdempotentTask
        original(self, *args, task_cls=task_cls, **kwargs)
        _installed.append(Idempotency(self, store="memory://"))

    Celery.__init__ = __init__  # type: ignore[method-assign]
    config.add_cleanup(functools.partial(setattr, Celery, "__init__", original))


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expected = config.stash.get(_expected, {})
    if not config.getoption("--idem-no-stale"):
        return
    stale = sorted(set(expected) - {item.nodeid for item in items})
    if stale:
        raise pytest.UsageError(
            f"{EXPECTED_FAILURES.name} lists tests that celery {celery.__version__} does not have "
            f"(renamed or removed? delete or rename the entries): {', '.join(stale)}"
        )


@pytest.hookimpl(hookwrapper=True)  # old style: Celery 5.3 pins pytest 7
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    reason = item.config.stash.get(_expected, {}).get(item.nodeid)
    if reason is None:
        return
    if report.failed:  # in any phase: setup, call or teardown
        item.stash[_failed] = True
        report.outcome = "skipped"
        report.wasxfail = reason
    elif report.when == "teardown" and not item.stash.get(_failed, False):
        report.outcome = "failed"
        report.longrepr = (
            f"[XPASS(strict)] listed in {EXPECTED_FAILURES.name} for celery {celery.__version__} "
            f"({reason}) but passed: delete its entry"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _installed.clear()  # apps built before this test (at import, by an earlier test) are not its own


def _alive_threads() -> list[threading.Thread]:
    # As t/unit/conftest.py's alive_threads(), whose list its threads_not_lingering fixture compares.
    return [t for t in threading.enumerate() if not t.name.startswith("pytest_timeout ") and t.is_alive()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, None]:
    if item.config.getoption("--idem-baseline"):
        yield
        return
    # The test is over: shut celery-idem down on the apps it built, as an app's owner does when the
    # app goes (before Celery's fixtures check that no thread was left behind).
    while _installed:
        _installed.pop().disconnect()
    yield
    # A thread left behind fails the test that left it (threads_not_lingering, in the teardown just
    # run), not every later test too: later tests compare against the threads alive now.
    session: Any = item.session
    if hasattr(session, "_threads_at_startup"):
        session._threads_at_startup = _alive_threads()
