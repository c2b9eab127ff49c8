"""MkDocs hooks for the celery-idem site (``hooks: [docs/hooks.py]`` in mkdocs.yml).

What this file does to each page's Markdown before MkDocs renders it:

1. **Configuration reference.** ``<!-- config-reference: IdempotencyPolicy -->`` and
   ``<!-- config-reference: IdempotencySettings -->`` are replaced by tables generated from the
   pydantic models in ``celery_idem.config`` (field, type with its bounds, default, description), so
   the reference cannot drift from the code. An unknown model name fails the build. A number is
   shown with its unit, read off the field's name: ``86400`` of ``ttl_seconds`` as
   ``86400 s (24 h)``, ``1048576`` of ``max_result_bytes`` as ``1048576 bytes (1 MiB)``.

2. **Benchmark results.** ``<!-- benchmarks-readme -->`` is replaced by ``benchmarks/README.md``
   from its ``## Results`` heading on (the whole file if there is no such heading), headings moved
   one level down and relative links turned into plain text, so the page always shows the
   numbers the repository holds.

3. **Runnable code blocks.** The convention, shared with ``docs/run_snippets.py``:

   - a fenced block whose info string is ``python title="run: NAME.py"`` is a complete script;
     ``docs/run_snippets.py`` writes it to ``NAME.py`` in an empty directory and runs
     ``python NAME.py`` in a fresh subprocess;
   - ``python title="run-pytest: test_NAME.py"`` is a complete pytest module, run with
     ``python -m pytest test_NAME.py``;
   - every other block is illustration only (it may need servers, or be a fragment).

   Runnable blocks must be self-contained and need no server: eager mode or the in-memory broker
   and store. On the page the title is shown as ``NAME.py · runs as is`` (or
   ``· runs with pytest``). The titles are plain ``python`` fences, so ``ruff format`` formats
   these blocks like every other Python block in the docs.

4. **Included files.** A fenced block between ``<!-- include: PATH -->`` and ``<!-- end-include -->``
   (PATH relative to the repository root) must hold exactly that file: the page shows it as the
   repository has it (readable on GitHub too), and the build fails when the two differ.
   tests/docs/test_docs.py checks it as well; ``CELERY_IDEM_WRITE_INCLUDES=1 python -m pytest
   tests/docs/test_docs.py -k included`` rewrites the blocks from the files.

And to each page's HTML:

5. **Code in table cells breaks only at its spaces.** A code span with spaces in a table cell gets
   class ``idem-words`` and each of its words a ``<span>``, which docs/stylesheets/extra.css keeps
   whole (tests/docs/test_site_browser.py checks every such word at 1280 px).
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent

CONFIG_MARKER = re.compile(r"<!--\s*config-reference:\s*(?P<model>\w+)\s*-->")
BENCHMARKS_MARKER = "<!-- benchmarks-readme -->"
# Only on the opening line of a fenced python block; the same regex is in docs/run_snippets.py.
RUNNABLE_TITLE = re.compile(
    r'^(?P<head>[ \t]*(?:`{3,}|~{3,})python\b[^\n]*?)title="(?P<kind>run|run-pytest): (?P<name>[^"]+)"',
    flags=re.MULTILINE,
)
RUNNABLE_LABEL = {"run": "runs as is", "run-pytest": "runs with pytest"}

# Fields typed ``Any`` in the models (pydantic cannot validate these unions of foreign classes).
# Shown with their real meaning; a name here that is not a field of the model fails the build.
TYPE_OVERRIDES = {
    "IdempotencySettings": {
        "store": "str | Store | None",
        "ledger": "Ledger | None",
    },
}


# ---- 1. configuration reference ---------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    """A short, readable spelling of a field annotation."""
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


# The unit of a field, by its name: every duration of celery_idem.config is named ``..._seconds`` (one
# time unit, seconds, in every name) and its one size ``max_result_bytes``.
# A number and its unit stay on one line in a narrow column ("24 h", not "24" then "h").
NBSP = "\u00a0"
_SECONDS_SPANS = ((86400 * 365, "years"), (86400, "days"), (3600, "h"), (60, "min"))
_BYTE_SPANS = ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB"))


def _unit(name: str) -> str | None:
    if name.endswith("_seconds"):
        return "s"
    if name.endswith("_bytes"):
        return "bytes"
    return None


def _readable(value: float, spans: tuple[tuple[int, str], ...]) -> str | None:
    """``86400`` -> ``24 h``: the largest span ``value`` is a whole number of (hours for a day, as
    TTLs are sized), or None when no span fits (a value already readable as it is)."""
    for span, name in spans:
        if value >= span and value % span == 0 and not (name == "days" and value < 7 * 86400):
            return f"{value // span:g}{NBSP}{name}"
    return None


def _amount(name: str, value: Any, *, code: bool = True) -> str:
    """A value of field ``name`` with its unit: ``86400`` of ``ttl_seconds`` is `` `86400` s (24 h)``."""
    spelled = f"`{value!r}`" if code else repr(value)
    unit = _unit(name)
    if unit is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return spelled
    readable = _readable(value, _SECONDS_SPANS if unit == "s" else _BYTE_SPANS)
    return f"{spelled}{NBSP}{unit}" + (f" ({readable})" if readable else "")


def _default(name: str, value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    return _amount(name, value)


def _constraints(name: str, field: Any) -> str:
    spelled = []
    for item in field.metadata:
        for attribute, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "min length")):
            value = getattr(item, attribute, None)
            if value is not None:
                spelled.append(f"{symbol}{NBSP}{_amount(name, value, code=False)}")
    return ", ".join(spelled)


def _type_cell(kind: str, constraints: str) -> str:
    # The bounds under the type rather than in a column of their own: one column fewer lets the
    # tables fit the page at 1280 px.
    return f"`{kind}`" + (f"<br>{_cell(constraints)}" if constraints else "")


def _cell(text: str) -> str:
    # Python-Markdown does not split cells at a pipe inside a code span; elsewhere it must be escaped.
    return text.replace("|", "\\|")


def config_table(model_name: str) -> str:
    """The Markdown reference table of one model of ``celery_idem.config``."""
    from celery_idem import config

    model = getattr(config, model_name, None)
    if model is None or not hasattr(model, "model_fields"):
        raise PluginError(f"config-reference: celery_idem.config has no pydantic model {model_name!r}")
    overrides = TYPE_OVERRIDES.get(model_name, {})
    unknown = set(overrides) - set(model.model_fields)
    if unknown:
        raise PluginError(f"hooks.TYPE_OVERRIDES names {sorted(unknown)}, not fields of {model_name}")

    fields = model.model_fields
    if model_name == "IdempotencySettings":
        # The policy fields are documented in the policy table; here only the app-wide ones.
        fields = {name: f for name, f in fields.items() if name not in config.POLICY_FIELDS}
    lines = [
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    for name, field in fields.items():
        kind = overrides.get(name) or _type_name(field.annotation)
        lines.append(
            f"| `{name}` | {_type_cell(kind, _constraints(name, field))} | {_default(name, field.default)} "
            f"| {_cell(field.description or '')} |"
        )
    return "\n".join(lines)


# ---- 2. benchmark results ------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")


def benchmarks_results() -> str:
    path = ROOT / "benchmarks" / "README.md"
    if not path.exists():
        return "*benchmarks/README.md is not in this checkout.*"
    text = path.read_text("utf-8")
    start = re.search(r"^## Results\s*$", text, flags=re.MULTILINE)
    if start is not None:
        text = text[start.start() :]
    else:
        text = re.sub(r"\A# .*\n", "", text)  # the file's own title: the page has one
    text = re.sub(r"^(#{1,5}) ", r"#\1 ", text, flags=re.MULTILINE)

    def unlink(match: re.Match[str]) -> str:
        target = match["target"]
        if target.startswith(("http://", "https://", "#", "mailto:")):
            return match[0]
        return match["text"]  # a path inside the repository: not a page of this site

    return _LINK.sub(unlink, text)


# ---- 3. runnable blocks --------------------------------------------------------------------------


def _runnable_title(match: re.Match[str]) -> str:
    return f'{match["head"]}title="{match["name"]} · {RUNNABLE_LABEL[match["kind"]]}"'


# ---- 4. included files ---------------------------------------------------------------------------

INCLUDED = re.compile(
    r"^<!-- include: (?P<path>\S+) -->\n(?P<fence>`{3,})(?P<info>[^\n]*)\n"
    r"(?P<body>.*?)^(?P=fence)\n<!-- end-include -->$",
    flags=re.MULTILINE | re.DOTALL,
)


def include_drift(markdown: str) -> list[str]:
    """The included files whose block in ``markdown`` is not what the file holds."""
    return [m["path"] for m in INCLUDED.finditer(markdown) if (ROOT / m["path"]).read_text("utf-8") != m["body"]]


def rewrite_includes(markdown: str) -> str:
    """``markdown`` with every included block holding its file again."""

    def fresh(match: re.Match[str]) -> str:
        body = (ROOT / match["path"]).read_text("utf-8")
        opening = f"<!-- include: {match['path']} -->\n{match['fence']}{match['info']}\n"
        return f"{opening}{body}{match['fence']}\n<!-- end-include -->"

    return INCLUDED.sub(fresh, markdown)


# ---- 5. code in table cells ----------------------------------------------------------------------

TABLE_CELL = re.compile(r"<(?P<tag>td|th)\b[^>]*>.*?</(?P=tag)>", flags=re.DOTALL)
# A code span of plain text (no link, no highlighting inside) with a space in it.
SPACED_CODE = re.compile(r"<code>(?P<text>[^<]*?\S\s+\S[^<]*)</code>")


def _words(match: re.Match[str]) -> str:
    parts = re.split(r"(\s+)", match["text"])
    return (
        '<code class="idem-words">'
        + "".join(p if p.isspace() or not p else f"<span>{p}</span>" for p in parts)
        + "</code>"
    )


def wrap_code_at_spaces(html: str) -> str:
    """Each word of a code span with spaces in a table cell in a span of its own, so that
    docs/stylesheets/extra.css can let such a span wrap at its spaces and nowhere else (a line of
    CSS alone would also break after a ``/`` or a ``-``, inside a path or a name)."""
    return TABLE_CELL.sub(lambda cell: SPACED_CODE.sub(_words, cell[0]), html)


# ---- the hook --------------------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    drifted = include_drift(markdown)
    if drifted:
        raise PluginError(
            f"{page.file.src_path}: the blocks of {drifted} are not what the files hold; rewrite them with "
            "CELERY_IDEM_WRITE_INCLUDES=1 python -m pytest tests/docs/test_docs.py -k included"
        )
    markdown = CONFIG_MARKER.sub(lambda m: config_table(m["model"]), markdown)
    if BENCHMARKS_MARKER in markdown:
        markdown = markdown.replace(BENCHMARKS_MARKER, benchmarks_results())
    return RUNNABLE_TITLE.sub(_runnable_title, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return wrap_code_at_spaces(html)
