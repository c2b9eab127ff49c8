"""``celery-idem demo`` end to end: its exit code is its verdict, on the embedded default and on the
real servers users point it at; it refuses in one line, exit 2, when it cannot start; it leaves
nothing behind on those servers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import sqlalchemy as sa
from addresses import REDIS_DEMO_BACKEND_URL, REDIS_DEMO_BROKER_URL
from conftest import POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_rabbitmq, require_server
from sql_layouts import make_layout_1

pytestmark = pytest.mark.slow

WIRINGS = {
    "embedded": [],
    "redis": ["--broker", REDIS_DEMO_BROKER_URL, "--backend", REDIS_DEMO_BACKEND_URL, "--store", REDIS_URL],
    "rabbitmq": ["--broker", RABBITMQ_URL, "--backend", REDIS_DEMO_BACKEND_URL],
    "postgresql": ["--store", POSTGRES_URL],
}
# The command the README runs (a console script: unlike `python -m`, it does not put the caller's
# directory first on the import path). One file: the tests compare the servers' keys before and
# after a run, so two runs at once would see each other's (the suite runs a file in one process).
CELERY_IDEM = str(Path(sys.executable).parent / "celery-idem")
SCENARIOS = (
    "storm of duplicate calls",
    "payload mismatch refused",
    "final failure replayed",
    "retryable failure retried",
    "worker killed mid-job",
    "worker killed after the payment",
)


def demo(*args: str, timeout: float = 240, **options: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CELERY_IDEM, "demo", *args], capture_output=True, text=True, timeout=timeout, **options)


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A schema of the test's own, holding a store table of an older layout with a row, as a user's
    deployment may: the demo must leave it as it is, and put its own tables beside it."""
    require_server("postgresql")
    schema = f"demo_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(POSTGRES_URL)
    with engine.begin() as connection:
        connection.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield schema
    finally:
        with engine.begin() as connection:
            connection.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()


def redis_keys() -> set[tuple[str, bytes]]:
    keys = set()
    for url in (REDIS_URL, REDIS_DEMO_BROKER_URL, REDIS_DEMO_BACKEND_URL):
        client = redis.Redis.from_url(url)
        keys |= {(url, key) for key in client.scan_iter(count=1000) if b"demo-" in key or b"celery-task-meta" in key}
        client.close()
    return keys


