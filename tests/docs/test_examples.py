"""The examples, run for real: the payments service (a Flask app driven in-process through its test
client, a ``celery worker`` and ``celery beat`` subprocess, PostgreSQL, RabbitMQ, Redis), the email
sender (a worker subprocess writing to a Maildir outbox), and the docker-compose file.

Side effects are counted outside the library: rows in the example's ``payments`` table, messages in
the outbox. Every run gets its own queue, key prefix and tables, and drops them afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
import yaml
from addresses import REDIS_BROKER_URL
from conftest import IN_CI, POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_server, wipe
from workers import BACKEND, wait_for

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the examples live beside the package, not inside it
    sys.path.insert(0, str(ROOT))

from celery_idem import Idempotency, store_from_url  # noqa: E402
from examples.email import tasks as email_tasks  # noqa: E402
from examples.payments import tasks as payment_tasks  # noqa: E402
from examples.payments.config import Config as PaymentsConfig  # noqa: E402
from examples.payments.web import create_app  # noqa: E402

REDIS_BROKER = REDIS_BROKER_URL
GET = 20  # seconds a test waits for an outcome

pytestmark = pytest.mark.slow


def require_rabbitmq() -> None:
    from kombu import Connection

    try:
        with Connection(RABBITMQ_URL, connect_timeout=3) as connection:
            connection.connect()
    except Exception as exc:  # noqa: BLE001 - any failure means the broker is not usable
        message = f"RabbitMQ is not reachable at {RABBITMQ_URL}: {exc}"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: servers are required)")
        pytest.skip(message)


class Process:
    """A ``celery -A <module> worker|beat`` subprocess of an example, logging to a file."""

    def __init__(self, tmp: Path, module: str, role: str, env: dict[str, str], *extra: str) -> None:
        self.log = tmp / f"{role}-{uuid.uuid4().hex[:6]}.log"
        env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "celery", "-A", module, role, "-l", "INFO", *extra]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        ready = "ready." if role == "worker" else "beat: Starting..."
        wait_for(lambda: ready in self.output() or self.process.poll() is not None, f"{role} start", 60)
        assert self.process.poll() is None, f"{role} exited:\n{self.output()}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def worker(tmp: Path, module: str, env: dict[str, str], name: str) -> Process:
    return Process(
        tmp,
        module,
        "worker",
        env,
        "-P",
        "prefork",
        "-c",
        "2",
        "-n",
        f"{name}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    )


# ---- payments -----------------------------------------------------------------------------------------


@dataclass
class Payments:
    config: PaymentsConfig
    app: Any  # the producer's Celery app
    client: Any  # the Flask test client
    engine: sa.Engine
    worker: Process

    def charge(self, key: str | None, order_id: Any, amount: Any) -> Any:
        headers = {} if key is None else {"Idempotency-Key": key}
        return self.client.post("/charges", json={"order_id": order_id, "amount": amount}, headers=headers)

    def settled(self, task_id: str) -> dict[str, Any]:
        """GET /charges/<task_id> until it is done."""

        def done() -> Any:
            body = self.client.get(f"/charges/{task_id}").get_json()
            return body if body["status"] in ("SUCCESS", "FAILURE") else None

        return wait_for(done, f"charge {task_id}", GET)

    def rows(self, **where: Any) -> list[Any]:
        table = payment_tasks.payments_table(self.config.payments_table)
        query = sa.select(table).where(*(table.c[name] == value for name, value in where.items()))
        with self.engine.connect() as connection:
            return list(connection.execute(query.order_by(table.c.id)))


@pytest.fixture(scope="module")
def payments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Payments]:
    require_server("redis")
    require_server("postgresql")
    require_rabbitmq()
    prefix = f"pay{uuid.uuid4().hex[:10]}"
    config = PaymentsConfig(
        broker_url=RABBITMQ_URL,
        result_backend=BACKEND,
        idempotency_store=REDIS_URL,
        database_url=POSTGRES_URL,
        queue=prefix,
        key_prefix=prefix,
        payments_table=f"payments_{prefix}",
        ledger_table=f"ledger_{prefix}",
        reconcile_interval_seconds=1.0,
    )
    payment_tasks.init_db(config)  # what `python -m examples.payments initdb` does
    engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
    app = payment_tasks.make_celery(config)
    started = None
    try:
        started = worker(tmp_path_factory.mktemp("payments"), "examples.payments.celery_app", config.to_env(), prefix)
        yield Payments(config, app, create_app(app).test_client(), engine, started)
    finally:
        if started is not None:
            started.stop()
        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(prefix)
        wipe(store_from_url(REDIS_URL, key_prefix=prefix), app.backend)
        payment_tasks.dispose(app)
        with engine.begin() as connection:
            connection.exec_driver_sql(f"DROP TABLE IF EXISTS {config.payments_table}, {config.ledger_table}")
        engine.dispose()


def test_a_retried_charge_is_one_payment_with_one_task_id(payments: Payments) -> None:
    key, order = f"charge-{uuid.uuid4().hex}", uuid.uuid4().hex[:12]
    # Given a charge, and the client's retry of it (same key, same body) while it is in flight
    first = payments.charge(key, order, 1999)
    again = payments.charge(key, order, 1999)
    assert first.status_code == 202 and first.get_json()["deduplicated"] is False
    task_id = first.get_json()["task_id"]
    assert again.status_code in (200, 202) and again.get_json()["task_id"] == task_id
    assert again.get_json()["deduplicated"] is True and again.headers["Idempotent-Replayed"] == "true"
    # Then GET shows the outcome, and a retry after it is done replays it (200, same task id)
    done = payments.settled(task_id)
    assert done["status"] == "SUCCESS" and done["result"]["amount"] == 1999 and done["result"]["order_id"] == order
    replayed = payments.charge(key, order, 1999)
    assert replayed.status_code == 200 and replayed.headers["Location"] == f"/charges/{task_id}"
    assert replayed.get_json()["task_id"] == task_id and replayed.get_json()["result"] == done["result"]
    # and PostgreSQL holds one payment, carrying the key it would send to the card processor
    (row,) = payments.rows(order_id=order)
    assert (row.amount, row.provider_idempotency_key, row.task_id) == (1999, key, task_id)
    assert row.id == done["result"]["payment_id"]


def test_the_same_key_with_another_amount_is_refused_with_422(payments: Payments) -> None:
    key, order = f"charge-{uuid.uuid4().hex}", str(uuid.uuid4().int % 10**9)
    first = payments.charge(key, order, 500)
    assert first.status_code == 202
    # Refused while the first is in flight, and after it is done
    assert payments.charge(key, order, 501).status_code == 422
    payments.settled(first.get_json()["task_id"])
    same = payments.charge(key, int(order), 500)  # 42 and "42" are one order: a duplicate, not a mismatch
    assert same.status_code == 200 and same.get_json()["task_id"] == first.get_json()["task_id"]
    mismatch = payments.charge(key, order, 5000)
    assert mismatch.status_code == 422 and mismatch.get_json()["error"] == "idempotency_key_reused"
    assert [row.amount for row in payments.rows(order_id=order)] == [500]


def test_a_missing_or_malformed_key_or_body_is_a_400_and_charges_nothing(payments: Payments) -> None:
    order = uuid.uuid4().hex[:12]
    for key, error in [
        (None, "missing_idempotency_key"),
        ("two words", "invalid_idempotency_key"),
        ("k" * 256, "invalid_idempotency_key"),
        ("", "invalid_idempotency_key"),
    ]:
        answer = payments.charge(key, order, 100)
        assert (answer.status_code, answer.get_json()["error"]) == (400, error), key
    for amount in (0, -5, "100", True, None):
        assert payments.charge(f"k-{uuid.uuid4().hex}", order, amount).status_code == 400
    assert payments.client.post("/charges", data="nope", headers={"Idempotency-Key": "k-x"}).status_code == 400
    assert payments.client.get("/charges/not-a-task-id").status_code == 404
    assert payments.rows(order_id=order) == []


def test_the_ledger_keeps_one_payment_when_the_store_forgot_the_key(payments: Payments) -> None:
    key, order = f"charge-{uuid.uuid4().hex}", uuid.uuid4().hex[:12]
    first = payments.settled(payments.charge(key, order, 750).get_json()["task_id"])
    # When the idempotency store loses the record (evicted, flushed, forgotten by an operator)
    assert Idempotency.of(payments.app).forget(payment_tasks.CHARGE, key)
    # Then the retry runs a new task, but the ledger in PostgreSQL answers with the committed payment
    retry = payments.charge(key, order, 750)
    assert retry.status_code == 202 and retry.get_json()["deduplicated"] is False
    assert retry.get_json()["task_id"] != first["task_id"]
    assert payments.settled(retry.get_json()["task_id"])["result"] == first["result"]
    # and a copy of the message sent by name, without the producer-side check, is replayed too
    by_name = payments.app.send_task(payment_tasks.CHARGE, (order, 750), headers={"idempotency_key": key})
    assert by_name.get(timeout=GET) == first["result"]
    assert len(payments.rows(order_id=order)) == 1


def test_beat_runs_the_reconciler_on_the_worker(payments: Payments, tmp_path: Path) -> None:
    schedule = payments.app.conf.beat_schedule["celery-idem-reconcile"]
    assert (schedule["task"], schedule["schedule"]) == ("celery_idem.reconcile", 1.0)
    beat = Process(
        tmp_path,
        "examples.payments.celery_app",
        "beat",
        payments.config.to_env(),
        "-s",
        str(tmp_path / "beat-schedule"),
    )
    try:
        wait_for(
            lambda: re.search(r"Task celery_idem\.reconcile\[[^]]+\] succeeded", payments.worker.output()),
            "a reconciler run from beat",
            GET,
        )
    finally:
        beat.stop()


# ---- email --------------------------------------------------------------------------------------------


@pytest.fixture
def mailer(tmp_path: Path) -> Iterator[tuple[Any, email_tasks.Config, Process]]:
    require_server("redis")
    prefix = f"mail{uuid.uuid4().hex[:10]}"
    config = email_tasks.Config(
        broker_url=REDIS_BROKER,
        result_backend=BACKEND,
        idempotency_store=REDIS_URL,
        queue=prefix,
        key_prefix=prefix,
        outbox=str(tmp_path / "outbox"),
    )
    app = email_tasks.make_celery(config)
    started = None
    try:
        started = worker(tmp_path, "examples.email.celery_app", config.to_env(), prefix)
        yield app, config, started
    finally:
        if started is not None:
            started.stop()
        wipe(store_from_url(REDIS_URL, key_prefix=prefix), app.backend)
        email_tasks.dispose(app)


def _sent(config: email_tasks.Config, order_id: str) -> list[Any]:
    outbox = email_tasks.open_outbox(config.outbox)
    return [message for message in outbox if message["Subject"] == f"Your receipt for order {order_id}"]


def test_a_duplicated_or_redelivered_receipt_is_one_email(mailer: tuple[Any, email_tasks.Config, Process]) -> None:
    app, config, running = mailer
    send_receipt = app.tasks[email_tasks.SEND_RECEIPT]
    # A duplicated call (any address: one receipt per order) is not even published
    first = send_receipt.delay("1001", "alice@example.com")
    again = send_receipt.delay("1001", "alice+retry@example.com")
    assert again.deduplicated and again.id == first.id
    outcome = first.get(timeout=GET)
    assert again.get(timeout=GET) == outcome and outcome["to"] == "alice@example.com"
    (message,) = _sent(config, "1001")
    assert message["Message-ID"] == outcome["message_id"] == f"<{first.idempotency_key}@receipts.example.com>"

    # One message delivered twice (plain send_task: no producer-side check), as a broker redelivers
    task_id = str(uuid.uuid4())
    for _ in range(2):
        app.send_task(email_tasks.SEND_RECEIPT, ("1002", "bob@example.com"), task_id=task_id)
    # The first delivery sends the email; the copy of its task id ends quietly (one answer per task id)
    wait_for(lambda: running.output().count(f"[{task_id}] ignored") == 1, "both deliveries", GET)
    assert running.output().count(f"[{task_id}] succeeded") == 1
    # and three copies sent by name at once, racing on the worker's two processes
    copies = [app.send_task(email_tasks.SEND_RECEIPT, ("1003", "carol@example.com")) for _ in range(3)]
    assert len({copy.get(timeout=GET)["outbox_key"] for copy in copies}) == 1
    assert len(_sent(config, "1002")) == 1 and len(_sent(config, "1003")) == 1
    assert len(email_tasks.open_outbox(config.outbox)) == 3


# ---- docker-compose.yml ---------------------------------------------------------------------------------

COMPOSE = ROOT / "docker-compose.yml"


def _module_exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return command.split() if isinstance(command, str) else [str(part) for part in command]


def test_the_compose_file_hangs_together() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, Any] = compose["services"]
    assert {"redis", "rabbitmq", "postgres", "worker", "beat", "web"} <= set(services)
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        depends = service.get("depends_on") or []
        assert set(depends) <= set(services), f"{name} depends on {set(depends) - set(services)}"
        build = service.get("build")
        if build:
            context = ROOT / build.get("context", ".")
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), name
            for line in dockerfile.read_text().splitlines():  # everything the image copies exists
                if line.startswith("COPY "):
                    for source in line.split()[1:-1]:
                        assert (context / source).exists(), f"{dockerfile.name}: {line}"
        for value in (service.get("environment") or {}).values():
            url = urlsplit(str(value))
            if url.scheme and url.hostname:
                assert url.hostname in services, f"{name}: {value} names no compose service"
    for name in ("redis", "rabbitmq", "postgres", "worker", "web"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    # The worker and beat load the payments app; beat with the reconciler every 60 s
    for name, role in (("worker", "worker"), ("beat", "beat")):
        command = _command(services[name])
        module = command[command.index("-A") + 1]
        assert role in command and _module_exists(module), f"{name}: {command}"
    assert services["beat"]["environment"]["PAYMENTS_RECONCILE_INTERVAL_SECONDS"] in ("60", 60)
    web = _command(services["web"])
    app_module = next(part for part in web if ":create_app" in part).split(":")[0]
    assert _module_exists(app_module), web
    migrate = _command(services["migrate"])
    assert _module_exists(migrate[migrate.index("-m") + 1]), migrate
    # Every variable the services set is one the example reads
    known = set(PaymentsConfig().to_env())
    for name, service in services.items():
        for variable in service.get("environment") or {}:
            assert not variable.startswith("PAYMENTS_") or variable in known, f"{name}: {variable}"


def _compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_accepts_the_file() -> None:
    client = _compose_client()
    if client is None:
        pytest.skip("no docker compose client (docker compose plugin or docker-compose) on this machine")
    checked = subprocess.run(
        [*client, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert checked.returncode == 0, checked.stderr
