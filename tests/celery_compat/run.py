"""Run Celery's own ``t/unit/tasks`` with celery-idem installed on every test app.

    python3 tests/celery_compat/run.py                 # oldest and newest Celery we support
    python3 tests/celery_compat/run.py --baseline      # the same tests on plain Celery
    python3 tests/celery_compat/run.py --celery 5.7.0 -- -x -k retry   # one version, pytest options

The oldest version is the floor of ``celery>=`` in pyproject.toml (with kombu at the floor of
``kombu>=``), the newest the one installed in the project's ``.venv``. For each, this downloads
the Celery sdist from PyPI, extracts its tests (not its ``celery/`` source: the installed package is
what is tested) and builds a virtualenv under ``.cache/celery-compat/`` with that Celery, the test
tools pinned by the sdist's requirements/test.txt, and this repository (editable). All three are
kept and reused: a second run downloads and installs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = REPO / ".cache" / "celery-compat"
SUITE = "t/unit/tasks"
# What t/unit/tasks needs, and the file of the sdist's requirements/ that pins it (tblib: without
# it test_result skips one test). Its conftest imports nothing else.
TEST_TOOLS = {
    "pytest": "test.txt",
    "pytest-subtests": "test.txt",
    "pytest-timeout": "test.txt",
    "tblib": "extras/tblib.txt",
}
PER_TEST_TIMEOUT_SECONDS = 300  # a hang fails its test instead of the CI run


def floor(package: str) -> str:
    """The lowest version pyproject.toml allows for ``package``, as X.Y.Z."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(rf'"{package}>=(\d+(?:\.\d+){{0,2}})', text)
    if found is None:
        sys.exit(f"pyproject.toml has no '{package}>=' requirement to take the oldest version from")
    parts = found[1].split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


def installed_celery() -> str:
    python = REPO / ".venv" / "bin" / "python"
    if not python.exists():
        sys.exit(f"{python} not found: create the dev venv first (see README.md), or pass --celery X.Y.Z")
    code = "import importlib.metadata as m; print(m.version('celery'))"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def pip(venv: Path, *args: str) -> None:
    subprocess.run([venv / "bin" / "python", "-m", "pip", "-q", *args], check=True)


def ensure_venv(version: str, suffix: str = "") -> Path:
    venv = CACHE / f"venv-{version}{suffix}"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
    return venv


def ensure_tests(venv: Path, version: str) -> Path:
    """The sdist's t/, pyproject.toml (pytest settings) and requirements/, extracted once."""
    tests = CACHE / f"celery-{version}"
    if tests.exists():
        return tests
    sdist_dir = CACHE / "sdist"
    sdist = sdist_dir / f"celery-{version}.tar.gz"
    if not sdist.exists():
        pip(venv, "download", f"celery=={version}", "--no-deps", "--no-binary", ":all:", "--dest", str(sdist_dir))
    partial = tests.with_name(tests.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    prefix = f"celery-{version}/"
    with tarfile.open(sdist) as archive:
        wanted = [
            member
            for member in archive.getmembers()
            if member.name.startswith(prefix)
            and member.name[len(prefix) :].split("/")[0] in {"t", "pyproject.toml", "requirements"}
        ]
        for member in wanted:
            member.name = member.name[len(prefix) :]
        archive.extractall(partial, members=wanted, filter="data")
    partial.rename(tests)
    return tests


def tool_pins(tests: Path, version: str, tools: dict[str, str] = TEST_TOOLS) -> list[str]:
    """``tool==X`` for each test tool, at the version the sdist's requirements file pins (``==X``)
    or at the floor it names (``>=X``)."""
    pins = []
    for tool, filename in tools.items():
        text = (tests / "requirements" / filename).read_text()
        found = re.search(rf"^{re.escape(tool)}\s*(?:==|>=)\s*([\w.]+)", text, re.MULTILINE)  # the first line
        if found is None:
            sys.exit(f"celery {version}'s requirements/{filename} names no version of {tool}: pin it in {__file__}")
        pins.append(f"{tool}=={found[1]}")
    return pins


def requirements(tests: Path, version: str, oldest: bool) -> list[str]:
    """What the venv of ``version`` holds: that Celery, the test tools (:func:`tool_pins`) and this
    repository."""
    wanted = [f"celery=={version}", *tool_pins(tests, version), "-e", str(REPO)]
    if oldest:
        wanted.insert(1, f"kombu=={floor('kombu')}")
    return wanted


def ensure_installed(venv: Path, wanted: list[str]) -> None:
    stamp = venv / "celery-compat.stamp"
    key = hashlib.sha256("\n".join([*wanted, (REPO / "pyproject.toml").read_text()]).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == key:
        return
    pip(venv, "install", *wanted)
    stamp.write_text(key)


def run(version: str, oldest: bool, baseline: bool, pytest_args: list[str]) -> tuple[int, float]:
    started = time.monotonic()
    venv = ensure_venv(version)
    tests = ensure_tests(venv, version)
    ensure_installed(venv, requirements(tests, version, oldest))
    prepared = time.monotonic()
    command = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "celery_idem_compat", "-p", "no:cacheprovider"]
    command += ["-o", f"timeout={PER_TEST_TIMEOUT_SECONDS}", "-q", "--disable-warnings"]
    command += ["--idem-baseline"] if baseline else []
    command += pytest_args or [SUITE, "--idem-no-stale"]
    env = {**os.environ, "PYTHONPATH": str(HERE), "PYTHONDONTWRITEBYTECODE": "1"}
    mode = "plain Celery (baseline)" if baseline else "celery-idem on every app"
    print(f"\n== celery {version}, {mode}: {' '.join(command[1:])}", flush=True)
    code = subprocess.run(command, cwd=tests, env=env).returncode
    done = time.monotonic()
    print(f"== celery {version}: pytest exit {code}, {done - prepared:.1f}s tests, {prepared - started:.1f}s setup")
    return code, done - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--celery", action="append", metavar="X.Y.Z", help="a version to run (default: both)")
    parser.add_argument("--baseline", action="store_true", help="plain Celery, celery-idem not installed")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments instead of the whole suite")
    args = parser.parse_args()
    oldest = floor("celery")
    versions = args.celery or list(dict.fromkeys([oldest, installed_celery()]))
    failed = []
    for version in versions:
        code, _ = run(version, version == oldest, args.baseline, args.pytest_args)
        if code:
            failed.append(version)
    if failed:
        print(
            f"celery-idem compatibility FAILED on celery {', '.join(failed)}: see "
            f"{HERE.relative_to(REPO)}/README.md for how to read and update the list"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
