"""Key and scope validation (DESIGN §2): str, 1-255 characters, printable, no whitespace."""

from __future__ import annotations

import pickle
import sys
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_idem.errors import IdempotencyError, InvalidKeyError
from celery_idem.keys import validate_key, validate_scope

RULE = "1-255 printable characters without whitespace"

# Every character Python calls whitespace (they all sit below U+3001, but scan the whole range
# so a future Unicode version cannot slip one past the property test).
WHITESPACE = [chr(code) for code in range(sys.maxunicode + 1) if chr(code).isspace()]

# Printable and not whitespace: letters, marks, numbers, punctuation, symbols (Z* and C* are
# whitespace or non-printable). The filter guards against a category/isprintable disagreement.
valid_chars = st.characters(categories=["L", "M", "N", "P", "S"]).filter(
    lambda char: char.isprintable() and not char.isspace()
)
valid_keys = st.text(valid_chars, min_size=1, max_size=255)


# --- the type rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ending"),
    [
        (42, "got int; pass str(...) of it, e.g. '42'"),
        (uuid.UUID(int=7), "got UUID; pass str(...) of it, e.g. '00000000-0000-0000-0000-000000000007'"),
        (True, "got bool"),  # an int to Python, never a key anyone meant
        (b"order-42", "got bytes"),
        (None, "got NoneType"),
    ],
)
def test_non_str_key_is_rejected_naming_the_type_and_for_a_number_how_to_pass_it(value: object, ending: str) -> None:
    with pytest.raises(InvalidKeyError) as excinfo:
        validate_key(value)

    message = str(excinfo.value)
    assert message.startswith("idempotency key must be a str")
    assert RULE in message
    assert message.endswith(ending)


@pytest.mark.parametrize(("value", "type_name"), [(42, "int; pass str(...) of it, e.g. '42'"), (b"tenant-a", "bytes")])
def test_non_str_scope_is_rejected_naming_scope_and_type(value: object, type_name: str) -> None:
    with pytest.raises(InvalidKeyError) as excinfo:
        validate_scope(value)

    message = str(excinfo.value)
    assert message.startswith("idempotency scope must be a str")
    assert message.endswith(f"got {type_name}")


# --- the length rule -----------------------------------------------------------------------------


def test_empty_key_is_rejected_as_empty_string() -> None:
    with pytest.raises(InvalidKeyError, match="idempotency key must be 1-255 .*; got an empty string$"):
        validate_key("")


def test_key_of_256_characters_is_rejected_with_its_length() -> None:
    with pytest.raises(InvalidKeyError, match="idempotency key must be 1-255 .*; got 256 characters$"):
        validate_key("k" * 256)


def test_key_of_255_ascii_characters_is_accepted() -> None:
    key = "k" * 255

    assert validate_key(key) == key


def test_key_of_255_non_ascii_printable_characters_is_accepted() -> None:
    # Given a key whose 255 characters take 2-4 bytes each in UTF-8:
    # the limit counts characters, not bytes.
    key = ("é" + "日" + "€" + "😀" + "ß") * 51
    assert len(key) == 255 and key.isprintable()
    assert len(key.encode("utf-8")) > 255

    assert validate_key(key) == key


def test_key_of_256_non_ascii_characters_is_rejected_with_its_length() -> None:
    with pytest.raises(InvalidKeyError, match="got 256 characters$"):
        validate_key("日" * 256)


# --- the whitespace rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "char",
    [" ", "\t", "\n", "\u00a0", "\u3000"],
    ids=["space", "tab", "newline", "no-break-space-U+00A0", "ideographic-space-U+3000"],
)
@pytest.mark.parametrize("position", [0, 5, 11])
def test_whitespace_is_rejected_naming_the_character_and_its_position(char: str, position: int) -> None:
    # Given a 12-character key with one whitespace character at the start, middle or end
    key = "order-000042"
    key = key[:position] + char + key[position + 1 :]
    assert len(key) == 12

    with pytest.raises(InvalidKeyError) as excinfo:
        validate_key(key)

    message = str(excinfo.value)
    assert message.startswith("idempotency key must be")
    assert RULE in message
    assert message.endswith(f"got whitespace {char!r} at position {position}")


def test_only_the_first_whitespace_position_is_reported() -> None:
    with pytest.raises(InvalidKeyError, match=r"got whitespace ' ' at position 2$"):
        validate_key("ab cd\tef")


def test_scope_with_whitespace_is_rejected_naming_scope() -> None:
    with pytest.raises(InvalidKeyError, match=r"^idempotency scope must be .*got whitespace ' ' at position 6$"):
        validate_scope("tenant a")


