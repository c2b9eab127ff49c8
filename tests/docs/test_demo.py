"""``celery-idem demo`` end to end: its exit code is its verdict, on the embedded default and on the
real servers users point it at."""

from __future__ import annotations

import subprocess
import sys

import pytest
from addresses import REDIS_DEMO_BACKEND_URL, REDIS_DEMO_BROKER_URL
from conftest import POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_rabbitmq, require_server

pytestmark = pytest.mark.slow

WIRINGS = {
    "embedded": [],
    "redis": ["--broker", REDIS_DEMO_BROKER_URL, "--backend", REDIS_DEMO_BACKEND_URL, "--store", REDIS_URL],
    "rabbitmq": ["--broker", RABBITMQ_URL, "--backend", REDIS_DEMO_BACKEND_URL],
    "postgresql": ["--store", POSTGRES_URL],
}


@pytest.mark.parametrize("wiring", sorted(WIRINGS))
def test_the_demo_shows_every_guarantee(wiring: str, tmp_path) -> None:
    if wiring in ("redis", "rabbitmq"):
        require_server("redis")
    if wiring == "rabbitmq":
        require_rabbitmq()
    if wiring == "postgresql":
        require_server("postgresql")
    run = subprocess.run(
        [sys.executable, "-m", "celery_idem", "demo", "--workdir", str(tmp_path), *WIRINGS[wiring]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every guarantee held" in run.stdout
    for scenario in (
        "storm of duplicate calls",
        "payload mismatch refused",
        "final failure replayed",
        "retryable failure retried",
        "worker killed mid-task",
    ):
        assert f"{scenario}" in run.stdout
    assert "200 calls from 8 threads: 1 execution, 1 task id, 1 distinct answer" in run.stdout
