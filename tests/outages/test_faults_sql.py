"""Fault injection (tests/faults.py) through a real worker on a PostgreSQL (and a MariaDB) store: the
SQL fault kinds.

test_faults.py drives the worker cells on a Redis store; here the same cells (the same checks and
helpers: test_faults.py's ``_drive``) run with the store on PostgreSQL, for every SQL fault kind:
refused, timeout, a lost reply (the statement committed, the reply never came), a read-only
transaction (a standby), a serialization failure, and an unexpected error. Each cell checks, with the
effect counted outside the library (an INCR in the task body):

(a) the effect happened at most once (here exactly once: a caller refused at claim calls again);
(b) the caller saw the outcome or a documented error within a bounded ``get``;
(c) one reconciler run, with the store healthy, leaves no record PENDING or IN_PROGRESS.

Its own module so that its worker never runs beside another in-process worker (see
test_faults_proceed.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from conftest import MARIADB_URL, POSTGRES_URL, require_server, wipe
from faults import SQL_FAULTS, Injector
from shop import make_app
from test_faults import BACKEND, BROKER, LATER, MYSQL_FAULTS, Cell, World, _drive, _world, cells

from celery_idem.stores import SQLStore

# Every call site of test_faults.py: the producer's claim and the worker's acquire, renew (the
# heartbeat), complete, fail, release by owner token (a Celery retry) and by task id (task_revoked).
SQL_SITES = ("claim", "acquire", "renew", "complete", "fail", "release_owner", "release_task_id")


@pytest.fixture(scope="module")
def sql_world(request: pytest.FixtureRequest) -> Iterator[World]:
    """A worker (on_store_error="raise") whose store is PostgreSQL (MariaDB)."""
    kind = str(request.param)
    require_server(kind)
    url = POSTGRES_URL if kind == "postgresql" else MARIADB_URL
    prefix = f"q{uuid.uuid4().hex[:10]}"
    store = SQLStore.from_url(url, key_prefix=prefix)
    store.create_schema()
    skew = store.now() - time.time()  # leases are the database's time: "later" is later than it
    later = SQLStore.from_url(url, key_prefix=prefix, clock=lambda: time.time() + skew + LATER)
    injector = Injector(store)
    app = make_app(
        broker=BROKER, backend=BACKEND, store=store, prefix=prefix, queue=prefix, inspect_timeout_seconds=0.5
    )
    try:
        yield from _world(app, store, later, prefix, injector)
    finally:
        later.close()
        wipe(store)


# On MariaDB a serialization failure is InnoDB's deadlock, which the store runs again rather than
# answer an outage (test_faults.py: test_a_deadlock_at_every_store_operation_is_run_again_then_an_outage).
WORLD_CELLS = [
    pytest.param(kind, cell.values[0], id=f"{kind}-{cell.id}")
    for kind, faults in (("postgresql", SQL_FAULTS), ("mariadb", MYSQL_FAULTS))
    for cell in cells(SQL_SITES, faults, ("raise",))
]


@pytest.mark.parametrize(("sql_world", "cell"), WORLD_CELLS, indirect=["sql_world"])
def test_a_sql_fault_at_a_worker_store_call_never_doubles_loses_or_hangs(sql_world: World, cell: Cell) -> None:
    try:
        _drive(sql_world, cell, f"k-{uuid.uuid4().hex}")
    finally:
        sql_world.faults.clear()
