"""celery_idem.contrib.pytest as a user's test suite uses it, run by pytester in a test session of its own.

Each test writes a user's conftest and test module into a fresh directory and runs pytest on them in
this process. The inner session warns as errors (``filterwarnings = error``), as this suite does.
"""

from __future__ import annotations

import contextlib

# celery.contrib.pytest's worker imports this module, whose shared task registers on every finalized
# app in the process. pytester drops what an inner session imported when it ends, so the next import
# would run the module again, and Celery 5.7 warns (an error here) that a new callable met the one an
# app of ours kept. Imported here, it stays, as it would in a user's single session.
import celery.contrib.testing.tasks  # noqa: F401
import pytest

# The first Idempotency(app) of the process imports opentelemetry (celery_idem/tracing.py). At the floor
# of the opentelemetry extra (1.20) that brings importlib_metadata < 7, which on import takes the
# standard library's finder of installed packages off (it puts its own on sys.meta_path instead).
# pytester then drops the module and restores sys.meta_path, leaving no finder at all: the next inner
# session's pytest cannot read pluggy's version. Imported here, it stays for the whole session.
with contextlib.suppress(ImportError):
    import opentelemetry.trace  # noqa: F401

pytest_plugins = ["pytester"]

INI = """
[pytest]
filterwarnings = error
"""

# A user's application: its own app, with celery-idem installed on it as production does.
SHOP = """
from celery import Celery

from celery_idem import Idempotency, IdempotentTask

app = Celery("shop", set_as_current=False)
app.conf.task_always_eager = True
app.conf.task_eager_propagates = True
ORIGINAL = Idempotency(app, store="memory://")
CHARGES = []


@app.task(base=IdempotentTask, shared=False, name="shop.charge")
def charge(order_id, amount):
    CHARGES.append((order_id, amount))
    return {"order_id": order_id, "charged": amount}
"""

CONFTEST = """
import pytest

import user_shop

pytest_plugins = ["celery_idem.contrib.pytest"]


@pytest.fixture
def idem_app():
    user_shop.CHARGES.clear()
    return user_shop.app
"""


# pytest-celery (in the dev extra, for tests/smoke) loads itself into every session through its pytest11 entry
# point, registered as "celery". A test of a user without it turns it off, as that user's session never has it.
WITHOUT_PYTEST_CELERY = ("-p", "no:celery")

# What docs/guides/testing.md tells a user with pytest-celery installed to add to filterwarnings = error: its
# plugin imports celery.contrib.pytest before a conftest's pytest_plugins asks for it, and pytest warns then
# that it cannot rewrite the module's asserts (pytest-celery's bug; the fixtures work the same).
INI_WITH_PYTEST_CELERY = """
[pytest]
filterwarnings =
    error
    ignore:Module already imported so cannot be rewritten. celery.contrib.pytest:pytest.PytestAssertRewriteWarning
"""


@pytest.fixture
def user(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI)
    pytester.makepyfile(user_shop=SHOP)  # not shop: tests/shop.py is imported already
    pytester.makeconftest(CONFTEST)
    return pytester


