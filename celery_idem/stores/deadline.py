"""A client-side deadline for blocking socket reads: the SQL store's guard against a silent server.

PostgreSQL's ``statement_timeout`` and ``lock_timeout`` are enforced by the server: a server that
has frozen (a paused VM, a network path that black-holes after the connection was pooled) never
answers, and the client's read blocks until the kernel gives up on the connection, hours later.
Redis has ``socket_timeout``; libpq has nothing like it. So every SQL statement registers its
connection's socket here for the length of the call, and one watchdog thread shuts down the socket
of a call that outlives its deadline: the blocked read fails at once, the store answers
``StoreUnavailableError``, and the pool discards the connection.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Watchdog", "socket_of"]

logger = logging.getLogger("celery_idem.stores")


class Watchdog:
    """Shuts down the socket of any registered call still running past its deadline."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, int]] = []  # (deadline, ticket, fd)
        self._live: set[int] = set()
        self._tickets = itertools.count()
        self._wake = threading.Condition()
        self._pid = 0
        self._wakes_at = math.inf  # when the watchdog thread looks next, by itself (monotonic)

    @contextlib.contextmanager
    def guard(self, fd: int | None, seconds: float) -> Iterator[None]:
        """Hold ``fd`` to ``seconds`` while the block runs (a no-op without a socket)."""
        if fd is None or fd < 0:
            yield
            return
        ticket = next(self._tickets)
        with self._wake:
            if self._pid != os.getpid():  # first use, or a forked child: threads do not survive a fork
                self._pid = os.getpid()
                self._due.clear()
                self._live.clear()
                self._wakes_at = math.inf
                threading.Thread(target=self._run, name="celery-idem-sql-deadline", daemon=True).start()
            deadline = time.monotonic() + seconds
            heapq.heappush(self._due, (deadline, ticket, fd))
            self._live.add(ticket)
            if deadline < self._wakes_at:
                # Only a deadline before the thread's next look needs it awake: calls under one
                # timeout come due in the order they start, so a steady stream wakes it about once
                # a deadline, not once a statement (a thread switch and the GIL each time).
                self._wakes_at = deadline
                self._wake.notify()
        try:
            yield
        finally:
            with self._wake:
                self._live.discard(ticket)

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._wake:
                if self._pid != pid:
                    return
                while self._due and self._due[0][1] not in self._live:
                    heapq.heappop(self._due)  # finished in time
                if not self._due:
                    self._wakes_at = math.inf  # a new call notifies
                    self._wake.wait(timeout=60)
                    continue
                deadline, ticket, fd = self._due[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._wakes_at = deadline
                    self._wake.wait(timeout=wait)
                    continue
                heapq.heappop(self._due)
                self._live.discard(ticket)
                try:
                    _shut_down(fd)
                except Exception:  # noqa: BLE001 - the watchdog survives anything one socket does
                    logger.exception("could not cut off a store call past its deadline")


def _shut_down(fd: int) -> None:
    """Shut the socket down for both directions: a read blocked on it returns at once."""
    duplicate = socket.socket(fileno=os.dup(fd))  # the same socket under a descriptor of our own
    try:
        duplicate.shutdown(socket.SHUT_RDWR)
        logger.warning("a store call outlived its deadline: its connection was cut off")
    finally:
        duplicate.close()


def socket_of(connection: Any) -> int | None:
    """A SQLAlchemy connection's socket descriptor on PostgreSQL (psycopg's ``pgconn.socket``) and on
    MySQL/MariaDB (PyMySQL's socket), else None: SQLite is a file, whose busy timeout bounds every wait."""
    name = connection.dialect.name
    if name not in ("postgresql", "mysql", "mariadb"):
        return None
    try:
        dbapi_connection = connection.connection.dbapi_connection
        if name != "postgresql":
            return int(dbapi_connection._sock.fileno())
        return int(dbapi_connection.pgconn.socket)
    except Exception:  # noqa: BLE001 - another driver, or a closed connection: no watchdog
        return None
