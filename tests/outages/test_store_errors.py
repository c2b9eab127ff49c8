"""Bad input and bad days: unknown URLs, oversized results, and stores that are down or silent.

A store that cannot answer must raise StoreUnavailableError within its timeout, never hang (DESIGN
§3), even when the server goes silent in the middle of a call on a pooled connection. The bound
checked here is generous (timeout + 5 s): it guards against a hang, it is not a benchmark.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from addresses import REDIS_URL
from conftest import POSTGRES_URL, require_server

from celery_idem import (
    ConfigurationError,
    IdempotencyError,
    ResultTooLargeError,
    SerializationError,
    StoreUnavailableError,
)
from celery_idem.records import Decision, Identity
from celery_idem.stores import MemoryStore, Store, store_from_url
from celery_idem.stores.sql import SQLStore
from celery_idem.telemetry import key_hash

ID = Identity("", "shop.charge", "order-1")
TIMEOUT = 0.5


@pytest.fixture
def closed_port() -> int:
    """A loopback port nobody listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never says a word: only a timeout ends a call."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    server.close()


def _assert_unavailable_fast(store: Store, operation: Callable[[Store], Any], bound: float) -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as caught:
        operation(store)
    elapsed = time.monotonic() - started
    assert elapsed < bound, f"took {elapsed:.1f}s: the store call must end by its timeout"
    message = str(caught.value)
    assert "check that the store is up" in message
    assert re.search(r"\(after \d+\.\d\ds, timeout [\d.]+s\)", message), f"says not how long it took: {message}"
    # Running unprotected is a choice the docs weigh, never the fix an error message suggests.
    assert "proceed" not in message and "unprotected" not in message
    assert caught.value.__cause__ is not None  # the driver's own error stays attached


OPERATIONS: dict[str, Callable[[Store], Any]] = {
    "claim": lambda s: s.claim(ID, "f" * 64, "t", pending_seconds=60, ttl_seconds=60),
    "acquire": lambda s: s.acquire(ID, "f" * 64, "t", lease_seconds=60, ttl_seconds=60),
    "complete": lambda s: s.complete(ID, "owner", b"1"),
    "get": lambda s: s.get(ID),
    "expired_leases": lambda s: s.expired_leases(limit=10),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
@pytest.mark.parametrize("scheme", ["redis", "postgresql", "mariadb"])
def test_refused_connection_is_store_unavailable_at_once(scheme: str, operation: str, closed_port: int) -> None:
    url = {
        "redis": f"redis://127.0.0.1:{closed_port}/0",
        "postgresql": f"postgresql://x@127.0.0.1:{closed_port}/x",
        "mariadb": f"mariadb://x@127.0.0.1:{closed_port}/x",
    }
    store = store_from_url(url[scheme], timeout_seconds=TIMEOUT)
    _assert_unavailable_fast(store, OPERATIONS[operation], bound=TIMEOUT + 5)


@pytest.mark.parametrize("operation", ["claim", "get"])
def test_silent_redis_is_store_unavailable_within_the_timeout(operation: str, silent_port: int) -> None:
    store = store_from_url(f"redis://127.0.0.1:{silent_port}/0", timeout_seconds=TIMEOUT)
    _assert_unavailable_fast(store, OPERATIONS[operation], bound=TIMEOUT + 5)


def test_silent_postgresql_is_store_unavailable_within_the_timeout(silent_port: int) -> None:
    # libpq's connect_timeout cannot go below 2 s, so this store's deadline is 2 s.
    store = store_from_url(f"postgresql://x@127.0.0.1:{silent_port}/x", timeout_seconds=TIMEOUT)
    _assert_unavailable_fast(store, OPERATIONS["claim"], bound=2 + 5)


@pytest.mark.parametrize("operation", ["claim", "get"])
def test_silent_mariadb_is_store_unavailable_within_the_timeout(operation: str, silent_port: int) -> None:
    # The TCP connect succeeds; PyMySQL then waits for the server's greeting, bounded by its read timeout.
    store = store_from_url(f"mysql://x@127.0.0.1:{silent_port}/x", timeout_seconds=TIMEOUT)
    _assert_unavailable_fast(store, OPERATIONS[operation], bound=TIMEOUT + 1 + 5)


def test_store_unavailable_names_the_identity(closed_port: int) -> None:
    store = store_from_url(f"redis://127.0.0.1:{closed_port}/0", timeout_seconds=TIMEOUT)
    with pytest.raises(StoreUnavailableError) as caught:
        store.claim(ID, "f" * 64, "t", pending_seconds=60, ttl_seconds=60)
    assert caught.value.key == "order-1" and caught.value.task_name == "shop.charge"
    # Named by the key's hash, as the log lines that print this error name it: the key itself stays
    # on the exception's attribute, out of the logs (keys can be personal data).
    assert f"shop.charge (key_hash={key_hash(ID)})" in str(caught.value)
    assert "order-1" not in str(caught.value)
    assert isinstance(caught.value, IdempotencyError)


# ---- URLs and options ---------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["mongodb://localhost/x", "http://localhost", "dynamodb://table"])
def test_unknown_store_scheme_names_the_scheme_and_the_known_ones(url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        store_from_url(url)
    message = str(caught.value)
    assert f"unknown store URL scheme {url.split(':')[0]!r}" in message
    assert "redis://" in message and "sqlite://" in message and "memory://" in message


@pytest.mark.parametrize("url", ["", "localhost:6379", None, 42])
def test_a_store_url_without_a_scheme_is_refused(url: Any) -> None:
    with pytest.raises(ConfigurationError, match="a store URL looks like 'redis://host:6379/0'"):
        store_from_url(url)


def test_memory_url_builds_a_fresh_memory_store() -> None:
    assert isinstance(store_from_url("memory://"), MemoryStore)
    assert store_from_url("memory://") is not store_from_url("memory://")


def test_redis_key_prefix_with_braces_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="must not contain braces"):
        store_from_url(REDIS_URL, key_prefix="{x}")


def test_sentinel_url_without_service_name_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="service_name"):
        store_from_url("redis+sentinel://127.0.0.1:26379")


