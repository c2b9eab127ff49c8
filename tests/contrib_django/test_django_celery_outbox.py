"""celery-idem's tasks under django-celery-outbox (PyPI 0.4.3), the other transactional outbox a
Django project may already run: its ``OutboxCelery.send_task`` writes a ``celery_outbox`` row in the
caller's transaction, and its relay (``manage.py celery_outbox_relay``) publishes the rows with
``Celery.send_task`` under the same task id, then deletes them.

A real project (tests/contrib_django/dco_settings.py, ``migrate`` applied) on a PostgreSQL schema of
this process and on a SQLite file, Redis as the broker, a ``celery worker`` and the real relay, each
in a child process: django-celery-outbox is never imported here (its app brings sentry-sdk,
structlog and datadog into whatever process loads it). The effect (``dco.ship``'s body), each
delivery to the worker and each message it finished are counted in Redis by the project
(tests/contrib_django/dco_app.py), outside the library.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")
if importlib.util.find_spec("django_celery_outbox") is None:
    pytest.skip("django-celery-outbox is not installed (the dev extra has it)", allow_module_level=True)

import redis  # noqa: E402
from conftest import IN_CI, POSTGRES_URL, REDIS_URL, require_server, wipe  # noqa: E402
from workers import TESTS, Worker, wait_for  # noqa: E402

from celery_idem import State, store_from_url  # noqa: E402
from celery_idem.keys import keyed_identity  # noqa: E402

# The broker and the counts: db 3 of the tests' Redis (the store is the tests' own REDIS_URL)
BROKER = urlunsplit(urlsplit(REDIS_URL)._replace(path="/3"))
_pg = urlsplit(POSTGRES_URL.replace("+psycopg", ""))
PG_URL = f"postgresql://{_pg.username or 'postgres'}@{_pg.hostname}:{_pg.port or 5432}{_pg.path}"
SCHEMA = f"dco_{os.getpid()}_{uuid.uuid4().hex[:8]}"
ALIASES = ("sqlite", "postgresql")


class Project:
    """The interop project's databases, each created and migrated at its first use; dropped after."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.schema = False  # created on PostgreSQL
        self.ready: dict[str, str] = {}  # alias -> DCO_DB, migrated

    def database(self, alias: str) -> str:
        if alias not in self.ready:
            url = f"sqlite:///{self.home / 'dco.sqlite3'}" if alias == "sqlite" else self._schema()
            # On SQLite, django-celery-outbox's own database check (celery_outbox.E001, no SKIP LOCKED)
            # stops migrate (test_django_celery_outbox_refuses_sqlite); its producer side still works
            # there, and that is what the SQLite tests run.
            skip = ["--skip-checks"] if alias == "sqlite" else []
            placeholders = {"SHOP_PREFIX": "migrate", "SHOP_BROKER": BROKER, "SHOP_STORE": REDIS_URL}
            run({"DCO_DB": url, "DCO_DB_SCHEMA": SCHEMA, **placeholders}, "-m", "django", "migrate", "-v0", *skip)
            self.ready[alias] = url
        return self.ready[alias]

    def _schema(self) -> str:
        import psycopg

        if not self.schema:
            try:
                with psycopg.connect(PG_URL, autocommit=True, connect_timeout=2) as connection:
                    connection.execute(f'CREATE SCHEMA "{SCHEMA}"')
            except Exception as exc:  # noqa: BLE001 - any failure means the server is not usable
                message = f"postgresql is not reachable at {PG_URL}: {exc}"
                if IN_CI:
                    pytest.fail(f"{message} (CI=true: servers are required)")
                pytest.skip(message)
            self.schema = True
        return PG_URL

    def outbox(self, alias: str, sql: str = "SELECT task_id FROM celery_outbox ORDER BY id") -> list[Any]:
        """Run ``sql`` on the project's database (as the project sees it); its rows."""
        if alias == "sqlite":
            with sqlite3.connect(self.home / "dco.sqlite3") as connection:
                return connection.execute(sql).fetchall()
        import psycopg

        with psycopg.connect(PG_URL, autocommit=True, options=f"-c search_path={SCHEMA}") as connection:
            cursor = connection.execute(sql)
            return cursor.fetchall() if cursor.description else []

    def drop(self) -> None:
        if self.schema:
            import psycopg

            with psycopg.connect(PG_URL, autocommit=True, connect_timeout=2) as connection:
                connection.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')


