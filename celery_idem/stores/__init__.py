"""Stores: where records live. Pick one by URL with :func:`store_from_url`.

=========================================================  ================  =====================
URL                                                        store             extra
=========================================================  ================  =====================
``redis://``, ``rediss://``, ``redis+sentinel://``,        RedisStore        ``celery-idem[redis]``
``redis+cluster://``; ``valkey://``, ``valkeys://``,
``valkey+sentinel://``, ``valkey+cluster://`` (Valkey)
``postgresql+psycopg://``, ``postgresql://``,              SQLStore          ``celery-idem[sql]``
``sqlite:///path``
``mysql://``, ``mariadb://``, ``mysql+pymysql://``         SQLStore          ``celery-idem[mysql]``
``memory://``                                              MemoryStore       (none)
``django://``, ``django://<alias>``                        DjangoStore       ``celery-idem[sql,django]``
=========================================================  ================  =====================

A package adds a scheme with :func:`register_scheme` (``celery_idem.contrib.django`` adds
``django://`` when Django starts it, from ``INSTALLED_APPS``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError, IdempotencyError, StoreUnavailableError
from ..records import Decision, ErrorInfo, IdempotencyRecord, Identity, State, Transition
from .base import Store
from .memory import MemoryStore
from .spi import Clock, Fence, Settlement, Wait

if TYPE_CHECKING:
    from .redis import RedisStore
    from .sql import SQLStore

# The store SPI: what a store of one's own (DynamoDB, MongoDB, the Django ORM) subclasses, takes and
# returns, under one import path (docs/reference.md, "Writing a store").
__all__ = [
    "Clock",
    "Decision",
    "ErrorInfo",
    "Fence",
    "IdempotencyRecord",
    "Identity",
    "MemoryStore",
    "RedisStore",
    "SQLStore",
    "Settlement",
    "State",
    "Store",
    "Transition",
    "Wait",
    "register_scheme",
    "store_from_url",
]

# Schemes packages register (register_scheme): scheme -> a class with from_url(url, **options).
_REGISTERED: dict[str, Any] = {}
# Schemes a package of ours registers once it is set up, and what that takes.
_NEEDS = {"django": "'celery_idem.contrib.django' in INSTALLED_APPS, and Django set up (django.setup())"}

_REDIS = (
    "redis",
    "rediss",
    "redis+sentinel",
    "redis+cluster",
    "unix",
    "valkey",
    "valkeys",
    "valkey+sentinel",
    "valkey+cluster",
)
_SQL = (
    "postgresql",
    "postgresql+psycopg",
    "postgres",
    "sqlite",
    "sqlite+pysqlite",
    "mysql",
    "mysql+pymysql",
    "mariadb",
    "mariadb+pymysql",
)


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

        return _opened(RedisStore, url, options)
    if scheme in _SQL:
        from .sql import SQLStore

        return _opened(SQLStore, url, options)
    if scheme in _REGISTERED:
        return _opened(_REGISTERED[scheme], url, options)
    if scheme in _NEEDS:
        raise ConfigurationError(f"the store URL {url!r} needs {_NEEDS[scheme]}")
    known = ", ".join(f"{s}://" for s in ("memory", *_REDIS, *_SQL, *_REGISTERED))
    raise ConfigurationError(f"unknown store URL scheme {scheme!r} in {url!r}; use one of {known}")


def register_scheme(scheme: str, cls: Any) -> None:
    """Let :func:`store_from_url` build ``cls.from_url(url, **options)`` for ``scheme://`` URLs.

    One registry per process; registering a scheme again replaces its class.

    Raises:
        ConfigurationError: ``scheme`` is one of celery-idem's own (``redis``, ``memory``, ...).
    """
    name = scheme.lower()
    if name in ("memory", *_REDIS, *_SQL):
        raise ConfigurationError(f"{name}:// is one of celery-idem's own store URL schemes: it cannot be registered")
    _REGISTERED[name] = cls


def _opened(cls: Any, url: str, options: dict[str, Any]) -> Store:
    """``cls.from_url``, its errors told apart: a mistake in the URL is a ConfigurationError; anything
    else is a StoreUnavailableError (a client that connects while it is built, as Redis Cluster does,
    meets an outage here), ``unexpected`` unless the store counts it as an outage."""
    try:
        store: Store = cls.from_url(url, **options)
    except ConfigurationError as exc:
        if _redacted(url) in str(exc):
            raise
        raise ConfigurationError(f"invalid store URL {_redacted(url)} (setting 'store'): {exc}") from exc
    except IdempotencyError:
        raise
    except ImportError as exc:  # a driver or an extra the store needs is not installed
        raise ConfigurationError(f"the store URL {_redacted(url)} needs a package that is missing: {exc}") from exc
    except Exception as exc:
        # A registered scheme's class may have only from_url: Store's own judgement then applies.
        judge = cls if hasattr(cls, "_misconfiguration") else Store
        fix = judge._misconfiguration(exc)
        if judge._is_mistake(exc) or fix is not None:
            raise ConfigurationError(
                f"invalid store URL {_redacted(url)} (setting 'store'): {type(exc).__name__}: {exc}"
                + (f"; {fix}" if fix else "")
            ) from exc
        error = StoreUnavailableError(
            f"could not open the idempotency store {_redacted(url)}: {type(exc).__name__}: {exc}; "
            "check that the store is up and the URL is right"
        )
        error.unexpected = not judge._is_outage(exc)
        raise error from exc
    store.url = _redacted(url)
    return store


# A password given as a query parameter (redis-py's ?password=, libpq's, ?sentinel_password=, ...).
_QUERY_PASSWORD = re.compile(r"([?&][A-Za-z_]*(?:password|passwd|pwd)=)[^&#]*", re.IGNORECASE)


def _redacted(url: str) -> str:
    """A store URL without its password (in the user info or in the query)."""
    scheme, _, rest = url.partition("://")
    rest = _QUERY_PASSWORD.sub(r"\1***", rest)
    url = f"{scheme}://{rest}"
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def __getattr__(name: str) -> Any:
    # RedisStore and SQLStore import their extras only when asked for.
    if name == "RedisStore":
        from .redis import RedisStore

        return RedisStore
    if name == "SQLStore":
        from .sql import SQLStore

        return SQLStore
    raise AttributeError(name)
