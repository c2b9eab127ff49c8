"""docker-compose.yml's own services, run from the file without a container engine.

``test_the_compose_file_hangs_together`` (test_examples.py) and ``docker compose config -q`` only read
the file. Here its own services, those it ``build``s from docker/Dockerfile (``migrate``, ``worker``,
``beat``, ``web``), run natively: each service's ``command`` and ``environment`` are read from the
file (``yaml.safe_load``, so its ``<<`` merge keys resolve, then compose's ``$$`` / ``${NAME:-default}``
interpolation), started in the order its ``depends_on`` gives (``migrate`` runs to exit 0 first), each
with its own healthcheck run until it passes; then the charge the file's header comment shows
(``curl -X POST localhost:8000/charges -H 'Idempotency-Key: ...' -d ...``) goes through ``web``,
completes on ``worker`` (one row in the ``payments`` table, counted in PostgreSQL) and is replayed
(same answer, still one row), and ``beat`` sends ``celery-idem-reconcile``, which ``worker`` runs.

Everything comes from the file verbatim, except what a container gives that a shared machine does not.
Rewritten, and why:

- **Server addresses.** ``redis``, ``rabbitmq`` and ``postgres`` are compose service names that resolve
  only on compose's network: every URL naming one gets the host, port and credentials of the machine's
  server (tests/addresses.py, from the ``CELERY_IDEM_TEST_*`` variables) and, for isolation, a
  database of its own: PostgreSQL's ``payments`` becomes a database this test creates and drops; RabbitMQ's
  vhost ``/`` becomes a vhost it creates and deletes (``rabbitmqctl`` on a loopback server, else the
  management API on port 15672; where neither can, the server's vhost stays and ``PAYMENTS_QUEUE`` is
  added, a queue of the test's own, deleted at the end); Redis's ``/1`` (result backend) and ``/2``
  (idempotency store) become the backend and store databases of addresses.py. The scheme, the query and
  every other variable stay. Before rewriting, each URL is held to the file's own server: its port is
  one the server's service maps, its credentials and database the ones that service's environment sets.
- **Added variables.** ``PAYMENTS_KEY_PREFIX`` (the store's key prefix, which the file leaves at the
  default ``idem``): a prefix of the test's own, whose records are removed at the end (never a FLUSHDB).
  The results the worker wrote to the backend are removed by task id.
- **``PAYMENTS_RECONCILE_INTERVAL_SECONDS``**: the file's 60 becomes 2 (after checking it is a positive
  number), because beat sends its first run one interval after it starts: 60 s would be the test's
  whole budget.
- **beat's ``-s /tmp/celerybeat-schedule``**: a file in the test's tmp directory; the container's /tmp
  is its own, the machine's is shared. The file's path must be under /tmp (the image's user ``app``
  cannot write /app).
- **web's ``-b 0.0.0.0:8000``** becomes ``127.0.0.1:<a free port>``, and the healthcheck's URL follows
  it: port 8000 may be taken here, and a test listens on loopback only. Before that, the file's bind is
  held to every interface (a published port reaches nothing else), on the port its ``ports`` publishes
  and its healthcheck asks.
- **The image.** The commands (``python``, ``celery``, ``gunicorn``) are this interpreter's (the venv
  of ``pip install -e ".[dev]"``, which has what the image installs: ``.[redis,sql]`` and
  examples/requirements.txt), run in the repository root with the Dockerfile's ``ENV`` (its
  ``WORKDIR`` /app is where the image copies the repository: read as the root) and ``HOSTNAME`` set to
  the host name, as Docker sets it to the container's (the worker's healthcheck addresses
  ``payments@$HOSTNAME``, the name ``-n payments@%h`` gives it), and ``HOME`` a directory of each
  service's own, as the image's user ``app`` has ``/home/app`` (gunicorn keeps its control socket
  there). ``PAYMENTS_*`` and ``DJANGO_SETTINGS_MODULE`` of the caller's shell are dropped (a container
  has neither).

A service the file builds that the test does not know how to check, a service key it does not know how
to run (``entrypoint``, ``env_file``, ``volumes``, ...), a URL naming no server, or an interpolation it
cannot resolve fails the test: the file and this test cannot drift apart. Not covered, with no container
engine: building the image, running as its user ``app``, compose's network, ``restart`` policies and the
servers' own images and healthchecks (the machine's servers stand in, checked by ``require_server``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import pytest
import redis
import sqlalchemy as sa
import yaml
from addresses import POSTGRES_URL, RABBITMQ_URL, REDIS_BACKEND_URL, REDIS_URL
from conftest import require_rabbitmq, require_server, wipe
from services import free_port
from workers import wait_for

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the examples live beside the package, not inside it
    sys.path.insert(0, str(ROOT))

from celery_idem import store_from_url  # noqa: E402
from examples.payments.config import Config  # noqa: E402

COMPOSE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent  # the image's python, celery and gunicorn: this venv's
UP = 45  # seconds the stack has to come up
GET = 20  # seconds a charge has to complete

# The services the file builds, and what the test checks of each once the stack is up. A service the
# file builds that is not here fails the test: say here how to check it, and check it below.
CHECKED = {
    "migrate": "exits 0, the payments and ledger tables made",
    "worker": "healthy; runs the charge once, and the reconciler beat sends",
    "beat": "sends celery-idem-reconcile",
    "web": "healthy; takes the header's charge, replays it",
}
# The service keys the test knows how to run natively. Any other (entrypoint, env_file, volumes, user,
# working_dir, ...) changes what runs in the container: the test refuses it until it is taught.
RUNNABLE = {"build", "image", "command", "environment", "depends_on", "healthcheck", "ports", "restart"}
SERVERS = ("redis", "rabbitmq", "postgres")  # the file's servers: the machine's stand in
# Which of the machine's Redis databases each of the file's Redis URLs becomes.
REDIS_FOR = {"PAYMENTS_RESULT_BACKEND": REDIS_BACKEND_URL, "PAYMENTS_IDEMPOTENCY_STORE": REDIS_URL}
RECONCILE = "PAYMENTS_RECONCILE_INTERVAL_SECONDS"
RECONCILE_EVERY = "2"  # seconds, instead of the file's 60 (docstring)


# ---- reading the file ---------------------------------------------------------------------------------

_DOLLAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<bare>\w+))")


def interpolate(value: str) -> str:
    """Compose's interpolation: ``$$`` is ``$``; ``${NAME:-default}`` / ``${NAME-default}`` the default
    (the test runs the file as a plain ``docker compose up``, with no variables set). Anything else
    would depend on the caller's shell: refused."""

    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        default = re.fullmatch(r"\w+:?-(.*)", match["braced"] or "")
        assert default, f"{value!r}: the test resolves $$ and ${{NAME:-default}} only, not {match[0]!r}"
        return default[1]

    return _DOLLAR.sub(one, value)


