"""``celery-idem demo`` end to end: its exit code is its verdict, on the embedded default and on the
real servers users point it at; it refuses in one line, exit 2, when it cannot start; it leaves
nothing behind on those servers."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import pytest
import redis
import sqlalchemy as sa
from addresses import REDIS_DEMO_BACKEND_URL, REDIS_DEMO_BROKER_URL
from conftest import POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_rabbitmq, require_server

pytestmark = pytest.mark.slow

WIRINGS = {
    "embedded": [],
    "redis": ["--broker", REDIS_DEMO_BROKER_URL, "--backend", REDIS_DEMO_BACKEND_URL, "--store", REDIS_URL],
    "rabbitmq": ["--broker", RABBITMQ_URL, "--backend", REDIS_DEMO_BACKEND_URL],
    "postgresql": ["--store", POSTGRES_URL],
}
SCENARIOS = (
    "storm of duplicate calls",
    "payload mismatch refused",
    "final failure replayed",
    "retryable failure retried",
    "worker killed mid-job",
    "worker killed after the payment",
)


def demo(*args: str, timeout: float = 240, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *python, "-m", "celery_idem", "demo", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A schema of the test's own: the demo's store creates its tables there, and they go with it."""
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wiring", sorted(WIRINGS))
def test_the_demo_shows_every_guarantee_and_leaves_nothing_behind(wiring: str, tmp_path, request) -> None:
    args = list(WIRINGS[wiring])
    if wiring in ("redis", "rabbitmq"):
        require_server("redis")
    if wiring == "rabbitmq":
        require_rabbitmq()
    if wiring == "postgresql":
        schema = request.getfixturevalue("pg_schema")
        separator = "&" if "?" in POSTGRES_URL else "?"
        args[1] = f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    before = redis_keys() if wiring in ("redis", "rabbitmq") else set()
    run = demo("--workdir", str(tmp_path), *args)
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
    if wiring in ("redis", "rabbitmq"):
        # Its records, results and queue (and the killed workers' unacked copies) are gone.
        assert redis_keys() - before == set()
    if wiring == "postgresql":
        engine = sa.create_engine(POSTGRES_URL)
        with engine.connect() as connection:
            left = connection.execute(sa.text(f"SELECT count(*) FROM {schema}.celery_idem_records")).scalar_one()
        engine.dispose()
        assert left == 0


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
