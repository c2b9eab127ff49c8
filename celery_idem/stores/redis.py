"""RedisStore: one Lua script per transition, one round trip each; Redis, Sentinel and Cluster.

The key layout, the hash fields and each script's contract are written at the top of the scripts
in ``stores/lua/``. Every key a script touches shares one hash tag, so the store works unchanged on
Redis Cluster; the lease index is split over ``INDEX_SHARDS`` hash tags so no one node holds all of
it. That count is part of every record's key, so it is fixed, never a setting: another value would
put every record somewhere else and hide the records written before.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import zlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from ..errors import ConfigurationError
from ..records import Decision, ErrorInfo, IdempotencyRecord, Identity, State, Transition
from .base import Store
from .rules import LOST, OK
from .spi import Clock, Fence, Settlement

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.commands.core import Script
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("RedisStore needs redis-py: pip install 'celery-idem[redis]'") from exc

__all__ = ["RedisStore"]

_SCRIPTS = ("claim", "acquire", "settle", "release", "renew", "forget", "due", "hand_over", "keep_alive", "alive")

INDEX_SHARDS = 16
"""How many hash tags (lease-index shards) records are spread over: part of the key layout, fixed."""


@functools.cache
def _source(name: str) -> str:
    lua = importlib.resources.files("celery_idem.stores") / "lua"
    return (lua / "_prelude.lua").read_text("utf-8") + "\n" + (lua / f"{name}.lua").read_text("utf-8")


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8")


def _record(flat: Sequence[bytes]) -> IdempotencyRecord:
    fields = {flat[i].decode("utf-8"): flat[i + 1] for i in range(0, len(flat), 2)}
    lease = fields.get("lease")
    error = fields.get("error")
    return IdempotencyRecord(
        scope=fields["scope"].decode("utf-8"),
        task_name=fields["task"].decode("utf-8"),
        key=fields["key"].decode("utf-8"),
        fingerprint=fields["fp"].decode("ascii"),
        state=State(fields["state"].decode("ascii")),
        task_id=fields["task_id"].decode("utf-8"),
        owner=fields["owner"].decode("ascii"),
        attempt=int(fields["attempt"]),
        lease_expires_at=float(lease) if lease is not None else None,
        created_at=float(fields["created"]),
        updated_at=float(fields["updated"]),
        expires_at=float(fields["expires"]),
        ttl_seconds=float(fields["ttl"]),
        result=fields.get("result"),
        content_type=_text(fields.get("ctype")),
        content_encoding=_text(fields.get("cenc")),
        error=ErrorInfo.model_validate_json(error) if error else None,
        call=fields.get("call"),
        previous_task_id=_text(fields.get("prev")),
    )


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


class RedisStore(Store):
    """Records as Redis hashes, transitions as Lua scripts, TTLs by Redis expiry.

    Args:
        client: A redis-py client (``Redis``, a Sentinel master, or ``RedisCluster``), created with
            ``decode_responses=False``. Build one from a URL with :meth:`from_url`.
        index_shards: Accepted only as ``INDEX_SHARDS`` (16), the fixed shard count of the key
            layout (it once was a setting; any other value is refused rather than hiding records).
        clock: An injected clock for tests; by default each script reads the server's clock, so
            every client agrees on lease expiry.
    """

    def __init__(
        self,
        client: Any,
        *,
        index_shards: int = INDEX_SHARDS,
        key_prefix: str = "idem",
        timeout_seconds: float = 2.0,
        max_result_bytes: int = 1_048_576,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            key_prefix=key_prefix, timeout_seconds=timeout_seconds, max_result_bytes=max_result_bytes, clock=clock
        )
        if "{" in key_prefix or "}" in key_prefix:
            raise ConfigurationError(
                f"key_prefix must not contain braces (they make Redis hash tags); got {key_prefix!r}"
            )
        if index_shards != INDEX_SHARDS:
            raise ConfigurationError(
                f"index_shards is fixed at {INDEX_SHARDS}: the shard is part of every record's key, so "
                f"another count would hide every record written before; got {index_shards!r}. Remove "
                "the option (records written under another count must be moved: see docs/stores.md)"
            )
        self.client = client
        self.index_shards = INDEX_SHARDS
        self._scripts: dict[str, Script] = {name: client.register_script(_source(name)) for name in _SCRIPTS}

    _unavailable = (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        redis.exceptions.ReadOnlyError,
        redis.exceptions.ClusterDownError,
        redis.exceptions.TryAgainError,
        redis.exceptions.OutOfMemoryError,  # a full Redis under noeviction: the store cannot take writes
        # A slot no node covers, redirections exhausted in a failover: redis-py's cluster client
        # raises these instead of a ConnectionError. (Its other RedisClusterExceptions are mistakes:
        # keys in two slots, cluster mode off on the node; a cluster with every node down is below.)
        redis.exceptions.SlotNotCoveredError,
        redis.exceptions.ClusterError,
        OSError,
    )
    # Error replies redis-py leaves as a plain ResponseError that still mean "cannot take this write
    # now": a script running past lua-time-limit (BUSY), too few replicas (NOREPLICAS), a server that
    # cannot persist (MISCONF). READONLY, LOADING and MASTERDOWN have classes of their own, above.
    # Redis 6 and older wrap a script's refused write as "ERR Error running script ... -READONLY ...".
    _unavailable_replies = ("BUSY ", "NOREPLICAS ", "MISCONF ")
    _unavailable_in_script = ("-READONLY", "-OOM", "-NOREPLICAS", "-MISCONF", "-BUSY", "-MASTERDOWN", "-LOADING")

    @classmethod
    def _is_mistake(cls, exc: Exception) -> bool:
        # redis+cluster:// pointing at a Redis that is not a cluster node
        return "Cluster mode is not enabled" in str(exc) or super()._is_mistake(exc)

    @classmethod
    def _misconfiguration(cls, exc: Exception) -> str | None:
        if isinstance(exc, redis.exceptions.ResponseError) and "DB index is out of range" in str(exc):
            return (
                "the database number in the URL is past the server's 'databases' (16 by default): "
                "use one it has (redis://host:6379/0 to /15), or raise 'databases' in redis.conf"
            )
        return None

    @classmethod
    def _is_outage(cls, exc: Exception) -> bool:
        if isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)):
            return False  # a ConnectionError by class, a wrong password or ACL by nature: no waiting fixes it
        if (
            isinstance(exc, redis.exceptions.RedisClusterException)
            and str(exc).startswith("Redis Cluster cannot be connected")
            and not cls._is_mistake(exc)
        ):
            return True  # every node down: redis-py raises this in place of the ConnectionError
        if isinstance(exc, redis.exceptions.ResponseError):
            text = str(exc)
            if text.startswith(cls._unavailable_replies):
                return True
            if text.startswith("Error running script") and any(code in text for code in cls._unavailable_in_script):
                return True
        return super()._is_outage(exc)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """Build a store from ``redis://``, ``rediss://``, ``redis+sentinel://`` or ``redis+cluster://``.

        ``redis+cluster://[user:password@]host:port[,host:port...]`` seeds the cluster client with
        every node named (it starts through the first that answers). ``redis+sentinel://[:password@]
        host[:port][,host[:port]...]/service_name[/db]`` asks the sentinels (port 26379 by default)
        for the master of ``service_name``. The query parameter ``index_shards`` is this store's
        (only its fixed value is accepted); the rest go to redis-py.
        """
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        if "index_shards" in query:
            options.setdefault("index_shards", int(query.pop("index_shards")))
        timeout = float(options.get("timeout_seconds", 2.0))
        connection = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # No hidden retries: a retry loop would blow through the caller's deadline.
            "retry": Retry(NoBackoff(), 0),
        }
        scheme = parts.scheme.lower()
        client: Any
        if (
            scheme in ("redis", "rediss", "redis+cluster")
            and parts.path.strip("/")
            and not parts.path.strip("/").isdigit()
        ):
            raise ConfigurationError(
                f"the path of a Redis URL is a database number (redis://host:6379/2); got {parts.path!r}"
            )
        if scheme in ("redis", "rediss", "unix"):
            plain = _joined(scheme, parts.netloc, parts.path, query)
            client = redis.Redis.from_url(plain, **connection)
        elif scheme == "redis+cluster":
            client = cls._cluster(parts, query, connection)
        elif scheme == "redis+sentinel":
            client = cls._sentinel_master(parts, connection)
        else:
            raise ConfigurationError(f"RedisStore cannot open {scheme!r} URLs")
        return cls(client, **options)

    @staticmethod
    def _cluster(parts: Any, query: dict[str, str], connection: dict[str, Any]) -> Any:
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

    @staticmethod
    def _sentinel_master(parts: Any, connection: dict[str, Any]) -> Any:
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
            raise ConfigurationError(
                f"the database of a sentinel URL is a number (/service_name/2); got {segments[1]!r}"
            )
        db = int(segments[1]) if len(segments) > 1 else 0
        sentinel = Sentinel(_hosts(hosts, 26379), sentinel_kwargs=connection, **connection)  # type: ignore[no-untyped-call]
        return sentinel.master_for(segments[0], password=password, db=db)

    # ---- keys ----------------------------------------------------------------------------------

    def keys_for(self, identity: Identity) -> tuple[str, str]:
        """The record key and its lease-index shard key (same hash tag, so same cluster slot)."""
        scope, task, key = identity
        shard = zlib.crc32(f"{scope}\0{task}\0{key}".encode()) % INDEX_SHARDS
        tag = self._tag(shard)
        return f"{tag}:r:{len(scope)}:{scope}:{len(task)}:{task}:{key}", f"{tag}:lease"

    def liveness_key(self, process: str) -> str:
        """A worker process's liveness record; all of them share one hash tag (one cluster slot),
        so a reconcile run reads every holder it needs in one script."""
        return f"{{{self.key_prefix}:live}}:{process}"

    def _tag(self, shard: int) -> str:
        return f"{{{self.key_prefix}:{shard}}}"

    def _now(self) -> str:
        """ARGV "now" of a script: the injected clock's time, '' for the server's clock, or
        '+<seconds>' for the server's clock shifted by a test (:meth:`advance_clock_for_tests`)."""
        if self._injected_clock:
            return f"{self._clock_now():.6f}"
        return f"+{self._time_offset!r}" if self._time_offset else ""

    # ---- primitives ----------------------------------------------------------------------------

    def _take(
        self,
        script: str,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        *more: str,
    ) -> Transition:
        args: list[Any] = [
            self._now(),
            fingerprint,
            task_id,
            owner,
            repr(lease),
            repr(ttl),
            *identity,
            call or b"",
            *more,
        ]
        answer = self._scripts[script](keys=self.keys_for(identity), args=args)
        decision = Decision(answer[0].decode("ascii"))
        if decision is not Decision.NEW and decision is not Decision.RUN:
            return Transition(decision, _record(answer[1]))
        # Taken: the script wrote what we sent; it answers only what we could not know.
        now = float(answer[1])
        claimed = decision is Decision.NEW
        record = IdempotencyRecord.model_construct(
            scope=identity.scope,
            task_name=identity.task_name,
            key=identity.key,
            fingerprint=fingerprint if claimed else answer[2].decode("ascii"),
            state=State.PENDING if claimed else State.IN_PROGRESS,
            task_id=task_id,
            owner=owner,
            attempt=0 if claimed else int(answer[3]),
            lease_expires_at=now + lease,
            created_at=now if claimed else float(answer[4]),
            updated_at=now,
            expires_at=now + lease + ttl,
            ttl_seconds=ttl,
            result=None,
            content_type=None,
            content_encoding=None,
            error=None,
            call=call if claimed else answer[5] or None,  # a run without a call keeps the claim's
            previous_task_id=_text(answer[2 if claimed else 6] or None),
        )
        return Transition(decision, record)

    def _claim(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
    ) -> Transition:
        return self._take("claim", identity, fingerprint, task_id, owner, lease, ttl, call)

    def _acquire(
        self,
        identity: Identity,
        fingerprint: str,
        task_id: str,
        owner: str,
        lease: float,
        ttl: float,
        call: bytes | None,
        next_look: float,
        retry: bool,
    ) -> Transition:
        return self._take(
            "acquire", identity, fingerprint, task_id, owner, lease, ttl, call, repr(next_look), "1" if retry else ""
        )

    def _fenced(self, script: str, identity: Identity, *argv: object) -> Transition:
        args: list[Any] = [self._now(), *argv]
        answer = self._scripts[script](keys=self.keys_for(identity), args=args)
        return OK if answer == b"OK" else LOST

    def _settle(self, identity: Identity, token: str, outcome: Settlement) -> Transition:
        state, result, content_type, content_encoding, error = outcome
        error_json = error.model_dump_json() if error else ""
        return self._fenced(
            "settle",
            identity,
            token,
            state.value,
            result or b"",
            content_type or "",
            content_encoding or "",
            error_json,
        )

    def _release(
        self, identity: Identity, fence: Fence, token: str, lease: float | None, new_owner: str, expired_only: bool
    ) -> Transition:
        pending = "" if lease is None else repr(lease)
        return self._fenced("release", identity, fence, token, pending, new_owner, "1" if expired_only else "0")

    def _renew(self, identity: Identity, token: str, lease: float) -> Transition:
        return self._fenced("renew", identity, token, repr(lease))

    def _keep_alive(self, process: str, token: str, seconds: float, create: bool) -> Transition:
        args = [self._now(), token, repr(seconds), "1" if create else "0"]
        answer = self._scripts["keep_alive"](keys=[self.liveness_key(process)], args=args)
        return OK if answer == b"OK" else LOST

    def _alive(self, processes: list[str]) -> set[str]:
        keys = [self.liveness_key(process) for process in processes]
        answer = self._scripts["alive"](keys=keys, args=[self._now()])
        return {process for process, live in zip(processes, answer, strict=True) if int(live)}

    def _hand_over(self, identity: Identity, token: str, new_owner: str, lease: float) -> Transition:
        return self._fenced("hand_over", identity, token, new_owner, repr(lease))

    def _live(self, flat: dict[bytes, bytes]) -> IdempotencyRecord | None:
        if not flat:
            return None
        record = _record([item for pair in flat.items() for item in pair])
        # With the server clock Redis expiry removes the key; an injected or shifted clock runs
        # ahead of that expiry, so it is checked here.
        if (self._injected_clock or self._time_offset) and record.expires_at <= self._server_now():
            return None
        return record

    def _get(self, identity: Identity) -> IdempotencyRecord | None:
        return self._live(self.client.hgetall(self.keys_for(identity)[0]))

    def _forget(self, identity: Identity) -> bool:
        return bool(self._scripts["forget"](keys=self.keys_for(identity), args=[self._now()]))

    # The reconciler's reads, bounded: index entries per shard and round trip, records per script call.
    _index_page = 128
    _due_batch = 32

    def _expired_leases(self, limit: int) -> list[IdempotencyRecord]:
        """The ``limit`` oldest due records over every shard, reading about ``limit`` records.

        Each round reads a page of due ids (``ZRANGEBYSCORE ... LIMIT``, ids only) from every shard
        that may hold one, merges them by lease, and reads only the records the run still needs
        through the ``due`` script, a bounded batch per call. A shard whose page was full may hold
        older entries past it than another shard's, so only the entries at or before the earliest
        last lease of a full page are taken in a round. Records the script finds gone or renewed do
        not count: the next round reads on. Each shard's offset counts the due records taken from
        it (they stay in the index; the dropped ones leave it).
        """
        now = self._server_now()
        taken: dict[bytes, IdempotencyRecord] = {}
        offsets = [0] * INDEX_SHARDS
        while len(taken) < limit:
            page = min(limit - len(taken), self._index_page)
            pipe = self.client.pipeline(transaction=False)
            for shard in range(INDEX_SHARDS):
                pipe.zrangebyscore(self._index(shard), "-inf", now, start=offsets[shard], num=page, withscores=True)
            pages: list[list[tuple[bytes, float]]] = pipe.execute()
            if not any(pages):
                break
            bound = min((entries[-1][1] for entries in pages if len(entries) == page), default=float("inf"))
            heads = sorted(
                (score, key, shard) for shard, entries in enumerate(pages) for key, score in entries if score <= bound
            )[: limit - len(taken)]
            picked: dict[int, list[bytes]] = {}
            for _, key, shard in heads:
                picked.setdefault(shard, []).append(key)
            for shard, keys in picked.items():
                for start in range(0, len(keys), self._due_batch):
                    batch = keys[start : start + self._due_batch]
                    answers = self._scripts["due"](keys=[self._index(shard), *batch], args=[self._now()])
                    for key, answer in zip(batch, answers, strict=True):
                        if answer != b"gone":  # still indexed: the next page starts past it
                            offsets[shard] += 1
                        if isinstance(answer, list):
                            taken.setdefault(key, _record(answer))
        return sorted(taken.values(), key=lambda r: (r.lease_expires_at or 0.0, str(r.identity)))[:limit]

    def _index(self, shard: int) -> str:
        return f"{self._tag(shard)}:lease"

    def _scan(self) -> Any:
        """Every live record of this prefix, in batches (a SCAN over its record keys).

        The glob is only a coarse filter (another prefix may extend this one, as ``idem:billing``
        extends ``idem``): each key is then matched exactly against ``{<prefix>:<shard>}:r:``.
        """
        glob = re.sub(r"([\\*?\[\]^])", r"\\\1", self.key_prefix)
        ours = re.compile(re.escape(f"{{{self.key_prefix}:".encode()) + rb"[0-9]+\}:r:")
        batch: list[Any] = []
        for key in self.client.scan_iter(match=f"{{{glob}:[0-9]*}}:r:*", count=1000):
            if not ours.match(key):
                continue
            batch.append(key)
            if len(batch) == 500:
                yield from self._read(batch)
                batch = []
        yield from self._read(batch)

    def _read(self, keys: list[Any]) -> Any:
        if not keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for flat in pipe.execute():
            record = self._live(flat)
            if record is not None:
                yield record

    def _records(self, state: State | None, task_name: str | None, limit: int) -> list[IdempotencyRecord]:
        # SCAN order is arbitrary: "newest first" needs every match before the cut.
        found = [r for r in self._scan() if state in (None, r.state) and task_name in (None, r.task_name)]
        return sorted(found, key=lambda r: r.updated_at, reverse=True)[:limit]

    def _count_by_state(self) -> dict[State, int]:
        counts = dict.fromkeys(State, 0)
        for record in self._scan():
            counts[record.state] += 1
        return counts

    def _server_now(self) -> float:
        if self._injected_clock:
            return self._clock_now()
        seconds, microseconds = self.client.time()
        return float(seconds) + float(microseconds) / 1_000_000 + self._time_offset

    def _ping(self) -> None:
        self.client.ping()

    def close(self) -> None:
        self.client.close()