def duration(text: Any) -> float:
    """A compose duration (``1m30s``, ``5s``, ``500ms``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"not a compose duration: {text!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert command, "a service the file builds runs the command the file gives it (the image's CMD is the worker)"
    parts = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
    return [interpolate(part) for part in parts]


def _environment(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    unset = [name for name, value in raw.items() if value is None]
    assert not unset, f"{unset}: taken from the caller's shell, so the file alone does not say what runs"
    return {str(name): interpolate(str(value)) for name, value in raw.items()}


def _depends_on(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("depends_on") or {}
    if isinstance(raw, list):
        return {name: "service_started" for name in raw}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in raw.items()}


def _container_ports(service: dict[str, Any]) -> set[int]:
    """The container side of ``ports`` (``"${WEB_PORT:-8000}:8000"``, ``"5672"``)."""
    return {int(interpolate(str(port)).split(":")[-1].split("/")[0]) for port in service.get("ports") or []}


def _host_ports(service: dict[str, Any]) -> set[int]:
    return {int(interpolate(str(port)).split(":")[-2]) for port in service.get("ports") or [] if ":" in str(port)}


def image(service: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The ``ENV`` and ``WORKDIR`` of the Dockerfile the service builds."""
    build = service["build"]
    context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
    dockerfile = context / ("Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile"))
    env: dict[str, str] = {}
    workdir = "/"
    for line in re.sub(r"\\\n", " ", dockerfile.read_text()).splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() == "WORKDIR":
            workdir = rest.strip()
        elif instruction.upper() == "ENV":
            words = shlex.split(rest)
            assert all("=" in word for word in words), f"{dockerfile.name}: ENV NAME=value only: {line}"
            env.update(word.split("=", 1) for word in words)
    return env, workdir


