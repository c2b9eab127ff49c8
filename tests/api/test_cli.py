"""``celery -A shop idem ...`` as an operator runs it: a subprocess, the shop app, a real Redis store.

Records are seeded from this process straight through the store (the same URL and prefix the shop
app is built with), and checked there again after a command that changes something.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL
from conftest import PICKLE, REDIS_URL, FakeClock, Planted, plant_pickle, require_server, wipe

from celery_idem import ReconcileReport
from celery_idem.records import ErrorInfo, Identity, State
from celery_idem.stores import Store, store_from_url

TESTS = Path(__file__).resolve().parents[1]  # tests/: the shop app the CLI loads
BROKER = REDIS_BROKER_URL
BACKEND = REDIS_BACKEND_URL
FP = "f" * 64
LONG = 600.0  # seconds: leases and TTLs that do not run out during a test


@dataclass
class Cli:
    prefix: str
    store: Store
    env: dict[str, str]

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "shop", "idem", *args],
            cwd=TESTS,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def parallel(self, *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
        """Several read-only commands at once (each subprocess spends about a second importing)."""
        with ThreadPoolExecutor(len(commands)) as pool:
            return list(pool.map(lambda args: self(*args), commands))

    def json(self, *args: str) -> Any:
        return self.loads(self(*args, "--json"))

    @staticmethod
    def loads(done: subprocess.CompletedProcess[str]) -> Any:
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    # ---- seeding, straight through the store ----

    def pending(self, task: str, key: str) -> str:
        task_id = str(uuid.uuid4())
        claimed = self.store.claim(Identity("", task, key), FP, task_id, pending_seconds=LONG, ttl_seconds=LONG)
        assert claimed.decision.value == "NEW"
        return task_id

    def running(self, task: str, key: str, store: Store | None = None, lease_seconds: float = LONG) -> str:
        task_id = str(uuid.uuid4())
        taken = (store or self.store).acquire(
            Identity("", task, key), FP, task_id, lease_seconds=lease_seconds, ttl_seconds=LONG
        )
        assert taken.decision.value == "RUN"
        return task_id

    def completed(self, task: str, key: str, value: Any) -> str:
        task_id = str(uuid.uuid4())
        identity = Identity("", task, key)
        taken = self.store.acquire(identity, FP, task_id, lease_seconds=LONG, ttl_seconds=LONG)
        assert taken.record is not None
        assert self.store.complete(identity, taken.record.owner, json.dumps(value).encode()).ok
        return task_id

    def failed(self, task: str, key: str, message: str) -> str:
        task_id = str(uuid.uuid4())
        identity = Identity("", task, key)
        taken = self.store.acquire(identity, FP, task_id, lease_seconds=LONG, ttl_seconds=LONG)
        assert taken.record is not None
        error = ErrorInfo(type="PermanentError", module="celery_idem.errors", message=message, args=[message])
        assert self.store.fail(identity, taken.record.owner, error).ok
        return task_id


@pytest.fixture
def cli() -> Iterator[Cli]:
    require_server("redis")
    prefix = f"cli{uuid.uuid4().hex[:10]}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        "SHOP_BROKER": BROKER,
        "SHOP_BACKEND": BACKEND,
        "SHOP_STORE": REDIS_URL,
        "SHOP_PREFIX": prefix,
        "SHOP_QUEUE": prefix,
    }
    store = store_from_url(REDIS_URL, key_prefix=prefix)
    try:
        yield Cli(prefix, store, env)
    finally:
        wipe(store)


class Backend:
    """The shop app's result backend, reached from this process (an app on the same broker and backend)."""

    def __init__(self, prefix: str) -> None:
        from shop import make_app

        self.app = make_app(broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=prefix, queue=prefix)
        self.stored: list[str] = []

    def succeed(self, task_id: str, value: Any) -> None:
        self.app.backend.store_result(task_id, value, "SUCCESS")
        self.stored.append(task_id)

    def close(self) -> None:
        for task_id in self.stored:
            self.app.backend.forget(task_id)
        self.app.close()


