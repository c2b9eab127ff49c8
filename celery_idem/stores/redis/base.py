"""What a RedisStore stands on: its client and scripts, the key layout, what redis-py's errors mean,
the clock its scripts read, and the plain reads (a record's hash; a SCAN for the operators).

Every key a script touches shares one hash tag, so the store works unchanged on Redis Cluster; the
lease index is split over ``INDEX_SHARDS`` hash tags so no one node holds all of it. That count is
part of every record's key, so it is fixed, never a setting: another value would put every record
somewhere else and hide the records written before.
"""

from __future__ import annotations

import collections
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from ...errors import ConfigurationError
from ...records import IdempotencyRecord, Identity, State
from ..base import Store
from ..spi import Clock, Wait
from . import notices, scripts

__all__ = ["INDEX_SHARDS", "RedisBase", "identity_of"]

INDEX_SHARDS = 16
"""How many hash tags (lease-index shards) records are spread over: part of the key layout, fixed."""


class RedisBase(Store):
    """What :class:`~celery_idem.stores.redis.RedisStore` (which documents the arguments) runs its
    scripts on: the client and its scripts, the key layout, what redis-py's errors mean, the clock
    a script reads, and the plain reads."""

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
        self._watch_slots = notices.slots(client)
        self._scripts: dict[str, scripts.Scripted] = scripts.register(client)

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

    def _index(self, shard: int) -> str:
        return f"{self._tag(shard)}:lease"

    def _now(self) -> str:
        """ARGV "now" of a script: the injected clock's time, '' for the server's clock, or
        '+<seconds>' for the server's clock shifted by a test (:meth:`advance_clock_for_tests`)."""
        if self._injected_clock:
            return f"{self._clock_now():.6f}"
        return f"+{self._time_offset!r}" if self._time_offset else ""

    # ---- plain reads ---------------------------------------------------------------------------

    def _live(self, stored: Any, identity: Identity | None) -> IdempotencyRecord | None:
        """The record as read (a packed settled record, a hash's flat list, or nothing), if live."""
        if not stored:
            return None
        record = scripts.record(stored, identity)
        # With the server clock Redis expiry removes the key; an injected or shifted clock runs
        # ahead of that expiry, so it is checked here.
        if (self._injected_clock or self._time_offset) and record.expires_at <= self._server_now():
            return None
        return record

    def _get(self, identity: Identity) -> IdempotencyRecord | None:
        return self._live(self._scripts["read"](keys=[self.keys_for(identity)[0]], args=[]), identity)

    def _scan(self) -> Any:
        """Every live record of this prefix, in batches (a SCAN over its record keys).

        The glob is only a coarse filter (another prefix may extend this one, as ``idem:billing``
        extends ``idem``): each key is then matched exactly against ``{<prefix>:<shard>}:r:``.
        """
        glob = re.sub(r"([\\*?\[\]^])", r"\\\1", self.key_prefix)
        ours = re.compile(re.escape(f"{{{self.key_prefix}:".encode()) + rb"[0-9]+\}:r:")
        batch: list[Any] = []
        seen: set[Any] = set()  # SCAN may return a key more than once (a rehash while it iterates)
        for key in self.client.scan_iter(match=f"{{{glob}:[0-9]*}}:r:*", count=1000):
            if not ours.match(key) or key in seen:
                continue
            seen.add(key)
            batch.append(key)
            if len(batch) == 500:
                yield from self._read(batch)
                batch = []
        yield from self._read(batch)

    def _read(self, keys: list[Any]) -> Any:
        """The live records under ``keys``: HGETALL, then GET where a key holds a settled record (a
        string: WRONGTYPE), again while a key changes type between reads (a scan is no snapshot).
        Plain pipelined commands, so a cluster pipeline routes each by its slot."""
        found: dict[Any, Any] = {}
        todo = {key: "hash" for key in keys}
        for _ in range(4):
            if not todo:
                break
            pipe = self.client.pipeline(transaction=False)
            for key, kind in todo.items():
                (pipe.hgetall if kind == "hash" else pipe.get)(key)
            changed: dict[Any, str] = {}
            for (key, kind), answer in zip(todo.items(), pipe.execute(raise_on_error=False), strict=True):
                if isinstance(answer, redis.exceptions.ResponseError) and str(answer).startswith("WRONGTYPE"):
                    changed[key] = "string" if kind == "hash" else "hash"
                elif isinstance(answer, Exception):
                    raise answer
                else:
                    found[key] = answer
            todo = changed
        for key, answer in found.items():
            if isinstance(answer, dict):
                answer = [item for pair in answer.items() for item in pair]
            record = self._live(answer, identity_of(key))
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

    def _count_by_task(self) -> dict[tuple[str, State], int]:
        return dict(collections.Counter((record.task_name, record.state) for record in self._scan()))

    # ---- notices -------------------------------------------------------------------------------

    @contextmanager
    def watch(self, identity: Identity) -> Iterator[Wait]:
        """Subscribes to the record key's channel (:mod:`~celery_idem.stores.redis.notices`)."""
        with notices.watch(self.client, self.keys_for(identity)[0], self._watch_slots, identity) as wait:
            yield wait

    def _server_now(self) -> float:
        if self._injected_clock:
            return self._clock_now()
        seconds, microseconds = self.client.time()
        return float(seconds) + float(microseconds) / 1_000_000 + self._time_offset

    def _ping(self) -> None:
        self.client.ping()

    def close(self) -> None:
        self.client.close()


def identity_of(key: bytes) -> Identity:
    """The identity a record key names: ``{<prefix>:<shard>}:r:<len(scope)>:<scope>:<len(task)>:<task>:<key>``
    (lengths in characters, :meth:`RedisBase.keys_for`)."""
    text = key.decode("utf-8")
    rest = text[text.index("}:r:") + 4 :]
    size, _, rest = rest.partition(":")
    scope, rest = rest[: int(size)], rest[int(size) + 1 :]
    size, _, rest = rest.partition(":")
    return Identity(scope, rest[: int(size)], rest[int(size) + 1 :])
