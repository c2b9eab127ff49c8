"""The public surface (DESIGN §1, §6): names in ``__all__``, ``py.typed``, and the error tree's contract."""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
from pathlib import Path

import pytest

import celery_idem
from celery_idem import errors

# DESIGN §1 fixes these names; outside code and tests import them from the package root.
REQUIRED_NAMES = {
    "ReconcileReport",
    "Idempotency",
    "IdempotentTask",
    "idempotent_task",
    "IdempotencyPolicy",
    "IdempotencySettings",
    "IdempotencyRecord",
    "State",
    "IdempotencyError",
    "InvalidKeyError",
    "PayloadMismatchError",
    "DuplicateTaskError",
    "StoreUnavailableError",
    "LockLostError",
    "ReplayedFailureError",
    "RetryableError",
    "PermanentError",
}

# What a user of each module needs from the package root: {module: names it must export there}.
# Internals (Decision, Identity, ErrorInfo, Handler, POLICY_FIELDS, COUNTERS...) are left out.
USER_FACING = {
    "celery_idem.config": {"IdempotencyPolicy", "IdempotencySettings"},
    "celery_idem.decorators": {"idempotent_task"},
    "celery_idem.errors": set(errors.__all__),
    "celery_idem.extension": {"Idempotency"},
    "celery_idem.records": {"IdempotencyRecord", "State"},
    "celery_idem.result": {"IdempotentResult"},
    "celery_idem.stores": {"MemoryStore", "Store", "store_from_url"},
    "celery_idem.task": {"IdempotentTask"},
}

MARKERS = (errors.RetryableError, errors.PermanentError)


def _error_classes() -> list[type[BaseException]]:
    """Every exception class defined in celery_idem.errors (not merely imported there)."""
    return [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__
    ]


ERROR_CLASSES = _error_classes()
LIBRARY_ERRORS = [cls for cls in ERROR_CLASSES if cls not in MARKERS]


def _ids(classes: list[type[BaseException]]) -> list[str]:
    return [cls.__name__ for cls in classes]


# --- __all__ -------------------------------------------------------------------------------------


def test_all_is_sorted() -> None:
    assert celery_idem.__all__ == sorted(celery_idem.__all__)


def test_all_has_no_duplicates() -> None:
    assert len(celery_idem.__all__) == len(set(celery_idem.__all__))


@pytest.mark.parametrize("name", celery_idem.__all__)
def test_every_name_in_all_is_importable_from_the_package(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from celery_idem import {name}", namespace)  # the exact statement a user writes

    assert namespace[name] is getattr(celery_idem, name)


def test_all_contains_every_name_the_design_requires() -> None:
    missing = REQUIRED_NAMES - set(celery_idem.__all__)

    assert not missing, f"DESIGN §1 names missing from celery_idem.__all__: {sorted(missing)}"


def test_all_exports_nothing_private() -> None:
    private = [name for name in celery_idem.__all__ if name.startswith("_")]

    assert not private


@pytest.mark.parametrize(("module_name", "names"), sorted(USER_FACING.items()))
def test_user_facing_names_of_each_module_are_exported_from_the_root(module_name: str, names: set[str]) -> None:
    module = importlib.import_module(module_name)

    for name in names:
        assert name in celery_idem.__all__, f"{module_name}.{name} is not in celery_idem.__all__"
        assert getattr(celery_idem, name) is getattr(module, name)


def test_every_error_class_is_exported_from_the_root() -> None:
    # Users catch these by name: none may be reachable only through celery_idem.errors.
    assert set(_ids(ERROR_CLASSES)) <= set(celery_idem.__all__)


@pytest.mark.parametrize("name", celery_idem.__all__)
def test_every_exported_class_and_function_has_a_docstring(name: str) -> None:
    value = getattr(celery_idem, name)
    if not (inspect.isclass(value) or inspect.isfunction(value)):
        pytest.skip(f"{name} is not a class or function")

    assert inspect.getdoc(value), f"celery_idem.{name} has no docstring"


def test_lazy_store_classes_are_reachable_from_the_stores_package() -> None:
    from celery_idem.stores import RedisStore, SQLStore, Store

    assert issubclass(RedisStore, Store)
    assert issubclass(SQLStore, Store)


# --- typing --------------------------------------------------------------------------------------


def test_py_typed_ships_in_the_package_directory() -> None:
    package_dir = Path(celery_idem.__file__).parent

    assert (package_dir / "py.typed").is_file()


# --- the error tree ------------------------------------------------------------------------------


def test_the_error_module_defines_the_whole_tree() -> None:
    # Guard for the parametrized tests below: they must not pass by iterating over nothing.
    assert {"IdempotencyError", "RetryableError", "PermanentError", "ReplayedFailureError"} <= set(_ids(ERROR_CLASSES))


@pytest.mark.parametrize("cls", LIBRARY_ERRORS, ids=_ids(LIBRARY_ERRORS))
def test_library_errors_are_idempotency_errors(cls: type[BaseException]) -> None:
    assert issubclass(cls, errors.IdempotencyError)


@pytest.mark.parametrize("cls", MARKERS, ids=_ids(list(MARKERS)))
def test_markers_are_plain_exceptions_outside_the_library_tree(cls: type[BaseException]) -> None:
    # Users raise these from their own code; catching IdempotencyError must not swallow them.
    assert issubclass(cls, Exception)
    assert not issubclass(cls, errors.IdempotencyError)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=_ids(ERROR_CLASSES))
