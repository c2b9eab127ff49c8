"""The documentation site builds strictly, and every code block marked runnable runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_runnable_block_in_the_docs_runs() -> None:
    run = subprocess.run([sys.executable, "docs/run_snippets.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def test_the_endings_table_in_the_docs_is_the_matrix() -> None:
    # The table between the endings-table markers in docs/concepts.md is rendered from the cells the
    # endings matrix asserts (tests/endings.py); tests/test_endings.py checks it against what it saw.
    from endings import docs_block, expected, render

    assert docs_block() == render(expected()), (
        "docs/concepts.md's endings table differs from tests/endings.py; rewrite it with "
        "CELERY_IDEM_WRITE_ENDINGS=1 python -m pytest tests/test_endings.py"
    )
