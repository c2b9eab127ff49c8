"""celery-idem's pytest plugin: a fresh in-memory store per test, a record of what celery-idem
decided, assertions on it, and redelivery of a message.

Enabled as Celery's own plugin is, in the ``conftest.py`` at the root of your tests (it is not
loaded into projects that do not ask for it)::

    pytest_plugins = ["celery_idem.contrib.pytest"]

Its fixtures are named ``idem*``, so they never clash with ``celery.contrib.pytest`` or
pytest-celery, and it imports neither: it asks for their fixtures by name, so it works beside
either, both, or none (docs/guides/testing.md gives the settings for both at once):

- ``idem_app``: the Celery app under test. Override it to return your app. Otherwise, in a test
  that uses pytest-celery's ``celery_setup``, it is that setup's app; else, with
  ``celery.contrib.pytest``'s fixtures loaded (pytest-celery loads them too), its ``celery_app``.
- ``idem_store``: the store of the test, a fresh :class:`~celery_idem.MemoryStore` (override it
  to give it a clock, or to test against your Redis).
- ``idem_settings``: more ``Idempotency(app, ...)`` settings for the test (default: none).
- ``idem``: an :class:`IdempotencyFixture`: celery-idem installed on ``idem_app`` with that store
  for the test (the app's own extension is put back after it), recording every decision.

(PYTEST_DONT_REWRITE: the assertions write their own messages, so a conftest may import this
module before pytest loads it as a plugin without pytest warning that it cannot rewrite it.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from celery.result import EagerResult

from ..extension import Idempotency
from ..records import IdempotencyRecord
from ..runtime import INSTALLED_ATTRIBUTE, installed_on
from ..stores import MemoryStore, Store
from .recorder import Decided, IdempotencyRecorder
from .redelivery import Message, Messages, deliver, message_for

__all__ = [
    "Decided",
    "IdempotencyFixture",
    "IdempotencyRecorder",
    "Message",
    "idem",
    "idem_app",
    "idem_settings",
    "idem_store",
]


class IdempotencyFixture(IdempotencyRecorder):
    """celery-idem installed on the test's app, with the test's store, and the decisions it made.

    The ``idem`` fixture builds one per test. Every method of :class:`IdempotencyRecorder`
    (``assert_ran_once``, ``assert_replayed``, ``assert_deduplicated``, ``assert_mismatch``,
    ``history``, ...) reads what it recorded.

    Args:
        app: The Celery app under test.
        store: The store the test's extension uses.
        settings: More ``Idempotency(app, ...)`` settings.
    """

    def __init__(self, app: Any, store: Store, settings: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.app = app
        self.store = store
        self._settings = dict(settings or {})
        self._messages = Messages()
        self._previous: Any = None
        self._conf: dict[str, Any] = {}
        self.extension: Idempotency | None = None

    def install(self) -> Idempotency:
        """Install celery-idem with the store on the app, and start recording."""
        app = self.app
        names = [f"idempotency_{name}" for name in ("store", *self._settings)]
        self._conf = {name: app.conf.get(name) for name in names}
        self._previous = installed_on(app)
        self.extension = Idempotency(app, store=self.store, **self._settings)
        self._messages.start()
        self.start()
        return self.extension

    def uninstall(self) -> None:
        """Stop recording and put back the app's own extension and settings."""
        self.stop()
        self._messages.stop()
        app = self.app
        for name, value in self._conf.items():
            app.conf[name] = value  # None reads as unset
        if isinstance(self._previous, Idempotency):
            self._previous.reinstall()
        elif self.extension is not None:
            self.extension.disconnect()
            app.__dict__.pop(INSTALLED_ATTRIBUTE, None)  # the next use installs one from the app's settings

    def record(self, task: Any, key: str, *, scope: str | None = None) -> IdempotencyRecord | None:
        """The store's record of ``key`` (None if there is none)."""
        assert self.extension is not None, "IdempotencyFixture.install() was not called"
        return self.extension.get(task, key, scope)

    def metrics(self) -> dict[str, int]:
        """The test's extension's counters (``Idempotency.metrics()``)."""
        assert self.extension is not None, "IdempotencyFixture.install() was not called"
        return self.extension.metrics()

    def redeliver(self, result: Any) -> EagerResult:
        """Deliver the message of ``result`` (a result handle, or a task id) once more, as a broker
        does after a lost ack: same task id, same headers, run here as a worker's pool runs it.

        Returns:
            An ``EagerResult`` of this delivery (``state``, ``result``, ``get()``).

        Raises:
            LookupError: no message of that task id was published or started during the test.
        """
        task_id = result if isinstance(result, str) else str(result.id)
        message = self._messages.get(task_id)
        if message is None:
            raise LookupError(
                f"no message of task id {task_id} was published or run during this test: redeliver() copies "
                "one it saw; use deliver() to send a message by hand"
            )
        return deliver(self.app, message)

    def deliver(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        task_id: str | None = None,
        key: str | None = None,
        scope: str | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> EagerResult:
        """Deliver a message built by hand (a message sent by name, a copy that never ran here),
        run here as a worker's pool runs it.

        Args:
            task: The task or its name.
            args: Its positional arguments.
            kwargs: Its keyword arguments.
            task_id: Its task id (default: a new one).
            key: Its ``idempotency_key`` header.
            scope: Its ``idempotency_scope`` header.
            headers: More message headers.

        Returns:
            An ``EagerResult`` of this delivery.
        """
        message = message_for(task, args, kwargs, task_id=task_id, key=key, scope=scope, headers=headers)
        return deliver(self.app, message)


# pytest-celery's fixture of a test's whole setup (its ``.app`` publishes to the setup's containers).
# Its plugin also loads celery.contrib.pytest's fixtures, so celery_app exists beside it: a test built
# on celery_setup must get the setup's app, not that unrelated one.
PYTEST_CELERY_SETUP = "celery_setup"


@pytest.fixture
def idem_app(request: pytest.FixtureRequest) -> Any:
    """The Celery app under test: override it in your conftest.py to return your app. In a test that
    uses pytest-celery's ``celery_setup``, it is that setup's app; else, with ``celery.contrib.pytest``'s
    fixtures loaded (by that plugin, or by pytest-celery's), it is ``celery_app``."""
    if PYTEST_CELERY_SETUP in request.fixturenames:
        return request.getfixturevalue(PYTEST_CELERY_SETUP).app
    try:
        return request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        pytest.fail(
            "celery_idem.contrib.pytest does not know your Celery app: define an idem_app fixture in your "
            "conftest.py that returns it (or enable celery.contrib.pytest, whose celery_app it then uses)",
            pytrace=False,
        )


@pytest.fixture
def idem_store() -> Store:
    """A fresh, empty :class:`~celery_idem.MemoryStore` for each test."""
    return MemoryStore()


@pytest.fixture
def idem_settings() -> dict[str, Any]:
    """More ``Idempotency(app, ...)`` settings for the test (``{"on_duplicate": "raise"}``); none by default."""
    return {}


@pytest.fixture
def idem(idem_app: Any, idem_store: Store, idem_settings: dict[str, Any]) -> Iterator[IdempotencyFixture]:
    """celery-idem on ``idem_app`` with ``idem_store`` for the test, recording what it decides."""
    fixture = IdempotencyFixture(idem_app, idem_store, idem_settings)
    fixture.install()
    try:
        yield fixture
    finally:
        fixture.uninstall()