def header_charge() -> tuple[str, str, dict[str, str], bytes]:
    """The request the file's header comment shows: method, URL, headers, body."""
    header = []
    for line in COMPOSE.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:])
    curl = next((line for line in "\n".join(header).replace("\\\n", " ").splitlines() if "curl " in line), None)
    assert curl, "docker-compose.yml's header comment shows a charge with curl: the test sends that one"
    words = iter(shlex.split(curl.split("curl ", 1)[1]))
    method, url, headers, body = "GET", "", {}, b""
    for word in words:
        if word == "-X":
            method = next(words)
        elif word == "-H":
            name, _, value = next(words).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            method, body = ("POST" if method == "GET" else method), next(words).encode()
        elif word != "-i":
            assert not word.startswith("-"), f"the test does not know curl's {word} (header comment: {curl})"
            url = word if "://" in word else f"http://{word}"
    return method, url, headers, body


# ---- what runs natively -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Own:
    """What this run has to itself on the machine's servers."""

    database: str  # a PostgreSQL database instead of the file's `payments`, created and dropped
    vhost: str | None  # a RabbitMQ vhost, created and deleted; None: the server's, and a queue of our own
    prefix: str  # the idempotency records' key prefix (and the queue when vhost is None)
    web_port: int
    tmp: Path


@dataclasses.dataclass
class Service:
    """One of the file's services as the test runs it."""

    name: str
    command: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None
    health_timeout: float
    depends_on: dict[str, str]  # service -> condition
    one_shot: bool  # another service waits for it to exit 0 (service_completed_successfully)


def _server_accepts(variable: str, url: Any, servers: dict[str, Any]) -> None:
    """The file's URL reaches its server: a port the service maps, the credentials its environment sets."""
    host = url.hostname
    assert host in SERVERS, f"{variable}: {host} is none of the file's servers {SERVERS}: where would it run here?"
    server = servers[host]
    assert url.port in _container_ports(server), f"{variable}: {host} serves {_container_ports(server)}"
    env = _environment(server)
    if host == "postgres":
        user = env.get("POSTGRES_USER", "postgres")
        database = url.path.lstrip("/")
        assert (url.username, url.password) == (user, env.get("POSTGRES_PASSWORD")), variable
        assert database == env.get("POSTGRES_DB", user), f"{variable}: postgres makes {env.get('POSTGRES_DB')}"
    elif host == "rabbitmq":
        user = (env.get("RABBITMQ_DEFAULT_USER", "guest"), env.get("RABBITMQ_DEFAULT_PASS", "guest"))
        assert (url.username, url.password) == user, variable
        assert unquote(url.path[1:]) == env.get("RABBITMQ_DEFAULT_VHOST", "/"), f"{variable}: vhost {url.path}"


def on_machine(variable: str, value: str, own: Own, servers: dict[str, Any]) -> str:
    """``value`` with the machine's server in place of the file's (docstring); anything else unchanged."""
    url = urlsplit(value)
    if not (url.scheme and url.hostname):
        return value
    _server_accepts(variable, url, servers)
    if url.hostname == "postgres":
        machine, path = POSTGRES_URL, "/" + own.database
    elif url.hostname == "rabbitmq":
        machine = _vhost_url(own.vhost)
        path = urlsplit(machine).path
    else:
        assert variable in REDIS_FOR, f"{variable}: which of the machine's Redis databases is it? (REDIS_FOR)"
        machine = REDIS_FOR[variable]
        path = urlsplit(machine).path
    return urlunsplit((url.scheme, urlsplit(machine).netloc, path, url.query, url.fragment))


def _option(command: list[str], *names: str) -> int:
    """The index of the value of the one option of ``names`` in ``command`` (``-b X``, ``--bind X``)."""
    found = [i for i, word in enumerate(command) if word in names]
    assert len(found) == 1 and found[0] + 1 < len(command), f"{command}: one {'/'.join(names)} with a value"
    return found[0] + 1