# Case (c), our plugin alone, and case (a), beside pytest-celery's plugin (which loads itself when installed).
@pytest.mark.parametrize("plugins", [WITHOUT_PYTEST_CELERY, ()], ids=["alone", "with-pytest-celery"])
def test_a_users_tests_assert_what_celery_idem_decided(user: pytest.Pytester, plugins: tuple[str, ...]) -> None:
    user.makepyfile(
        test_charge="""
        import pytest

        from celery_idem import Idempotency, PayloadMismatchError, State
        from user_shop import CHARGES, ORIGINAL, app, charge


        def test_a_retried_checkout_charges_once(idem):
            first = charge.apply_async((42, 100), idempotency_key="order-42")
            again = charge.apply_async((42, 100), idempotency_key="order-42")

            assert again.deduplicated and again.id == first.id
            assert CHARGES == [(42, 100)]
            idem.assert_ran_once(charge, "order-42")
            idem.assert_replayed(charge, "order-42")
            idem.assert_deduplicated("shop.charge", "order-42")
            assert idem.decisions(charge, "order-42") == ["publish NEW", "worker RUN", "publish REPLAY"]
            assert idem.record(charge, "order-42").state is State.COMPLETED


        def test_another_amount_under_the_key_is_refused(idem):
            charge.apply_async((42, 100), idempotency_key="order-42")
            with pytest.raises(PayloadMismatchError):
                charge.apply_async((42, 999), idempotency_key="order-42")

            idem.assert_mismatch(charge, "order-42")
            idem.assert_ran_once(charge, "order-42")


        def test_each_test_has_a_fresh_store_on_the_apps_own_extension(idem):
            assert Idempotency.of(app) is idem.extension and idem.extension is not ORIGINAL
            assert idem.record(charge, "order-42") is None
            charge.apply_async((42, 100), idempotency_key="order-42")
            idem.assert_ran_once(charge, "order-42")


        def test_scoped_keys_are_told_apart(idem):
            charge.apply_async((1, 5), idempotency_key="k", idempotency_scope="tenant-a")
            charge.apply_async((2, 5), idempotency_key="k", idempotency_scope="tenant-b")

            idem.assert_ran_once(charge, "k", scope="tenant-a")
            idem.assert_ran_once(charge, "k", scope="tenant-b")
            idem.assert_ran(charge, "k", times=0)


        def test_the_apps_own_extension_is_back_after_a_test():
            assert Idempotency.of(app) is ORIGINAL
        """
    )
    result = user.runpytest(*plugins)
    result.assert_outcomes(passed=5)
    loaded = [line for line in result.outlines if line.startswith("plugins:")]
    assert ("celery-1." in "".join(loaded)) is not bool(plugins), loaded


def test_a_failed_assertion_says_what_happened_instead(user: pytest.Pytester) -> None:
    user.makepyfile(
        test_failing="""
        from user_shop import charge


        def test_ran_twice(idem):
            charge.apply_async((42, 100), idempotency_key="order-42")
            idem.extension.forget(charge, "order-42")
            charge.apply_async((42, 100), idempotency_key="order-42")
            idem.assert_ran_once(charge, "order-42")


        def test_no_replay(idem):
            charge.apply_async((42, 100), idempotency_key="order-42")
            idem.assert_replayed(charge, "order-42")


        def test_no_mismatch(idem):
            charge.apply_async((42, 100), idempotency_key="order-42")
            idem.assert_mismatch(charge, "order-42")


        def test_another_key(idem):
            charge.apply_async((42, 100), idempotency_key="order-42")
            idem.assert_ran_once(charge, "order-43")


        def test_nothing_at_all(idem):
            idem.assert_deduplicated(charge, "order-42")
        """
    )
    result = user.runpytest()
    result.assert_outcomes(failed=5)
    result.stdout.fnmatch_lines(
        [
            "*AssertionError: task 'shop.charge', key 'order-42': expected to run once, it ran 2 times; what happened:",
            "*publish NEW (task *, record PENDING)",
            "*worker RUN (task *, record IN_PROGRESS)",
            "*publish NEW (task *, record PENDING)",
            "*worker RUN (task *, record IN_PROGRESS)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*AssertionError: task 'shop.charge', key 'order-42': "
            "expected a replay of its stored outcome, there was none;*"
        ]
    )
    result.stdout.fnmatch_lines(["*expected a call refused for other arguments (MISMATCH), there was none*"])
    result.stdout.fnmatch_lines(
        [
            "*key 'order-43': expected to run once, it never ran; nothing was decided about this key "
            "(keys seen for this task: 'order-42')"
        ]
    )
    result.stdout.fnmatch_lines(["*celery-idem decided nothing about this task in this process*"])


