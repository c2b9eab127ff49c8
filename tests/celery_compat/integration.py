"""Run Celery's own integration tests of tasks and canvas through a real worker, with celery-idem.

    python3 tests/celery_compat/integration.py               # as CI: celery-idem on every app
    python3 tests/celery_compat/integration.py --baseline    # the same tests on plain Celery
    python3 tests/celery_compat/integration.py --slow        # also the tests the list marks slow
    python3 tests/celery_compat/integration.py -- t/integration/test_canvas.py -k chord   # a part

For the Celery installed in the project's ``.venv``, this reuses run.py's sdist under
``.cache/celery-compat/`` and builds one more virtualenv there (``venv-X.Y.Z-integration``: that
Celery with its Redis extra, the test tools its sdist pins, and this repository with its Redis
extra, and pytest-xdist). It copies ``integration_variants.py`` into the sdist's ``t/integration/``
(as ``test_idem_variants.py``, so Celery's integration conftest applies to it) and runs pytest with
``celery_idem_integration.py`` loaded, in ``--processes`` pytest-xdist processes: each starts its
own redis-server (broker, result backend and celery-idem store) and Celery's conftest starts its
embedded worker (celery.contrib.testing, prefork, one child) for the session.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from run import HERE, REPO, TEST_TOOLS, ensure_installed, ensure_tests, ensure_venv, installed_celery, tool_pins

# Our tests, copied into the sdist's t/integration/ so that Celery's integration conftest applies.
OURS = {"integration_variants.py": "test_idem_variants.py", "integration_regressions.py": "test_idem_regressions.py"}
SUITE = [
    "t/integration/test_tasks.py",
    "t/integration/test_canvas.py",
    *(f"t/integration/{name}" for name in OURS.values()),
]
PER_TEST_TIMEOUT_SECONDS = 120  # Celery's @flaky tests carry their own 300
# pytest-rerunfailures (Celery's CI reruns @flaky tests) is left out on purpose: with celery-idem a
# rerun is the same call again, answered from the store, and would turn a failure into a pass.
TOOLS = {tool: TEST_TOOLS[tool] for tool in ("pytest", "pytest-subtests", "pytest-timeout")}
XDIST = "pytest-xdist==3.8.0"  # Celery's requirements name none; the version the project's dev venv has


def run(version: str, baseline: bool, slow: bool, processes: int, pytest_args: list[str]) -> tuple[int, float]:
    started = time.monotonic()
    venv = ensure_venv(version, "-integration")
    tests = ensure_tests(venv, version)
    tools = [*tool_pins(tests, version, TOOLS), XDIST]
    ensure_installed(venv, [f"celery[redis]=={version}", *tools, "-e", f"{REPO}[redis]"])
    for ours, theirs in OURS.items():
        shutil.copyfile(HERE / ours, tests / "t" / "integration" / theirs)
    prepared = time.monotonic()
    command = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "celery.contrib.pytest"]
    command += ["-p", "celery_idem_integration", "-p", "no:cacheprovider", "-o", f"timeout={PER_TEST_TIMEOUT_SECONDS}"]
    command += ["-q", "--disable-warnings", "-n", str(processes)]
    command += ["--idem-baseline"] if baseline else []
    command += ["--idem-slow"] if slow else []
    # Arguments that name no test (-x, -k, --durations) apply to the whole suite; paths replace it.
    names_tests = any(arg.startswith("t/") for arg in pytest_args)
    command += pytest_args if names_tests else [*SUITE, "--idem-no-stale", *pytest_args]
    env = {**os.environ, "PYTHONPATH": str(HERE), "PYTHONDONTWRITEBYTECODE": "1"}
    mode = "plain Celery (baseline)" if baseline else "celery-idem on every app"
    print(f"\n== celery {version} integration, {mode}: {' '.join(command[1:])}", flush=True)
    code = subprocess.run(command, cwd=tests, env=env).returncode
    done = time.monotonic()
    print(
        f"== celery {version} integration: pytest exit {code}, {done - prepared:.1f}s tests, "
        f"{prepared - started:.1f}s setup"
    )
    return code, done - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="store_true", help="plain Celery, celery-idem not installed")
    parser.add_argument("--slow", action="store_true", help="also run the tests the list marks slow")
    parser.add_argument("--processes", "-n", type=int, default=4, help="pytest-xdist processes (0: one, no xdist)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments; test paths replace the suite")
    args = parser.parse_args()
    code, _ = run(installed_celery(), args.baseline, args.slow, args.processes, args.pytest_args)
    if code:
        print(
            f"celery-idem integration compatibility FAILED: see {HERE.relative_to(REPO)}/README.md "
            "for how to read and update integration_expected_failures.txt"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
