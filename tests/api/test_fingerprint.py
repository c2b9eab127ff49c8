"""The call fingerprint (DESIGN §2): one call, one fingerprint, however it is spelled."""

from __future__ import annotations

import datetime
import decimal
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import pytest
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_idem.errors import SerializationError
from celery_idem.fingerprint import fingerprint

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: tagged_orders.py, run as a producer

# The canonical JSON of charge(42, 100): sorted keys, no whitespace, the parameter at its default left out.
CHARGE_42_100_CANONICAL = b'{"amount":100,"order_id":42}'
CHARGE_42_100_FINGERPRINT = hashlib.sha256(CHARGE_42_100_CANONICAL).hexdigest()
# ...and as celery-idem before 0.2 fingerprinted it (its records still hold this: keep_defaults=True).
CHARGE_42_100_EARLIER_CANONICAL = b'{"amount":100,"currency":"EUR","order_id":42}'
CHARGE_42_100_EARLIER_FINGERPRINT = "190e6618c812c7fe98a036bdd1ff93bc46207b5e12f7db8e9892aae3c35a95f1"


def charge(order_id: Any, amount: Any, currency: Any = "EUR") -> None:
    """A task's run function: the call shapes below are bound to this signature."""


def one(value: Any) -> None:
    """A one-argument task, to compare values through the same parameter."""


def anything(**kwargs: Any) -> None:
    """A task taking only keyword arguments."""


def charge_with_extras(order_id: Any, **kwargs: Any) -> None:
    """A task whose key argument may travel in **kwargs."""


def bound_charge(self: Any, order_id: Any, amount: Any, currency: Any = "EUR") -> None:
    """The run function of a ``bind=True`` task: ``self`` is the task, not an argument."""


class Point:
    """Pickles by reference, but has no canonical JSON form."""

    def __init__(self, x: int, y: int) -> None:
        self.x = x
        self.y = y


class FakeSocket:
    """Socket-like: a live resource handle no serializer should pretend to encode."""

    def fileno(self) -> int:
        return 3

    def send(self, data: bytes) -> int:
        return len(data)

    def recv(self, size: int) -> bytes:
        return b""

    def close(self) -> None:
        pass


def round_tripped_canonical(value: Any) -> str:
    """What JSON leaves of ``value``: tuples become lists, nothing else merges."""
    return json.dumps(json.loads(json.dumps(value)), sort_keys=True, separators=(",", ":"))


