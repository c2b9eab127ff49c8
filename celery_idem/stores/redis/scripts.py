"""The Lua scripts of the Redis store, one per transition, and the record hashes they write.

The key layout, the hash fields and each script's contract are written at the top of the scripts,
in ``lua/`` beside this module (``_prelude.lua`` is prepended to each). :func:`record` reads a
record hash back, as ``HGETALL`` or a script returns it.
"""

from __future__ import annotations

import functools
import importlib.resources
import inspect
import struct
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

from ...records import ErrorInfo, IdempotencyRecord, Identity, State

__all__ = ["NAMES", "Scripted", "record", "register", "source", "text"]

NAMES = (
    "claim",
    "acquire",
    "settle",
    "release",
    "renew",
    "forget",
    "due",
    "hand_over",
    "keep_alive",
    "alive",
    "read",
)
"""Every script, by the name of its file in ``lua/``."""


@functools.cache
def source(name: str) -> str:
    """The text of the script ``name``: the prelude, then the script."""
    lua = importlib.resources.files("celery_idem.stores.redis") / "lua"
    return (lua / "_prelude.lua").read_text("utf-8") + "\n" + (lua / f"{name}.lua").read_text("utf-8")


class Scripted:
    """One script on one client, called as ``script(keys=..., args=...)``: by SHA, loaded again when
    the server answers NOSCRIPT (a restart, a failover, SCRIPT FLUSH), as redis-py's ``Script`` does.

    On a plain client (one server, or a Sentinel master) the call goes straight to a connection of
    its pool: redis-py's command path (its retry wrapper, with no retries here, and its per-command
    bookkeeping) cost half the client CPU of a transition. The connection is redis-py's, with its
    timeouts and health checks; a call that did not end with its reply read drops it (no unread
    reply ever goes back to the pool), whatever interrupted it. Cluster clients take redis-py's
    path, which routes by slot.
    """

    def __init__(self, client: Any, text: str) -> None:
        self.script = client.register_script(text)
        self._pool: Any = None
        self._named = False
        if type(client) is redis.Redis and getattr(client, "connection", None) is None:
            self._pool = client.connection_pool
            # redis-py 5.0 wants the command's name; later ones warn when given any.
            named = inspect.signature(self._pool.get_connection).parameters.get("command_name")
            self._named = named is not None and named.default is inspect.Parameter.empty

    def __call__(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if self._pool is None:
            return self.script(keys=keys, args=args)
        try:
            return self._evalsha(keys, args)
        except NoScriptError:
            self.script.sha = self.script.registered_client.script_load(self.script.script)
            return self._evalsha(keys, args)

    def _evalsha(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        pool = self._pool
        conn = pool.get_connection("EVALSHA") if self._named else pool.get_connection()
        try:
            try:
                conn.send_command("EVALSHA", self.script.sha, len(keys), *keys, *args)
                return conn.read_response()
            except BaseException:
                # Whatever stopped it (a timeout, a soft time limit raised mid-read, an error reply):
                # a reply may be left unread on this connection, and the next transition would read
                # it as its own. Not every connection class drops itself (Sentinel's does not).
                conn.disconnect()
                raise
            finally:
                should_reconnect = getattr(conn, "should_reconnect", None)  # redis-py 7+: server maintenance
                if should_reconnect is not None and should_reconnect():
                    conn.disconnect()
        finally:
            pool.release(conn)


def register(client: Any) -> dict[str, Scripted]:
    """Every script, registered on the redis-py ``client``."""
    return {name: Scripted(client, source(name)) for name in NAMES}


def text(value: bytes | None) -> str | None:
    """An optional hash field as text."""
    return None if value is None else value.decode("utf-8")


def record(stored: Sequence[bytes] | bytes, identity: Identity | None = None) -> IdempotencyRecord:
    """A record as a script or a read returns it: a packed settled record (``bytes``; its identity
    is in its key only, so the caller gives it), or a hash as a flat field, value, ... list."""
    if isinstance(stored, bytes):
        if identity is None:
            raise ValueError("a packed record is read with its identity (it is in the record's key only)")
        return settled(stored, identity)
    flat = stored
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
        content_type=text(fields.get("ctype")),
        content_encoding=text(fields.get("cenc")),
        error=ErrorInfo.model_validate_json(error) if error else None,
        call=fields.get("call"),
        previous_task_id=text(fields.get("prev")),
    )


_HEADER = struct.Struct(">BBBddddI")
_LONG = struct.Struct(">I")  # a string's length when its one-byte length says 255
_PACKED = 1  # the format byte of lua/_prelude.lua's packed settled record
_DEFAULT_CONTENT = ("application/json", "utf-8")


def settled(blob: bytes, identity: Identity) -> IdempotencyRecord:
    """A packed settled record (format 1, ``lua/_prelude.lua`` says how it is laid out)."""
    form, state, flags, expires, created, updated, ttl, attempt = _HEADER.unpack_from(blob)
    if form != _PACKED:
        raise ValueError(f"a record in an unknown format ({form}): written by a newer celery-idem?")
    at, strings = _HEADER.size, []
    for _ in range(6):
        size, at = blob[at], at + 1
        if size == 255:
            (size,), at = _LONG.unpack_from(blob, at), at + _LONG.size
        strings.append(blob[at : at + size])
        at += size
    fp, task_id, prev, owner, ctype, cenc = strings
    payload = blob[at:]
    completed = state == ord("C")
    if completed and not ctype and not cenc and not flags & 8:  # flag 8: the caller's own empty pair
        ctype, cenc = (part.encode("ascii") for part in _DEFAULT_CONTENT)
    return IdempotencyRecord.model_construct(
        scope=identity.scope,
        task_name=identity.task_name,
        key=identity.key,
        fingerprint=fp.hex() if flags & 1 else fp.decode("utf-8"),
        state=State.COMPLETED if completed else State.FAILED,
        task_id=_task_id(task_id, flags & 2),
        owner="#" + owner.hex(),
        attempt=attempt,
        lease_expires_at=None,
        created_at=created,
        updated_at=updated,
        expires_at=expires,
        ttl_seconds=ttl,
        result=payload if completed else None,
        content_type=ctype.decode("utf-8") if completed else None,
        content_encoding=cenc.decode("utf-8") if completed else None,
        error=None if completed else ErrorInfo.model_validate_json(payload),
        call=None,
        previous_task_id=_task_id(prev, flags & 4) or None,
    )


def _task_id(stored: bytes, packed: int) -> str:
    return str(uuid.UUID(bytes=stored)) if packed else stored.decode("utf-8")
