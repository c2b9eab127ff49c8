"""Found by an attacker: redis-py raises RedisClusterException for mistakes too (keys in two slots, a
node not in cluster mode, a db other than 0). Those are not outages: a worker fails the message after
the 8-surprise limit instead of sending it back forever; only "every node down" is an outage."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import RedisClusterException

from celery_idem import StoreUnavailableError
from celery_idem.records import Identity
from celery_idem.stores import RedisStore

PERMANENT = [
    "EVALSHA - all keys must map to the same key slot",
    "Cluster mode is not enabled on this node",
    "Argument 'db' is not possible to use in cluster mode",
    "Invalid args in command: ('EVALSHA',)",
]


@pytest.mark.parametrize("text", PERMANENT)
def test_permanent_cluster_errors_are_outages(text: str) -> None:
    store = RedisStore(redis.Redis(), key_prefix="a4")
    with pytest.raises(StoreUnavailableError) as info:
        with store._guard("acquire", Identity("", "t", "k")):
            raise RedisClusterException(text)
    assert info.value.unexpected, f"{text!r} is treated as a real outage: the message loops forever"
