"""Private service instances the chaos tests may kill, freeze and restart (never the machine's shared
ones): a redis-server and a PostgreSQL cluster, each on a free loopback port in a tmp directory."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import IN_CI


def free_port() -> int:
    """A free loopback port, picked at random so parallel runs rarely collide."""
    for candidate in range(20000 + secrets.randbelow(10000), 32000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        return candidate
    raise RuntimeError("no free loopback port")


def missing(what: str) -> None:
    """Skip locally, fail in CI: CI never goes green by skipping the real thing."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: servers are required)")
    pytest.skip(what)


def wait_until(predicate: Callable[[], Any], what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not happen within {seconds}s")


class RedisServer:
    """A private redis-server on a free port; ``persistent``: appendonly yes, appendfsync always."""

    def __init__(self, tmp: Path, *, persistent: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            missing("redis-server is not installed: cannot start a private Redis")
        self.binary = str(binary)
        self.port = free_port()
        self.dir = tmp / f"redis-{self.port}"
        self.dir.mkdir()
        self.persistent = persistent
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        command = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            *aof,
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ping, f"redis-server on port {self.port}")

    def ping(self) -> bool:
        import redis

        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no goodbye to clients; what was fsynced is all that is left."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()


def _postgres_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    binary = shutil.which(name)
    if binary is None:
        missing(f"PostgreSQL's {name} is not installed: cannot start a private PostgreSQL")
    return str(binary)


class PostgresServer:
    """A private PostgreSQL cluster (initdb + pg_ctl) in a tmp directory, on a free port.

    initdb refuses to run as root, so as root every command runs as the ``postgres`` user, in a
    directory of its own under the system's tmp (pytest's tmp_path is private to the user)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="celery-idem-pg-"))
        self.data = self.root / "data"
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            runuser = shutil.which("runuser")
            if runuser is None:
                missing("running as root without runuser: cannot start PostgreSQL as another user")
            self.as_user = [str(runuser), "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres")
        self._run(
            _postgres_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"
        )
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *command: str) -> None:
        done = subprocess.run([*self.as_user, *command], capture_output=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {done.stdout.decode()}{done.stderr.decode()}")

    def _pg_ctl(self, *args: str) -> None:
        self._run(_postgres_bin("pg_ctl"), "-D", str(self.data), *args)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._pg_ctl("-o", options, "-l", str(self.root / "log"), "-w", "-t", "30", "start")

    def kill(self) -> None:
        """Immediate stop: every backend is cut off mid-statement, as when the server crashes."""
        self._pg_ctl("-m", "immediate", "-w", "stop")

    def pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()
        with contextlib.suppress(Exception):
            os.kill(self.pid(), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)
