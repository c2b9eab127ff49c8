"""How a RedisStore reaches Redis: a redis-py client built from a store URL (plain Redis, a Sentinel
master, or Redis Cluster), with the store's deadline on every socket call and no hidden retries."""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult, unquote, urlencode

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ...errors import ConfigurationError

__all__ = ["connect"]


# valkey:// and its variants, as the Redis schemes they are (kombu has no valkey:// yet: a Valkey
# broker is still named redis://).
VALKEY_SCHEMES = {
    "valkey": "redis",
    "valkeys": "rediss",
    "valkey+sentinel": "redis+sentinel",
    "valkey+cluster": "redis+cluster",
}


def connect(parts: SplitResult, query: dict[str, str], timeout: float) -> Any:
    """A redis-py client for the URL ``parts`` (its ``query`` without the store's own parameters),
    each of whose calls waits at most ``timeout`` seconds (see :meth:`RedisStore.from_url`)."""
    connection = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        # No hidden retries: a retry loop would blow through the caller's deadline.
        "retry": Retry(NoBackoff(), 0),
    }
    # Valkey speaks the Redis protocol, scripts and TIME included: its schemes name the same clients.
    scheme = VALKEY_SCHEMES.get(parts.scheme.lower(), parts.scheme.lower())
    client: Any
    if scheme in ("redis", "rediss", "redis+cluster") and parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise ConfigurationError(
            f"the path of a Redis URL is a database number (redis://host:6379/2); got {parts.path!r}"
        )
    if scheme in ("redis", "rediss", "unix"):
        plain = _joined(scheme, parts.netloc, parts.path, query)
        client = redis.Redis.from_url(plain, **connection)
    elif scheme == "redis+cluster":
        client = _cluster(parts, query, connection)
    elif scheme == "redis+sentinel":
        client = _sentinel_master(parts, connection)
    else:
        raise ConfigurationError(f"RedisStore cannot open {scheme!r} URLs")
    return client


def _cluster(parts: SplitResult, query: dict[str, str], connection: dict[str, Any]) -> Any:
    from redis.cluster import ClusterNode, RedisCluster

    credentials, _, hosts = parts.netloc.rpartition("@")
    seeds = _hosts(hosts, 6379)
    first = f"{seeds[0][0]}:{seeds[0][1]}" if ":" not in seeds[0][0] else f"[{seeds[0][0]}]:{seeds[0][1]}"
    netloc = f"{credentials}@{first}" if credentials else first
    if parts.path.strip("/") not in ("", "0"):
        raise ConfigurationError(f"Redis Cluster has database 0 only; drop {parts.path!r} from the URL")
    url = _joined("redis", netloc, "", query)
    others = [ClusterNode(host, port) for host, port in seeds[1:]]  # type: ignore[no-untyped-call]
    # redis-py adds the URL's node after startup_nodes and tries each until one answers.
    return RedisCluster(url=url, startup_nodes=others, **connection)


def _sentinel_master(parts: SplitResult, connection: dict[str, Any]) -> Any:
    from redis.sentinel import Sentinel

    sentinel: Any
    hosts = parts.netloc.rpartition("@")[2]
    password = unquote(parts.password) if parts.password else None
    segments = [s for s in parts.path.split("/") if s]
    if not hosts or not segments:
        raise ConfigurationError(
            "a sentinel URL names the sentinels and the service: "
            "redis+sentinel://[:password@]host[:port][,host[:port]]/service_name[/db]"
        )
    if len(segments) > 1 and not segments[1].isdigit():
        raise ConfigurationError(f"the database of a sentinel URL is a number (/service_name/2); got {segments[1]!r}")
    db = int(segments[1]) if len(segments) > 1 else 0
    sentinel = Sentinel(_hosts(hosts, 26379), sentinel_kwargs=connection, **connection)  # type: ignore[no-untyped-call]
    return sentinel.master_for(segments[0], password=password, db=db)


def _joined(scheme: str, netloc: str, path: str, query: dict[str, str]) -> str:
    """A URL again, with "//" kept for every scheme (urlunsplit drops it from ``unix:`` URLs)."""
    return f"{scheme}://{netloc}{path}" + (f"?{urlencode(query)}" if query else "")


def _hosts(text: str, default_port: int) -> list[tuple[str, int]]:
    """``h1:7000,h2,[::1]:7001`` as (host, port) pairs; a host without a port gets ``default_port``."""
    pairs = []
    for item in text.split(","):
        host, port = item, ""
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port = rest.removeprefix(":")
        elif ":" in item:
            host, _, port = item.rpartition(":")
        if not host:
            raise ConfigurationError(f"a Redis URL names each node as host[:port]; got {item!r} in {text!r}")
        if port and not port.isdigit():
            raise ConfigurationError(f"a port is a number; got {port!r} in {text!r}")
        pairs.append((host, int(port) if port else default_port))
    return pairs
