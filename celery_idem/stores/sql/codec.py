"""How the SQL store's compact row (layout 2) writes a record's fields, and reads them back.

A settled row is the bill a user pays for every call kept for its TTL, so each field takes the
fewest bytes that still read back exactly:

- the row's key is a 16-byte identity hash (``id``: SHA-256 of the length-prefixed namespace,
  scope, task name and key), so the primary key index holds 16 bytes a row instead of the four text
  columns again; the text columns stay in the row (listing, filters), and every statement checks
  them too, so two identities whose hashes collide never read or take each other's row;
- the state is a small integer (:data:`STATE_CODES`);
- the fingerprint, the task ids and the owner are bytes: the form our own code writes packed
  (a SHA-256 hex digest as its 32 bytes, a canonical UUID as its 16, an owner token of 32 hex digits
  as its 16, a settled record's owner digest ``#`` + 16 hex digits as its 8), any other string as
  ``0xFF`` + its UTF-8 (+ one more ``0xFF`` where that length is a packed one). UTF-8 never holds
  the byte ``0xFF``, and a packed form has a length of its own, so the encoding is one-to-one:
  comparing encodings in SQL compares the strings;
- the content type and encoding of a JSON result in UTF-8, nearly every result, are NULL (a row
  without a result has NULL too, and reads back None).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ...records import State, identity_id

__all__ = [
    "FINGERPRINT",
    "OWNER",
    "STATE_CODES",
    "TASK_ID",
    "Packing",
    "content_encoding",
    "content_type",
    "identity_id",
    "read_content_encoding",
    "read_content_type",
    "state_of",
]

STATE_CODES: dict[State, int] = {State.PENDING: 1, State.IN_PROGRESS: 2, State.COMPLETED: 3, State.FAILED: 4}
_STATES = {code: state for state, code in STATE_CODES.items()}

_TEXT = b"\xff"  # never a byte of UTF-8: marks a string kept as its text
_JSON, _UTF8 = "application/json", "utf-8"


def state_of(code: int) -> State:
    return _STATES[code]


@dataclass(frozen=True)
class _Form:
    """One packed form of a field: the strings it matches, its length in bytes, and how it packs."""

    pattern: re.Pattern[str]
    length: int
    pack: Callable[[str], bytes]
    unpack: Callable[[bytes], str]


def _hex_form(digits: int, prefix: str = "") -> _Form:
    return _Form(
        re.compile(re.escape(prefix) + f"[0-9a-f]{{{digits}}}"),
        digits // 2,
        lambda text: bytes.fromhex(text[len(prefix) :]),
        lambda raw: prefix + raw.hex(),
    )


_UUID = _Form(
    re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
    16,
    lambda text: uuid.UUID(text).bytes,
    lambda raw: str(uuid.UUID(bytes=raw)),
)


class Packing:
    """A field's encoding: its packed forms, each of a length of its own, else its text."""

    def __init__(self, *forms: _Form) -> None:
        self._forms = forms
        self._by_length = {form.length: form for form in forms}

    def pack(self, value: str) -> bytes:
        for form in self._forms:
            if form.pattern.fullmatch(value):
                return form.pack(value)
        text = _TEXT + value.encode("utf-8")
        while len(text) in self._by_length:
            text += _TEXT  # a text never takes a packed form's length
        return text

    def unpack(self, raw: bytes) -> str:
        raw = bytes(raw)
        form = self._by_length.get(len(raw))
        if form is not None:
            return form.unpack(raw)
        return raw[1:].rstrip(_TEXT).decode("utf-8")

    def pack_optional(self, value: str | None) -> bytes | None:
        return None if value is None else self.pack(value)

    def unpack_optional(self, raw: bytes | None) -> str | None:
        return None if raw is None else self.unpack(raw)


FINGERPRINT = Packing(_hex_form(64))  # SHA-256, as fingerprint.py writes it
TASK_ID = Packing(_UUID)  # Celery's task ids
# Owner tokens (uuid4().hex), and what a settled record keeps of one (records.owner_digest).
OWNER = Packing(_hex_form(32), _hex_form(16, "#"))


def content_type(value: str | None) -> str | None:
    """What the row keeps of a result's content type: NULL for JSON (a row without a result has
    NULL too, and reads back None)."""
    return None if value == _JSON else value


def content_encoding(value: str | None) -> str | None:
    return None if value == _UTF8 else value


def read_content_type(value: str | None, result: bytes | None) -> str | None:
    return _JSON if value is None and result is not None else value


def read_content_encoding(value: str | None, result: bytes | None) -> str | None:
    return _UTF8 if value is None and result is not None else value