def _natively(name: str, service: dict[str, Any], command: list[str], health: list[str] | None, own: Own) -> None:
    """Rewrite, in place, what of the command and healthcheck cannot run as it is here (docstring)."""
    if command[0] == "gunicorn":
        at = _option(command, "-b", "--bind")
        host, _, port = command[at].rpartition(":")
        # Published ports reach a container's interfaces, not its loopback
        assert host == "0.0.0.0", f"{name}: gunicorn binds {command[at]}: the published port would reach nothing"
        assert int(port) in _container_ports(service), f"{name}: binds {port}, publishes {service.get('ports')}"
        command[at] = f"127.0.0.1:{own.web_port}"
        asked = [i for i, word in enumerate(health or []) if re.search(rf"(127\.0\.0\.1|localhost):{port}\b", word)]
        assert asked, f"{name}: its healthcheck should ask the port gunicorn binds, {port}: {health}"
        for i in asked:
            assert health is not None
            health[i] = re.sub(rf"(127\.0\.0\.1|localhost):{port}\b", f"127.0.0.1:{own.web_port}", health[i])
    elif command[:1] == ["celery"] and "beat" in command:
        at = _option(command, "-s", "--schedule")
        assert command[at].startswith("/tmp/"), f"{name}: the schedule file {command[at]}: /app is not the user's"
        command[at] = str(own.tmp / Path(command[at]).name)


def plan(compose: dict[str, Any], own: Own) -> list[Service]:
    """The file's own services as they run natively, in the order ``depends_on`` starts them."""
    services: dict[str, Any] = compose["services"]
    built = [name for name, service in services.items() if service.get("build")]
    unknown, gone = set(built) - set(CHECKED), set(CHECKED) - set(built)
    assert not unknown, f"the file builds {sorted(unknown)}, which this test does not check: teach it (CHECKED)"
    assert not gone, f"the file no longer builds {sorted(gone)}: take them out of CHECKED"
    base = {name: value for name, value in os.environ.items() if not name.startswith("PAYMENTS_")}
    base.pop("PYTHONPATH", None)  # the image's ENV sets it
    base.pop("DJANGO_SETTINGS_MODULE", None)  # Celery's Django fixup would load it
    plans: dict[str, Service] = {}
    for name in built:
        service = services[name]
        extra = set(service) - RUNNABLE
        assert not extra, f"{name}: the test does not know how to run {sorted(extra)} natively: teach it"
        image_env, workdir = image(service)
        env = {**base, **{key: _in_repo(value, workdir) for key, value in image_env.items()}}
        home = own.tmp / f"home-{name}"  # the image's user has a home of its own (gunicorn keeps a socket there)
        path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
        env.update(HOSTNAME=socket.gethostname(), PATH=path, HOME=str(home))
        file_env = _environment(service)
        env.update({variable: on_machine(variable, value, own, services) for variable, value in file_env.items()})
        added = {"PAYMENTS_KEY_PREFIX": own.prefix, **({} if own.vhost else {"PAYMENTS_QUEUE": own.prefix})}
        assert not set(added) & set(file_env), f"{name}: the file sets {set(added) & set(file_env)} now (docstring)"
        env.update(added)
        if RECONCILE in file_env:
            assert float(file_env[RECONCILE]) > 0, f"{name}: {RECONCILE}={file_env[RECONCILE]}"
            env[RECONCILE] = RECONCILE_EVERY
        command = _command(service)
        assert shutil.which(command[0], path=env["PATH"]), f"{name}: {command[0]} is not installed here"
        health, timeout = _healthcheck(service)
        _natively(name, service, command, health, own)
        one_shot = any(_depends_on(other).get(name) == "service_completed_successfully" for other in services.values())
        plans[name] = Service(name, command, env, health, timeout, _depends_on(service), one_shot)
    assert RECONCILE in _environment(services["beat"]), f"beat runs the reconciler only with {RECONCILE} set"
    ordered: list[Service] = []

    def visit(name: str, path: tuple[str, ...] = ()) -> None:
        assert name not in path, f"depends_on loops: {' -> '.join((*path, name))}"
        if name in plans and plans[name] not in ordered:
            for dependency in plans[name].depends_on:
                assert dependency in services, f"{name} depends on {dependency}, which the file does not have"
                visit(dependency, (*path, name))
            ordered.append(plans[name])

    for name in built:
        visit(name)
    return ordered


def _in_repo(value: str, workdir: str) -> str:
    """A path in the image's WORKDIR (where it copies the repository) as the same path in the repository."""
    if value == workdir or value.startswith(workdir.rstrip("/") + "/"):
        return str(ROOT) + value[len(workdir.rstrip("/")) :]
    return value