# --- the printable rule --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("char", "code"),
    [("\x00", "U+0000"), ("\x07", "U+0007"), ("\u200b", "U+200B")],
    ids=["NUL", "BEL", "zero-width-space-U+200B"],
)
def test_non_printable_character_is_rejected_naming_code_point_and_position(char: str, code: str) -> None:
    # Given a character Python itself calls non-printable and not whitespace
    assert not char.isprintable()
    assert not char.isspace()
    key = "order" + char + "42"

    with pytest.raises(InvalidKeyError) as excinfo:
        validate_key(key)

    message = str(excinfo.value)
    assert message.startswith("idempotency key must be")
    assert RULE in message
    assert message.endswith(f"got non-printable character {code} at position 5")


# --- scopes --------------------------------------------------------------------------------------


def test_none_scope_means_unscoped_and_is_stored_as_empty_string() -> None:
    assert validate_scope(None) == ""


def test_empty_string_scope_is_rejected_naming_scope() -> None:
    # Given "" as an explicit scope: unscoped is spelled None, so "" is a mistake, not a synonym
    with pytest.raises(InvalidKeyError) as excinfo:
        validate_scope("")

    message = str(excinfo.value)
    assert "idempotency scope" in message
    assert message.endswith("got an empty string")


def test_valid_scope_is_returned_unchanged() -> None:
    assert validate_scope("tenant-42") == "tenant-42"


# --- properties ----------------------------------------------------------------------------------


@settings(max_examples=150)
@given(key=valid_keys)
def test_any_printable_key_without_whitespace_of_1_to_255_characters_is_accepted_unchanged(key: str) -> None:
    assert validate_key(key) == key
    assert validate_scope(key) == key


@settings(max_examples=150)
@given(
    prefix=st.text(max_size=150),
    whitespace=st.sampled_from(WHITESPACE),
    suffix=st.text(max_size=150),
)
def test_any_key_containing_whitespace_is_rejected(prefix: str, whitespace: str, suffix: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(prefix + whitespace + suffix)


@settings(max_examples=150)
@given(
    prefix=st.text(valid_chars, max_size=120),
    whitespace=st.sampled_from(WHITESPACE),
    suffix=st.text(max_size=120),
)
def test_first_whitespace_after_a_valid_prefix_is_reported_at_its_position(
    prefix: str, whitespace: str, suffix: str
) -> None:
    with pytest.raises(InvalidKeyError) as excinfo:
        validate_key(prefix + whitespace + suffix)

    assert str(excinfo.value).endswith(f"got whitespace {whitespace!r} at position {len(prefix)}")


# --- the exception itself ------------------------------------------------------------------------


def test_invalid_key_error_is_a_value_error_and_an_idempotency_error() -> None:
    with pytest.raises(ValueError):
        validate_key("")
    assert issubclass(InvalidKeyError, ValueError)
    assert issubclass(InvalidKeyError, IdempotencyError)


def test_invalid_key_error_survives_pickling_with_class_and_message() -> None:
    with pytest.raises(InvalidKeyError) as excinfo:
        validate_key("a b")
    error = excinfo.value

    restored = pickle.loads(pickle.dumps(error))

    assert type(restored) is InvalidKeyError
    assert str(restored) == str(error)
    assert restored.args == error.args
    assert restored.message == error.message


def test_invalid_key_error_keeps_context_attributes_across_pickling() -> None:
    error = InvalidKeyError("idempotency key must be ...", key="a b", task_name="shop.charge", task_id="t-1")

    restored = pickle.loads(pickle.dumps(error))

    assert type(restored) is InvalidKeyError
    assert str(restored) == "idempotency key must be ..."
    assert (restored.key, restored.task_name, restored.task_id) == ("a b", "shop.charge", "t-1")


def test_invalid_key_error_rebuilds_from_its_positional_args_alone() -> None:
    # Given only the (type, args) pair Celery ships through JSON for a failed task
    with pytest.raises(InvalidKeyError) as excinfo:
        validate_key(None)
    error = excinfo.value

    rebuilt = type(error)(*error.args)

    assert str(rebuilt) == str(error)


def test_apply_checks_the_key_rules_before_anything_runs() -> None:
    from celery import Celery

    from celery_idem import Idempotency, IdempotentTask

    app = Celery("apply-keys", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store="memory://")
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, idempotency={"require_key": True})
    def charge(order_id: int) -> int:
        runs.append(order_id)
        return order_id

    # Task.apply() refuses as apply_async does: at the call, naming the rule, with nothing run
    with pytest.raises(InvalidKeyError, match="whitespace"):
        charge.apply((1,), idempotency_key="order 1")
    with pytest.raises(InvalidKeyError, match="idempotency scope"):
        charge.apply((1,), idempotency_key="order-1", idempotency_scope="")
    with pytest.raises(InvalidKeyError, match="requires an idempotency key"):
        charge.apply((1,))
    assert runs == []
    # and a valid key runs it, as does a call that bypasses idempotency
    assert charge.apply((1,), idempotency_key="order-1").get() == 1
    assert charge.apply((2,), idempotency=False).get() == 2 and runs == [1, 2]
