"""The documentation site in a real browser: every page of the build works offline.

The site is built strictly into a tmp directory, served by a local HTTP server on 127.0.0.1 (at a
path below the server's root, as a reader's own server or a project site may serve it, and the 404
page for any missing URL, as hosts do), and every page is loaded in headless Chromium (Debian's
/usr/bin/chromium, driven by playwright, which downloads no browser of its own) with a fresh
profile. Every request to another host is recorded and refused. A page fails on a console error, a
request that left the machine, an image that did not load, a diagram left as text, or a stylesheet
or the theme's script that did not load; at 1280 px no word of code in a table cell may be split
across lines (a code span may wrap at its spaces). The full story: tests/README.md, "The site in a
browser". Screenshots of the key pages land in $CELERY_IDEM_ARTIFACTS (default
.artifacts/screenshots under the repository).

Without Chromium or playwright this skips with the reason; with CI=true it fails instead.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import IN_CI

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CELERY_IDEM_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("CELERY_IDEM_ARTIFACTS") or REPO / ".artifacts" / "screenshots")
# Where the site is served: anywhere but the server's root, so a link that assumes the root fails.
MOUNT = "/any/mount/path/"
WIDTH, HEIGHT = 1280, 900
# Without the background-networking flags Chromium itself calls home, which a closed network refuses.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MERMAID_KEYWORDS = ("stateDiagram", "sequenceDiagram", "flowchart ", "graph TD", "graph LR", "classDiagram")

pytestmark = pytest.mark.slow


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: .ci/run installs chromium and the dev extra)")
    pytest.skip(reason)


# ---- the site and its server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        # Built as anywhere but Read the Docs, whose canonical URL would move the 404 page's base.
        env={**{k: v for k, v in os.environ.items() if k != "READTHEDOCS_CANONICAL_URL"}, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode != 0:
        pytest.fail(f"the site did not build:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return out


class _SiteHandler(http.server.SimpleHTTPRequestHandler):
    """The built site under MOUNT (and at the root), with its 404.html for any missing path."""

    site: Path

    def translate_path(self, path: str) -> str:
        if path.startswith(MOUNT):
            path = "/" + path[len(MOUNT) :]
        return super().translate_path(path)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        page = self.site / "404.html"
        if code != 404 or not page.exists():
            super().send_error(code, message, explain)
            return
        body = page.read_bytes()
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    handler = type("Handler", (_SiteHandler,), {"site": site})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---- the browser --------------------------------------------------------------------------------------


@dataclass
class Seen:
    """What the browser saw while loading one page."""

    errors: list[str] = field(default_factory=list)
    offsite: list[str] = field(default_factory=list)


class Browser:
    """One Chromium page at 1280 px whose requests to any host but the local server are refused."""

    def __init__(self, context: Any, origin: str) -> None:
        self.context, self.origin = context, origin
        self.seen = Seen()
        context.route(self._offsite, self._refuse)
        self.page = context.pages[0] if context.pages else context.new_page()
        self.page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.seen.errors.append(f"uncaught: {exc}"))
        self.page.on("requestfailed", self._failed)

    def _offsite(self, url: str) -> bool:
        # Anything the page asks another host for; what the page holds itself (data:, blob:) stays.
        return not url.startswith((self.origin + "/", "data:", "blob:", "about:"))

    def _refuse(self, route: Any) -> None:
        self.seen.offsite.append(route.request.url)
        route.abort("blockedbyclient")

    def _console(self, message: Any) -> None:
        if message.type == "error":
            where = (message.location or {}).get("url", "")
            self.seen.errors.append(f"console: {message.text} ({where})")

    def _failed(self, request: Any) -> None:
        if request.url.startswith(self.origin + "/"):
            self.seen.errors.append(f"request failed: {request.url} ({request.failure})")

    def load(self, url: str) -> tuple[Seen, Any]:
        self.seen = Seen()
        response = self.page.goto(url, wait_until="load")
        # Let the theme's script finish what it starts after load (search index, components).
        self.page.wait_for_load_state("networkidle")
        return self.seen, response


@pytest.fixture(scope="module")
def browser(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    if not Path(CHROMIUM).exists() and shutil.which(CHROMIUM) is None:
        _unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium chromium-driver)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[dev]')")
    profile = tmp_path_factory.mktemp("chromium-profile")  # fresh: no cache, no service worker
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": WIDTH, "height": HEIGHT},
            service_workers="block",
        )
        try:
            yield Browser(context, server)
        finally:
            context.close()


def _pages(site: Path) -> list[str]:
    """Every page of the build, as a path below the site's root (``""`` for the home page)."""
    pages = sorted(p.parent.relative_to(site).as_posix() for p in site.rglob("index.html"))
    return ["" if p == "." else p + "/" for p in pages]


