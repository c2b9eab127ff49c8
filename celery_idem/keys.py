"""What makes an idempotency key and scope valid, and how they become an :class:`Identity` (DESIGN §2).

A key (and a scope) is 1-255 printable characters without whitespace: it is written into store keys,
log lines and SQL rows as given, so nothing in it may split, hide or reorder what it names.
"""

from __future__ import annotations

import uuid

from .errors import InvalidKeyError
from .records import Identity

__all__ = ["MAX_KEY_LENGTH", "keyed_identity", "validate_key", "validate_scope"]

MAX_KEY_LENGTH = 255
_RULE = f"1-{MAX_KEY_LENGTH} printable characters without whitespace"


def validate_key(value: object, *, what: str = "idempotency key") -> str:
    """Return ``value`` if it is a valid key, else raise :class:`InvalidKeyError` naming the rule.

    Raises:
        InvalidKeyError: not a str, empty, longer than 255 characters, or holding whitespace or a
            non-printable character.
    """
    # Fast path: str.isprintable() is False for every separator but the ASCII space, so this is the
    # whole rule at C speed; the loop below only runs to say what is wrong.
    if type(value) is str and 0 < len(value) <= MAX_KEY_LENGTH and value.isprintable() and " " not in value:
        return value
    if not isinstance(value, str):
        # A number or a UUID is a key once made text: say how, where the type is one str() keeps whole.
        hint = (
            f"; pass str(...) of it, e.g. {str(value)!r}"
            if isinstance(value, (int, uuid.UUID)) and not isinstance(value, bool)
            else ""
        )
        raise InvalidKeyError(f"{what} must be a str of {_RULE}; got {type(value).__name__}{hint}")
    if not value:
        raise InvalidKeyError(f"{what} must be {_RULE}; got an empty string")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"{what} must be {_RULE}; got {len(value)} characters")
    for position, char in enumerate(value):
        if char.isspace():
            raise InvalidKeyError(f"{what} must be {_RULE}; got whitespace {char!r} at position {position}")
        if not char.isprintable():
            raise InvalidKeyError(
                f"{what} must be {_RULE}; got non-printable character U+{ord(char):04X} at position {position}"
            )
    return value


def validate_scope(value: object) -> str:
    """Validate an ``idempotency_scope``; ``None`` means unscoped and is stored as ``""``."""
    return "" if value is None else validate_key(value, what="idempotency scope")


def keyed_identity(task_name: str, key: object, scope: object) -> Identity:
    """The identity of a call given a key: the one way a caller's key and scope become an Identity
    (a call without a key is keyed by its fingerprint: :meth:`celery_idem.calling.TaskCalls.identify`)."""
    return Identity(validate_scope(scope), task_name, validate_key(key))