def run(env: dict[str, str], *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A child process of the project (``python *argv``) with ``env`` added to its environment."""
    done = subprocess.run(
        [sys.executable, *argv], cwd=TESTS, env=child_env(env), capture_output=True, text=True, timeout=120
    )
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def child_env(env: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "contrib_django.dco_settings",
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        "DCO_COUNTER": BROKER,
        **env,
    }


def forget(*patterns: str) -> None:
    """Delete the broker's and the counts' keys that match ``patterns`` (db 3 is shared)."""
    client = redis.Redis.from_url(BROKER)
    keys = [key for pattern in patterns for key in client.scan_iter(match=pattern)]
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    made = Project(tmp_path_factory.mktemp("dco"))
    yield made
    made.drop()
    # The relay declares kombu's native delayed delivery queues (celery_delayed_0..27) on any broker;
    # on Redis they are only bindings, left behind
    forget("_kombu.binding.celery_delayed_*", "_kombu.binding_permanent.celery_delayed_*")


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def prefix() -> str:
    return f"dco{uuid.uuid4().hex[:10]}"


@pytest.fixture
def env(project: Project, alias: str, prefix: str) -> Iterator[dict[str, str]]:
    """The environment of every process of one test: its database, key prefix, queue and store."""
    require_server("redis")
    made = {
        "DCO_DB": project.database(alias),
        "DCO_DB_SCHEMA": SCHEMA,
        "SHOP_PREFIX": prefix,
        "SHOP_QUEUE": prefix,
        "SHOP_BROKER": BROKER,
        "SHOP_STORE": REDIS_URL,
    }
    yield made
    project.outbox(alias, "DELETE FROM celery_outbox")  # a row left here would be another test's message
    wipe(store_from_url(REDIS_URL, key_prefix=prefix))
    forget(prefix, f"_kombu.binding.{prefix}", f"_kombu.binding_permanent.{prefix}", f"dco:{prefix}:*")


@pytest.fixture
def worker(tmp_path: Path, prefix: str, env: dict[str, str]) -> Iterator[Callable[[], Worker]]:
    started: list[Worker] = []

    def start() -> Worker:
        made = Worker(tmp_path, BROKER, REDIS_URL, prefix, app="contrib_django.dco_app", env=child_env(env))
        started.append(made)
        return made

    yield start
    for made in started:
        made.stop()


class Relay:
    """``manage.py celery_outbox_relay`` in a child process (tests/contrib_django/dco_relay.py)."""

    def __init__(self, env: dict[str, str], log: Path, *, hold: bool = False) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, str(TESTS / "contrib_django" / "dco_relay.py")],
            cwd=TESTS,
            env=child_env({**env, "DCO_RELAY_HOLD": "1" if hold else ""}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.log = log
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.log.open("a") as out:
            for line in self.process.stdout:
                out.write(line)
                out.flush()
                self.lines.put(line)
        self.lines.put("")  # it exited

    def published(self) -> str:
        """The line a held relay prints once its batch is published; it waits there, its rows undeleted."""
        while True:
            line = self.lines.get(timeout=60)
            assert line, f"the relay exited before it published:\n{self.log.read_text()}"
            if line.startswith("published "):
                return line

    def kill(self) -> int:
        os.killpg(self.process.pid, signal.SIGKILL)
        return self._closed(self.process.wait(timeout=10))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # it finishes its batch, then exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._closed(self.process.returncode)

    def _closed(self, returncode: int) -> int:
        self.reader.join(timeout=10)  # the pipe is at its end once the process is gone
        assert self.process.stdout is not None
        self.process.stdout.close()
        return returncode


@pytest.fixture
def relays(tmp_path: Path, env: dict[str, str]) -> Iterator[Callable[..., Relay]]:
    started: list[Relay] = []

    def start(*, hold: bool = False) -> Relay:
        made = Relay(env, tmp_path / f"relay-{len(started)}.log", hold=hold)
        started.append(made)
        return made

    yield start
    for made in started:
        made.stop()


def call(env: dict[str, str], *calls: dict[str, Any]) -> list[dict[str, Any]]:
    """Make each call in a producer process (tests/contrib_django/dco_call.py); what each got back."""
    out = run(env, str(TESTS / "contrib_django" / "dco_call.py"), json.dumps(list(calls))).stdout
    answer: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])
    return answer


class Counts:
    """What the project counted in Redis for one test (tests/contrib_django/dco_app.py)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.redis = redis.Redis.from_url(BROKER, decode_responses=True)

    def effect(self, order: int) -> int:
        return int(self.redis.get(f"dco:{self.prefix}:effect:{order}") or 0)

    def deliveries(self) -> list[dict[str, Any]]:
        return [json.loads(item) for item in self.redis.lrange(f"dco:{self.prefix}:deliveries", 0, -1)]

    def finished(self) -> list[str]:
        return list(self.redis.lrange(f"dco:{self.prefix}:finished", 0, -1))

    def queued(self) -> int:
        return int(self.redis.llen(self.prefix))


def new_order() -> int:
    return uuid.uuid4().int % 2_000_000_000


def record_of(prefix: str, key: str) -> Any:
    """celery-idem's record of ``dco.ship`` under ``key``, read from the store."""
    store = store_from_url(REDIS_URL, key_prefix=prefix)
    try:
        return store.get(keyed_identity("dco.ship", key, None))
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["postgresql"])
def test_a_relay_killed_after_publishing_resends_and_the_effect_happens_once(
    env: dict[str, str], project: Project, prefix: str, worker: Callable[[], Worker], relays: Callable[..., Relay]
) -> None:
    counts = Counts(prefix)
    order, key = new_order(), f"ship-{uuid.uuid4().hex}"
    worker()
    # Given a keyed call staged in a committed transaction
    (made,) = call(env, {"key": key, "order": order})
    assert made["staged"] == 1 and made["outbox"] == [made["task_id"]] and not made["deduplicated"]
    # and a relay SIGKILLed after it published the row, before it deleted it
    doomed = relays(hold=True)
    doomed.published()
    assert doomed.kill() == -signal.SIGKILL
    assert project.outbox("postgresql") == [(made["task_id"],)]  # its DELETE never committed
    # When the next relay takes the row up again (once it is stale: 1 s after the first took it)
    relays()
    wait_for(lambda: len(counts.finished()) == 2, "both messages finished", 60)
    # Then the message was delivered twice, under the call's task id, and its effect happened once
    assert [delivery["task_id"] for delivery in counts.deliveries()] == [made["task_id"]] * 2
    assert counts.effect(order) == 1
    assert wait_for(lambda: project.outbox("postgresql") == [], "the second relay's cleanup")


