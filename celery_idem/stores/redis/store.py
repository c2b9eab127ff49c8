"""RedisStore: one Lua script per transition, one round trip each; Redis, Sentinel and Cluster.

The key layout, the hash fields and each script's contract are written at the top of the scripts
in ``lua/`` (:mod:`~celery_idem.stores.redis.scripts` loads them). The store's client, key layout,
error classes and plain reads are set up in :mod:`~celery_idem.stores.redis.base`; here, every
operation that runs a script: the transitions, the reconciler's walk of the lease index, and the
processes' liveness records.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ...records import Decision, IdempotencyRecord, Identity, State, Transition
from ..rules import LOST, OK
from ..spi import Fence, Settlement
from . import scripts
from .base import INDEX_SHARDS, RedisBase
from .client import connect

__all__ = ["RedisStore"]


class RedisStore(RedisBase):
    """Records as Redis hashes, transitions as Lua scripts, TTLs by Redis expiry.

    Args:
        client: A redis-py client (``Redis``, a Sentinel master, or ``RedisCluster``), created with
            ``decode_responses=False``. Build one from a URL with :meth:`from_url`.
        index_shards: Accepted only as ``INDEX_SHARDS`` (16), the fixed shard count of the key
            layout (it once was a setting; any other value is refused rather than hiding records).
        clock: An injected clock for tests; by default each script reads the server's clock, so
            every client agrees on lease expiry.
    """

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """Build a store from ``redis://``, ``rediss://``, ``redis+sentinel://`` or ``redis+cluster://``,
        and from the same URLs of a Valkey server (``valkey://``, ``valkeys://``, ``valkey+sentinel://``,
        ``valkey+cluster://``).

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
        client = connect(parts, query, float(options.get("timeout_seconds", 2.0)))
        return cls(client, **options)

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
            return Transition(decision, scripts.record(answer[1], identity))
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
            previous_task_id=scripts.text(answer[2 if claimed else 6] or None),
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
        settled_is_free: bool,
    ) -> Transition:
        return self._take(
            "claim", identity, fingerprint, task_id, owner, lease, ttl, call, "1" if settled_is_free else ""
        )

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
                            taken.setdefault(key, scripts.record(answer))
        return sorted(taken.values(), key=lambda r: (r.lease_expires_at or 0.0, str(r.identity)))[:limit]
