"""The README's two commands, run as written, in a fresh copy of the repository with a fresh venv:
the demo must exit 0 with its summary, and the test command must install and run pytest."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def readme_commands() -> list[str]:
    """The shell lines of the README block under the ``two-commands`` marker."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- two-commands[^>]*-->\s*```bash\n(.*?)```", text, re.S)
    assert block, "the README lost its two-commands block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_every_path_the_status_table_names_exists() -> None:
    text = (REPO / "README.md").read_text()
    table = text.split("## Status", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`([\w./-]+\.(?:py|json|yml|md))`|`([\w./-]+/)`|\]\(([\w./-]+)\)", table)
    paths = [next(part for part in found if part) for found in named]
    assert len(paths) >= 8, table
    assert [p for p in paths if not (REPO / p).exists()] == []


def test_the_readme_names_every_field_of_the_reconcile_report() -> None:
    from celery_idem import ReconcileReport

    text = (REPO / "README.md").read_text()
    listed = re.search(r"It returns a `ReconcileReport` \(([^)]*)\)", text, re.S)
    assert listed, "the README lost its list of the report's fields"
    words = set(re.findall(r"[a-z_]+", listed.group(1)))
    fields = set(ReconcileReport.model_fields) - {"dry_run", "left_records"}  # said in words: "the records it left"
    assert fields <= words, fields - words
    assert "left with why" in " ".join(listed.group(1).split())


def test_the_readme_has_exactly_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert "demo" in commands[0] and "pytest" in commands[1]


@pytest.mark.timeout(1200)  # two fresh installs and the demo: each command has its own 600 s bound below
def test_the_readme_commands_work_in_a_fresh_copy(tmp_path: Path) -> None:
    # Given a clean copy of the repository (what git would check out), and no venv
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    copy = tmp_path / "celery-idem"
    for name in files:
        source = REPO / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    demo, tests = readme_commands()
    # When the first command runs: it installs and runs the demo
    run = subprocess.run(demo, shell=True, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every guarantee held" in run.stdout
    # When the second runs (here on a few tests: the whole suite is what runs us)
    env["PYTEST_ADDOPTS"] = "-q -p no:cacheprovider tests/api/test_keys.py -k 255"
    run = subprocess.run(tests, shell=True, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"\d+ passed", run.stdout)