def reorder(value: Any) -> Any:
    """The same value with every dict, at any depth, built in reverse insertion order."""
    if isinstance(value, dict):
        return {key: reorder(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [reorder(item) for item in value]
    return value


def tuplify(value: Any) -> Any:
    """The same value with every list, at any depth, turned into a tuple."""
    if isinstance(value, dict):
        return {key: tuplify(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(tuplify(item) for item in value)
    return value


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=5)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
ids = st.integers() | st.text(max_size=12)


# --- one call, many spellings --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((42, 100), {}),
        ((), {"order_id": 42, "amount": 100}),
        ((), {"amount": 100, "order_id": 42}),
        ((42,), {"amount": 100}),
        ((42, 100, "EUR"), {}),
        ((42, 100), {"currency": "EUR"}),
        ((), {"currency": "EUR", "amount": 100, "order_id": 42}),
    ],
    ids=["positional", "keyword", "keyword-reversed", "mixed", "default-explicit", "default-keyword", "all-keyword"],
)
def test_positional_keyword_and_defaulted_spellings_of_one_call_are_equal(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    assert fingerprint(charge, args, kwargs) == fingerprint(charge, (42, 100), {})


@settings(max_examples=60)
@given(order_id=ids, amount=st.integers(), currency=st.text(max_size=5))
def test_every_spelling_of_one_call_has_one_fingerprint(order_id: Any, amount: int, currency: str) -> None:
    spellings = [
        ((order_id, amount, currency), {}),
        ((order_id, amount), {"currency": currency}),
        ((order_id,), {"amount": amount, "currency": currency}),
        ((), {"currency": currency, "amount": amount, "order_id": order_id}),
        ([order_id, amount, currency], None),
    ]

    fingerprints = {fingerprint(charge, args, kwargs) for args, kwargs in spellings}

    assert len(fingerprints) == 1


@settings(max_examples=60)
@given(order_id=ids, amount=st.integers())
def test_leaving_out_a_default_equals_passing_the_default(order_id: Any, amount: int) -> None:
    assert fingerprint(charge, (order_id, amount), {}) == fingerprint(charge, (order_id, amount, "EUR"), {})
    assert fingerprint(charge, (), {"order_id": order_id, "amount": amount}) == fingerprint(
        charge, (order_id,), {"amount": amount, "currency": "EUR"}
    )


@settings(max_examples=60)
@given(data=st.data(), kwargs=st.dictionaries(names, json_values, max_size=6))
def test_keyword_order_does_not_matter(data: st.DataObject, kwargs: dict[str, Any]) -> None:
    # Given the same keyword arguments inserted in another order
    shuffled = dict(data.draw(st.permutations(list(kwargs.items()))))

    assert fingerprint(anything, (), shuffled) == fingerprint(anything, (), kwargs)


@settings(max_examples=60)
@given(value=json_objects)
def test_nested_dict_key_order_does_not_matter(value: dict[str, Any]) -> None:
    assert fingerprint(one, (reorder(value),), {}) == fingerprint(one, (value,), {})


def test_nested_dict_key_order_does_not_matter_example() -> None:
    first = {"b": {"y": 1, "x": [{"q": 1, "p": 2}]}, "a": 1}
    second = {"a": 1, "b": {"x": [{"p": 2, "q": 1}], "y": 1}}

    assert fingerprint(one, (first,), {}) == fingerprint(one, (second,), {})


@settings(max_examples=60)
@given(value=st.lists(json_values, max_size=5))
def test_tuple_and_list_of_the_same_items_are_equal(value: list[Any]) -> None:
    # Given a tuple and a list of the same items, at every depth: JSON sends both as an array
    assert fingerprint(one, (tuplify(value),), {}) == fingerprint(one, (value,), {})


def test_tuple_and_list_of_the_same_items_are_equal_example() -> None:
    assert fingerprint(one, ((1, (2, 3)),), {}) == fingerprint(one, ([1, [2, 3]],), {})


# --- different calls -----------------------------------------------------------------------------


@settings(max_examples=100)
@given(pair=st.lists(json_values, min_size=2, max_size=2, unique_by=round_tripped_canonical))
def test_different_json_values_have_different_fingerprints(pair: list[Any]) -> None:
    # Given two values JSON keeps apart (a tuple and its list are one value, so never a pair)
    first, second = pair

    assert fingerprint(one, (first,), {}) != fingerprint(one, (second,), {})


def test_values_json_keeps_apart_have_different_fingerprints() -> None:
    # Equal in Python (1 == 1.0 == True), but the worker receives an int, a float and a bool.
    values: list[Any] = [1, 1.0, True, "1", [1], {"1": 1}, None, "null", 0, 0.0, -0.0, False, "", []]

    fingerprints = {fingerprint(one, (value,), {}) for value in values}

    assert len(fingerprints) == len(values)


@settings(max_examples=60)
@given(first=json_objects, second=json_objects)
def test_different_keyword_arguments_have_different_fingerprints(first: dict[str, Any], second: dict[str, Any]) -> None:
    if round_tripped_canonical(first) == round_tripped_canonical(second):
        assert fingerprint(anything, (), first) == fingerprint(anything, (), second)
    else:
        assert fingerprint(anything, (), first) != fingerprint(anything, (), second)


# --- values JSON cannot carry as such ------------------------------------------------------------


@settings(max_examples=40)
@given(value=st.uuids())
def test_uuid_and_its_string_are_equal(value: uuid.UUID) -> None:
    assert fingerprint(one, (value,), {}) == fingerprint(one, (str(value),), {})
    assert fingerprint(one, ([value, {"id": value}],), {}) == fingerprint(one, ([str(value), {"id": str(value)}],), {})


utc_offsets = st.builds(
    datetime.timezone,
    st.integers(min_value=-23 * 60 - 59, max_value=23 * 60 + 59).map(
        lambda minutes: datetime.timedelta(minutes=minutes)
    ),
)


@settings(max_examples=40)
@given(value=st.datetimes(timezones=st.none() | utc_offsets))
def test_datetime_and_its_isoformat_are_equal(value: datetime.datetime) -> None:
    assert fingerprint(one, (value,), {}) == fingerprint(one, (value.isoformat(),), {})


@settings(max_examples=40)
@given(value=st.dates() | st.times(timezones=st.none() | utc_offsets))
def test_date_and_time_and_their_isoformat_are_equal(value: datetime.date | datetime.time) -> None:
    assert fingerprint(one, (value,), {}) == fingerprint(one, (value.isoformat(),), {})


@settings(max_examples=40)
@given(value=st.decimals())
def test_decimal_and_its_string_are_equal(value: decimal.Decimal) -> None:
    assert fingerprint(one, (value,), {}) == fingerprint(one, (str(value),), {})


def test_uuid_datetime_and_decimal_examples() -> None:
    order = uuid.UUID("12345678-1234-5678-1234-567812345678")
    at = datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc)
    amount = decimal.Decimal("100.10")

    assert fingerprint(charge, (order, amount, at), {}) == fingerprint(
        charge, ("12345678-1234-5678-1234-567812345678", "100.10", "2024-05-01T12:30:00+00:00"), {}
    )


# --- key_args and bound tasks --------------------------------------------------------------------


@settings(max_examples=60)
@given(order_id=ids, first=st.tuples(st.integers(), st.text(max_size=5)), second=st.tuples(st.integers(), st.text()))
def test_key_args_ignores_the_other_arguments(order_id: Any, first: tuple[int, str], second: tuple[int, str]) -> None:
    assert fingerprint(charge, (order_id, *first), {}, key_args=["order_id"]) == fingerprint(
        charge, (order_id, *second), {}, key_args=["order_id"]
    )


def test_key_args_still_tells_different_keys_apart() -> None:
    assert fingerprint(charge, (42, 100), {}, key_args=["order_id"]) != fingerprint(
        charge, (43, 100), {}, key_args=["order_id"]
    )


def test_key_args_fingerprint_covers_only_the_named_arguments() -> None:
    expected = hashlib.sha256(b'{"order_id":42}').hexdigest()

    assert fingerprint(charge, (42, 100), {"currency": "USD"}, key_args=["order_id"]) == expected


def test_key_args_naming_a_missing_parameter_raises_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"key_args names 'order_no', which is not a parameter of charge") as excinfo:
        fingerprint(charge, (42, 100), {}, key_args=["order_no"])

    assert not isinstance(excinfo.value, SerializationError)


