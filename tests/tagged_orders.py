"""A ``pydantic=True`` task whose model holds sets, for the tests that fingerprint it in processes
with different hash seeds (tests/api/test_fingerprint.py). Module level: Celery's pydantic support and
the producer subprocesses resolve the models by name.

``python tagged_orders.py fingerprint [SERIALIZER]`` prints the fingerprint of :data:`CALL` as the producer
computes it; ``python tagged_orders.py send BROKER BACKEND STORE PREFIX [KEY]`` sends it and prints
the task id (run with another ``PYTHONHASHSEED`` each).
"""

from __future__ import annotations

import datetime
import decimal
import enum
import sys
import uuid
from typing import Any

import redis
from addresses import REDIS_COUNTER_URL
from celery import Celery
from pydantic import BaseModel, ConfigDict, Field

from celery_idem import Idempotency, IdempotentTask

COUNTER_URL = REDIS_COUNTER_URL


class Speed(enum.Enum):
    EXPRESS = "express"
    STANDARD = "standard"


class Line(BaseModel, frozen=True):
    sku: str
    quantity: int = 1


class Parcel(BaseModel):
    labels: frozenset[str] = frozenset()
    lines: set[Line] = set()
    contents: list[Parcel] = []


class TaggedOrder(BaseModel):
    """Sets at every depth: a field, a frozenset under an alias, a set of models, sets in a dict, a
    tuple and an optional, a recursive model; and the other values a JSON dump carries."""

    model_config = ConfigDict(validate_by_name=True)  # Celery's dump writes names, read back here

    order_id: int
    tags: set[str]
    codes: frozenset[int] = Field(default=frozenset(), alias="promoCodes")
    lines: set[Line] = set()
    by_warehouse: dict[str, set[str]] = {}
    pair: tuple[set[str], int] = (set(), 0)
    gift_tags: set[str] | None = None
    parcel: Parcel | None = None
    ordered: list[str] = []
    speed: Speed = Speed.STANDARD
    at: datetime.datetime | None = None
    total: decimal.Decimal = decimal.Decimal("0")
    ref: uuid.UUID | None = None
    blob: bytes = b""
    counts: dict[int, int] = {}


def order(**overrides: Any) -> TaggedOrder:
    """The call: the same data whatever the process (its sets iterate in the process's hash order)."""
    fields: dict[str, Any] = {
        "order_id": 7,
        "tags": {"gift", "fragile", "express", "oversize", "priority"},
        "promoCodes": frozenset({1001, 2002, 3003}),
        "lines": {Line(sku="alpha"), Line(sku="beta", quantity=2), Line(sku="gamma")},
        "by_warehouse": {"north": {"a1", "b2", "c3"}, "south": {"x9", "y8"}},
        "pair": ({"left", "right", "up", "down"}, 4),
        "gift_tags": {"red", "green", "blue"},
        "parcel": Parcel(
            labels=frozenset({"top", "bottom", "side"}),
            contents=[Parcel(labels=frozenset({"inner", "outer", "middle"}))],
        ),
        "ordered": ["first", "second", "third"],
        "speed": Speed.EXPRESS,
        "at": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
        "total": decimal.Decimal("12.50"),
        "ref": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "blob": b"bytes",
        "counts": {3: 1, 1: 2},
    }
    return TaggedOrder(**{**fields, **overrides})


def make_app(broker: str, backend: str | None, store: str, prefix: str, serializer: str = "json") -> Celery:
    app = Celery("tagged", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=prefix,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        task_serializer=serializer,
        accept_content=[serializer, "json"],
    )
    Idempotency(app, store=store, key_prefix=prefix, accept_pickle=serializer == "pickle")
    counter = redis.Redis.from_url(COUNTER_URL)

    @app.task(base=IdempotentTask, name="tagged.place", pydantic=True, shared=False, bind=True)
    def place(self: Any, order: TaggedOrder) -> dict[str, Any]:
        counter.incr(f"effects:{prefix}:tagged.place")  # the side effect, counted outside the library
        return {"order": order.order_id, "tags": sorted(order.tags), "key": self.request.idempotency_key}

    return app


def main(argv: list[str]) -> None:
    if argv[0] == "fingerprint":  # [serializer]
        app = make_app("memory://", None, "memory://", "fp", *argv[1:])
        task = app.tasks["tagged.place"]
        handler = task.idempotency_handler
        args, kwargs = handler.as_sent((order(),), {}, {})
        print(handler.fingerprint(args, kwargs))
    elif argv[0] == "send":
        broker, backend, store, prefix, *key = argv[1:]
        app = make_app(broker, backend, store, prefix)
        print(app.tasks["tagged.place"].apply_async((order(),), idempotency_key=key[0] if key else None).id)


if __name__ == "__main__":
    main(sys.argv[1:])