@pytest.mark.parametrize("alias", ["sqlite"])
def test_django_celery_outbox_refuses_sqlite(env: dict[str, str]) -> None:
    # It stages calls on SQLite, but its relay needs SKIP LOCKED: nothing would ever publish them.
    # Its system check (a database one: migrate runs it) says so, and its relay will not start.
    checked = run(env, "-m", "django", "check", "--database", "default", check=False)
    assert checked.returncode != 0 and "celery_outbox.E001" in checked.stderr
    relayed = run(env, str(TESTS / "contrib_django" / "dco_relay.py"), check=False)
    assert relayed.returncode != 0
    assert 'Database backend "sqlite" does not support SELECT FOR UPDATE SKIP LOCKED' in relayed.stderr


def test_a_rolled_back_call_publishes_nothing(env: dict[str, str], project: Project, alias: str, prefix: str) -> None:
    # Given a keyed call staged inside a transaction that then raises
    (made,) = call(env, {"key": f"ship-{uuid.uuid4().hex}", "order": new_order(), "rollback": True})
    # Then the row was there inside it, and nothing is left to publish or published
    assert made["staged"] == 1 and made["outbox"] == []
    assert project.outbox(alias) == [] and Counts(prefix).queued() == 0


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["postgresql"])
def test_a_key_given_to_send_task_as_an_option_survives_a_rollback_and_the_relay(
    env: dict[str, str], prefix: str, worker: Callable[[], Worker], relays: Callable[..., Relay]
) -> None:
    # What works today: sent by name with the key as an option (not in headers=), a call is claimed by
    # nobody at the call, and django-celery-outbox stores the unknown option with the row; its relay
    # sends it as an option, which celery-idem's before_task_publish hook moves into the headers.
    counts = Counts(prefix)
    order, key, other = new_order(), f"ship-{uuid.uuid4().hex}", f"ship-{uuid.uuid4().hex}"
    worker()
    # Given a call rolled back, then committed twice, and a call under another key, all by name
    rolled_back, made, again, elsewhere = call(
        env,
        {"key": key, "order": order, "rollback": True, "by_name": True},
        {"key": key, "order": order, "by_name": True},
        {"key": key, "order": order, "by_name": True},
        {"key": other, "order": order, "by_name": True},
    )
    assert rolled_back["record"] is None and made["record"] is None  # no claim: the worker claims
    assert len(elsewhere["outbox"]) == 3
    # When the relay publishes the three rows
    relays()
    wait_for(lambda: len(counts.finished()) == 3, "the three messages finished", 60)
    # Then each carried its key, and each key had its effect once: of the two calls under one key, the
    # one the worker took second (two pool processes: either) was replayed the other's outcome
    assert sorted(delivery["idempotency_key"] for delivery in counts.deliveries()) == sorted([key, key, other])
    assert counts.effect(order) == 2
    record = record_of(prefix, key)
    assert record is not None and record.state is State.COMPLETED
    assert record.task_id in (made["task_id"], again["task_id"])


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["postgresql"])
def test_the_relayed_message_carries_the_callers_idempotency_key(
    env: dict[str, str], prefix: str, worker: Callable[[], Worker], relays: Callable[..., Relay]
) -> None:
    counts = Counts(prefix)
    order, key = new_order(), f"ship-{uuid.uuid4().hex}"
    worker()
    # Given a keyed call staged in a committed transaction (the worker claims it: a claim made in the
    # caller's transaction would outlive a rollback)
    (made,) = call(env, {"key": key, "order": order})
    assert made["record"] is None
    # When the relay publishes it and the worker runs it
    relays()
    wait_for(lambda: counts.finished(), "the message finished", 60)
    # Then the worker got the caller's key, and the key's record holds the outcome. (django-celery-outbox
    # stores no "headers" option: serialize_options drops it as transient, and its relay publishes with
    # headers={} plus Sentry's. celery-idem gives the key as an option too, which it keeps.)
    assert [delivery["idempotency_key"] for delivery in counts.deliveries()] == [key]
    record = record_of(prefix, key)
    assert record is not None and record.state is State.COMPLETED and record.task_id == made["task_id"]


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["postgresql"])
def test_two_keys_with_the_same_arguments_are_two_calls(
    env: dict[str, str], prefix: str, worker: Callable[[], Worker], relays: Callable[..., Relay]
) -> None:
    counts = Counts(prefix)
    order = new_order()
    worker()
    # Given two calls with the same arguments under two keys (two shipments the caller asked for)
    first, second = call(env, {"key": f"ship-a-{order}", "order": order}, {"key": f"ship-b-{order}", "order": order})
    assert not first["deduplicated"] and not second["deduplicated"] and first["task_id"] != second["task_id"]
    # When the relay publishes both and the worker runs them
    relays()
    wait_for(lambda: len(counts.finished()) == 2, "both messages finished", 60)
    # Then each key had its effect (without the key header, the second is replayed the first's outcome)
    assert counts.effect(order) == 2