def test_empty_key_prefix_and_bad_timeout_are_refused() -> None:
    with pytest.raises(ValueError, match="key_prefix must be a non-empty string"):
        MemoryStore(key_prefix="")
    with pytest.raises(ValueError, match="timeout_seconds must be a positive"):
        MemoryStore(timeout_seconds=0)


# ---- results over max_result_bytes -------------------------------------------------------------


def test_result_over_max_result_bytes_is_refused_and_the_attempt_can_still_release(store: Store) -> None:
    # Given a store that keeps results up to 1 KiB
    store.max_result_bytes = 1024
    taken = store.acquire(ID, "f" * 64, "t", lease_seconds=60, ttl_seconds=60)
    assert taken.record is not None
    # When the task returns 1025 bytes
    with pytest.raises(ResultTooLargeError) as caught:
        store.complete(ID, taken.record.owner, b"x" * 1025)
    # Then the error says what was wrong and what to do, and nothing was stored
    assert "1025 bytes, over max_result_bytes=1024" in str(caught.value)
    assert "raise max_result_bytes" in str(caught.value)
    assert isinstance(caught.value, SerializationError)
    record = store.get(ID)
    assert record is not None and record.result is None
    # and the attempt still owns the record, so the handler can give it back
    assert store.release(ID, taken.record.owner).decision is Decision.OK
    # exactly the limit is fine
    again = store.acquire(ID, "f" * 64, "t", lease_seconds=60, ttl_seconds=60)
    assert again.record is not None
    assert store.complete(ID, again.record.owner, b"x" * 1024).ok


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
def test_a_store_built_from_a_plain_engine_honours_its_timeout_on_a_held_lock(kind: str, tmp_path: Any) -> None:
    # Given a store built from the user's own plain engine, with a short timeout
    import sqlite3

    import sqlalchemy as sa
    from conftest import MARIADB_URL, POSTGRES_URL, require_server

    require_server(kind)
    url = {
        "postgresql": POSTGRES_URL,
        "mariadb": MARIADB_URL.replace("mysql://", "mysql+pymysql://", 1),
        "sqlite": f"sqlite:///{tmp_path}/plain.db",
    }[kind]
    engine = sa.create_engine(url)
    store = SQLStore(engine, key_prefix=f"lock{uuid.uuid4().hex[:8]}", timeout_seconds=0.3)
    identity = Identity("", "shop.charge", "locked")
    store.claim(identity, "f" * 64, "t1", pending_seconds=60, ttl_seconds=600)
    answers: list[BaseException | None] = []

    def acquire() -> None:
        try:
            store.acquire(identity, "f" * 64, "t1", lease_seconds=30, ttl_seconds=600)
            answers.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            answers.append(exc)

    # When another connection holds the row's lock (SQLite: the database's write lock)
    holder: Any
    if kind in ("postgresql", "mariadb"):
        holder = engine.connect()
        holder.execute(sa.update(store.table).where(store.table.c.namespace == store.key_prefix).values(attempt=7))
    else:
        holder = sqlite3.connect(f"{tmp_path}/plain.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
    try:
        caller = threading.Thread(target=acquire, daemon=True)
        caller.start()
        caller.join(timeout=3)  # ten times the timeout: the call must have returned by then
        # Then the store call answers StoreUnavailableError instead of waiting for the lock
        assert answers and isinstance(answers[0], StoreUnavailableError), answers
    finally:
        holder.rollback()
        holder.close()
        caller.join(timeout=30)
        store.forget(identity)
        store.close()
        engine.dispose()


def test_a_soft_time_limit_raised_inside_a_store_call_stays_a_soft_time_limit(store: Store, monkeypatch: Any) -> None:
    # Every other error of a store call is an outage (StoreUnavailableError); the soft time limit is
    # raised into whatever the body was doing, and the task's own handling of it must see it.
    from celery.exceptions import SoftTimeLimitExceeded

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(store, "_claim", interrupted)
    with pytest.raises(SoftTimeLimitExceeded):
        store.claim(Identity("", "t", "k"), "f" * 64, "task-1", pending_seconds=30, ttl_seconds=60)


# ---- a PostgreSQL server gone silent in the middle of a call -----------------------------------

# Every store call honours its timeout even when the server goes silent (DESIGN §3: never hang).
#
# PostgreSQL's statement and lock timeouts are the server's: a server that stops answering (a frozen
# VM, a network path that black-holes after the connection was pooled) would leave the client's read
# blocked for hours. A small TCP relay between the store and PostgreSQL stops relaying mid-call here.


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


def test_a_move_of_the_table_whose_server_goes_silent_ends_within_its_deadline(
    relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a table of the older layout (tests/stores/test_sql_schema.py), a move whose deadline is
    # a second (it grows with the table: a minute and more), and a server that goes silent once the
    # move's copy is sent
    from sql_layouts import drop, make_layout_1

    from celery_idem.stores.sql import migrate

    direct = sa.create_engine(POSTGRES_URL)
    table = f"t_move_{uuid.uuid4().hex[:8]}"
    make_layout_1(direct, table)
    monkeypatch.setattr(migrate, "move_seconds", lambda rows: 1.0)
    url = sa.engine.make_url(POSTGRES_URL).set(host="127.0.0.1", port=relay.port)
    store = SQLStore.from_url(url.render_as_string(hide_password=False), table_name=table, timeout_seconds=1.0)

    @sa.event.listens_for(store.engine, "before_cursor_execute")
    def silence(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO"):
            relay.silent = True

    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(store.get(Identity("", "shop.charge", "paid")))
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(exc)

    try:
        # When the first store call moves the table, then it ends with an outage (before, nothing
        # bounded it: no statement timeout, no watchdog)
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(timeout=15)
        assert not caller.is_alive(), "a move under a silent server still blocked after 15 s"
        assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailableError), outcome
        # And once the server answers again, a later call moves the table (the server may still be
        # rolling the cut-off move back: an outage or two first)
        sa.event.remove(store.engine, "before_cursor_execute", silence)
        relay.silent = False
        deadline = time.monotonic() + 30
        while True:
            try:
                record = store.get(Identity("", "shop.charge", "paid"))
                break
            except StoreUnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert record is not None and record.state.value == "COMPLETED"
    finally:
        relay.silent = False
        store.close()
        drop(direct, table, f"{table}_layout1", f"{table}_live")
        direct.dispose()


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