def test_key_args_picks_a_value_out_of_var_keyword_arguments() -> None:
    # Given a task whose key argument "tenant" is not a parameter but travels in **kwargs
    first = fingerprint(charge_with_extras, (42,), {"tenant": "a", "note": "first"}, key_args=["tenant"])
    second = fingerprint(charge_with_extras, (43,), {"tenant": "a", "note": "second"}, key_args=["tenant"])
    other = fingerprint(charge_with_extras, (42,), {"tenant": "b", "note": "first"}, key_args=["tenant"])

    assert first == second == hashlib.sha256(b'{"tenant":"a"}').hexdigest()
    assert other != first


def test_key_args_mixes_named_parameters_and_var_keyword_arguments() -> None:
    result = fingerprint(charge_with_extras, (42,), {"tenant": "a", "note": "x"}, key_args=["order_id", "tenant"])

    assert result == hashlib.sha256(b'{"order_id":42,"tenant":"a"}').hexdigest()


def test_key_args_naming_the_var_keyword_parameter_keys_on_all_of_its_contents() -> None:
    # Given key_args naming the **kwargs parameter itself
    first = fingerprint(charge_with_extras, (42,), {"tenant": "a"}, key_args=["kwargs"])
    other = fingerprint(charge_with_extras, (42,), {"tenant": "b"}, key_args=["kwargs"])
    # Then two calls differing only in a **kwargs entry are two calls, not one
    assert other != first
    assert first == hashlib.sha256(b'{"kwargs":{"tenant":"a"}}').hexdigest()
    assert fingerprint(charge_with_extras, (43,), {"tenant": "a"}, key_args=["kwargs"]) == first


def test_key_args_naming_the_var_keyword_parameter_works_through_the_task() -> None:
    from celery import Celery

    from celery_idem import Idempotency, IdempotentTask

    app = Celery("kw", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    Idempotency(app, store="memory://")

    @app.task(shared=False, base=IdempotentTask, name="kw.tag", idempotency={"key_args": ["extras"]})
    def tag(order_id: int, **extras: Any) -> Any:
        return extras

    first, second = tag.delay(1, tenant="a"), tag.delay(1, tenant="b")
    assert second.id != first.id and not second.deduplicated
    assert (first.get(), second.get()) == ({"tenant": "a"}, {"tenant": "b"})
    assert tag.delay(2, tenant="a").deduplicated


def test_skip_first_drops_self_of_a_bound_task() -> None:
    # Given the run function of a bind=True task, called as the producer calls it: without self
    result = fingerprint(bound_charge, (42, 100), {}, skip_first=True)

    assert result == fingerprint(charge, (42, 100), {}) == CHARGE_42_100_FINGERPRINT


@settings(max_examples=40)
@given(order_id=ids, amount=st.integers())
def test_skip_first_spellings_of_one_call_are_equal(order_id: Any, amount: int) -> None:
    assert (
        fingerprint(bound_charge, (order_id, amount), {}, skip_first=True)
        == fingerprint(bound_charge, (), {"amount": amount, "order_id": order_id}, skip_first=True)
        == fingerprint(charge, (order_id, amount), {})
    )


def test_skip_first_with_key_args() -> None:
    result = fingerprint(bound_charge, (42, 100), {}, skip_first=True, key_args=["order_id"])

    assert result == hashlib.sha256(b'{"order_id":42}').hexdigest()


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [object(), lambda: None, FakeSocket()],
    ids=["object", "lambda", "socket-like"],
)
def test_arguments_json_cannot_encode_raise_serialization_error_saying_what_to_do(value: Any) -> None:
    with pytest.raises(SerializationError) as excinfo:
        fingerprint(one, (value,), {})

    error = excinfo.value
    assert isinstance(error, TypeError)
    assert "cannot be encoded with the 'json' serializer" in str(error)
    assert "pass JSON-serializable values" in str(error)
    assert error.__cause__ is not None