def test_every_error_class_has_a_one_line_docstring(cls: type[BaseException]) -> None:
    doc = cls.__doc__

    assert doc and doc.strip(), f"{cls.__name__} has no docstring"
    assert "\n" not in doc.strip(), f"{cls.__name__}'s docstring is not one line: {doc!r}"


def _instance(cls: type[BaseException]) -> BaseException:
    """An error as the library raises it: a message and, for library errors, its context."""
    if issubclass(cls, errors.IdempotencyError):
        return cls("order-42 went wrong", key="order-42", task_name="shop.charge", task_id="tid-1")
    return cls("order-42 went wrong")


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=_ids(ERROR_CLASSES))
def test_every_error_rebuilds_from_its_positional_args(cls: type[BaseException]) -> None:
    original = _instance(cls)

    rebuilt = cls(*original.args)

    assert type(rebuilt) is cls
    assert str(rebuilt) == str(original) == "order-42 went wrong"


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=_ids(ERROR_CLASSES))
def test_every_error_rebuilds_from_args_shipped_through_json(cls: type[BaseException]) -> None:
    # Given: Celery ships a task's exception as its type name and args through JSON
    original = _instance(cls)
    shipped = json.loads(json.dumps({"exc_type": cls.__name__, "exc_message": original.args}))

    # When: a producer that only has plain Celery rebuilds it
    rebuilt = getattr(errors, shipped["exc_type"])(*shipped["exc_message"])

    # Then: it sees the same class and message
    assert type(rebuilt) is cls
    assert str(rebuilt) == str(original)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=_ids(ERROR_CLASSES))
def test_every_error_survives_pickle_with_its_context(cls: type[BaseException]) -> None:
    original = _instance(cls)

    restored = pickle.loads(pickle.dumps(original))

    assert type(restored) is cls
    assert str(restored) == str(original)
    assert restored.args == original.args
    if isinstance(original, errors.IdempotencyError):
        assert isinstance(restored, errors.IdempotencyError)
        assert (restored.key, restored.task_name, restored.task_id) == ("order-42", "shop.charge", "tid-1")
        assert restored.message == original.message


@pytest.mark.parametrize("cls", LIBRARY_ERRORS, ids=_ids(LIBRARY_ERRORS))
def test_context_attributes_default_to_none_when_rebuilt_from_args(cls: type[BaseException]) -> None:
    rebuilt = cls("only a message")

    assert isinstance(rebuilt, errors.IdempotencyError)
    assert (rebuilt.key, rebuilt.task_name, rebuilt.task_id) == (None, None, None)
