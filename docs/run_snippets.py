#!/usr/bin/env python
"""Run every runnable code block of the documentation; exit non-zero if any fails.

A runnable block is a fenced ``python`` block whose title starts with ``run:`` (a script) or
``run-pytest:`` (a pytest module)::

    ```python title="run: quickstart.py"
    ...
    ```

Each block is written, under the name its title gives, into a fresh temporary directory and run
there in its own subprocess with this interpreter: ``python NAME.py`` or
``python -m pytest -q -p no:cacheprovider NAME.py``. Runnable blocks must need no server (eager
mode, or the in-memory broker and store). The convention is described in ``docs/hooks.py``,
which shows these titles on the site as ``NAME.py · runs as is``.

Usage::

    python docs/run_snippets.py                  # every runnable block under docs/
    python docs/run_snippets.py docs/index.md    # the blocks of some pages
    python docs/run_snippets.py -k ledger        # blocks whose page or file name contains "ledger"
    python docs/run_snippets.py --list           # list them, run nothing
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The same convention as docs/hooks.py: an opening python fence whose title is "run: ..." or "run-pytest: ...".
OPENING = re.compile(
    r'^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})python\b[^\n]*?title="(?P<kind>run|run-pytest): (?P<name>[^"]+)"'
)
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.py$")


@dataclass
class Snippet:
    page: Path
    line: int  # 1-based line of the opening fence
    kind: str  # "run" or "run-pytest"
    name: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.name})"


@dataclass
class Outcome:
    snippet: Snippet
    returncode: int
    seconds: float
    output: str


def extract(page: Path) -> list[Snippet]:
    """The runnable blocks of one Markdown file, dedented to their fence's indentation."""
    lines = page.read_text("utf-8").splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        match = OPENING.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        closing = re.compile(rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise SystemExit(f"{page.relative_to(ROOT)}:{i + 1}: runnable block is never closed")
        name = match["name"].strip()
        if not NAME.match(name):
            raise SystemExit(f"{page.relative_to(ROOT)}:{i + 1}: {name!r} is not a Python module file name")
        if match["kind"] == "run-pytest" and not name.startswith("test_"):
            raise SystemExit(f"{page.relative_to(ROOT)}:{i + 1}: a run-pytest block must be named test_*.py")
        found.append(Snippet(page, i + 1, match["kind"], name, "\n".join(body) + "\n"))
        i = j + 1
    return found


def run(snippet: Snippet, timeout: float) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="celery-idem-snippet-") as workdir:
        path = Path(workdir) / snippet.name
        path.write_text(snippet.code, "utf-8")
        if snippet.kind == "run-pytest":
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", snippet.name]
        else:
            command = [sys.executable, snippet.name]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # the snippet sees the installed package, as a user would
        started = time.monotonic()
        try:
            done = subprocess.run(
                command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            captured = (exc.stdout or b"") + (exc.stderr or b"")
            text = captured.decode("utf-8", "replace") if isinstance(captured, bytes) else str(captured)
            code, output = -1, f"{text}\ntimed out after {timeout:g} s"
        return Outcome(snippet, code, time.monotonic() - started, output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown files (default: docs/**/*.md)")
    parser.add_argument("-k", dest="pattern", help="only blocks whose page path or file name contains this")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="blocks run in parallel")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per block (120)")
    parser.add_argument("--list", action="store_true", help="list the runnable blocks and exit")
    args = parser.parse_args(argv)

    pages = [p.resolve() for p in args.pages] or sorted(DOCS.rglob("*.md"))
    snippets = [s for page in pages for s in extract(page)]
    if args.pattern:
        snippets = [s for s in snippets if args.pattern in str(s.page.relative_to(ROOT)) or args.pattern in s.name]
    if args.list:
        for snippet in snippets:
            print(f"{snippet.where}  [{snippet.kind}]")
        return 0
    if not snippets:
        print("no runnable blocks found", file=sys.stderr)
        return 1

    names = [(s.page, s.name) for s in snippets]
    clashes = {n for n in names if names.count(n) > 1}
    if clashes:
        print(f"two runnable blocks share a page and a name: {sorted(str(n) for n in clashes)}", file=sys.stderr)
        return 1

    failures = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for outcome in pool.map(lambda s: run(s, args.timeout), snippets):
            ok = outcome.returncode == 0
            print(f"{'ok  ' if ok else 'FAIL'} {outcome.seconds:5.1f}s  {outcome.snippet.where}", flush=True)
            if not ok:
                failures += 1
                print("    " + outcome.output.rstrip().replace("\n", "\n    "), flush=True)
    print(f"\n{len(snippets) - failures} passed, {failures} failed, {len(snippets)} runnable blocks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