def test_arguments_pickle_cannot_encode_raise_serialization_error_naming_pickle() -> None:
    with pytest.raises(SerializationError, match="cannot be encoded with the 'pickle' serializer"):
        fingerprint(one, (lambda: None,), {}, serializer="pickle")


@pytest.mark.parametrize("value", [complex(1, 2), Point(1, 2)], ids=["complex", "custom-class"])
def test_pickleable_argument_without_canonical_json_raises_serialization_error(value: Any) -> None:
    # Given the pickle serializer, which carries the value to the worker intact,
    # but a value the fingerprint has no canonical JSON form for
    with pytest.raises(SerializationError) as excinfo:
        fingerprint(one, (value,), {}, serializer="pickle")

    error = excinfo.value
    assert isinstance(error, TypeError)
    assert "no canonical form for the fingerprint" in str(error)
    assert type(value).__qualname__ in str(error)
    assert "pass JSON-like values" in str(error)


def test_pickle_serializer_gives_the_same_fingerprint_as_json_for_json_values() -> None:
    assert fingerprint(charge, (42, 100), {}, serializer="pickle") == CHARGE_42_100_FINGERPRINT


@pytest.mark.parametrize(
    ("args", "kwargs", "complaint"),
    [
        ((42,), {}, "missing a required argument: 'amount'"),
        ((42, 100), {"discount": 5}, "got an unexpected keyword argument 'discount'"),
        ((42, 100, "EUR", "extra"), {}, "too many positional arguments"),
        ((42, 100), {"order_id": 42}, "multiple values for argument 'order_id'"),
    ],
    ids=["missing-required", "unexpected-keyword", "too-many-positional", "duplicate-argument"],
)
def test_arguments_that_do_not_fit_the_signature_raise_type_error(
    args: tuple[Any, ...], kwargs: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(TypeError) as excinfo:
        fingerprint(charge, args, kwargs)

    assert not isinstance(excinfo.value, SerializationError)
    assert str(excinfo.value).startswith("charge(order_id")
    assert complaint in str(excinfo.value)


# --- form and stability --------------------------------------------------------------------------


@settings(max_examples=40)
@given(value=json_values)
def test_fingerprint_is_64_lowercase_hex_characters(value: Any) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint(one, (value,), {}))


def test_fingerprint_of_a_known_call_is_pinned() -> None:
    # A change here changes every stored fingerprint: every in-flight key would mismatch.
    assert CHARGE_42_100_FINGERPRINT == "5747414616fa1d43865494a5473d1e79af3bfa986658ee9f45a026a45649beec"

    assert fingerprint(charge, (42, 100), {}) == CHARGE_42_100_FINGERPRINT


def test_the_earlier_form_of_a_known_call_is_pinned() -> None:
    # Records written by celery-idem before 0.2 hold this form: a call that finds one under its key
    # is recognised by it (celery_idem.releases), so it must never change either.
    assert hashlib.sha256(CHARGE_42_100_EARLIER_CANONICAL).hexdigest() == CHARGE_42_100_EARLIER_FINGERPRINT

    assert fingerprint(charge, (42, 100), {}, keep_defaults=True) == CHARGE_42_100_EARLIER_FINGERPRINT
    assert fingerprint(charge, (42, 100), {"currency": "EUR"}, keep_defaults=True) == CHARGE_42_100_EARLIER_FINGERPRINT


# ---- across releases: a parameter at its default is not part of the call -------------------------


def charge_v1(order_id: Any, amount: Any) -> None:
    """charge as the release before one that added ``currency="EUR"`` declared it."""


def charge_v3(order_id: Any, amount: Any, currency: Any = "EUR", *extra: Any, note: Any = None, **options: Any) -> None:
    """A later release: an optional parameter, a keyword-only default and *args/**kwargs added."""


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((42, 100), {}), ((42, 100, "EUR"), {}), ((42,), {"amount": 100, "currency": "EUR", "note": None})],
    ids=["left-out", "default-by-position", "defaults-by-keyword"],
)
def test_a_release_that_adds_parameters_with_defaults_changes_no_call(args: Any, kwargs: Any) -> None:
    assert fingerprint(charge_v3, args, kwargs) == fingerprint(charge_v1, (42, 100), {}) == CHARGE_42_100_FINGERPRINT