def _screenshot(browser: Browser, name: str, target: Any = None) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # Of an element: without the sticky header, which would land on it wherever it was scrolled to.
    style = ".md-header { visibility: hidden; }" if target is not None else None
    (target or browser.page).screenshot(path=str(ARTIFACTS / f"{name}.png"), style=style)


# ---- what every page must pass --------------------------------------------------------------------------

# Run in the page: what the page shows that it should not. Images are made to load now (a lazy one
# below the fold would otherwise count as broken), then each must be complete with a width.
PAGE_CHECK = r"""async ({mermaid}) => {
  const images = [...document.images];
  images.forEach((img) => { img.loading = "eager"; });
  await Promise.all(images.map((img) => img.decode().catch(() => null)));
  const broken = images.filter((img) => !img.complete || img.naturalWidth === 0).map((img) => img.src);
  const sheets = [...document.querySelectorAll('link[rel="stylesheet"]')].map((link) => {
    let rules = 0;
    try { rules = link.sheet ? link.sheet.cssRules.length : 0; } catch (e) { rules = -1; }
    return { href: link.href, rules };
  });
  const unstyled = sheets.filter((s) => s.rules === 0).map((s) => s.href);
  const header = document.querySelector(".md-header");
  const themed = header !== null && getComputedStyle(header).position === "sticky";
  const scripted = typeof window.document$ !== "undefined" && typeof window.component$ !== "undefined";
  const diagramsAsText = [...document.querySelectorAll("pre, .mermaid")]
    .filter((el) => el.classList.contains("mermaid") || mermaid.some((k) => el.textContent.trim().startsWith(k)))
    .map((el) => el.textContent.trim().slice(0, 60));
  // A word of code in a table cell (a run without spaces) that the page shows on two lines.
  const broke = [];
  for (const code of document.querySelectorAll("td code, th code")) {
    const words = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let text = words.nextNode(); text; text = words.nextNode()) {
      for (const word of text.data.matchAll(/\S+/g)) {
        const range = document.createRange();
        range.setStart(text, word.index);
        range.setEnd(text, word.index + word[0].length);
        if (range.getClientRects().length > 1) broke.push(word[0]);
      }
    }
  }
  return { broken, unstyled, sheets: sheets.length, themed, scripted, diagramsAsText, broke };
}"""


def _problems(seen: Seen, found: dict[str, Any], *, ignore_errors_from: str = "") -> list[str]:
    problems = [f"a request left the machine: {url}" for url in seen.offsite]
    problems += [e for e in seen.errors if not (ignore_errors_from and e.endswith(f"({ignore_errors_from})"))]
    problems += [f"image did not load: {src}" for src in found["broken"]]
    problems += [f"stylesheet did not load: {href}" for href in found["unstyled"]]
    if not found["sheets"] or not found["themed"]:
        problems.append("the theme's stylesheet is not applied (the header is not sticky)")
    if not found["scripted"]:
        problems.append("the theme's script did not run (no window.document$)")
    problems += [f"diagram shown as text: {text!r}" for text in found["diagramsAsText"]]
    problems += [f"code in a table cell breaks inside a word at {WIDTH} px: {word!r}" for word in found["broke"]]
    return problems


