"""What the model tests drive: the vocabulary of operations, one store per kind, and the judge.

An :class:`Op` is one store call, by the store's own method name and arguments; :func:`perform`
runs it on a real store or on the model (whose methods share those names), and :func:`problems`
says how a store's answer differs from the model's. The state machine and the linearizability tests
(both in tests/models/test_model_stores.py) speak this vocabulary, so a new operation is added once,
here (tests/README.md says how).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conftest import make_store
from model import QUANTUM, Model, Timeline

from celery_idem.records import ErrorInfo, Identity
from celery_idem.stores import MemoryStore, Store, store_from_url

# ---- the vocabulary: few values, so operations collide on purpose ------------------------------------

IDENTITIES = (
    Identity("", "shop.charge", "k1"),
    Identity("acme", "shop.charge", "k1"),
    Identity("", "shop.refund", "k2"),
)
FINGERPRINTS = ("fp-a", "fp-b")
TASK_IDS = ("task-1", "task-2", "task-3")
OWNERS = ("owner-1", "owner-2", "owner-3")
CALLS = (None, b"call-1", b"call-2")
RESULTS = (b'"r1"', b'{"r":2}')
ERRORS = (
    ErrorInfo(type="CardDeclined", module="shop", message="no", args=["no"]),
    ErrorInfo(type="Boom", module="shop", message="boom", args=[1, None]),
)
# Every duration and time step is a whole number of quanta (see model.py); steps land exactly on
# lease and TTL boundaries, where "expires_at <= now" counts as expired.
LEASES = (QUANTUM, 2 * QUANTUM, 3 * QUANTUM)
TTLS = (2 * QUANTUM, 8 * QUANTUM)
STEPS = (QUANTUM, 2 * QUANTUM, 4 * QUANTUM)
# How long a BUSY waiter may take to look again: none, within a TTL, and past the longest TTL.
NEXT_LOOKS = (0.0, QUANTUM, 10 * QUANTUM)
LIMITS = (1, 2, 10)

# CELERY_IDEM_MODEL_SCALE=100 runs 100 times the examples/histories; CELERY_IDEM_MODEL_SEED another seed;
SCALE = max(1, int(os.environ.get("CELERY_IDEM_MODEL_SCALE", "1")))
SEED = int(os.environ.get("CELERY_IDEM_MODEL_SEED", "20240610"))
SHRINK = os.environ.get("CELERY_IDEM_MODEL_SHRINK", "") not in ("", "0")  # minimize a failing state machine run
KINDS = ("memory", "sqlite", "postgresql", "mariadb", "redis", "redis-cluster", "django", "django-mariadb")


@dataclass(frozen=True)
class Op:
    """One store call: ``name(*args, **kwargs)``, run alike on a store and on the model."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        shown = [str(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.name}({', '.join(shown)})"


def op(name: str, *args: Any, **kwargs: Any) -> Op:
    return Op(name, args, tuple(kwargs.items()))


def perform(target: Store | Model, call: Op) -> Any:
    return getattr(target, call.name)(*call.args, **dict(call.kwargs))


def problems(call: Op, expected: Any, actual: Any, timeline: Timeline, purge: str) -> list[str]:
    """How a store's answer to ``call`` differs from the model's (empty: they agree)."""
    name = call.name
    if name in ("claim", "acquire", "complete", "fail", "release", "renew"):
        return timeline.answer_problems(expected, actual)
    if name == "get":
        return timeline.record_problems(expected, actual)
    if name == "expired_leases":
        return timeline.due_problems(expected, actual, dict(call.kwargs)["limit"])
    if name == "purge_expired":
        # Purging only frees space (what it finds depends on what the store still holds): SQL deletes
        # exactly the rows past their TTL, Redis expires keys itself (0), memory drops some lazily.
        allowed = {"exact": actual == expected, "zero": actual == 0, "at_most": 0 <= actual <= expected}[purge]
        return [] if allowed else [f"purge_expired: model at most {expected}, store {actual} ({purge})"]
    if name == "now":
        return [] if timeline.same_time(expected, actual) else [f"now: model {expected}, store {actual}"]
    return [] if expected == actual else [f"{name}: model {expected!r}, store {actual!r}"]