@pytest.mark.parametrize(
    ("value", "default"),
    [(True, 1), (1, True), (1.0, 1), (0, False), ("1", 1), (None, ""), ([], {}), ("EUR ", "EUR")],
)
def test_a_value_is_left_out_only_when_the_worker_receives_it_as_the_default(value: Any, default: Any) -> None:
    # 1 == True in Python, but the worker receives `1` and `true`: two calls, as before defaults were left out.
    def task(order_id: Any, flag: Any = default) -> None: ...

    assert fingerprint(task, (42, value), {}) != fingerprint(task, (42,), {})


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_sentinel_default_left_out_is_absent_and_passing_it_is_refused(serializer: str) -> None:
    # A sentinel default has no canonical form (before 0.2, a call that left it out could not be
    # fingerprinted at all): a call that leaves it out is fingerprinted without it. Passed explicitly
    # it travels as a copy (pickle) or not at all (json), which the worker could not fingerprint
    # alike: refused at publish, as any value without a canonical form.
    sentinel = object()

    def task(order_id: Any, flag: Any = sentinel) -> None: ...

    def without_flag(order_id: Any) -> None: ...

    left_out = fingerprint(task, (42,), {}, serializer=serializer)
    assert left_out == fingerprint(without_flag, (42,), {}, serializer=serializer)
    assert left_out != fingerprint(task, (42, None), {}, serializer=serializer)
    with pytest.raises(SerializationError):
        fingerprint(task, (42, sentinel), {}, serializer=serializer)


def test_a_models_default_is_left_out_as_celery_sends_it() -> None:
    # A pydantic=True task receives its model arguments as model_dump(mode="json"): passing the
    # default model's dump is passing the default.
    from pydantic import BaseModel

    class Options(BaseModel):
        express: bool = False
        note: str = ""

    def ship(order_id: Any, options: Any = Options()) -> None: ...  # noqa: B008 - the case under test

    assert fingerprint(ship, (7,), {}) == fingerprint(ship, (7,), {"options": {"express": False, "note": ""}})
    assert fingerprint(ship, (7,), {}) != fingerprint(ship, (7,), {"options": {"express": True, "note": ""}})


def test_a_key_arg_at_its_default_is_left_out_as_it_is_from_the_whole_call() -> None:
    whole = fingerprint(charge, (42, 100), {})
    assert fingerprint(charge, (42, 100), {}, key_args=["order_id", "amount", "currency"]) == whole
    assert fingerprint(charge, (42, 100, "USD"), {}, key_args=["order_id", "currency"]) != fingerprint(
        charge, (42, 100), {}, key_args=["order_id", "currency"]
    )


