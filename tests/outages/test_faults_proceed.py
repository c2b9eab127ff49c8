"""Fault injection (tests/faults.py) where on_store_error="proceed" decides: claim and acquire.

Its own module so that its worker never runs beside test_faults.py's (two in-process workers in one
process share Celery's worker state, and the second one's shutdown can hang). The cells, the checks
and the helpers are test_faults.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from faults import REDIS_FAULTS
from test_faults import Cell, World, _drive, _redis_world, cells


@pytest.fixture(scope="module")
def proceed_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A worker with on_store_error="proceed" (fail open)."""
    yield from _redis_world("proceed", tmp_path_factory)


@pytest.mark.parametrize("cell", cells(("claim", "acquire"), REDIS_FAULTS, ("proceed",)))
def test_a_fault_where_on_store_error_proceed_runs_unprotected_once(proceed_world: World, cell: Cell) -> None:
    try:
        _drive(proceed_world, cell, f"k-{uuid.uuid4().hex}")
    finally:
        proceed_world.faults.clear()