def test_a_rolled_back_call_leaves_no_claim(env: dict[str, str], alias: str, prefix: str) -> None:
    key = f"ship-{uuid.uuid4().hex}"
    # Given a keyed call inside a transaction that then raises
    (made,) = call(env, {"key": key, "order": new_order(), "rollback": True})
    # Then nothing of it is left: no row, and no claim on the key. (Today the claim is made by
    # IdempotentTask.apply_async before OutboxCelery.send_task writes the row; the rollback takes
    # the row and leaves the PENDING claim, for pending_timeout_seconds.)
    assert made["outbox"] == []
    assert made["record"] is None and record_of(prefix, key) is None


def test_a_call_repeated_after_a_rollback_runs(
    env: dict[str, str], alias: str, prefix: str, worker: Callable[[], Worker], relays: Callable[..., Relay]
) -> None:
    counts = Counts(prefix)
    order, key = new_order(), f"ship-{uuid.uuid4().hex}"
    # Given a keyed call whose transaction rolled back, and the same call again, committed
    rolled_back, again = call(env, {"key": key, "order": order, "rollback": True}, {"key": key, "order": order})
    # Then the second call is a new call, staged: not a duplicate of the one that never happened
    assert not again["deduplicated"], f"handed the rolled-back call's task id {rolled_back['task_id']}"
    assert again["staged"] == 1 and again["outbox"] == [again["task_id"]] != [rolled_back["task_id"]]
    if alias != "postgresql":
        return  # its relay refuses SQLite (see above): staging is all a SQLite project gets of it
    # and its effect happens once it is relayed
    worker()
    relays()
    wait_for(lambda: counts.finished(), "the call's message finished", 60)
    assert counts.effect(order) == 1
