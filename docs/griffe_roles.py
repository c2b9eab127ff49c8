"""Griffe extension for the API reference (``extensions:`` of mkdocstrings in mkdocs.yml).

celery-idem's docstrings name other objects with Sphinx roles (``:class:`Store```,
``:meth:`~Store.claim```), which Markdown would show as ``:class:Store``. Before mkdocstrings
renders a docstring, each role becomes a code span inside an *optional* cross-reference: a link
when the object it names is on a page of the site, plain code otherwise. Optional, because a
docstring may name an internal object that the reference leaves out on purpose, and a strict
build must not fail on that. Names are resolved where Python would resolve them: the object's
own scope, then its parents' (so ``:meth:`from_url``` in a class docstring is that class's).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|mod|attr|exc|data|obj):`(?P<tilde>~?)(?P<name>[\w.]+)(?:\(\))?`")


def _resolved(obj: griffe.Object, name: str) -> str | None:
    """The canonical path of what ``name`` names in ``obj``'s docstring, or None."""
    head, _, rest = name.partition(".")
    try:
        if head == obj.package.name:  # a full path, perhaps through a re-export
            target = obj.package[rest] if rest else obj.package
            return target.final_target.path if target.is_alias else target.path
        path = obj.resolve(head)
    except (KeyError, griffe.NameResolutionError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    return f"{path}.{rest}" if rest else path


def _rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None and ":" in obj.docstring.value:

        def cross_reference(match: re.Match[str]) -> str:
            name = match["name"]
            text = name.rsplit(".", 1)[-1] if match["tilde"] else name
            path = _resolved(obj, name)
            if path is None:
                return f"`{text}`"
            return f'<autoref identifier="{path}" optional><code>{text}</code></autoref>'

        obj.docstring.value = ROLE.sub(cross_reference, obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:  # a re-export is rewritten where it is defined
            _rewrite(member)


class SphinxRolesAsCrossReferences(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite(pkg)