SUBPROCESS_CALLS = {
    "json-dict": (
        "fingerprint(charge, (42, {'zeta': 1, 'alpha': [1, 2], 'mid': {'b': 2, 'a': 1}}), {'currency': 'USD'})",
        lambda: fingerprint(charge, (42, {"zeta": 1, "alpha": [1, 2], "mid": {"b": 2, "a": 1}}), {"currency": "USD"}),
    ),
    "pickle-frozenset": (
        "fingerprint(charge, (42, frozenset({'alpha', 'beta', 'gamma', 'delta', 'epsilon'})), {}, serializer='pickle')",
        lambda: fingerprint(
            charge, (42, frozenset({"alpha", "beta", "gamma", "delta", "epsilon"})), {}, serializer="pickle"
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("call", list(SUBPROCESS_CALLS))
def test_same_call_has_same_fingerprint_in_fresh_processes_with_other_hash_seeds(call: str) -> None:
    # Given two fresh interpreters whose str hashes (and so set and dict internals) differ
    expression, in_process = SUBPROCESS_CALLS[call]
    script = textwrap.dedent(
        f"""
        from celery_idem.fingerprint import fingerprint

        def charge(order_id, amount, currency="EUR"):
            pass

        print({expression})
        """
    )
    results = []
    for seed in ("1", "2"):
        completed = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        results.append(completed.stdout.strip())

    # Then both processes, and this one, agree
    assert results[0] == results[1] == in_process()


# ---- no value can spell another's canonical form -------------------------------------------------


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_bytes_do_not_collide_with_a_dict_spelling_their_encoding(serializer: str) -> None:
    as_bytes = fingerprint(one, [b"ab"], {}, serializer=serializer)
    assert as_bytes != fingerprint(one, [{"__bytes__": "6162"}], {}, serializer=serializer)
    assert as_bytes != fingerprint(one, [{"\x00bytes": "6162"}], {}, serializer=serializer)
    assert as_bytes != fingerprint(one, ["6162"], {}, serializer=serializer)


def test_a_set_does_not_collide_with_a_list_of_its_members_json() -> None:
    as_set = fingerprint(one, [{1, 2}], {}, serializer="pickle")
    assert as_set != fingerprint(one, [["1", "2"]], {}, serializer="pickle")
    assert as_set != fingerprint(one, [{"\x00set": ["1", "2"]}], {}, serializer="pickle")
    assert as_set == fingerprint(one, [frozenset({2, 1})], {}, serializer="pickle")


def test_int_and_str_dict_keys_stay_apart_under_pickle() -> None:
    assert fingerprint(one, [{1: "a"}], {}, serializer="pickle") != fingerprint(
        one, [{"1": "a"}], {}, serializer="pickle"
    )


def test_key_args_given_as_one_string_is_refused_with_a_clear_message() -> None:
    with pytest.raises(TypeError, match="key_args must be a list of parameter names, not a str; got 'order_id'"):
        fingerprint(charge, [42, 100], {}, key_args="order_id")  # type: ignore[arg-type]


# ---- typing off: the call as given -----------------------------------------------------------------


def test_unbound_fingerprint_takes_the_call_as_given_without_the_signature() -> None:
    # typing=False: Celery does not check the call against the signature, so neither do we
    extra = fingerprint(charge, (42, 100), {"extra": 3}, bind=False)
    assert extra != fingerprint(charge, (42, 100), {}, bind=False)
    # the call as given: its spelling and its defaults count
    assert fingerprint(charge, (42, 100), {}, bind=False) != fingerprint(
        charge, (), {"order_id": 42, "amount": 100}, bind=False
    )
    assert fingerprint(charge, (42, 100), {}, bind=False) != fingerprint(charge, (42, 100, "EUR"), {}, bind=False)
    # still through the serializer: a tuple and a list, a UUID and its string are one call
    order = uuid.uuid4()
    as_list = fingerprint(charge, [[1, 2], str(order)], None, bind=False)
    assert fingerprint(charge, ((1, 2), order), {}, bind=False) == as_list


def test_unbound_fingerprint_refuses_key_args() -> None:
    with pytest.raises(TypeError, match="key_args needs the call bound to the task's signature"):
        fingerprint(charge, (42, 100), {}, key_args=["order_id"], bind=False)


# ---- a pydantic=True task's sets: one call whatever the process (DESIGN §3) -----------------------
# Celery dumps a model argument with model_dump(mode="json"): a set field becomes a list in the set's
# iteration order, which the process's hash seed decides. The worker's validation reads it as a set.


def _tagged_task(serializer: str = "json") -> Any:
    import tagged_orders

    return tagged_orders.make_app("memory://", None, "memory://", "fp", serializer).tasks["tagged.place"]


def _fingerprint_of_dump(task: Any, dumped: dict[str, Any]) -> str:
    """The fingerprint of a message carrying ``dumped`` as the order, as the worker computes it."""
    return str(task.idempotency_handler.fingerprint((dumped,), {}))


def _dump(**overrides: Any) -> dict[str, Any]:
    import tagged_orders

    dumped: dict[str, Any] = tagged_orders.order(**overrides).model_dump(mode="json")
    return dumped


@pytest.mark.slow
@pytest.mark.parametrize("serializer", ["json", "yaml", "pickle"])
def test_a_pydantic_call_with_sets_has_one_fingerprint_in_processes_with_other_hash_seeds(serializer: str) -> None:
    # Given two producer processes whose hash seeds order every set differently
    fingerprints = [
        subprocess.run(
            [sys.executable, "tagged_orders.py", "fingerprint", serializer],
            cwd=TESTS,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    ]
    # Then both fingerprint the same call the same, and so does this process, and so does a worker
    # receiving it (the dumped lists in any order)
    task = _tagged_task(serializer)
    here = task.idempotency_handler.fingerprint(*task.idempotency_handler.as_sent((_order(),), {}, {}))
    assert fingerprints[0] == fingerprints[1] == here == _fingerprint_of_dump(_tagged_task(), _reversed_sets(_dump()))


def _order(**overrides: Any) -> Any:
    import tagged_orders

    return tagged_orders.order(**overrides)


def _reversed_sets(dumped: dict[str, Any]) -> dict[str, Any]:
    """The dump as another process may write it: every list that came from a set, reversed."""
    flipped = dict(dumped)
    for name in ("tags", "codes", "lines", "gift_tags"):
        flipped[name] = list(reversed(dumped[name]))
    flipped["by_warehouse"] = {k: list(reversed(v)) for k, v in dumped["by_warehouse"].items()}
    flipped["pair"] = [list(reversed(dumped["pair"][0])), dumped["pair"][1]]
    parcel = dumped["parcel"]
    inner = parcel["contents"][0]
    flipped["parcel"] = {
        **parcel,
        "labels": list(reversed(parcel["labels"])),
        "contents": [{**inner, "labels": list(reversed(inner["labels"]))}],
    }
    return flipped


def test_each_set_field_of_a_pydantic_argument_is_read_unordered_at_any_depth() -> None:
    task = _tagged_task()
    dumped = _dump()
    base = _fingerprint_of_dump(task, dumped)
    for name in ("tags", "codes", "lines", "gift_tags"):
        assert _fingerprint_of_dump(task, {**dumped, name: list(reversed(dumped[name]))}) == base, name
    # the worker's validation makes one set of repeated members too
    assert _fingerprint_of_dump(task, {**dumped, "tags": dumped["tags"] + dumped["tags"][:1]}) == base
    # and a set is still told apart from another set
    assert _fingerprint_of_dump(task, {**dumped, "tags": dumped["tags"][1:]}) != base
    assert _fingerprint_of_dump(task, _reversed_sets(dumped)) == base


def test_an_ordered_list_beside_the_sets_keeps_its_order() -> None:
    # A missed merge runs a call twice; a wrong one would answer a different call: lists stay lists
    task = _tagged_task()
    dumped = _dump()
    assert _fingerprint_of_dump(task, {**dumped, "ordered": list(reversed(dumped["ordered"]))}) != (
        _fingerprint_of_dump(task, dumped)
    )


def test_a_list_a_union_reads_both_as_a_set_and_in_order_keeps_its_order() -> None:
    from pydantic import BaseModel

    from celery_idem.pydantic_sets import model_shape, unordered

    class Either(BaseModel):
        values: set[str] | list[str]
        tags: set[str] | None = None

    shape = model_shape(Either)
    seen = unordered({"values": ["b", "a"], "tags": ["b", "a"]}, shape)
    assert seen["values"] == ["b", "a"]  # ambiguous: left as sent
    assert type(seen["tags"]).__name__ == "Unordered"


def test_models_without_sets_add_no_work_to_the_fingerprint() -> None:
    from celery import Celery
    from pydantic import BaseModel

    from celery_idem import Idempotency, IdempotentTask
    from celery_idem.pydantic_sets import parameter_shapes

    class Plain(BaseModel):
        order_id: int
        lines: list[str] = []
        notes: dict[str, list[int]] = {}

    app = Celery("no-sets", set_as_current=False, broker="memory://")
    Idempotency(app, store="memory://")

    @app.task(base=IdempotentTask, pydantic=True, shared=False)
    def place(order: Plain) -> None: ...

    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: int, tags: list[str]) -> None: ...

    assert parameter_shapes(place) is None and parameter_shapes(charge) is None
    assert parameter_shapes(_tagged_task()) is not None


def test_an_enum_and_a_model_carried_by_pickle_have_a_canonical_form() -> None:
    import tagged_orders

    speed = tagged_orders.Speed.EXPRESS
    assert fingerprint(one, (speed,), {}, serializer="pickle") == fingerprint(one, (speed,), {}, serializer="pickle")
    assert fingerprint(one, (speed,), {}, serializer="pickle") != fingerprint(
        one, ("express",), {}, serializer="pickle"
    )
    # A model pickled as itself is fingerprinted as its JSON form with its sets unordered: the call
    # a json task gets from Celery's dump of it
    task = _tagged_task("pickle")
    assert task.idempotency_handler.fingerprint((_order(),), {}) == _fingerprint_of_dump(_tagged_task(), _dump())


@pytest.mark.slow
@pytest.mark.parametrize("keyed", [False, True], ids=["key-less", "keyed"])
def test_the_same_pydantic_call_from_producers_with_other_hash_seeds_runs_once_on_a_real_worker(
    keyed: bool, prefix: str
) -> None:
    import redis
    import tagged_orders
    from celery.contrib.testing.worker import start_worker
    from conftest import REDIS_URL, require_server, wipe

    from celery_idem import Idempotency

    require_server("redis")
    broker, backend = REDIS_BROKER_URL, REDIS_BACKEND_URL
    app = tagged_orders.make_app(broker, backend, REDIS_URL, prefix)
    counter = redis.Redis.from_url(tagged_orders.COUNTER_URL)
    effects = f"effects:{prefix}:tagged.place"
    key = [f"{prefix}-order-7"] if keyed else []

    def send(seed: str) -> str:
        """A web process with its own hash seed sends Order 7 (its sets in that process's order)."""
        sent = subprocess.run(
            [sys.executable, "tagged_orders.py", "send", broker, backend, REDIS_URL, prefix, *key],
            cwd=TESTS,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr  # keyed, a PayloadMismatchError would end here
        return sent.stdout.strip()

    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=20):
            # Given one producer's call has run
            first = send("1")
            outcome = app.AsyncResult(first).get(timeout=20)
            # When another producer, whose hash seed orders every set otherwise, sends the same call
            second = send("2")
            # Then it is the same call: handed the first's task id and outcome, the body run once
            assert second == first and app.AsyncResult(second).get(timeout=20) == outcome
            assert int(counter.get(effects) or 0) == 1
    finally:
        counter.delete(effects)
        wipe(Idempotency.of(app).store)


# ---- plain JSON takes a short way to the same fingerprint ----------------------------------------

# Any text, surrogates too (a pair as two code points is one character once the worker decodes it).
any_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=4)
plain_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(any_text.filter(lambda k: k != "__type__"), inner, max_size=4)
    ),
    max_leaves=12,
)


