"""MemoryStore: one process, thread-safe, injectable clock. For tests and eager mode.

It is a real store (every rule of :mod:`celery_idem.stores.rules` holds, under one lock) and the
plainest statement of those rules; the Lua scripts and SQL statements do the same thing atomically
on their servers.

By concern: ``store``, the transitions, each a step under the lock (the rules, stated plainly); and
``records``, the dict of records under that lock, with every operation that only reads or drops
them and the processes' liveness records.
"""

from __future__ import annotations

from .store import MemoryStore

__all__ = ["MemoryStore"]