@pytest.fixture
def backend(cli: Cli) -> Iterator[Backend]:
    instance = Backend(cli.prefix)
    try:
        yield instance
    finally:
        instance.close()


def columns(text: str) -> list[dict[str, str]]:
    """The rows of a table the CLI printed, by its header's column names (a cell may hold spaces)."""
    header, *lines = text.rstrip().splitlines()
    names = re.findall(r"\S+(?: \S+)*", header)
    starts = [header.index(name) for name in names]
    ends = [*starts[1:], None]
    return [{n: line[a:b].strip() for n, a, b in zip(names, starts, ends, strict=True)} for line in lines]


def key() -> str:
    return f"k-{uuid.uuid4().hex[:16]}"


# ---- show ----------------------------------------------------------------------------------------


def test_show_prints_a_completed_record_for_people_and_as_json(cli: Cli) -> None:
    k = key()
    task_id = cli.completed("shop.charge", k, {"order": "42", "charged": 100})
    human, as_json = cli.parallel(("show", "--task", "shop.charge", k), ("show", "--task", "shop.charge", k, "--json"))
    assert human.returncode == 0, human.stderr
    # One "field  value" line per field that has a value (the unscoped record's scope is empty).
    lines = {name: value.strip() for name, _, value in (line.partition(" ") for line in human.stdout.splitlines())}
    assert lines["key"] == k and lines["task_name"] == "shop.charge"
    assert lines["state"] == "COMPLETED" and lines["task_id"] == task_id
    assert "'charged': 100" in lines["result"]
    # Times for people: ISO-8601 UTC with how long ago or ahead (the store server's clock), and the TTL
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+(\.\d)? m?s ago\)", lines["created_at"]), lines
    assert re.fullmatch(r"\S+Z \(in \d+ min( \d+ s)?\)", lines["expires_at"]), lines
    assert lines["ttl_seconds"] == "600 (10 min)"  # LONG
    assert "lease" not in lines  # a settled record has none

    view = cli.loads(as_json)
    assert view["state"] == "COMPLETED" and view["task_id"] == task_id and view["key"] == k
    assert view["result"] == {"order": "42", "charged": 100}
    assert view["error"] is None


def test_show_of_a_failed_record_shows_its_error(cli: Cli) -> None:
    k = key()
    cli.failed("shop.declined", k, "card declined for order 3")
    view = cli.json("show", "--task", "shop.declined", k)
    assert view["state"] == "FAILED" and "result" not in view
    assert view["error"]["type"] == "PermanentError" and view["error"]["message"] == "card declined for order 3"


def test_show_and_forget_with_a_scope_reach_only_the_scoped_record(cli: Cli) -> None:
    k = key()
    identity = Identity("eu", "shop.charge", k)
    assert cli.store.claim(identity, FP, "t-eu", pending_seconds=LONG, ttl_seconds=LONG).decision.value == "NEW"
    view = cli.json("show", "--task", "shop.charge", "--scope", "eu", k)
    assert (view["scope"], view["task_id"], view["state"]) == ("eu", "t-eu", "PENDING")
    unscoped = cli("show", "--task", "shop.charge", k)
    assert unscoped.returncode == 1 and "no record" in unscoped.stderr
    assert cli("forget", "--task", "shop.charge", "--scope", "eu", k).returncode == 0
    assert cli.store.get(identity) is None