def long_way(args: list[Any], kwargs: dict[str, Any], serializer: str = "json") -> str:
    """The fingerprint as every call took it before the short way: round trip, normalise, hash."""
    from celery_idem.fingerprint import _round_trip, canonical_json

    received = _round_trip({"args": list(args), "kwargs": dict(kwargs)}, serializer)
    return hashlib.sha256(canonical_json(received).encode("utf-8")).hexdigest()


def as_received(value: Any) -> Any:
    """A value as the worker's task is called with it (through kombu's json)."""
    from celery_idem.fingerprint import _round_trip

    return _round_trip(value, "json")


@settings(max_examples=300, deadline=None)
@given(st.lists(plain_values, max_size=4), st.dictionaries(any_text, plain_values, max_size=4))
def test_a_plain_json_call_has_the_fingerprint_of_the_long_way(args: list[Any], kwargs: dict[str, Any]) -> None:
    # NUL-opened keys (tagged by the long way) are drawn too: they must take the long way themselves.
    kwargs = {k: v for k, v in kwargs.items() if k != "__type__"}
    assert fingerprint(charge, args, kwargs, bind=False) == long_way(args, kwargs)


@settings(max_examples=300, deadline=None)
@given(plain_values)
def test_the_producer_and_the_worker_fingerprint_a_plain_call_alike(value: Any) -> None:
    assert fingerprint(one, (value,), {}) == fingerprint(one, (as_received(value),), {})


