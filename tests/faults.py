"""Fault injection at every store call: make the N-th call of a store method fail as real stores fail.

``Injector(store)`` patches one real store instance in place (it stays the same ``RedisStore`` or
``SQLStore``, so ``Idempotency(app, store=store)`` accepts it and a worker uses it as it is):

- each public store method (``claim``, ``acquire``, ``renew``, ``complete``, ``fail``, ``release``,
  ``get``, ...) counts its calls against the armed :class:`Plan` objects, per idempotency key;
- the call a plan picks arms a fault for its own thread, and the fault fires at the DRIVER level,
  below the store: on Redis in each pooled connection's ``send_command`` (what every script and
  command goes through, redis-py's command path and the store's own), or the client's
  ``execute_command`` for a client without a pool (Cluster); on SQL in SQLAlchemy's cursor
  events. So the store's own error mapping is what turns the driver's error into what the library
  sees, exactly as with a real outage.

Fault kinds (:class:`Fault`), with the driver error each raises:

=============  ===============================================  ================================
kind           Redis (redis-py)                                 SQL (psycopg / sqlite3)
=============  ===============================================  ================================
refused        ConnectionError, command never sent              OperationalError, never sent
timeout        TimeoutError, command never sent                 QueryCanceled / "database is locked"
lost_reply     the command RUNS, its reply unread: TimeoutError the statement RUNS (autocommit),
                                                                then "server closed the connection"
busy           ``BUSY`` error reply (ResponseError)             -
readonly       ``READONLY`` error reply (ReadOnlyError)         ReadOnlySqlTransaction (25006) /
                                                                "attempt to write a readonly database"
noreplicas     ``NOREPLICAS`` error reply (ResponseError)       -
serialization  -                                                SerializationFailure (40001) /
                                                                "database is locked"
unexpected     RuntimeError                                     RuntimeError
=============  ===============================================  ================================

Redis error replies are built by redis-py's own reply parser, so the exception class is exactly the
one a real server's reply would give.

A worker started as a subprocess (tests/workers.py) installs faults from the environment:
``CELERY_IDEM_FAULTS='[{"method": "complete", "fault": "lost_reply"}]'`` and a call of
:func:`install_from_env` on its store (tests/shop.py does it). Plans count per process: use the
threads or solo pool, or give each plan a ``key``, when a fault must fire once per worker.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["FAULTS_ENV", "Fault", "Injector", "Plan", "REDIS_FAULTS", "SQL_FAULTS", "install_from_env"]

FAULTS_ENV = "CELERY_IDEM_FAULTS"


class Fault(str, enum.Enum):
    REFUSED = "refused"
    TIMEOUT = "timeout"
    LOST_REPLY = "lost_reply"
    BUSY = "busy"
    READONLY = "readonly"
    NOREPLICAS = "noreplicas"
    SERIALIZATION = "serialization"
    UNEXPECTED = "unexpected"


REDIS_FAULTS = tuple(f for f in Fault if f is not Fault.SERIALIZATION)
SQL_FAULTS = tuple(f for f in Fault if f not in (Fault.BUSY, Fault.NOREPLICAS))

# Store methods that take the identity first; the others (expired_leases, now, ...) have no key.
KEYED = ("claim", "acquire", "renew", "complete", "fail", "release", "get", "forget")
METHODS = (*KEYED, "expired_leases", "purge_expired", "now", "ping", "records", "count_by_state", "count_by_task")


@dataclass
class Plan:
    """Fail the ``nth`` (1-based) call of ``method`` (for ``key`` only, when given), and the
    ``times - 1`` calls after it. ``seen`` and ``fired`` count what happened."""

    method: str
    fault: Fault
    nth: int = 1
    key: str | None = None
    times: int = 1
    seen: int = 0
    fired: int = 0

    def picks(self, method: str, key: str | None) -> bool:
        if method != self.method or (self.key is not None and key != self.key):
            return False
        self.seen += 1
        return self.nth <= self.seen < self.nth + self.times


class Injector:
    """Patches ``store`` in place; :meth:`arm` adds a plan, :meth:`clear` removes them all."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.plans: list[Plan] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        for name in METHODS:
            setattr(store, name, self._counted(name, getattr(store, name)))
        if hasattr(store, "client"):
            self._hook_redis(store.client)
        else:
            self._hook_sql(store.engine)

    def arm(self, plan: Plan) -> Plan:
        with self._lock:
            self.plans.append(plan)
        return plan

    def clear(self) -> None:
        with self._lock:
            self.plans.clear()

    # ---- which call fails --------------------------------------------------------------------

    def _counted(self, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            identity = args[0] if name in KEYED and args else kwargs.get("identity")
            key = getattr(identity, "key", None)
            with self._lock:
                chosen = next((plan for plan in self.plans if plan.picks(name, key)), None)
            if chosen is None:
                return method(*args, **kwargs)
            self._local.fault, self._local.plan = chosen.fault, chosen
            try:
                return method(*args, **kwargs)
            finally:
                self._local.fault = self._local.plan = None
                self._local.in_transaction = False

        return call

    def _take_fault(self) -> Fault | None:
        """The fault armed for this thread's current store call, once (its first command fails)."""
        fault = getattr(self._local, "fault", None)
        if fault is not None:
            self._local.fault = None
            with self._lock:
                self._local.plan.fired += 1
        return fault

    # ---- Redis: below the store, in the client -------------------------------------------------

    def _hook_redis(self, client: Any) -> None:
        pool = getattr(client, "connection_pool", None)
        if type(client).__name__ != "Redis" or pool is None:
            self._hook_redis_client(client)
            return
        get = pool.get_connection

        @functools.wraps(get)
        def get_connection(*args: Any, **kwargs: Any) -> Any:
            conn = get(*args, **kwargs)
            hooked = conn.__dict__.setdefault("_fault_injectors", set())  # two stores may share a client
            if id(self) not in hooked:
                hooked.add(id(self))
                self._hook_redis_connection(conn)
            return conn

        pool.get_connection = get_connection

    def _hook_redis_connection(self, conn: Any) -> None:
        """Faults fire on the commands a transition sends, never on a (re)connect's handshake or a
        script's load. A lost
        reply is left unread on the connection, as one that comes too late is: dropping the
        connection is the library's job (a connection that kept it would answer the next command
        with it)."""
        send = conn.send_command
        for name in ("connect", "connect_check_health"):
            if hasattr(conn, name):
                setattr(conn, name, self._in_handshake(getattr(conn, name)))

        def send_command(*args: Any, **options: Any) -> Any:
            if getattr(self._local, "handshake", 0) or str(args[0]).upper().startswith("SCRIPT"):
                return send(*args, **options)  # plumbing: a connection's handshake, a script's load
            fault = self._take_fault()
            if fault is None:
                return send(*args, **options)
            if fault is Fault.LOST_REPLY:
                if str(args[0]).upper() == "EVALSHA" and not _script_exists(conn, send, args[1]):
                    self._rearm(fault)  # NOSCRIPT runs nothing: the try after the script's load loses its reply
                    return send(*args, **options)
                send(*args, **options)  # the server runs it; its reply is never read
            raise redis_error(fault)

        conn.send_command = send_command

    def _in_handshake(self, connect: Any) -> Any:
        def handshake(*args: Any, **kwargs: Any) -> Any:
            self._local.handshake = getattr(self._local, "handshake", 0) + 1
            try:
                return connect(*args, **kwargs)
            finally:
                self._local.handshake -= 1

        return handshake

    def _rearm(self, fault: Fault) -> None:
        self._local.fault = fault
        with self._lock:
            self._local.plan.fired -= 1

    def _hook_redis_client(self, client: Any) -> None:
        execute = client.execute_command

        def execute_command(*args: Any, **options: Any) -> Any:
            fault = self._take_fault()
            if fault is None:
                return execute(*args, **options)
            if fault is Fault.LOST_REPLY:
                execute(*args, **options)  # the server ran it
                raise redis_error(Fault.TIMEOUT)
            raise redis_error(fault)

        client.execute_command = execute_command

    # ---- SQL: below the store, in the cursor ---------------------------------------------------

    def _hook_sql(self, engine: Any) -> None:
        import sqlalchemy as sa

        dbapi = engine.dialect.loaded_dbapi
        dialect = engine.dialect.name

        def before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            fault = getattr(self._local, "fault", None)
            if fault is None or fault is Fault.LOST_REPLY:
                return
            self._take_fault()
            raise sql_error(fault, dialect, dbapi)

        def after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            if getattr(self._local, "fault", None) is Fault.LOST_REPLY:
                # A transaction of the store's own (MySQL's Locked transitions) loses the reply of its
                # COMMIT: it ran and committed, as one autocommit statement does below.
                verb = statement.lstrip().split(None, 1)[0].upper()
                if verb == "START" or (getattr(self._local, "in_transaction", False) and verb != "COMMIT"):
                    self._local.in_transaction = True
                    return
                self._local.in_transaction = False
                self._take_fault()  # the statement ran and committed (autocommit): only its reply is lost
                raise sql_error(Fault.LOST_REPLY, dialect, dbapi)

        sa.event.listen(engine, "before_cursor_execute", before)
        sa.event.listen(engine, "after_cursor_execute", after)


_REDIS_REPLIES = {
    Fault.BUSY: "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    Fault.READONLY: "READONLY You can't write against a read only replica.",
    Fault.NOREPLICAS: "NOREPLICAS Not enough good replicas to write.",
}


def _script_exists(conn: Any, send: Any, sha: Any) -> bool:
    send("SCRIPT", "EXISTS", sha)
    return bool(conn.read_response()[0])


def redis_error(fault: Fault) -> BaseException:
    """The exception redis-py raises for ``fault``; error replies go through its own parser."""
    import redis
    from redis._parsers.base import BaseParser

    if fault is Fault.REFUSED:
        return redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    if fault in (Fault.TIMEOUT, Fault.LOST_REPLY):
        return redis.exceptions.TimeoutError("Timeout reading from socket")
    if fault is Fault.UNEXPECTED:
        return RuntimeError("injected: an unexpected error in the Redis client")
    if fault in _REDIS_REPLIES:
        error: BaseException = BaseParser.parse_error(_REDIS_REPLIES[fault])
        return error
    raise ValueError(f"{fault.value} is not a Redis fault")


def sql_error(fault: Fault, dialect: str, dbapi: Any) -> BaseException:
    """The DBAPI exception the driver raises for ``fault`` (SQLAlchemy wraps it as for a real one)."""
    if fault is Fault.UNEXPECTED:
        return RuntimeError("injected: an unexpected error in the SQL driver")
    if dialect == "postgresql":
        import psycopg.errors as pg

        return {
            Fault.REFUSED: lambda: pg.OperationalError("connection failed: Connection refused"),
            Fault.TIMEOUT: lambda: pg.QueryCanceled("canceling statement due to statement timeout"),
            Fault.LOST_REPLY: lambda: pg.OperationalError("consuming input failed: server closed the connection"),
            Fault.READONLY: lambda: pg.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"),
            Fault.SERIALIZATION: lambda: pg.SerializationFailure("could not serialize access"),
        }[fault]()
    if dialect in ("mysql", "mariadb"):  # PyMySQL's errors carry MySQL's error code first, as the server's do
        return {
            Fault.REFUSED: lambda: dbapi.OperationalError(
                2003, "Can't connect to MySQL server on '127.0.0.1' ([Errno 111] Connection refused)"
            ),
            Fault.TIMEOUT: lambda: dbapi.OperationalError(
                1969, "Query execution was interrupted (max_statement_time exceeded)"
            ),
            Fault.LOST_REPLY: lambda: dbapi.OperationalError(2013, "Lost connection to MySQL server during query"),
            Fault.READONLY: lambda: dbapi.OperationalError(
                1290, "The MariaDB server is running with the --read-only option so it cannot execute this statement"
            ),
            # InnoDB's serialization failure: the store runs the statement again (test_faults.py)
            Fault.SERIALIZATION: lambda: dbapi.OperationalError(
                1213, "Deadlock found when trying to get lock; try restarting transaction"
            ),
        }[fault]()
    messages = {
        Fault.REFUSED: "unable to open database file",
        Fault.TIMEOUT: "database is locked",
        Fault.LOST_REPLY: "disk I/O error",
        Fault.READONLY: "attempt to write a readonly database",
        Fault.SERIALIZATION: "database is locked",
    }
    return dbapi.OperationalError(messages[fault])


def install_from_env(store: Any, environ: Any = os.environ) -> Injector | None:
    """Patch ``store`` with the plans in ``$CELERY_IDEM_FAULTS`` (a JSON list of Plan fields)."""
    raw = environ.get(FAULTS_ENV)
    if not raw:
        return None
    injector = Injector(store)
    for fields in json.loads(raw):
        injector.arm(Plan(**{**fields, "fault": Fault(fields["fault"])}))
    return injector
