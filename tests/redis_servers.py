"""Private redis-server processes for tests: free ports, and a 3-master Redis Cluster.

The machine's shared Redis is never restarted or reconfigured: a test that needs a topology of its
own (a cluster, a sentinel, a full Redis) starts it here, on free loopback ports.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import IN_CI


def free_port(*, with_bus: bool = False) -> int:
    """A free loopback port; ``with_bus``: port + 10000 free too (a cluster node's bus port)."""
    for candidate in range(21000 + secrets.randbelow(9000), 32000):
        try:
            for port in (candidate, candidate + 10000) if with_bus else (candidate,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return candidate
    raise RuntimeError("no free port pair for a cluster node")


def need_redis_server() -> str:
    """The redis-server binary; skips (locally) or fails (CI) without one."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed: cannot start a cluster or sentinel"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return binary


def wait_until(predicate: Any, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not come up within {seconds}s")


@contextlib.contextmanager
def redis_cluster(root: Path) -> Iterator[str]:
    """Start a 3-master Redis Cluster (no replicas) with its files under ``root``; its URL."""
    binary = need_redis_server()
    ports: list[int] = []
    while len(ports) < 3:
        port = free_port(with_bus=True)
        if not {port, port + 10000} & {q for p in ports for q in (p, p + 10000)}:
            ports.append(port)
    nodes = [
        subprocess.Popen(
            [
                binary,
                "--port",
                str(p),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{p}.conf",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(root),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        import redis

        for p in ports:
            wait_until(lambda p=p: redis.Redis(port=p).ping(), f"cluster node {p}")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_until(lambda: redis.Redis(port=ports[0]).cluster("INFO").get("cluster_state") == "ok", "cluster")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(timeout=10)