@pytest.mark.parametrize(
    "payload",
    [{"\ud83d\ude00": 1, "\uffff": 2}, {"\ud83d\ude00": 1, "\U0001f600": 2}],
    ids=["reordered", "merged"],
)
def test_a_surrogate_pair_in_a_key_is_fingerprinted_as_the_worker_decodes_it(payload: dict[str, int]) -> None:
    # Found by an attack: the short way sorted the producer's keys, the worker sorts the decoded ones.
    assert fingerprint(one, (payload,), {}) == fingerprint(one, (as_received(payload),), {})


def test_an_app_that_registers_its_own_json_is_fingerprinted_through_it() -> None:
    """Money apps read JSON floats as Decimal: the worker gets Decimal('12.5'), so the producer must
    fingerprint through that codec, never the standard library's json."""
    import decimal as decimal_module

    from kombu import serialization
    from kombu.utils import json as kombu_json

    serialization.registry.register(
        "json",
        kombu_json.dumps,
        functools.partial(kombu_json.loads, _loads=functools.partial(json.loads, parse_float=decimal_module.Decimal)),
        content_type="application/json",
        content_encoding="utf-8",
    )
    try:
        received = as_received([42, 12.5])
        assert received == [42, decimal_module.Decimal("12.5")]
        assert fingerprint(charge, (42, 12.5), {}) == fingerprint(charge, tuple(received), {})
    finally:
        serialization.register_json()


def circular() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize("value", [10**5000, circular(), {"a": circular()}], ids=["huge-int", "cycle", "cycle-in-dict"])
def test_a_plain_looking_argument_json_cannot_dump_is_a_serialization_error(value: Any) -> None:
    with pytest.raises(SerializationError):
        fingerprint(one, (value,), {})


def test_deeply_nested_plain_json_fingerprints_as_deep_as_the_long_way() -> None:
    for depth in (100, 300, 450):
        value: Any = 0
        for _ in range(depth):
            value = [value]
        assert fingerprint(one, (value,), {}) == fingerprint(one, (as_received(value),), {})


def test_a_dict_kombu_would_decode_into_an_object_takes_the_long_way() -> None:
    # {"__type__", "__value__"} reaches the worker as the object kombu's json decodes it into.
    stamp = {"__type__": "datetime", "__value__": "2026-11-26T12:00:00"}
    assert fingerprint(charge, [stamp], {}, bind=False) == long_way([stamp], {})
    assert fingerprint(charge, [stamp], {}, bind=False) == fingerprint(
        charge, [datetime.datetime(2026, 11, 26, 12)], {}, bind=False
    )
