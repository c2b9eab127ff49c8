"""The ledger against real PostgreSQL and SQLite: one business effect per identity. The first execution
commits the effect and its ledger row together and a later one returns the committed outcome without
running; an fn that raises rolls both back and the next execution runs; a key-less call is keyed by its
fingerprint; other arguments under a committed key are refused; a committed outcome claiming pickle is
never unpickled unless the app accepts pickle.

Every execution runs through a real idempotent task (eager app, memory store), so the handler sets the
request's key, scope and fingerprint exactly as a worker does; side effects are counted outside the
library, as rows of a business table with no unique constraint and calls of the effect function. The
apps and the ``db`` fixture (SQLite, then PostgreSQL) are tests/ledger_shop.py's.
"""

from __future__ import annotations

import pickle
from typing import Any

import ledger_shop
import pytest
import sqlalchemy as sa
from conftest import PICKLE, Planted
from ledger_shop import TASK, CardDeclined, Db, pay, shop_app

from celery_idem import Idempotency, PayloadMismatchError, SerializationError
from celery_idem.records import Identity

db = ledger_shop.db
key = ledger_shop.key


# ---- once ---------------------------------------------------------------------------------------


def test_first_execution_commits_effect_and_ledger_row_and_a_later_one_returns_it_without_running(
    db: Db, key: str
) -> None:
    calls: list[str] = []
    # When the call runs for the first time
    first_id, first = pay(shop_app(db.ledger, db.payments, calls), 1, 100, key)
    # Then the effect and the ledger row are committed, and the task returns fn's value
    assert first == {"order": 1, "paid": 100, "task_id": first_id}
    assert calls == [first_id]
    assert [(r.order_id, r.amount, r.task_id) for r in db.payment_rows()] == [(1, 100, first_id)]
    [row] = db.ledger_rows()
    assert (row.scope, row.task_name, row.key, row.task_id, row.outcome) == ("", TASK, key, first_id, "COMPLETED")

    # When the same call runs again on a worker whose store knows nothing of it (a lost lease, a dead worker)
    second_id, second = pay(shop_app(db.ledger, db.payments, calls), 1, 100, key)
    # Then fn is not called again and the committed outcome comes back, with the first task's id in it
    assert second_id != first_id
    assert second == first
    assert calls == [first_id]
    assert len(db.payment_rows()) == 1
    assert len(db.ledger_rows()) == 1


def test_lookup_is_none_before_and_the_committed_entry_after(db: Db, key: str) -> None:
    identity = Identity("", TASK, key)
    assert db.ledger.lookup(identity) is None
    app = shop_app(db.ledger, db.payments, [])
    task_id, value = pay(app, 2, 250, key)
    entry = db.ledger.lookup(identity)
    assert entry is not None
    assert entry.identity == identity
    assert entry.task_id == task_id
    assert entry.value() == value == {"order": 2, "paid": 250, "task_id": task_id}
    assert entry.content_type == "application/json"
    # The ledger holds the fingerprint of the call, the same one the store recorded.
    record = Idempotency.of(app).get(TASK, key)
    assert record is not None and entry.fingerprint == record.fingerprint
    # Another key, another task name or a scope is another identity.
    assert db.ledger.lookup(Identity("", TASK, key + "x")) is None
    assert db.ledger.lookup(Identity("", "ledger.other", key)) is None
    assert db.ledger.lookup(Identity("eu", TASK, key)) is None


def test_same_key_in_two_scopes_is_two_identities_each_run_once(db: Db, key: str) -> None:
    calls: list[str] = []
    eu_id, eu = pay(shop_app(db.ledger, db.payments, calls), 3, 30, key, scope="eu")
    us_id, us = pay(shop_app(db.ledger, db.payments, calls), 3, 30, key, scope="us")
    _, eu_again = pay(shop_app(db.ledger, db.payments, calls), 3, 30, key, scope="eu")
    assert calls == [eu_id, us_id]
    assert eu["task_id"] == eu_id and us["task_id"] == us_id and eu_again == eu
    assert len(db.payment_rows()) == 2
    assert {(r.scope, r.key) for r in db.ledger_rows()} == {("eu", key), ("us", key)}
    assert db.ledger.lookup(Identity("", TASK, key)) is None


# ---- failure, mismatch --------------------------------------------------------------------------