def test_show_and_list_never_unpickle_a_result_and_show_its_content_type_and_size(cli: Cli, tmp_path: Path) -> None:
    # Given a COMPLETED record whose result claims pickle and would create a directory if unpickled
    k, flag = key(), tmp_path / "unpickled"
    task_id = plant_pickle(cli.store, Identity("", "shop.charge", k), FP, str(flag))
    size = len(pickle.dumps(Planted(str(flag))))
    # When an operator shows it and lists completed records, for people and as JSON
    human, shown, listed = cli.parallel(
        ("show", "--task", "shop.charge", k),
        ("show", "--task", "shop.charge", k, "--json"),
        ("list", "--state", "COMPLETED", "--json"),
    )
    # Then every command answers with the content type and size instead of the value, and nothing ran
    assert human.returncode == 0, human.stderr
    assert "application/x-python-serialize" in human.stdout and "not decoded" in human.stdout
    for view in (cli.loads(shown), *cli.loads(listed)):
        assert view["task_id"] == task_id and view["content_type"] == PICKLE
        assert view["result"]["content_type"] == PICKLE and view["result"]["bytes"] == size
        assert "accept_pickle" in view["result"]["not_decoded"]
    assert not flag.exists()


def test_show_of_a_missing_key_exits_1_naming_it(cli: Cli) -> None:
    human, as_json = cli.parallel(
        ("show", "--task", "shop.charge", "no-such-key"), ("show", "--task", "shop.charge", "no-such-key", "--json")
    )
    assert human.returncode == 1
    assert "no record for key 'no-such-key' of task 'shop.charge'" in human.stderr
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout) == {"error": "no record for key 'no-such-key' of task 'shop.charge'"}


def test_show_of_an_unknown_task_exits_2_naming_the_idempotent_tasks(cli: Cli) -> None:
    done = cli("show", "--task", "no.such.task", "k1")
    assert done.returncode == 2
    assert "'no.such.task' is not a task of app 'shop'" in done.stderr
    idempotent = done.stderr.partition("idempotent tasks:")[2]
    assert "shop.charge" in idempotent and "shop.slow" in idempotent
    assert "shop.add" not in idempotent and "celery_idem.reconcile" not in idempotent  # plain tasks


def test_show_of_an_invalid_key_exits_nonzero_stating_the_rule(cli: Cli) -> None:
    done = cli("show", "--task", "shop.charge", "has space")
    assert done.returncode != 0
    assert "1-255 printable characters without whitespace" in done.stderr
    assert "position 3" in done.stderr


# ---- forget -------------------------------------------------------------------------------------


def test_forget_removes_the_record_and_forgetting_again_exits_1(cli: Cli) -> None:
    k, other = key(), key()
    cli.running("shop.slow", k)
    cli.pending("shop.slow", other)
    # When an operator forgets a record that is IN_PROGRESS
    done = cli("forget", "--task", "shop.slow", k)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"forgot shop.slow {k}"
    # Then it is gone (show says so), and nothing else was touched
    assert cli.store.get(Identity("", "shop.slow", k)) is None
    assert cli("show", "--task", "shop.slow", k).returncode == 1
    assert cli.store.get(Identity("", "shop.slow", other)) is not None
    # And forgetting it again is an error: there is nothing to forget
    again = cli("forget", "--task", "shop.slow", k, "--json")
    assert again.returncode == 1
    assert json.loads(again.stdout) == {"error": f"no record for key {k!r} of task 'shop.slow'"}


# ---- list, stats ----------------------------------------------------------------------------------