def test_every_page_loads_offline_with_its_styles_images_and_diagrams(browser: Browser, site: Path) -> None:
    pages = _pages(site)
    assert len(pages) > 20 and "concepts/" in pages and "configuration/" in pages, pages
    failures: dict[str, list[str]] = {}
    for path in pages:
        url = f"{browser.origin}{MOUNT}{path}"
        seen, response = browser.load(url)
        problems = [] if response is not None and response.ok else [f"HTTP {response and response.status}"]
        problems += _problems(seen, browser.page.evaluate(PAGE_CHECK, {"mermaid": list(MERMAID_KEYWORDS)}))
        if problems:
            failures[path or "(home)"] = problems
        if path == "":
            _screenshot(browser, "home")
        elif path == "configuration/":
            _screenshot(browser, "configuration")
            policy = browser.page.locator("#per-task-policy-idempotencypolicy ~ .md-typeset__scrollwrap table")
            _screenshot(browser, "configuration-policy-table", policy.first)
    assert not failures, "\n".join(f"{page}:\n  " + "\n  ".join(p) for page, p in failures.items())


def test_the_state_diagram_is_an_image_large_enough_to_read(browser: Browser) -> None:
    seen, _ = browser.load(f"{browser.origin}{MOUNT}concepts/")
    diagram = browser.page.locator("img.state-diagram")
    assert diagram.count() == 1, "docs/concepts.md shows the state machine as img/state-machine.svg"
    diagram.scroll_into_view_if_needed()
    size = diagram.evaluate(
        "(img) => ({natural: img.naturalWidth, shown: img.getBoundingClientRect().width, src: img.currentSrc})"
    )
    _screenshot(browser, "concepts-state-diagram")
    _screenshot(browser, "state-diagram", diagram)
    assert size["src"].endswith("/img/state-machine.svg"), size
    # Drawn with 13 pt labels: shown at three quarters or more, they are 13 px or larger.
    assert size["shown"] >= 0.75 * size["natural"], f"the diagram is shrunk to {size} at {WIDTH} px"
    assert not seen.offsite and not seen.errors, seen


def test_the_404_page_at_a_nested_missing_url_loads_its_stylesheet_and_script(browser: Browser) -> None:
    # The 404 page's links are absolute under site_url's path (MkDocs does so that one page serves
    # every depth); site_url's path is the root unless Read the Docs builds it.
    missing = f"{browser.origin}/no/such/page/at/depth/"
    seen, response = browser.load(missing)
    assert response is not None and response.status == 404
    assert "404" in browser.page.locator("article h1").inner_text()
    found = browser.page.evaluate(PAGE_CHECK, {"mermaid": list(MERMAID_KEYWORDS)})
    # The document's own 404 is logged as a console error: that one is the point.
    problems = _problems(seen, found, ignore_errors_from=missing)
    _screenshot(browser, "404")
    assert not problems, problems


def test_the_site_served_at_the_root_loads_too(browser: Browser) -> None:
    for path in ("", "guides/django/"):
        seen, response = browser.load(f"{browser.origin}/{path}")
        assert response is not None and response.ok
        problems = _problems(seen, browser.page.evaluate(PAGE_CHECK, {"mermaid": list(MERMAID_KEYWORDS)}))
        assert not problems, (path, problems)


def test_no_page_names_an_offsite_script_stylesheet_or_font(site: Path) -> None:
    # What the browser test sees only when it is run, said of every file of the build: the theme's
    # web fonts and Mermaid come from CDNs unless mkdocs.yml says otherwise.
    loaded_from_elsewhere = []
    for page in site.rglob("*.html"):
        text = page.read_text("utf-8")
        for needle in ("fonts.googleapis.com", "fonts.gstatic.com", "unpkg.com", "cdn.jsdelivr.net"):
            if needle in text:
                loaded_from_elsewhere.append(f"{page.relative_to(site)}: {needle}")
    assert not loaded_from_elsewhere, loaded_from_elsewhere


def test_the_server_serves_the_404_page_for_a_missing_url(server: str) -> None:
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{server}{MOUNT}missing/", timeout=5)
    assert info.value.code == 404 and b"404 - Not found" in info.value.read()
