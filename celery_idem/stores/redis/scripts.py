"""The Lua scripts of the Redis store, one per transition, and the record hashes they write.

The key layout, the hash fields and each script's contract are written at the top of the scripts,
in ``lua/`` beside this module (``_prelude.lua`` is prepended to each). :func:`record` reads a
record hash back, as ``HGETALL`` or a script returns it.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Sequence
from typing import Any

from redis.commands.core import Script

from ...records import ErrorInfo, IdempotencyRecord, State

__all__ = ["NAMES", "record", "register", "source", "text"]

NAMES = ("claim", "acquire", "settle", "release", "renew", "forget", "due", "hand_over", "keep_alive", "alive")
"""Every script, by the name of its file in ``lua/``."""


@functools.cache
def source(name: str) -> str:
    """The text of the script ``name``: the prelude, then the script."""
    lua = importlib.resources.files("celery_idem.stores.redis") / "lua"
    return (lua / "_prelude.lua").read_text("utf-8") + "\n" + (lua / f"{name}.lua").read_text("utf-8")


def register(client: Any) -> dict[str, Script]:
    """Every script, registered on the redis-py ``client`` (sent by SHA, loaded again when missing)."""
    return {name: client.register_script(source(name)) for name in NAMES}


def text(value: bytes | None) -> str | None:
    """An optional hash field as text."""
    return None if value is None else value.decode("utf-8")


def record(flat: Sequence[bytes]) -> IdempotencyRecord:
    """A record hash, given as a flat field, value, field, value... list."""
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
