"""Concurrent histories whose calls come from separate processes (the model tests' part 2, across processes).

:class:`Processes` starts a few ``spawn`` processes once; each opens its own store object on the
same data (a URL and a key prefix) and keeps it. For one history, :meth:`Processes.run` hands each
process a plan of operations and the clock shift the test's store carries; the processes wait on one
barrier, run their plans at once and send back every call with its invocation and response times.

The times are ``time.monotonic()``: CLOCK_MONOTONIC on Linux, one clock for every process of the
machine, so calls from different processes are ordered in real time as the checker needs. The shift
(``Store.advance_clock_for_tests``) belongs to one store object: every process applies the same total
to its own, so all of them read the same shifted server clock as the test's store.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from linearizability import Call
from model_harness import Op, perform

from celery_idem.stores import Store, store_from_url

__all__ = ["Processes"]

REPLY = 60  # seconds a process may take to answer a history: a bound against a hang, not a benchmark


def _serve(connection: Any, barrier: Any) -> None:
    """One process: for each job, open (once) the store it names, match its shift, run the plan."""
    stores: dict[tuple[str, str], tuple[Store, list[float]]] = {}
    try:
        while (job := connection.recv()) is not None:
            url, prefix, shift, plan = job
            if (url, prefix) not in stores:
                stores[(url, prefix)] = (store_from_url(url, key_prefix=prefix), [0.0])
            store, shifted = stores[(url, prefix)]
            if shift > shifted[0]:  # the test's store moved on since the last history: follow it
                store.advance_clock_for_tests(shift - shifted[0])
                shifted[0] = shift
            barrier.wait(timeout=REPLY)
            calls: list[tuple[Op, float, float, Any]] = []
            error = None
            for call in plan:
                start = time.monotonic()
                try:
                    answer = perform(store, call)
                except Exception as exc:  # noqa: BLE001 - reported to the test, with the calls so far
                    error = repr(exc)
                    break
                calls.append((call, start, time.monotonic(), answer))
            connection.send((calls, error))
    finally:
        for store, _ in stores.values():
            store.close()


class Processes:
    """``count`` spawned processes that run plans on a store at once (see the module docstring)."""

    def __init__(self, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.barrier = context.Barrier(count)
        self.connections: list[Any] = []
        self.processes: list[Any] = []
        for _ in range(count):
            mine, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, self.barrier), daemon=True)
            process.start()
            self.connections.append(mine)
            self.processes.append(process)

    def run(self, url: str, prefix: str, shift: float, plans: list[list[Op]]) -> tuple[list[Call], list[str]]:
        """Each plan in its own process, all released at once: every call (``thread`` = the process's
        index) with its times and answer, and the errors any process raised."""
        assert len(plans) == len(self.connections)
        for connection, plan in zip(self.connections, plans, strict=True):
            connection.send((url, prefix, shift, plan))
        history: list[Call] = []
        errors: list[str] = []
        for n, connection in enumerate(self.connections):
            if not connection.poll(REPLY):
                raise AssertionError(f"process {n} did not answer within {REPLY}s")
            calls, error = connection.recv()
            history += [Call(n, call, start, end, answer) for call, start, end, answer in calls]
            if error is not None:
                errors.append(f"process {n}: {error}")
        return history, errors

    def close(self) -> None:
        for connection in self.connections:
            connection.send(None)
        for process in self.processes:
            process.join(timeout=REPLY)
            if process.is_alive():
                process.kill()
