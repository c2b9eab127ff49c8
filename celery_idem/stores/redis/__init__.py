"""RedisStore: records as Redis hashes, transitions as Lua scripts, TTLs by Redis expiry; Redis,
Sentinel and Cluster.

By concern: ``store``, the store class and every operation that runs a script; ``base``, what it
stands on (its client and scripts, the key layout, what redis-py's errors mean, the plain reads);
``scripts``, the Lua scripts (``lua/``) and the record hashes they write; ``client``, the redis-py
client a store URL names.
"""

from __future__ import annotations

from ...errors import ConfigurationError

try:  # the extra, checked here once for every module of the package
    import redis  # noqa: F401
    import redis.backoff  # noqa: F401
    import redis.commands.core  # noqa: F401
    import redis.retry  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("RedisStore needs redis-py: pip install 'celery-idem[redis]'") from exc

from .base import INDEX_SHARDS
from .store import RedisStore

__all__ = ["INDEX_SHARDS", "RedisStore"]