def random_op(rng: random.Random, identities: tuple[Identity, ...], *, with_time: bool) -> Op:
    """One random operation on ``identities`` (the linearizability test's generator)."""
    i, owner, task_id = rng.choice(identities), rng.choice(OWNERS), rng.choice(TASK_IDS)
    take = {"ttl_seconds": rng.choice(TTLS), "owner": owner, "call": rng.choice(CALLS)}
    choices: list[Callable[[], Op]] = [
        lambda: op("claim", i, rng.choice(FINGERPRINTS), task_id, pending_seconds=rng.choice(LEASES), **take),
        # the claim of a mode that keeps no outcome for new calls (until_done): a settled record is free
        lambda: op(
            "claim",
            i,
            rng.choice(FINGERPRINTS),
            task_id,
            pending_seconds=rng.choice(LEASES),
            settled_is_free=True,
            **take,
        ),
        lambda: op(
            "acquire",
            i,
            rng.choice(FINGERPRINTS),
            task_id,
            lease_seconds=rng.choice(LEASES),
            next_look_seconds=rng.choice(NEXT_LOOKS),
            retry=rng.random() < 0.5,
            **take,
        ),
        lambda: op("complete", i, owner, rng.choice(RESULTS)),
        lambda: op("fail", i, owner, rng.choice(ERRORS)),
        lambda: op("release", i, owner, pending_seconds=rng.choice((None, *LEASES)), expired_only=rng.random() < 0.2),
        lambda: op("release", i, task_id, pending_seconds=rng.choice((None, *LEASES)), fence="task_id"),
        lambda: op("renew", i, owner, lease_seconds=rng.choice(LEASES)),
        lambda: op("forget", i),
        lambda: op("get", i),
        lambda: op("expired_leases", limit=rng.choice(LIMITS)),
        lambda: op("purge_expired", limit=10),
    ]
    if with_time:
        choices.append(lambda: op("advance_clock_for_tests", rng.choice(STEPS)))
    return rng.choice(choices)()


# ---- one real store per kind, emptied between runs ---------------------------------------------------


class Harness:
    """One store of ``kind`` for a whole test; :meth:`fresh` empties it for the next run."""

    @classmethod
    def open(cls, kind: str, prefix: str, tmp_path: Any, cluster_url: Callable[[], str]) -> Harness:
        if kind == "memory":
            return cls(kind, MemoryStore(key_prefix=prefix))
        if kind == "redis-cluster":
            return cls(kind, store_from_url(cluster_url(), key_prefix=prefix))
        store = make_store(kind, tmp_path, prefix)
        if kind != "redis":
            store.create_schema()  # type: ignore[attr-defined]
        return cls(kind, store)

    def close(self) -> None:
        self.fresh()  # a cluster's keys, gone by name: wipe() would scan every node
        self.store.close()

    def __init__(self, kind: str, store: Store) -> None:
        self.kind = kind
        self.store = store
        sql = ("sqlite", "postgresql", "mariadb", "django", "django-mariadb")
        self.purge = {"memory": "at_most", **dict.fromkeys(sql, "exact")}.get(kind, "zero")

    def fresh(self) -> tuple[Store, Model, Timeline]:
        """The store emptied of this test's records, a new model, and the timeline between them."""
        if self.kind == "memory":
            self.store = MemoryStore(key_prefix=self.store.key_prefix)
        elif self.kind.startswith("redis"):
            client: Any = self.store.client  # type: ignore[attr-defined]
            for identity in IDENTITIES:  # one key per call: a cluster keeps them on several nodes
                for key in self.store.keys_for(identity):  # type: ignore[attr-defined]
                    client.delete(key)
        else:
            import sqlalchemy as sa

            table = self.store.table  # type: ignore[attr-defined]
            with self.store.engine.begin() as connection:  # type: ignore[attr-defined]
                connection.execute(sa.delete(table).where(table.c.namespace == self.store.key_prefix))
        # The model clock reads 0 now; the store's clock, whatever tests shifted it by before, is the base.
        return self.store, Model(), Timeline(self.store.now(), frozenset(OWNERS))
