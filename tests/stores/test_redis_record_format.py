"""The Redis store's record formats: a settled record is written packed (``lua/_prelude.lua``) and
read back as the very record the store settled, whatever its fields hold; a settled record written
before the packed format (a hash with every field) is still read and answered by every script.

The semantics are every store's (test_store_semantics.py, the model checker); this module checks
what only the Redis layout can get wrong: each field's encoding round trip, including the values
the compact encodings special-case (a lowercase hex fingerprint, a canonical UUID task id) and the
values they must leave alone (upper case, other lengths, other text).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import make_store, wipe

from celery_idem.records import Decision, ErrorInfo, Identity, State, owner_digest
from celery_idem.stores import Store

HEX_FP = "0123456789abcdef" * 4
CELERY_ID = "6f1c2e8a-1111-4222-8333-444455556666"


@pytest.fixture
def redis_store(tmp_path: Any) -> Iterator[Store]:
    store = make_store("redis", tmp_path, f"fmt{uuid.uuid4().hex[:8]}")
    yield store
    wipe(store)


def _settle(
    store: Store,
    identity: Identity,
    fp: str,
    task_id: str,
    *,
    prev: str | None = None,
    failed: bool = False,
    **content: str,
) -> tuple[str, Any]:
    if prev is not None:
        # An attempt under ``prev`` whose lease ran out, taken over by ``task_id``: the record keeps ``prev``
        store.acquire(identity, fp, prev, lease_seconds=0.001, ttl_seconds=600)
        store.advance_clock_for_tests(1)
    taken = store.acquire(identity, fp, task_id, lease_seconds=60, ttl_seconds=600)
    assert taken.decision is Decision.RUN and taken.record is not None
    owner = taken.record.owner
    if failed:
        assert store.fail(identity, owner, ErrorInfo(type="Declined", module="shop", message="ü no", args=[1, "x"])).ok
    else:
        assert store.complete(identity, owner, b'{"paid": true}', **content).ok
    return owner, taken.record


@pytest.mark.parametrize(
    ("fp", "task_id", "prev"),
    [
        pytest.param(HEX_FP, CELERY_ID, None, id="hex-fingerprint-uuid-id"),
        pytest.param(HEX_FP.upper(), CELERY_ID.upper(), None, id="upper-case-kept-as-given"),
        pytest.param("fp-a", "task-1", None, id="other-text"),
        pytest.param(HEX_FP[:-1], CELERY_ID.replace("-", ""), None, id="near-misses"),
        pytest.param("f" * 300, "t" * 200, None, id="long-values"),
        pytest.param(HEX_FP, "t" * 70_000, "p" * 65_536, id="ids-past-a-two-byte-length"),
        pytest.param(HEX_FP, CELERY_ID, str(uuid.uuid4()), id="previous-task-id-uuid"),
        pytest.param(HEX_FP, CELERY_ID, "earlier-attempt", id="previous-task-id-text"),
    ],
)
def test_a_settled_record_reads_back_exactly_as_settled(
    redis_store: Store, fp: str, task_id: str, prev: str | None
) -> None:
    identity = Identity("scope:ü", "shop:charge", "order:42:ü")
    owner, taken = _settle(redis_store, identity, fp, task_id, prev=prev)
    record = redis_store.get(identity)
    assert record is not None and record.state is State.COMPLETED
    assert (record.scope, record.task_name, record.key) == identity
    assert (record.fingerprint, record.task_id, record.previous_task_id) == (fp, task_id, prev)
    assert (record.result, record.content_type, record.content_encoding) == (
        b'{"paid": true}',
        "application/json",
        "utf-8",
    )
    assert record.attempt == taken.attempt and record.created_at == taken.created_at
    assert record.ttl_seconds == 600 and record.lease_expires_at is None and record.call is None
    # What it keeps of its owner tells the owner from anyone else
    assert record.owner == owner_digest(owner) and record.held_by(owner) and not record.held_by(owner + "x")
    # And every script reads it: a duplicate is handed it, other arguments are refused
    again = redis_store.claim(identity, fp, "another-id", pending_seconds=60, ttl_seconds=600)
    assert again.decision is Decision.REPLAY and again.record == record
    assert redis_store.claim(identity, fp + "x", "x", pending_seconds=60, ttl_seconds=600).decision is Decision.MISMATCH
    assert redis_store.acquire(identity, fp, "x", lease_seconds=60, ttl_seconds=600).decision is Decision.REPLAY
    # The scan the operators' commands read finds it with its identity, from the key alone
    assert [r for r in redis_store.records() if r.identity == identity] == [record]


def test_an_attempt_count_past_two_bytes_reads_back(redis_store: Store) -> None:
    # A task retried without bound (max_retries=None) counts its attempts past 65,535
    identity = Identity("", "shop.poll", "many-attempts")
    redis_store.claim(identity, HEX_FP, CELERY_ID, pending_seconds=60, ttl_seconds=600)
    taken = redis_store.acquire(identity, HEX_FP, CELERY_ID, lease_seconds=60, ttl_seconds=600)
    assert taken.record is not None
    redis_store.client.hset(redis_store.keys_for(identity)[0], "attempt", "70000")  # type: ignore[attr-defined]
    assert redis_store.complete(identity, taken.record.owner, b"1").ok
    record = redis_store.get(identity)
    assert record is not None and record.attempt == 70_000
    # and the chain rule (a retry of the settled task id, other arguments) still sees an attempt that ran
    again = redis_store.acquire(identity, "c" * 64, CELERY_ID, lease_seconds=60, ttl_seconds=600, retry=True)
    assert again.decision is Decision.REPLAY


def test_a_failure_and_another_content_type_read_back(redis_store: Store) -> None:
    failed = Identity("", "shop.charge", "failed")
    _settle(redis_store, failed, HEX_FP, CELERY_ID, failed=True)
    record = redis_store.get(failed)
    assert record is not None and record.state is State.FAILED and record.result is None
    assert record.error == ErrorInfo(type="Declined", module="shop", message="ü no", args=[1, "x"])
    assert (record.content_type, record.content_encoding) == (None, None)
    other = Identity("", "shop.charge", "msgpack")
    _settle(redis_store, other, HEX_FP, CELERY_ID, content_type="application/x-msgpack", content_encoding="binary")
    record = redis_store.get(other)
    assert record is not None and (record.content_type, record.content_encoding) == ("application/x-msgpack", "binary")


def test_a_settled_record_written_before_the_packed_format_is_still_read(redis_store: Store) -> None:
    # Given a COMPLETED record as the store wrote it before the packed format: a hash with every field
    identity = Identity("", "shop.charge", "old")
    key = redis_store.keys_for(identity)[0]  # type: ignore[attr-defined]
    now = redis_store.now()
    redis_store.client.hset(  # type: ignore[attr-defined]
        key,
        mapping={
            "scope": "", "task": "shop.charge", "key": "old", "fp": HEX_FP, "state": "COMPLETED",
            "task_id": CELERY_ID, "owner": "a-whole-owner-token", "attempt": "1",
            "created": f"{now:.6f}", "updated": f"{now:.6f}", "expires": f"{now + 600:.6f}", "ttl": "600.0",
            "result": b'{"paid": true}', "ctype": "application/json", "cenc": "utf-8",
        },
    )  # fmt: skip
    redis_store.client.pexpire(key, 600_000)  # type: ignore[attr-defined]
    # Then it reads as it did, and every script answers from it
    record = redis_store.get(identity)
    assert record is not None and record.state is State.COMPLETED and record.owner == "a-whole-owner-token"
    assert record.result == b'{"paid": true}' and record.held_by("a-whole-owner-token")
    assert redis_store.claim(identity, HEX_FP, "x", pending_seconds=60, ttl_seconds=600).decision is Decision.REPLAY
    assert redis_store.acquire(identity, "0" * 64, "x", lease_seconds=60, ttl_seconds=600).decision is Decision.MISMATCH
    assert [r.identity for r in redis_store.records()] == [identity]
    assert redis_store.forget(identity) and redis_store.get(identity) is None


def test_a_record_in_an_unknown_format_is_an_error_never_a_guess(redis_store: Store) -> None:
    identity = Identity("", "shop.charge", "future")
    key = redis_store.keys_for(identity)[0]  # type: ignore[attr-defined]
    redis_store.client.set(key, b"\x09" + b"\x00" * 60, px=600_000)  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="unknown format"):
        redis_store.claim(identity, HEX_FP, "x", pending_seconds=60, ttl_seconds=600)
    with pytest.raises(Exception, match="unknown format"):
        redis_store.get(identity)


def test_a_scan_reads_a_record_that_changed_type_between_its_reads(redis_store: Store, tmp_path: Any) -> None:
    # Given a settled record (a string) that is forgotten and claimed again (a hash) by another
    # process between the scan's read of hashes and its read of strings
    identity = Identity("", "shop.charge", "changes-type")
    _settle(redis_store, identity, HEX_FP, CELERY_ID)
    other = make_store("redis", tmp_path, redis_store.key_prefix)
    client: Any = redis_store.client  # type: ignore[attr-defined]
    pipelines, real = [0], client.pipeline

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipelines[0] += 1
        if pipelines[0] == 2:
            other.forget(identity)
            other.claim(identity, HEX_FP, "another-call", pending_seconds=60, ttl_seconds=600)
        return real(*args, **kwargs)

    client.pipeline = pipeline
    try:
        # Then the scan answers with the record as it stands, instead of failing the operators' list
        assert [(r.task_id, r.state) for r in redis_store.records()] == [("another-call", State.PENDING)]
    finally:
        client.pipeline = real
        other.close()
