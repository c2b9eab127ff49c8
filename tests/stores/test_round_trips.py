"""Round trips per store transition, held as counts, on every store.

One atomic round trip per transition is a design rule (STYLE.md, "Stores"); here a change that adds
one fails a test instead of showing up, maybe, in a benchmark table. The counting is
benchmarks/_common.py's ``account``, the code benchmarks/store_ops.py reports its round trips
with, on the same transitions (claim of a new key, claim of a duplicate, acquire, complete), with
the store built as the benchmark builds it: on the server's clock, not an injected one. Speed is
never asserted, only counts.

- Redis: the requests redis-py writes (round trips) and the commands it sends, on the client side.
  The benchmark's server-side cross-check (``INFO commandstats``, which also counts what the Lua
  scripts run) is server-wide: other tests' commands would land in it, so it is left out here.
- PostgreSQL: round trips from a libpq trace (one per ``ReadyForQuery``), the statements
  SQLAlchemy runs, and the extended-protocol messages; no Parse, because psycopg prepares a
  statement once it has run it five times, and the warm-up runs each one more often than that.
- SQLite: in-process, no round trips; the statements SQLAlchemy runs and every statement sqlite3
  runs (with the ``PRAGMA`` SQLAlchemy sends when the pool hands out a connection).
- MariaDB: every command PyMySQL sends waits for its reply (one round trip each), the statements
  SQLAlchemy runs, and the queries the driver sends (its own included: none, since the pool's
  rollback of an autocommit connection is skipped).
- memory: in-process; nothing to count.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_store, wipe

from celery_idem.stores import MemoryStore, Store

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks live beside the package, not inside it
    sys.path.insert(0, str(ROOT))

from benchmarks._common import ACCOUNTED, InProcess, account, wire_for  # noqa: E402

WARM = 10  # operations per transition before counting: connections, scripts, schema, prepared statements
COUNTED = 10  # operations per counted transition


def _per_op(round_trips: int | None, commands: dict[str, int], driver: dict[str, int]) -> dict[str, Any]:
    return {"round_trips": round_trips, "commands": commands, "driver": driver}


# What benchmarks/store_ops.py reported per operation at the commit that added this test.
EXPECTED: dict[str, dict[str, dict[str, Any]]] = {
    "memory": {transition: _per_op(None, {}, {}) for transition in ACCOUNTED},
    # SQLite's PRAGMA a statement (the switch of a pooled connection to autocommit and back) is gone
    # since the store's engine is in autocommit mode itself.
    "sqlite": {
        "claim (new)": _per_op(None, {"INSERT": 1}, {"INSERT": 1}),
        # The upsert that takes nothing, then the read of the record that holds the key.
        "claim (duplicate)": _per_op(None, {"INSERT": 1, "SELECT": 1}, {"INSERT": 1, "SELECT": 1}),
        "acquire": _per_op(None, {"INSERT": 1}, {"INSERT": 1}),
        "complete": _per_op(None, {"UPDATE": 1}, {"UPDATE": 1}),
    },
    "redis": {transition: _per_op(1, {"EVALSHA": 1}, {}) for transition in ACCOUNTED},
    "postgresql": {
        "claim (new)": _per_op(1, {"INSERT": 1}, {"Bind": 1, "Execute": 1, "Sync": 1}),
        "claim (duplicate)": _per_op(2, {"INSERT": 1, "SELECT": 1}, {"Bind": 2, "Execute": 2, "Sync": 2}),
        "acquire": _per_op(1, {"INSERT": 1}, {"Bind": 1, "Execute": 1, "Sync": 1}),
        "complete": _per_op(1, {"UPDATE": 1}, {"Bind": 1, "Execute": 1, "Sync": 1}),
    },
    # claim and acquire are one Locked transaction: START, the locking SELECT, the INSERT (a new
    # key) or the conditional UPDATE, the SELECT that reads the row back (when it wrote), COMMIT; a
    # duplicate's UPDATE takes nothing, and the record is then read as on the other databases.
    "mariadb": {
        "claim (new)": _per_op(5, {"COMMIT": 1, "INSERT": 1, "SELECT": 2, "START": 1}, {}),
        "claim (duplicate)": _per_op(5, {"COMMIT": 1, "SELECT": 2, "START": 1, "UPDATE": 1}, {}),
        "acquire": _per_op(5, {"COMMIT": 1, "INSERT": 1, "SELECT": 2, "START": 1}, {}),
        "complete": _per_op(1, {"UPDATE": 1}, {"UPDATE": 1}),
    },
}
for _transition, _counts in EXPECTED["mariadb"].items():  # the driver sends just what SQLAlchemy runs
    _counts["driver"] = dict(_counts["commands"])


@pytest.fixture
def server_clock_store(store_kind: str, tmp_path: Any, prefix: str) -> Iterator[Store]:
    """The store as benchmarks/store_ops.py builds it (the conftest ``store`` injects a fake clock)."""
    store = MemoryStore(key_prefix=prefix) if store_kind == "memory" else make_store(store_kind, tmp_path, prefix)
    yield store
    wipe(store)


def test_each_transition_makes_the_round_trips_the_benchmark_reports(
    store_kind: str, server_clock_store: Store
) -> None:
    account(server_clock_store, WARM, "w", InProcess())
    counted = account(server_clock_store, COUNTED, "c", wire_for(server_clock_store))
    per_op = {transition: tally.per_op(COUNTED) for transition, tally in counted.items()}
    assert per_op == EXPECTED[store_kind]
