"""The documentation site builds strictly, and every code block marked runnable runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import IN_CI

import celery_idem
import celery_idem.stores

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


class Build(NamedTuple):
    run: subprocess.CompletedProcess[str]
    site: Path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    site = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Build(run, site)


def test_mkdocs_build_is_strict_clean(build: Build) -> None:
    assert build.run.returncode == 0, build.run.stdout + build.run.stderr


# ---- the API reference is the public API -------------------------------------------------------


def _reference(build: Build) -> str:
    if build.run.returncode != 0:
        pytest.fail("the site did not build (test_mkdocs_build_is_strict_clean says why)")
    return (build.site / "reference" / "index.html").read_text("utf-8")


def test_the_api_reference_documents_every_public_name_under_its_public_path(build: Build) -> None:
    # mkdocstrings gives each object it renders an anchor named by the path the page asked for, so
    # `id="celery_idem.Store"` means it is documented as `celery_idem.Store`, not as a module's.
    documented = set(re.findall(r'id="(celery_idem\.[\w.]+)"', _reference(build)))
    wanted = {f"celery_idem.{name}" for name in celery_idem.__all__}
    for name in celery_idem.stores.__all__:  # the stores' own: from celery_idem if it is there too
        wanted.add(f"celery_idem.{name}" if name in celery_idem.__all__ else f"celery_idem.stores.{name}")
    missing = sorted(wanted - documented)
    assert not missing, f"public names the API reference (docs/reference.md) does not document: {missing}"


def test_the_api_reference_shows_no_sphinx_role_as_text(build: Build) -> None:
    # docs/griffe_roles.py turns :class:`X` in a docstring into a cross-reference; left alone,
    # Markdown would print ":class:" before the name.
    page = _reference(build)
    leaked = sorted(set(re.findall(r":(?:class|meth|func|mod|attr|exc|data|obj):<code>[^<]*</code>", page)))
    assert not leaked, f"Sphinx roles shown as text on the API reference: {leaked}"


def test_every_runnable_block_in_the_docs_runs() -> None:
    run = subprocess.run(
        [sys.executable, "docs/run_snippets.py"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def test_the_endings_table_in_the_docs_is_the_matrix() -> None:
    # The table between the endings-table markers in docs/concepts.md is rendered from the cells the
    # endings matrix asserts (tests/endings.py); tests/worker/test_endings.py checks it against what it saw.
    from endings import docs_block, expected, render

    assert docs_block() == render(expected()), (
        "docs/concepts.md's endings table differs from tests/endings.py; rewrite it with "
        "CELERY_IDEM_WRITE_ENDINGS=1 python -m pytest tests/worker/test_endings.py"
    )


def test_the_included_files_in_the_docs_are_the_files() -> None:
    # A block between <!-- include: PATH --> and <!-- end-include --> shows the file as the repository
    # holds it (docs/hooks.py, which also fails the build on a difference); with
    # CELERY_IDEM_WRITE_INCLUDES=1 this rewrites the blocks from the files instead.
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    drifted, including = [], []
    for page in sorted((REPO / "docs").rglob("*.md")):
        markdown = page.read_text("utf-8")
        if hooks.INCLUDED.search(markdown):
            including.append(page.name)
        if os.environ.get("CELERY_IDEM_WRITE_INCLUDES"):
            page.write_text(hooks.rewrite_includes(markdown), "utf-8")
            markdown = page.read_text("utf-8")
        drifted += [f"{page.relative_to(REPO)}: {path}" for path in hooks.include_drift(markdown)]
    assert "production.md" in including  # the recommended configuration is shown by inclusion
    assert not drifted, (
        f"included blocks differ from their files: {drifted}; rewrite them with "
        "CELERY_IDEM_WRITE_INCLUDES=1 python -m pytest tests/docs/test_docs.py -k included"
    )


# ---- the state diagram is drawn from its source, and draws the code's states ----------------------

DIAGRAM_SOURCE = REPO / "docs" / "img" / "state-machine.dot"
DIAGRAM = REPO / "docs" / "img" / "state-machine.svg"


def test_the_state_diagram_svg_is_what_graphviz_makes_of_its_source() -> None:
    # The site shows the committed SVG (no Mermaid, no JavaScript: it renders offline); this holds it
    # to docs/img/state-machine.dot. CELERY_IDEM_WRITE_DIAGRAMS=1 writes the SVG instead.
    dot = shutil.which("dot")
    if dot is None:
        reason = "Graphviz's dot is not installed (apt-get install graphviz)"
        if IN_CI:
            pytest.fail(f"{reason}; CI=true: .ci/run installs it")
        pytest.skip(reason)
    drawn = subprocess.run(
        [dot, "-Tsvg"], input=DIAGRAM_SOURCE.read_bytes(), capture_output=True, timeout=60, check=True
    ).stdout
    if os.environ.get("CELERY_IDEM_WRITE_DIAGRAMS"):
        DIAGRAM.write_bytes(drawn)
    assert DIAGRAM.read_bytes() == drawn, (
        "docs/img/state-machine.svg is not what dot draws from docs/img/state-machine.dot; rewrite it with "
        "CELERY_IDEM_WRITE_DIAGRAMS=1 python -m pytest tests/docs/test_docs.py -k diagram"
    )


def test_the_state_diagram_draws_the_states_of_the_code_and_the_operations_of_the_concepts_page() -> None:
    from celery_idem import State, Store

    source = re.sub(r"//[^\n]*", "", DIAGRAM_SOURCE.read_text("utf-8"))
    edges = re.findall(r"^\s*(\w+) -> (\w+) \[label=<(.*?)>\];$", source, flags=re.MULTILINE)
    drawn_states = {end for edge in edges for end in edge[:2]} - {"start", "end"}
    assert drawn_states == {state.value for state in State}
    drawn = {op for *_, label in edges for op in re.findall(r"<b>(\w+)</b>", label)}
    # The operations the concepts page tables under the diagram (its first column, in bold).
    page = (REPO / "docs" / "concepts.md").read_text("utf-8")
    tabled = set(re.findall(r"^\| \*\*(\w+)\*\*(?: / \*\*(\w+)\*\*)? \|", page, flags=re.MULTILINE))
    operations = {op for pair in tabled for op in pair if op}
    assert drawn == operations == {"claim", "acquire", "renew", "hand_over", "complete", "fail", "release", "forget"}
    assert all(callable(getattr(Store, op, None)) for op in drawn)
    # Every state is reached and left; a settled one only by its expiry or forget.
    for state in drawn_states:
        assert any(b == state for _, b, _ in edges) and any(a == state and b != state for a, b, _ in edges), state
    assert {(a, b) for a, b, _ in edges if a in ("COMPLETED", "FAILED")} == {("COMPLETED", "end"), ("FAILED", "end")}


# ---- what the stores page tells operators is what the code does ----------------------------------

STORES_PAGE = REPO / "docs" / "stores.md"


def _page() -> str:
    return " ".join(STORES_PAGE.read_text().split())  # sentences, whatever the line breaks


def test_the_stores_page_says_a_worker_sends_an_outage_message_back_and_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery import Celery
    from redis_servers import free_port
    from workers import execute_as_worker

    from celery_idem import Idempotency, IdempotentTask
    from celery_idem.handler import Handler
    from celery_idem.protocol import OUTAGE_HEADER

    page = _page()
    assert "the body does not run and the message goes back to the broker" in page
    assert "re-published under the same task id with a countdown of 1 s doubling up to 30 s" in page
    assert "fails the message, after 8 trips back" in page
    for wrong in ("the message fails with `StoreUnavailableError` before the body runs", "does not retry it"):
        assert wrong not in page, f"the stores page says again what the code does not do: {wrong!r}"
    # Given a worker whose store is down (nothing listens on its port)
    app = Celery("docs-outage", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=f"redis://127.0.0.1:{free_port()}/0", store_timeout_seconds=0.5)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    app.finalize()
    sent: list[tuple[float, dict[str, object]]] = []
    monkeypatch.setattr(
        Handler,
        "republish",
        lambda self, a, k, *, countdown, headers=None: sent.append((countdown, dict(headers or {}))),
    )
    # When its message runs, first and after many trips back
    execute_as_worker(app, charge.name, "t-1", idempotency_key="k")
    execute_as_worker(app, charge.name, "t-1", idempotency_key="k", **{OUTAGE_HEADER: 20})
    # Then the body did not run, and each time the message went back (1 s, then the 30 s cap)
    assert runs == []
    assert [countdown for countdown, _ in sent] == [1.0, 30.0]
    assert [headers[OUTAGE_HEADER] for _, headers in sent] == [1, 21]
    assert app.AsyncResult("t-1").state != "FAILURE"


def test_the_stores_page_says_reconcile_runs_purge_expired_sql_rows_and_they_do(tmp_path: Path) -> None:
    import sqlalchemy as sa
    from celery import Celery

    from celery_idem import Idempotency
    from celery_idem.records import Identity

    page = _page()
    assert "Expired rows are deleted by reconcile runs" in page
    assert "Every reconcile run (not a dry run) then deletes up to its `limit` (1000 by default) rows" in page
    assert "| deleted by reconcile runs | deleted by reconcile runs |" in page
    assert "nothing deletes expired rows" not in page and "stay until you delete them" not in page
    # Given a SQLite store holding a row past its TTL and one inside it
    app = Celery("docs-purge", set_as_current=False, broker="memory://")
    idem = Idempotency(app, store=f"sqlite:///{tmp_path}/idem.db")
    store = idem.store
    for key, ttl in (("old", 1.0), ("live", 3600.0)):
        taken = store.acquire(Identity("", "shop.charge", key), "a" * 64, key, lease_seconds=30, ttl_seconds=ttl)
        assert store.complete(Identity("", "shop.charge", key), taken.record.owner, b"1").ok
    store.advance_clock_for_tests(60)

    def rows() -> int:
        with store.engine.connect() as connection:  # type: ignore[attr-defined]
            return int(connection.execute(sa.select(sa.func.count()).select_from(store.table)).scalar_one())  # type: ignore[attr-defined]

    assert rows() == 2
    # When a dry run and then a reconcile run go by
    assert idem.reconcile(dry_run=True).purged == 0 and rows() == 2
    report = idem.reconcile()
    # Then the expired row is deleted and the live one kept
    assert report.purged == 1 and rows() == 1
    assert store.get(Identity("", "shop.charge", "live")) is not None
