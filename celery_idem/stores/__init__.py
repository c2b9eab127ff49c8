"""Stores: where records live. Pick one by URL with :func:`store_from_url`.

=========================================================  ================  =====================
URL                                                        store             extra
=========================================================  ================  =====================
``redis://``, ``rediss://``, ``redis+sentinel://``,        RedisStore        ``celery-idem[redis]``
``redis+cluster://``
``postgresql+psycopg://``, ``postgresql://``,              SQLStore          ``celery-idem[sql]``
``sqlite:///path``
``memory://``                                              MemoryStore       (none)
=========================================================  ================  =====================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from .base import Store
from .memory import MemoryStore

if TYPE_CHECKING:
    from .redis import RedisStore
    from .sql import SQLStore

__all__ = ["MemoryStore", "RedisStore", "SQLStore", "Store", "store_from_url"]

_REDIS = ("redis", "rediss", "redis+sentinel", "redis+cluster", "unix")
_SQL = ("postgresql", "postgresql+psycopg", "postgres", "sqlite", "sqlite+pysqlite")


def store_from_url(url: str, **options: Any) -> Store:
    """Build the store a URL names.

    Args:
        url: See the table in this module's docstring.
        **options: Store keywords: ``key_prefix``, ``timeout_seconds``, ``max_result_bytes``,
            ``clock``; ``index_shards`` for Redis, ``table_name`` for SQL.

    Raises:
        ConfigurationError: the scheme is unknown, or its extra is not installed.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(f"a store URL looks like 'redis://host:6379/0'; got {url!r}")
    scheme = url.partition("://")[0].lower()
    if scheme == "memory":
        return MemoryStore(**options)
    if scheme in _REDIS:
        from .redis import RedisStore

        return RedisStore.from_url(url, **options)
    if scheme in _SQL:
        from .sql import SQLStore

        return SQLStore.from_url(url, **options)
    known = ", ".join(f"{s}://" for s in ("memory", *_REDIS, *_SQL))
    raise ConfigurationError(f"unknown store URL scheme {scheme!r} in {url!r}; use one of {known}")


def __getattr__(name: str) -> Any:
    # RedisStore and SQLStore import their extras only when asked for.
    if name == "RedisStore":
        from .redis import RedisStore

        return RedisStore
    if name == "SQLStore":
        from .sql import SQLStore

        return SQLStore
    raise AttributeError(name)