def rabbitmq_has_exchange(name: str) -> bool:
    from kombu import Connection, Exchange

    with Connection(RABBITMQ_URL) as connection:
        try:
            Exchange(name, "direct").bind(connection.channel()).declare(passive=True)
        except Exception as exc:  # amqp's NotFound (404), however kombu wraps it
            if "404" in str(exc) or "NOT_FOUND" in str(exc):
                return False
            raise
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wiring", sorted(WIRINGS))
def test_the_demo_shows_every_guarantee_and_leaves_nothing_behind(wiring: str, tmp_path, request) -> None:
    args = list(WIRINGS[wiring])
    env = dict(os.environ)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    if wiring in ("redis", "rabbitmq"):
        require_server("redis")
    if wiring == "rabbitmq":
        require_rabbitmq()
    if wiring == "postgresql":
        schema = request.getfixturevalue("pg_schema")
        separator = "&" if "?" in POSTGRES_URL else "?"
        args[1] = f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
        engine = sa.create_engine(args[1])
        users_rows = make_layout_1(engine, "celery_idem_records")  # a user's store table, older layout
    if wiring == "embedded":
        # What a user's shell and directory may hold: Celery's own variables (read before any
        # configuration), a celery.py that would shadow Celery in a worker started there, and the
        # files of an earlier run in the work directory.
        require_server("redis")
        env |= {"CELERY_RESULT_BACKEND": REDIS_DEMO_BACKEND_URL, "CELERY_BROKER_URL": REDIS_DEMO_BROKER_URL}
        (cwd / "celery.py").write_text("from celery import Celery\n")
        # A work directory of the user's, with files named as the demo's are, and a module that would
        # shadow Celery's in a worker running there: the demo's files go to a directory of their own.
        users = {"effects.log": "demo.plain_charge x 1\n" * 300, "celery.py": "raise SystemExit(3)\n"}
        users |= {"results/report.csv": "a,b\n", "worker-prod.log": "prod\n", "shop.db": "not sqlite"}
        for name, text in users.items():
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_text(text)
    before = redis_keys() if wiring != "postgresql" else set()
    run = demo("--workdir", str(tmp_path), *args, env=env, cwd=cwd)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every guarantee held" in run.stdout
    for scenario in SCENARIOS:
        assert f"-> {scenario} ..." in run.stdout
    # Side by side: the same storm on a plain task, and the executions counted outside the library.
    assert "plain Celery: 200 charges; celery-idem: 1 charge, 1 task id, 1 answer" in run.stdout
    # The ledger: one payment row, whatever the broker did with the killed worker's message.
    assert "1 payment row" in run.stdout
    # What happened after each kill is said (the reconciler's part, or the broker's redelivery's).
    assert "the reconciler" in run.stdout.split("-> worker killed mid-job")[1]
    assert "stopping the worker: a warm shutdown" in run.stdout
    if wiring == "embedded":
        assert "removed what the demo wrote" not in run.stdout  # nothing on a server: its files are the workdir
    else:
        assert "removed what the demo wrote to your servers" in run.stdout
    assert "could not remove" not in run.stdout
    # Its records, results and queue (and the killed workers' unacked copies) are gone; on the
    # embedded wiring, nothing was written to the servers Celery's variables named.
    assert redis_keys() - before == set()
    if wiring == "embedded":
        assert all((tmp_path / name).read_text() == text for name, text in users.items())
        assert [p.name for p in tmp_path.glob("run-demo-*")] != []  # the run's files, kept as asked
    if wiring == "rabbitmq":
        prefix = re.search(r"the queue (demo-\w+)-q", run.stdout)[1]
        assert not rabbitmq_has_exchange(f"{prefix}-q")
    if wiring == "postgresql":
        # Its own tables are dropped; the user's table keeps its layout and its rows.
        inspector = sa.inspect(engine)
        assert inspector.get_table_names() == ["celery_idem_records"]
        assert "state" in {c["name"] for c in inspector.get_columns("celery_idem_records")}  # layout 1's
        with engine.connect() as connection:
            count = connection.execute(sa.text("SELECT count(*) FROM celery_idem_records")).scalar_one()
        assert count == len(users_rows)
        engine.dispose()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "its reader gone"])
def test_a_demo_stopped_midway_stops_its_worker_and_removes_what_it_wrote(how: str, tmp_path) -> None:
    require_server("redis")
    before = redis_keys()
    command = [CELERY_IDEM, "demo", "--workdir", str(tmp_path), *WIRINGS["redis"]]
    demo_process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    assert demo_process.stdout is not None
    while "-> storm of duplicate calls" not in demo_process.stdout.readline():
        pass
    time.sleep(1.5)  # in the middle of the storm
    if how == "its reader gone":
        demo_process.stdout.close()  # `celery-idem demo | head`
    else:
        demo_process.send_signal(getattr(signal, how))
    if how == "its reader gone":
        # It goes on unseen to the end, and stops its worker and cleans up as always.
        assert demo_process.wait(timeout=120) == 0
        assert demo_process.stderr is not None
        errors = demo_process.stderr.read()
        demo_process.stderr.close()
        assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
    else:
        output, errors = demo_process.communicate(timeout=60)
        assert demo_process.returncode == 130, output + errors
        assert "interrupted: stopping the worker at once" in output
        assert "removed what the demo wrote to your servers" in output
    assert processes_in(tmp_path) == [], "the demo's worker outlived it"
    assert redis_keys() - before == set()