def test_list_by_state_is_case_insensitive_and_filters_by_task_and_limit(cli: Cli) -> None:
    charges = {cli.pending("shop.charge", k): k for k in (key(), key(), key())}
    cli.pending("shop.slow", key())
    done = {cli.completed("shop.charge", k, {"n": i}): k for i, k in enumerate((key(), key()))}

    answers = cli.parallel(
        ("list", "--state", "PENDING", "--task", "shop.charge", "--json"),
        ("list", "--state", "pending", "--json"),
        ("list", "--state", "Pending", "--task", "shop.charge", "--limit", "2", "--json"),
        ("list", "--state", "completed"),
    )
    pending, every_pending, limited = (cli.loads(answer) for answer in answers[:3])
    completed = answers[3]
    assert {(r["task_id"], r["key"]) for r in pending} == set(charges.items())
    assert {(r["state"], r["task_name"]) for r in pending} == {("PENDING", "shop.charge")}

    assert len(every_pending) == 4 and {r["task_name"] for r in every_pending} == {"shop.charge", "shop.slow"}

    assert len(limited) == 2 and {r["key"] for r in limited} <= set(charges.values())

    assert completed.returncode == 0, completed.stderr
    header, *lines = completed.stdout.strip().splitlines()
    assert header.split() == [
        "STATE",
        "TASK",
        "SCOPE",
        "KEY",
        "TASK",
        "ID",
        "ATTEMPT",
        "CHANGED",
        "LEASE",
        "LEFT",
        "EXPIRES",
        "IN",
    ]
    assert len(lines) == 2
    assert {line.split()[3] for line in lines} == set(done.values())  # state  task  scope  key  task_id ...
    assert {line.split()[4] for line in lines} == set(done)
    assert {line.split()[0] for line in lines} == {"COMPLETED"}


# Regression: Redis used to cut at `limit` in SCAN order before sorting.
def test_list_with_limit_shows_the_newest_records(cli: Cli) -> None:
    # Given 40 PENDING records claimed one after another (distinct updated_at, oldest first)
    keys = []
    for _ in range(40):
        keys.append(key())
        cli.pending("shop.charge", keys[-1])
    # When an operator asks for the 4 newest
    newest = cli.json("list", "--state", "PENDING", "--limit", "4")
    # Then they are the last 4 claimed, newest first (1 chance in 91,390 to pass by luck of SCAN order)
    assert [r["key"] for r in newest] == keys[:-5:-1]


def test_list_of_an_empty_state(cli: Cli) -> None:
    cli.pending("shop.charge", key())
    human, as_json = cli.parallel(("list", "--state", "FAILED"), ("list", "--state", "in_progress", "--json"))
    assert human.returncode == 0 and human.stdout.strip() == "no records"
    assert cli.loads(as_json) == []


def test_list_of_an_unknown_state_exits_2_naming_the_states_on_one_line(cli: Cli) -> None:
    done = cli("list", "--state", "DONE")
    assert done.returncode == 2
    assert "'DONE' is not a state; states: PENDING, IN_PROGRESS, COMPLETED, FAILED (or all)" in done.stderr


def test_list_shows_every_state_by_default_under_a_header_and_filters_by_states_and_age(cli: Cli) -> None:
    old = store_from_url(REDIS_URL, key_prefix=cli.prefix, clock=FakeClock(time.time() - 7200))
    try:
        aged = cli.running("shop.slow", key(), store=old, lease_seconds=LONG * 4)
    finally:
        old.close()
    waiting = cli.pending("shop.charge", key())
    done = cli.completed("shop.charge", key(), 1)
    every, some, older, before = cli.parallel(
        ("list",),
        ("list", "--state", "pending,in_progress", "--json"),
        ("list", "--older-than", "1h", "--json"),
        ("--json", "list", "--state", "all"),  # --json before the command works too
    )
    rows = {row["TASK ID"]: row for row in columns(every.stdout)}
    assert set(rows) == {aged, waiting, done}
    assert rows[aged]["STATE"] == "IN_PROGRESS" and rows[aged]["CHANGED"] == "2 h"
    assert rows[waiting]["STATE"] == "PENDING" and rows[done]["STATE"] == "COMPLETED"
    assert rows[done]["LEASE LEFT"] == "-" and rows[aged]["LEASE LEFT"] != "-"  # a settled record has no lease
    assert {r["task_id"] for r in cli.loads(some)} == {aged, waiting}
    assert [r["task_id"] for r in cli.loads(older)] == [aged]
    assert {r["task_id"] for r in cli.loads(before)} == {aged, waiting, done}