def _healthcheck(service: dict[str, Any]) -> tuple[list[str] | None, float]:
    check = service.get("healthcheck")
    if not check or check.get("disable"):
        return None, 0.0
    test = check["test"]
    kind, *rest = ["CMD-SHELL", test] if isinstance(test, str) else [str(word) for word in test]
    assert kind in ("CMD", "CMD-SHELL", "NONE"), f"healthcheck {test}"
    if kind == "NONE":
        return None, 0.0
    argv = ["/bin/sh", "-c", interpolate(rest[0])] if kind == "CMD-SHELL" else [interpolate(word) for word in rest]
    return argv, duration(check.get("timeout", "30s"))


# ---- the machine's servers, isolated -----------------------------------------------------------------


def _rabbitmq_api(method: str, path: str, body: dict[str, str] | None = None) -> bool:
    """The management API of the broker's host (port 15672), with the broker URL's credentials."""
    server = urlsplit(RABBITMQ_URL)
    login = f"{unquote(server.username or 'guest')}:{unquote(server.password or 'guest')}"
    request = urllib.request.Request(
        f"http://{server.hostname}:15672/api/{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={
            "Authorization": "Basic " + base64.b64encode(login.encode()).decode(),
            "content-type": "application/json",
        },
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=3) as answer:
            return bool(200 <= answer.status < 300)
    except (OSError, urllib.error.URLError):
        return False