def test_fn_raising_rolls_back_effect_and_ledger_row_and_a_later_execution_runs(db: Db, key: str) -> None:
    calls: list[str] = []
    failing = shop_app(db.ledger, db.payments, calls, fail=True)
    # When fn inserts its row and then raises
    with pytest.raises(CardDeclined, match="card declined for order 4"):
        pay(failing, 4, 40, key)
    # Then the exception propagated and nothing was committed: no business row, no ledger row
    assert len(calls) == 1
    assert db.payment_rows() == []
    assert db.ledger_rows() == []
    assert db.ledger.lookup(Identity("", TASK, key)) is None
    # And a later execution of the same call runs fn and commits
    task_id, value = pay(shop_app(db.ledger, db.payments, calls), 4, 40, key)
    assert len(calls) == 2 and calls[1] == task_id
    assert value == {"order": 4, "paid": 40, "task_id": task_id}
    assert [r.task_id for r in db.payment_rows()] == [task_id]
    assert [r.task_id for r in db.ledger_rows()] == [task_id]


def test_keyless_calls_are_keyed_by_their_fingerprint_in_the_ledger(db: Db) -> None:
    calls: list[str] = []
    # Two workers run the same key-less call (a redelivery to a worker whose store lost it)
    first = shop_app(db.ledger, db.payments, calls).tasks[TASK].apply_async((9, 90))
    second = shop_app(db.ledger, db.payments, calls).tasks[TASK].apply_async((9, 90))
    assert second.get() == first.get() == {"order": 9, "paid": 90, "task_id": first.id}
    assert calls == [first.id] and len(db.payment_rows()) == 1
    entry = db.ledger.lookup(Identity("", TASK, first.idempotency_key))
    assert entry is not None and entry.task_id == first.id and entry.fingerprint == first.idempotency_key


def test_committed_row_for_other_arguments_raises_payload_mismatch_without_running(db: Db, key: str) -> None:
    calls: list[str] = []
    first_id, _ = pay(shop_app(db.ledger, db.payments, calls), 5, 500, key)
    # When the same key reaches the ledger with another amount (a store that lost the record)
    with pytest.raises(PayloadMismatchError, match="other arguments") as raised:
        pay(shop_app(db.ledger, db.payments, calls), 5, 999, key)
    # Then it is refused, naming the committed task, and nothing else ran or was written
    assert raised.value.key == key and raised.value.task_name == TASK and raised.value.task_id == first_id
    assert calls == [first_id]
    assert [(r.amount, r.task_id) for r in db.payment_rows()] == [(500, first_id)]
    assert len(db.ledger_rows()) == 1


# ---- safe decode ---------------------------------------------------------------------------------


def test_a_ledger_row_claiming_pickle_is_never_unpickled_without_accept_pickle(db: Db, key: str, tmp_path: Any) -> None:
    calls: list[str] = []
    first_id, _ = pay(shop_app(db.ledger, db.payments, calls), 4, 40, key)
    # Given the committed row's outcome replaced by a pickle that would create a directory when loaded
    flag = tmp_path / "unpickled"
    with db.engine.begin() as connection:
        connection.execute(
            sa.update(db.ledger.table)
            .where(db.ledger.table.c.key == key)
            .values(result=pickle.dumps(Planted(str(flag))), content_type=PICKLE, content_encoding="binary")
        )
    # When another execution of the call reaches the ledger, and when the entry is read directly
    with pytest.raises(SerializationError, match="application/x-python-serialize") as raised:
        pay(shop_app(db.ledger, db.payments, calls), 4, 40, key)
    entry = db.ledger.lookup(Identity("", TASK, key))
    assert entry is not None
    with pytest.raises(SerializationError, match="does not accept"):
        entry.value()
    # Then it is refused clearly and nothing was unpickled; fn did not run again
    assert raised.value.key == key and raised.value.task_id == first_id
    assert not flag.exists()
    assert calls == [first_id] and len(db.payment_rows()) == 1

    # An app that opted in with accept_pickle=True decodes it
    trusting = shop_app(db.ledger, db.payments, calls)
    Idempotency(trusting, accept_pickle=True)
    assert pay(trusting, 4, 40, key)[1] is None  # what os.makedirs returned
    assert flag.exists()
    assert calls == [first_id]