def test_an_age_that_is_not_one_exits_2_saying_how_to_write_it(cli: Cli) -> None:
    done = cli("list", "--older-than", "yesterday")
    assert done.returncode == 2 and "'yesterday' is not an age; write it as 90s, 10m, 2h or 1d" in done.stderr


def test_stats_counts_the_records_of_each_state(cli: Cli) -> None:
    for _ in range(3):
        cli.pending("shop.charge", key())
    cli.running("shop.slow", key())
    for i in range(2):
        cli.completed("shop.charge", key(), i)
    cli.failed("shop.declined", key(), "declined")
    stats, human = cli.parallel(("stats", "--json"), ("stats",))
    stats = cli.loads(stats)
    assert stats["records"] == {"PENDING": 3, "IN_PROGRESS": 1, "COMPLETED": 2, "FAILED": 1}
    assert stats["store"] == REDIS_URL and stats["prefix"] == cli.prefix  # the URL, not the object's repr
    assert stats["by_task"] == {
        "shop.charge": {"PENDING": 3, "IN_PROGRESS": 0, "COMPLETED": 2, "FAILED": 0},
        "shop.declined": {"PENDING": 0, "IN_PROGRESS": 0, "COMPLETED": 0, "FAILED": 1},
        "shop.slow": {"PENDING": 0, "IN_PROGRESS": 1, "COMPLETED": 0, "FAILED": 0},
    }
    assert "celery_idem_events_total" in stats["counters"]  # where a prefork worker's counters are
    lines = human.stdout.splitlines()
    assert lines[0].split() == ["store", REDIS_URL] and "<" not in human.stdout
    assert ["shop.charge", "3", "0", "2", "0"] in [line.split() for line in lines]


def test_every_record_list_shows_after_a_duplicate_with_a_link_can_be_shown_and_forgotten(cli: Cli) -> None:
    # Given one call of shop.charge answered by a worker, and one duplicate of it carrying a link (each
    # message run as a worker's pool runs it: Celery's own Request)
    from shop import make_app
    from workers import execute_as_worker

    app = make_app(broker=BROKER, backend=BACKEND, store=REDIS_URL, prefix=cli.prefix, queue=cli.prefix)
    k, first, duplicate = key(), str(uuid.uuid4()), str(uuid.uuid4())
    try:
        execute_as_worker(app, "shop.charge", first, args=(1, 70), idempotency_key=k)
        link = dict(app.tasks["shop.add"].s(1))
        execute_as_worker(app, "shop.charge", duplicate, args=(1, 70), idempotency_key=k, callbacks=[link])
        # When an operator lists the task's records and counts them
        listed = cli.json("list", "--task", "shop.charge")
        stats = cli.json("stats")
    finally:
        app.control.purge()  # the link's message, which no worker here takes
        for task_id in (first, duplicate):
            app.backend.forget(task_id)
        app.close()
    # Then what they see is the one call's record, which show and forget reach by its key
    keys = [row["key"] for row in listed]
    refused = {kept: cli("show", "--task", "shop.charge", kept).returncode for kept in keys}
    assert all(code == 0 for code in refused.values()), f"listed records show cannot reach: {refused}"
    assert stats["by_task"]["shop.charge"]["COMPLETED"] == 1, stats["by_task"]


# ---- reconcile ------------------------------------------------------------------------------------


def stale_record(cli: Cli, backend: Backend, task: str = "shop.charge") -> tuple[str, str]:
    """An IN_PROGRESS record whose lease ran out a minute ago and whose task SUCCEEDED in the result
    backend (its worker died between storing the result and completing the record)."""
    k = key()
    # A store whose clock runs 2 minutes behind writes a lease that, on the server's clock, expired long
    # ago: no sleeping past a lease.
    past = store_from_url(REDIS_URL, key_prefix=cli.prefix, clock=FakeClock(time.time() - 120))
    try:
        task_id = cli.running(task, k, store=past, lease_seconds=1)
    finally:
        past.close()
    backend.succeed(task_id, {"ok": 1})
    return k, task_id


