"""Found by an attacker: a forked process inherits the heartbeat's leases and deferred settlements, and runs
them from its own thread as soon as it adds a lease or defers a write of its own.

Heartbeat keeps _leases/_settlements across fork (no os.register_at_fork reset, no pid check on the
sets); _start() in the child starts a new thread over the parent's sets. The child then renews the
parent's leases (a parent that dies keeps its record IN_PROGRESS for as long as the child lives)
and repeats the parent's outcome writes. Celery's prefork parent runs no attempts, so a plain prefork
worker is not hit; a body that forks (multiprocessing 'fork' context) and whose child runs an
idempotent task eagerly is. Run in a fresh interpreter (a fork inside pytest's threads can deadlock
on an unrelated lock, which is the other half of the same hazard).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, time, uuid
    from celery_idem.errors import StoreUnavailableError
    from celery_idem.heartbeat import Heartbeat
    from celery_idem.records import Identity
    from celery_idem.stores.base import OK
    from celery_idem.stores.memory import MemoryStore

    marker = sys.argv[1]
    parent = os.getpid()
    heartbeat = Heartbeat()

    def parents_outcome():
        if os.getpid() == parent:
            raise StoreUnavailableError("still down in the parent")
        with open(marker, "w") as f:
            f.write(str(os.getpid()))  # the child wrote the parent's outcome
        return OK

    heartbeat.defer(Identity("", "t", "parent-outcome"), parents_outcome, lambda: False, seconds=600)
    pid = os.fork()
    if pid == 0:  # the child runs an idempotent attempt of its own
        try:
            store = MemoryStore()
            mine = Identity("", "t", "child-" + uuid.uuid4().hex)
            taken = store.acquire(mine, "f" * 64, "c", lease_seconds=30, ttl_seconds=60)
            heartbeat.add(store, mine, taken.record.owner, 30)
            time.sleep(2.5)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_child_does_not_run_the_parents_deferred_write(tmp_path) -> None:
    marker = tmp_path / "child-wrote"
    subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], check=True, timeout=30)
    assert not marker.exists(), f"child {marker.read_text()} wrote the parent's deferred outcome"
