"""Every store call honours its timeout even when the server goes silent (DESIGN §3: never hang).

PostgreSQL's statement and lock timeouts are the server's: a server that stops answering (a frozen
VM, a network path that black-holes after the connection was pooled) would leave the client's read
blocked for hours. A small TCP relay between the store and PostgreSQL stops relaying mid-call here.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from conftest import POSTGRES_URL, require_server

from celery_idem import StoreUnavailableError
from celery_idem.records import Identity
from celery_idem.stores.sql import SQLStore


class Relay:
    """127.0.0.1:<port> -> PostgreSQL; with ``silent`` set it holds every byte (sockets stay open)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.silent = False
        self.upstream = upstream
        self.sockets: list[socket.socket] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                while self.silent:
                    time.sleep(0.05)  # held: the peer hears nothing, and nothing is refused
                b.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


@pytest.fixture
def relay() -> Iterator[Relay]:
    require_server("postgresql")
    url = sa.engine.make_url(POSTGRES_URL)
    relay = Relay((url.host or "127.0.0.1", url.port or 5432))
    yield relay
    relay.silent = False
    relay.close()


def test_a_call_to_a_postgresql_server_gone_silent_ends_within_its_timeout(relay: Relay) -> None:
    url = sa.engine.make_url(POSTGRES_URL).set(host="127.0.0.1", port=relay.port)
    table = f"t_deadline_{uuid.uuid4().hex[:8]}"
    store = SQLStore.from_url(url.render_as_string(hide_password=False), table_name=table, timeout_seconds=1.0)
    identity = Identity("", "shop.charge", "order-1")
    try:
        assert store.get(identity) is None  # the schema is made and a connection is pooled
        # Given the server goes silent after the connection was made
        relay.silent = True
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(store.get(identity))
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                outcome.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        # When a store call is made, Then it ends (generous bound: 10x the timeout) with a clear error
        caller.join(timeout=10)
        assert not caller.is_alive(), "a store call with timeout_seconds=1 still blocked after 10 s"
        assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailableError), outcome
        # And once the server answers again, the store does too (the cut connection was discarded)
        relay.silent = False
        assert store.get(identity) is None
    finally:
        store.close()
        direct = sa.create_engine(POSTGRES_URL)
        with direct.begin() as connection:
            store.table.drop(connection, checkfirst=True)
        direct.dispose()