def _rabbitmqctl(*args: str) -> bool:
    """``rabbitmqctl`` on the local node: only when the broker is on this machine's loopback."""
    if urlsplit(RABBITMQ_URL).hostname not in ("127.0.0.1", "localhost", "::1") or not shutil.which("rabbitmqctl"):
        return False
    try:
        return subprocess.run(["rabbitmqctl", *args], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _vhost_url(vhost: str | None) -> str:
    """The machine's broker URL, on ``vhost`` (None: the URL's own)."""
    server = urlsplit(RABBITMQ_URL)
    path = "/" + quote(vhost, safe="") if vhost else server.path
    return urlunsplit((server.scheme, server.netloc, path, server.query, ""))


def _make_vhost(name: str) -> str | None:
    """A vhost of this run's own, reachable with the broker URL's user; None where none can be made."""
    from kombu import Connection

    user = unquote(urlsplit(RABBITMQ_URL).username or "guest")
    made = _rabbitmqctl("add_vhost", name) and _rabbitmqctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
    if not made:
        made = _rabbitmq_api("PUT", f"vhosts/{quote(name, safe='')}") and _rabbitmq_api(
            "PUT",
            f"permissions/{quote(name, safe='')}/{quote(user, safe='')}",
            {"configure": ".*", "write": ".*", "read": ".*"},
        )
    if made:
        try:
            with Connection(_vhost_url(name), connect_timeout=3) as connection:
                connection.connect()
            return name
        except Exception:  # noqa: BLE001 - made on another node than the one the URL reaches
            _drop_vhost(name)
    return None


def _drop_vhost(name: str) -> None:
    if not _rabbitmqctl("delete_vhost", name):
        _rabbitmq_api("DELETE", f"vhosts/{quote(name, safe='')}")


@contextlib.contextmanager
def isolated(tmp: Path) -> Iterator[Own]:
    """A PostgreSQL database, a RabbitMQ vhost (or queue) and a store prefix of this run's own, removed after."""
    from kombu import Connection

    token = uuid.uuid4().hex[:10]
    own = Own(f"compose_{token}", None, f"compose{token}", free_port(), tmp)
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{own.database}"')
        own = dataclasses.replace(own, vhost=_make_vhost(f"compose-{token}"))
        if own.vhost is None:
            print(f"no vhost of its own (neither rabbitmqctl nor the management API): queue {own.prefix}")
        yield own
    finally:
        if own.vhost:
            _drop_vhost(own.vhost)
        else:  # the queue, and the exchange Celery names after the default queue
            with Connection(RABBITMQ_URL, connect_timeout=3) as connection:
                connection.default_channel.queue_delete(own.prefix)
                connection.default_channel.exchange_delete(own.prefix)
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{own.database}" WITH (FORCE)')
        admin.dispose()
        wipe(store_from_url(REDIS_URL, key_prefix=own.prefix))


# ---- the stack ----------------------------------------------------------------------------------------


class Stack:
    """The file's services as processes (a process group each, logging to a file), in compose's order."""

    def __init__(self, services: list[Service], tmp: Path) -> None:
        self.services = {service.name: service for service in services}
        self.tmp = tmp
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.ready: set[str] = set()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        self.down()
        if error is not None:
            for name in self.processes:
                print(f"---- {name}: {' '.join(self.services[name].command)}\n{self.log(name)[-6000:]}")
        self._remove_results()

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def up(self) -> None:
        """Start every service once what it depends on is as its condition says; then wait for each."""
        for service in self.services.values():
            for dependency, condition in service.depends_on.items():
                if dependency not in self.services:
                    continue  # a server: the machine's, which require_server checked
                assert condition in ("service_started", "service_healthy", "service_completed_successfully")
                if condition == "service_completed_successfully":
                    self.completed(dependency)
                elif condition == "service_healthy":
                    self.healthy(dependency)
            self.start(service)
        for name, service in self.services.items():
            if service.one_shot:
                self.completed(name)
            elif service.healthcheck:
                self.healthy(name)
            else:  # beat: the file gives it no healthcheck; the test checks what it sends
                assert self.processes[name].poll() is None, f"{name} exited {self.processes[name].returncode}"

    def start(self, service: Service) -> None:
        Path(service.env["HOME"]).mkdir(exist_ok=True)
        with (self.tmp / f"{service.name}.log").open("wb") as out:
            self.processes[service.name] = subprocess.Popen(
                service.command,
                cwd=ROOT,
                env=service.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def completed(self, name: str) -> None:
        """A one-shot service ran to exit 0 (``service_completed_successfully``)."""
        try:
            code = self.processes[name].wait(timeout=UP)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not finish within {UP}s") from None
        assert code == 0, f"{name} exited {code}"
        self.ready.add(name)

    def healthy(self, name: str) -> None:
        """The service's own healthcheck passes (``service_healthy``); it is run until it does."""
        if name in self.ready:
            return
        service, deadline, answer = self.services[name], time.monotonic() + UP, "not run"
        assert service.healthcheck, f"{name}: something waits for it to be healthy, and it has no healthcheck"
        while time.monotonic() < deadline:
            assert self.processes[name].poll() is None, f"{name} exited {self.processes[name].returncode}"
            try:
                check = subprocess.run(
                    service.healthcheck,
                    cwd=ROOT,
                    env=service.env,
                    capture_output=True,
                    text=True,
                    timeout=service.health_timeout,
                )
            except subprocess.TimeoutExpired:
                answer = f"timed out after the file's {service.health_timeout}s"
            else:
                if check.returncode == 0:
                    self.ready.add(name)
                    return
                answer = f"exit {check.returncode}: {check.stdout[-500:]}{check.stderr[-1500:]}"
            time.sleep(0.5)
        raise AssertionError(f"{name}'s healthcheck {service.healthcheck} did not pass within {UP}s: {answer}")

    def down(self) -> None:
        """SIGTERM to every process group, SIGKILL to whatever of a group is left 20 s later."""
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # a child the leader left behind
            process.wait(timeout=10)

    def _remove_results(self) -> None:
        """The result backend's records of every task the worker received (the store's go with the prefix)."""
        if "worker" not in self.processes:
            return
        task_ids = set(re.findall(r"Task [\w.]+\[([0-9a-f-]{36})\] received", self.log("worker")))
        backend = redis.Redis.from_url(REDIS_BACKEND_URL)
        try:
            if task_ids:
                backend.delete(*(f"celery-task-meta-{task_id}" for task_id in task_ids))
        finally:
            backend.close()


def http(method: str, url: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> Any:
    """``(status, headers, JSON body)`` of one request."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.headers, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers, json.loads(error.read() or b"null")


def payments(env: dict[str, str]) -> list[Any]:
    """The rows of the payments table, read straight from PostgreSQL."""
    config = Config.from_env(env)  # the example's own reading of the service's environment
    engine = sa.create_engine(config.database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            return list(connection.execute(sa.text(f"SELECT * FROM {config.payments_table} ORDER BY id")))
    finally:
        engine.dispose()


# ---- the tests ----------------------------------------------------------------------------------------


def test_every_service_the_file_builds_is_run_as_the_docstring_says(tmp_path: Path) -> None:
    # No servers needed: what the slow test below would run, rewritten as its docstring says
    own = Own("compose_db", "compose-vhost", "composeprefix", 18000, tmp_path)
    services = {service.name: service for service in plan(yaml.safe_load(COMPOSE.read_text()), own)}
    assert list(services) == ["migrate", "worker", "beat", "web"]  # migrate first: worker waits for it
    assert services["worker"].depends_on["migrate"] == "service_completed_successfully"
    for service in services.values():
        urls = [urlsplit(value) for value in service.env.values() if "://" in value]
        assert not [url for url in urls if url.hostname in SERVERS], service.name
        assert service.env["PAYMENTS_DATABASE_URL"].endswith("/compose_db")
        assert service.env["PAYMENTS_BROKER_URL"].endswith("/compose-vhost")
        assert service.env["PAYMENTS_KEY_PREFIX"] == "composeprefix" and "PAYMENTS_QUEUE" not in service.env
    assert "127.0.0.1:18000" in services["web"].command and "127.0.0.1:18000" in " ".join(
        services["web"].healthcheck or []
    )
    assert str(tmp_path / "celerybeat-schedule") in services["beat"].command
    # The charge of the header comment goes to the port web publishes
    method, url, headers, body = header_charge()
    assert (method, urlsplit(url).path) == ("POST", "/charges") and headers.get("Idempotency-Key"), url
    assert urlsplit(url).port in _host_ports(yaml.safe_load(COMPOSE.read_text())["services"]["web"]), url
    json.loads(body)


@pytest.mark.slow
def test_the_compose_services_run_from_the_file_and_charge_once(tmp_path: Path) -> None:
    require_server("redis")
    require_server("postgresql")
    require_rabbitmq()
    compose = yaml.safe_load(COMPOSE.read_text())
    with isolated(tmp_path) as own, Stack(plan(compose, own), tmp_path) as stack:
        # Given the services, started as depends_on says, each healthy by its own healthcheck
        stack.up()
        config = Config.from_env(stack.services["migrate"].env)
        tables = sa.inspect(engine := sa.create_engine(config.database_url, poolclass=sa.pool.NullPool))
        assert {config.payments_table, config.ledger_table} <= set(tables.get_table_names())
        engine.dispose()

        # When the header comment's charge is sent to web
        method, url, headers, body = header_charge()
        web = f"http://127.0.0.1:{own.web_port}"
        status, answer, first = http(method, web + urlsplit(url).path, headers, body)
        assert (status, first["deduplicated"]) == (202, False), first
        task_id = first["task_id"]

        # Then it completes on the worker (polled as the API says: GET its Location), one row in PostgreSQL
        def settled() -> Any:
            done = http("GET", web + answer["Location"])[2]
            return done if done["status"] in ("SUCCESS", "FAILURE") else None

        done = wait_for(settled, f"charge {task_id}", GET)
        order = json.loads(body)
        assert done["status"] == "SUCCESS" and done["result"]["amount"] == order["amount"], done
        (row,) = payments(stack.services["worker"].env)
        key = headers["Idempotency-Key"]
        assert (row.id, row.order_id, row.amount, row.provider_idempotency_key, row.task_id) == (
            done["result"]["payment_id"],
            str(order["order_id"]),
            order["amount"],
            key,
            task_id,
        )
        # and the same request again (the client's retry) is answered with the stored charge: no second row
        status, answer, again = http(method, web + urlsplit(url).path, headers, body)
        assert (status, answer["Idempotent-Replayed"], again["deduplicated"]) == (200, "true", True), again
        assert (again["task_id"], again["result"]) == (task_id, done["result"])
        assert len(payments(stack.services["worker"].env)) == 1
        assert stack.log("worker").count(f"Task payments.charge[{task_id}] succeeded") == 1

        # And beat sends the reconciler's schedule, which the worker runs
        wait_for(
            lambda: "Sending due task celery-idem-reconcile (celery_idem.reconcile)" in stack.log("beat"),
            "beat sending celery-idem-reconcile",
            GET,
        )
        wait_for(
            lambda: re.search(r"Task celery_idem\.reconcile\[[^]]+\] succeeded", stack.log("worker")),
            "the worker running celery_idem.reconcile",
            GET,
        )