def test_without_an_app_the_plugin_says_how_to_give_it_one(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makeconftest('pytest_plugins = ["celery_idem.contrib.pytest"]')
    pytester.makepyfile(test_nothing="def test_it(idem):\n    pass\n")
    result = pytester.runpytest(*WITHOUT_PYTEST_CELERY)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*define an idem_app fixture in your conftest.py that returns it*"])


def test_a_conftest_may_import_the_plugin_before_loading_it(user: pytest.Pytester) -> None:
    # Under filterwarnings = error, pytest's "cannot rewrite, already imported" warning would stop the session.
    user.makeconftest("from celery_idem.contrib.pytest import IdempotencyFixture\n" + CONFTEST)
    user.makepyfile(
        test_typed="""
        from celery_idem.contrib.pytest import IdempotencyFixture
        from user_shop import charge


        def test_it(idem: IdempotencyFixture):
            charge.delay(1, 2)
            assert len(idem.keys(charge)) == 1  # a key-less call is recorded under its fingerprint
        """
    )
    user.runpytest().assert_outcomes(passed=1)


def test_side_by_side_with_celery_contrib_pytest_and_its_worker(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makeconftest(
        """
        import pytest

        pytest_plugins = ["celery.contrib.pytest", "celery_idem.contrib.pytest"]


        @pytest.fixture(scope="session")
        def celery_config():
            return {"broker_url": "memory://", "result_backend": "cache+memory://"}
        """
    )
    pytester.makepyfile(
        test_worker="""
        from celery_idem import Idempotency, IdempotentTask

        RAN = []


        def test_the_worker_thread_is_recorded(celery_app, celery_worker, idem):
            @celery_app.task(base=IdempotentTask, shared=False, name="side.charge")
            def charge(order_id):
                RAN.append(order_id)
                return order_id

            celery_worker.reload()
            first = charge.apply_async((7,), idempotency_key="order-7")
            assert first.get(timeout=10) == 7
            again = charge.apply_async((7,), idempotency_key="order-7")
            assert again.get(timeout=10) == 7

            assert RAN == [7]
            assert idem.app is celery_app and Idempotency.of(celery_app) is idem.extension
            idem.assert_ran_once(charge, "order-7")
            idem.assert_deduplicated(charge, "order-7")

            # The broker delivers the message again (its ack was lost): it ends quietly, the
            # body does not run, and the first delivery's result stands.
            copy = idem.redeliver(first)
            assert copy.state == "IGNORED" and copy.id == first.id
            assert RAN == [7] and first.get(timeout=10) == 7
            assert idem.decisions(charge, "order-7")[-1] == "worker REPLAY"
        """
    )
    # In a process of its own, as a user's session starts: in this one, pytest-celery has imported
    # celery.contrib.pytest unrewritten already, which a session here would warn about, -p no:celery or not.
    pytester.runpytest_subprocess(*WITHOUT_PYTEST_CELERY).assert_outcomes(passed=1)


def test_redelivery_runs_the_same_message_again_as_a_worker(user: pytest.Pytester) -> None:
    user.makepyfile(
        test_redelivery="""
        import pytest

        from celery_idem import PayloadMismatchError
        from user_shop import CHARGES, charge


        def test_a_redelivered_message_ends_quietly_without_running(idem):
            first = charge.apply_async((42, 100), idempotency_key="order-42")

            copy = idem.redeliver(first)

            assert copy.id == first.id and copy.state == "IGNORED"
            assert CHARGES == [(42, 100)]
            idem.assert_ran_once(charge, "order-42")
            assert idem.decisions(charge, "order-42") == ["publish NEW", "worker RUN", "worker REPLAY"]
            assert idem.history(charge, "order-42")[-1].task_id == first.id


        def test_a_message_by_hand_with_other_arguments_is_refused(idem):
            charge.apply_async((42, 100), idempotency_key="order-42")

            copy = idem.deliver(charge, (42, 999), key="order-42")

            assert copy.state == "FAILURE"
            with pytest.raises(PayloadMismatchError):
                copy.get()
            idem.assert_mismatch(charge, "order-42")


        def test_a_message_sent_by_name_runs_once(idem):
            first = idem.deliver("shop.charge", (1, 2), key="by-name")
            copy = idem.redeliver(first.id)
            other = idem.deliver("shop.charge", (1, 2), key="by-name")  # another task id, same call

            assert first.state == "SUCCESS" and copy.state == "IGNORED"
            assert first.get() == other.get() == {"order_id": 1, "charged": 2}
            idem.assert_ran_once(charge, "by-name")
            idem.assert_replayed(charge, "by-name")


        def test_only_a_message_seen_can_be_redelivered(idem):
            with pytest.raises(LookupError, match="use deliver"):
                idem.redeliver("no-such-task-id")
        """
    )
    user.runpytest().assert_outcomes(passed=4)


def test_a_published_message_is_redelivered_with_its_headers(pytester: pytest.Pytester) -> None:
    # Not eager: the call is published to an in-memory broker that no worker consumes, so the
    # message is taken from before_task_publish, headers and all, and delivered here twice.
    pytester.makeini(INI)
    pytester.makepyfile(
        user_queue="""
        from celery import Celery

        from celery_idem import IdempotentTask

        app = Celery("queued", broker="memory://", set_as_current=False)
        RAN = []


        @app.task(base=IdempotentTask, shared=False, name="queued.ship")
        def ship(parcel):
            RAN.append(parcel)
            return parcel
        """
    )
    pytester.makeconftest(
        """
        import pytest

        import user_queue

        pytest_plugins = ["celery_idem.contrib.pytest"]


        @pytest.fixture
        def idem_app():
            return user_queue.app
        """
    )
    pytester.makepyfile(
        test_queued="""
        from user_queue import RAN, ship


        def test_it(idem):
            sent = ship.apply_async(("p-1",), idempotency_key="parcel-1", idempotency_scope="eu")
            assert RAN == []

            first, second = idem.redeliver(sent), idem.redeliver(sent)

            assert first.get() == "p-1" and second.state == "IGNORED" and RAN == ["p-1"]
            assert idem.decisions(ship, "parcel-1", scope="eu") == ["publish NEW", "worker RUN", "worker REPLAY"]
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


# ---- beside pytest-celery (installed: its plugin loads itself) ------------------------------------------


def test_our_fixtures_are_named_so_no_celery_plugin_defines_them() -> None:
    import celery.contrib.pytest as celery_contrib
    import pytest_celery.plugin

    from celery_idem.contrib import pytest as plugin

    ours = {name for name in dir(plugin) if _is_fixture(getattr(plugin, name))}
    theirs = {name for module in (celery_contrib, pytest_celery.plugin) for name in dir(module)}
    assert ours == {"idem", "idem_app", "idem_settings", "idem_store"}
    assert not ours & theirs


def _is_fixture(obj: object) -> bool:
    return type(obj).__name__ == "FixtureFunctionDefinition" or hasattr(obj, "_pytestfixturefunction")


def test_with_pytest_celery_our_plugin_alone_works_on_the_users_app(user: pytest.Pytester) -> None:
    # Case (a): pytest-celery installed, the conftest lists only celery_idem.contrib.pytest.
    user.makepyfile(
        test_alone="""
        from user_shop import CHARGES, app, charge


        def test_it(idem):
            charge.apply_async((42, 100), idempotency_key="order-42")
            charge.apply_async((42, 100), idempotency_key="order-42")

            assert idem.app is app and CHARGES == [(42, 100)]
            idem.assert_ran_once(charge, "order-42")
            idem.assert_deduplicated(charge, "order-42")
        """
    )
    result = user.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["plugins:*celery-1.*"])  # pytest-celery really was in the session


def test_with_pytest_celery_and_no_app_of_ours_idem_uses_the_celery_app_it_loads(pytester: pytest.Pytester) -> None:
    # pytest-celery's plugin loads celery.contrib.pytest's fixtures, celery_app among them.
    pytester.makeini(INI)
    pytester.makeconftest('pytest_plugins = ["celery_idem.contrib.pytest"]')
    pytester.makepyfile(
        test_app="""
        def test_it(idem, celery_app):
            assert idem.app is celery_app
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


def test_in_a_test_on_pytest_celerys_setup_idem_uses_the_setups_app(pytester: pytest.Pytester) -> None:
    # celery_app exists beside celery_setup (pytest-celery loads both): a test built on celery_setup
    # publishes with celery_setup.app, so that is the app celery-idem must be installed on. The setup
    # here is a stand-in with its app: the real one needs Docker (tests/smoke runs it).
    pytester.makeini(INI)
    pytester.makeconftest(
        """
        import types

        import pytest
        from celery import Celery

        pytest_plugins = ["celery_idem.contrib.pytest"]


        @pytest.fixture
        def celery_setup():
            app = Celery("setup", set_as_current=False)
            app.conf.task_always_eager = True
            return types.SimpleNamespace(app=app)
        """
    )
    pytester.makepyfile(
        test_setup="""
        from celery_idem import Idempotency, IdempotentTask


        def test_it(idem, celery_setup, celery_app):
            assert idem.app is celery_setup.app and idem.app is not celery_app

            @celery_setup.app.task(base=IdempotentTask, shared=False, name="setup.charge")
            def charge(order_id):
                return order_id

            charge.apply_async((1,), idempotency_key="k")
            charge.apply_async((1,), idempotency_key="k")
            assert Idempotency.of(celery_setup.app) is idem.extension
            idem.assert_ran_once(charge, "k")
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


CONTRIB_AND_DOCKER_CONFTEST = """
import pytest

pytest_plugins = ["celery.contrib.pytest", "celery_idem.contrib.pytest"]


@pytest.fixture(scope="session")
def celery_config():
    return {"broker_url": "memory://", "result_backend": "cache+memory://"}
"""

CONTRIB_WORKER_TEST = """
from celery_idem import IdempotentTask

RAN = []


def test_the_worker_thread_is_recorded(celery_app, celery_worker, idem):
    @celery_app.task(base=IdempotentTask, shared=False, name="both.charge")
    def charge(order_id):
        RAN.append(order_id)
        return order_id

    celery_worker.reload()  # celery.contrib.pytest's worker: a thread of this process, not a container
    assert charge.apply_async((7,), idempotency_key="order-7").get(timeout=10) == 7
    assert charge.apply_async((7,), idempotency_key="order-7").get(timeout=10) == 7

    assert RAN == [7]
    idem.assert_ran_once(charge, "order-7")
    idem.assert_deduplicated(charge, "order-7")
"""


def test_pytest_celery_stops_a_session_that_lists_celery_contrib_pytest_under_filterwarnings_error(
    pytester: pytest.Pytester,
) -> None:
    # Case (b) as a user writes it first: pytest-celery's bug, which the line of INI_WITH_PYTEST_CELERY works
    # around. If this starts to pass, pytest-celery fixed it: drop that line from pyproject.toml and the guide.
    pytester.makeini(INI)
    pytester.makeconftest(CONTRIB_AND_DOCKER_CONFTEST)
    pytester.makepyfile(test_worker=CONTRIB_WORKER_TEST)
    result = pytester.runpytest_subprocess()
    assert result.ret != 0
    assert "Module already imported so cannot be rewritten; celery.contrib.pytest" in result.stderr.str()
    assert "passed" not in result.stdout.str()  # the session stopped before any test


def test_with_pytest_celery_and_celery_contrib_pytest_each_worker_serves_its_own_tests(
    pytester: pytest.Pytester,
) -> None:
    # Case (b) in the documented setup: the ini line, celery.contrib.pytest in the root conftest (its in-process
    # celery_worker, registered after pytest-celery's, wins), and a folder of Docker tests whose conftest
    # builds pytest-celery's worker cluster from celery_setup_worker, so it never asks for "celery_worker".
    pytester.makeini(INI_WITH_PYTEST_CELERY)
    pytester.makeconftest(CONTRIB_AND_DOCKER_CONFTEST)
    pytester.makepyfile(test_worker=CONTRIB_WORKER_TEST)
    docker = pytester.mkpydir("docker_tests")
    (docker / "conftest.py").write_text(
        """
import pytest
from pytest_celery import CeleryWorkerCluster


@pytest.fixture
def celery_worker_cluster(celery_setup_worker):
    cluster = CeleryWorkerCluster(celery_setup_worker)
    yield cluster
    cluster.teardown()
"""
    )
    (docker / "test_in_containers.py").write_text(
        """
def test_it(celery_setup, idem):
    assert idem.app is celery_setup.app
"""
    )
    result = pytester.runpytest_subprocess("test_worker.py")  # a fresh process, as the warning is judged there
    result.assert_outcomes(passed=1)
    # The same session, planned only (the Docker tests need an engine): pytest-celery's worker, not contrib's.
    plan = pytester.runpytest("--setup-plan", "docker_tests", "test_worker.py")
    assert plan.ret == 0
    plan.stdout.fnmatch_lines(["*docker_tests/test_in_containers.py::test_it[[]*redis*"])  # one per broker
    plan.stdout.fnmatch_lines(["*SETUP    F celery_worker_cluster (fixtures used: celery_setup_worker)"])
    plan.stdout.fnmatch_lines(["*SETUP    F celery_worker (fixtures used: celery_app, celery_includes, *)"])
    plan.stdout.no_fnmatch_line("*test_worker.py::test_the_worker_thread_is_recorded[[]*")  # not parametrized