def processes_in(directory: Path) -> list[int]:
    """The processes working in ``directory`` or below (the demo's workers run in its run directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(directory):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_the_demo_without_the_sql_extra_says_so_in_one_line_and_exits_2() -> None:
    # SQLAlchemy made unimportable, as in a venv with only celery-idem[redis].
    hide = "import sys; sys.modules['sqlalchemy'] = None; from celery_idem.demo import main; main()"
    run = subprocess.run([sys.executable, "-c", hide, "demo"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1, run.stderr
    assert "celery-idem[sql]" in run.stderr


@pytest.mark.parametrize(
    ("option", "what"),
    [("--store", "store"), ("--broker", "broker"), ("--backend", "result backend")],
)
def test_the_demo_with_a_server_it_cannot_reach_names_it_in_one_line_and_exits_2(option: str, what: str) -> None:
    url = "redis://:secret@127.0.0.1:1/0"  # nothing listens on port 1
    run = demo(option, url, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1, run.stderr
    assert f"cannot use the {what} at redis://:**@127.0.0.1:1/0: " in run.stderr
    assert "Connection refused" in run.stderr
    assert "secret" not in run.stderr


@pytest.mark.parametrize(
    ("option", "url"),
    [("--store", "memory://"), ("--broker", "memory://"), ("--backend", "cache+memory://")],
)
def test_the_demo_refuses_a_server_that_lives_in_one_process_in_one_line_and_exits_2(option: str, url: str) -> None:
    # The demo's worker is another process: it would never see what these hold.
    run = demo(option, url, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert "lives inside one process, and the demo's worker is another" in run.stderr


def test_the_demo_broker_writes_a_message_where_no_consumer_reads_it_until_it_is_whole(tmp_path, monkeypatch) -> None:
    # kombu's filesystem transport creates the message file under its final name, then writes it: a
    # consumer that takes it in between reads an empty file and the worker stops (the demo's "job never
    # started" on a loaded machine). The demo's transport renames a whole file into place.
    import os
    import queue

    from kombu import Connection

    from celery_idem.demo.transport import Transport

    folder = tmp_path / "queue"
    folder.mkdir()
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder), "control_folder": str(tmp_path)}
    seen_before_rename: list[list[str]] = []
    rename = os.replace

    def watched(source: str, target: str) -> None:
        seen_before_rename.append(sorted(os.listdir(folder)))
        with Connection("filesystem://", transport=Transport, transport_options=options) as other:
            with pytest.raises(queue.Empty):
                other.default_channel._get("q")  # a consumer polling at the worst moment
        rename(source, target)

    monkeypatch.setattr(os, "replace", watched)
    with Connection("filesystem://", transport=Transport, transport_options=options) as connection:
        connection.default_channel._put("q", {"body": "x" * 100_000})
        monkeypatch.setattr(os, "replace", rename)
        assert connection.default_channel._get("q") == {"body": "x" * 100_000}
    assert len(seen_before_rename) == 1 and all(name.endswith(".tmp") for name in seen_before_rename[0])


def test_a_cleanup_step_whose_server_stopped_answering_is_given_up_and_said(monkeypatch) -> None:
    # A store on a server that stopped answering (no reply, no refusal) must not hold the demo's end:
    # signals wait while it cleans up, so every step is bounded.
    import threading

    from celery_idem.demo import harness

    monkeypatch.setattr(harness, "STEP_SECONDS", 0.3)
    hang = threading.Event()

    class SilentStore:
        def records(self, **_: Any) -> list[Any]:
            hang.wait(30)
            return []

        def close(self) -> None:
            pass

    demo = harness.Demo.__new__(harness.Demo)
    demo.prefix, demo.task_ids = "demo-abcdef", set()
    demo.wiring = {"broker": None, "backend": None, "store": "redis://silent"}
    demo.idem = type("Idem", (), {"store": SilentStore(), "settings": None})()
    demo.app = type("App", (), {"close": lambda self: None})()
    started = time.monotonic()
    removed, failed = demo.clean_up()
    hang.set()
    assert time.monotonic() - started < 5
    assert removed == [] and failed == ["its records (no answer within 0.3 s)"]
