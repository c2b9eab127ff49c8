from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import shop_worker
from celery import chord, group, signals
from shop import effects_key
from shop_worker import GET, Shop
from shop_worker import until as _until

shop = shop_worker.shop
key = shop_worker.key


@pytest.fixture
def captured() -> Any:
    sent: list[dict[str, Any]] = []

    def keep(sender: Any = None, headers: Any = None, body: Any = None, **kw: Any) -> None:
        if str(sender) == "shop.charge":
            sent.append({"headers": dict(headers), "body": body, "kw": kw})

    signals.before_task_publish.connect(keep, weak=False)
    yield sent
    signals.before_task_publish.disconnect(keep)


def test_chord_of_duplicates(shop: Shop, key: str, captured) -> None:
    charge, noted = shop.task("charge"), shop.task("noted")
    order = int(uuid.uuid4().int % 10**9)
    assert charge.apply_async((order, 70), idempotency_key=key).get(timeout=GET)["charged"] == 70
    tag = uuid.uuid4().hex
    c = chord([charge.s(order, 70).set(idempotency_key=key), charge.s(order, 70).set(idempotency_key=key)], noted.s(tag))
    res = c.apply_async()
    body = effects_key(shop.prefix, "shop.noted", tag)
    _until(lambda: shop.counter.get(body) is not None)
    time.sleep(1)
    assert int(shop.counter.get(body)) == 1
    # copy of a member message
    m = [c for c in captured if c["headers"].get("chord") or c["body"][2].get("chord")][-1]
    hdr = m["headers"]
    args, kwargs, embed = m["body"]
    print(hdr, embed)
    shop.app.send_task(
        "shop.charge", args, kwargs, task_id=hdr["id"], headers={"idempotency_key": key},
        chord=embed.get("chord"), group_id=hdr.get("group"), group_index=hdr.get("group_index"), queue=shop.prefix,
    )
    time.sleep(2)
    assert int(shop.counter.get(body)) == 1
    assert shop.effects("charge", key) == 1


def test_group_of_failed_duplicates_link_error(shop: Shop, key: str) -> None:
    declined, noted_error = shop.task("declined"), shop.task("noted_error")
    order = int(uuid.uuid4().int % 10**9)
    first = declined.apply_async((order,), idempotency_key=key)
    with pytest.raises(Exception):
        first.get(timeout=GET)
    tag = uuid.uuid4().hex
    dup = declined.apply_async((order,), idempotency_key=key, link_error=noted_error.s(tag))
    errs = effects_key(shop.prefix, "shop.noted_error", tag)
    _until(lambda: shop.counter.get(errs) is not None)
    shop.app.send_task("shop.declined", (order,), task_id=dup.id, headers={"idempotency_key": key},
                       link_error=noted_error.s(tag), queue=shop.prefix)
    time.sleep(2)
    assert int(shop.counter.get(errs)) == 1