def test_reconcile_dry_run_reports_and_changes_nothing(cli: Cli, backend: Backend) -> None:
    k, task_id = stale_record(cli, backend)
    before = cli.store.get(Identity("", "shop.charge", k))
    report = cli.json("reconcile", "--dry-run")
    assert set(report) == set(ReconcileReport.model_fields)
    assert report["dry_run"] is True
    assert (report["scanned"], report["completed"], report["released"], report["left"]) == (1, 1, 0, 0)
    after = cli.store.get(Identity("", "shop.charge", k))
    assert after is not None and after.state is State.IN_PROGRESS and after == before


def test_reconcile_says_which_records_it_left_and_why_with_its_time_rounded(cli: Cli, backend: Backend) -> None:
    stale_record(cli, backend)  # completed from the backend
    past = store_from_url(REDIS_URL, key_prefix=cli.prefix, clock=FakeClock(time.time() - 120))
    try:
        k = key()
        left = cli.running("shop.charge", k, store=past, lease_seconds=1)  # no evidence, within the grace
    finally:
        past.close()
    human = cli("reconcile", "--dry-run")
    assert human.returncode == 0, human.stderr
    first, *rest = human.stdout.strip().splitlines()
    assert re.fullmatch(
        r"dry run in \d+(\.\d)? m?s: scanned=2, completed=1, failed=0, released=0, requeued=0, left=1, purged=0", first
    )
    assert "left as they were:" in rest
    (row,) = [line for line in rest if left in line]
    assert row.split()[:5] == ["shop.charge", "-", k, left, "IN_PROGRESS"] and "grace" in row


def test_reconcile_completes_a_stale_record_whose_task_succeeded(cli: Cli, backend: Backend) -> None:
    k, task_id = stale_record(cli, backend)
    report = cli.json("reconcile")
    assert report["dry_run"] is False
    assert (report["scanned"], report["completed"], report["failed"], report["released"]) == (1, 1, 0, 0)
    view = cli.json("show", "--task", "shop.charge", k)
    assert view["state"] == "COMPLETED" and view["task_id"] == task_id and view["result"] == {"ok": 1}


def test_a_store_that_is_down_is_one_clear_line_not_a_traceback(cli: Cli) -> None:
    # Given the CLI pointed at a Redis port nobody listens on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    env = {**cli.env, "SHOP_STORE": down, "SHOP_SETTINGS": json.dumps({"store_timeout_seconds": 0.5})}
    commands = [("stats",), ("list", "--state", "PENDING"), ("reconcile", "--dry-run")]
    done = dataclasses.replace(cli, env=env).parallel(*commands, *[(*args, "--json") for args in commands])
    for human in done[: len(commands)]:
        assert human.returncode == 1 and "Traceback" not in human.stderr, human.stderr
        assert "check that the store is up" in human.stderr
    for as_json in done[len(commands) :]:
        assert as_json.returncode == 1 and "check that the store is up" in json.loads(as_json.stdout)["error"]


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/8?password=s3cret-pw",
        "valkey://127.0.0.1:6379/8?socket_keepalive=true&password=s3cret-pw",
        "postgresql+psycopg://postgres@127.0.0.1:5432/test?password=s3cret-pw",
    ],
)
def test_stats_never_shows_a_password_given_in_the_query_string(url: str) -> None:
    # Shows: redis-py and libpq both take the password as a query parameter (?password=...), and the
    # store's URL (what `stats` prints as "store", and errors name) redacted only user:password@: the
    # password was printed as given.
    store = store_from_url(url)
    try:
        assert store.url is not None and "s3cret-pw" not in store.url
        assert store.url == url.replace("s3cret-pw", "***")
    finally:
        store.close()
