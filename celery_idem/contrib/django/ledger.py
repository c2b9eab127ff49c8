"""The ledger on the Django ORM: a task's outcome recorded in the same transaction as the ORM writes
of its effect, on the same connection (:class:`DjangoLedger`).

It keeps the SQLAlchemy ledger's promise (:mod:`celery_idem.ledger`) with Django's transactions:

- The row goes first, in ``transaction.atomic(using=alias)``: on PostgreSQL a racer's INSERT waits
  for the first attempt's transaction and fails on the primary key once it commits; on SQLite the
  INSERT takes the write lock, so racers queue on the busy timeout; on MySQL/MariaDB (InnoDB) the
  duplicate key waits as on PostgreSQL. The loser rolls back without calling ``fn`` and returns the
  committed outcome.
- Called inside the caller's ``atomic()`` block, the row and ``fn`` run in a savepoint of it: a
  lost race or an exception leaves the caller's transaction usable, and the caller commits.
  Django forbids a commit or rollback inside ``atomic()``, so ``fn`` cannot end the transaction that
  holds the row.
- Every row carries the nonce of the call that wrote it: an error at COMMIT is settled by asking
  the database what it holds, on a connection of its own.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models.functions import Now

from ... import telemetry
from ...errors import ConfigurationError, LedgerUnavailableError
from ...ledger.calls import COMMITTED, UNSETTLED, LedgerCall, after_ambiguous_commit, second_call
from ...outcome import encode_result
from ...records import Identity, State, identity_id
from .timeouts import bounded

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from .models import LedgerEntry

__all__ = ["DjangoLedger"]

# Errors that say the database is down or unreachable, not that a statement is wrong.
_DOWN = (OperationalError, InterfaceError)

T = TypeVar("T")
logger = logging.getLogger("celery_idem.ledger")


class DjangoLedger:
    """Record task outcomes in the Django database, in the transaction of the ORM writes.

    Args:
        using: The database alias of the ledger table and of the business writes it protects
            (default ``"default"``). Its table comes from ``manage.py migrate`` (app label
            ``celery_idem``; on another alias, ``migrate --database=<alias>`` or a router).
        namespace: Separates apps that share the table, as ``key_prefix`` separates them in a store.
        commit_check_seconds: How long to keep asking the database what an ambiguous COMMIT did.
        read_timeout_seconds: How long a reader (a duplicate's replay, ``get()``, the handler
            settling a failure, the reconciler) waits for the ledger before it counts as down.

    Use it inside an idempotent task, and give it to the app so its readers ask it too::

        ledger = DjangoLedger()
        Idempotency(app, ledger=ledger)

        @shared_task(base=IdempotentTask, bind=True)
        def charge(self, order_id, amount):
            def effect():
                Payment.objects.create(order_id=order_id, amount=amount)
                return {"charged": amount}
            return ledger.run_once(self, effect)
    """

    def __init__(
        self,
        using: str = DEFAULT_DB_ALIAS,
        *,
        namespace: str = "idem",
        commit_check_seconds: float = 10.0,
        read_timeout_seconds: float = 3.0,
    ) -> None:
        if not 1 <= len(namespace) <= 255 or not namespace.isprintable():
            raise ConfigurationError(f"the ledger's namespace must be 1-255 printable characters; got {namespace!r}")
        if not read_timeout_seconds > 0:
            raise ConfigurationError(f"the ledger's read_timeout_seconds must be > 0; got {read_timeout_seconds!r}")
        self.using = using  # checked at first use: Django's settings may not be loaded yet
        self.namespace = namespace
        self.commit_check_seconds = commit_check_seconds
        self.read_timeout_seconds = read_timeout_seconds
        self._warned = False  # run_once: told once that the app reads another ledger
        self._table_checked = False
        self._stuck: threading.Thread | None = None  # a bounded read still waiting past its timeout

    def __repr__(self) -> str:
        return f"DjangoLedger(using={self.using!r}, namespace={self.namespace!r})"

    # ---- the call a task body makes ---------------------------------------------------------------

    def run_once(self, task: Any, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in a transaction that also records the outcome, once per identity.

        Args:
            task: The running idempotent task (``self`` of a bound task).
            fn: Does the business writes through the ORM on this ledger's database and returns the
                outcome (serializable with the task's serializer).

        Returns:
            ``fn``'s result on the first execution; the committed outcome on any later execution
            or lost race, without calling ``fn``. A call that bypasses celery-idem
            (``idempotency=False``) runs ``fn`` in a transaction without a ledger row.

        Raises:
            PayloadMismatchError: the identity's committed row belongs to other arguments.
            ConfigurationError: called outside an idempotent task's run, or a second time in one
                attempt whose first row stands.
        """
        call = LedgerCall.of(task, "DjangoLedger")
        if call is None:
            with transaction.atomic(using=self.using):
                return fn()
        self._check_alias()
        self._refuse_second_call(call)
        connection = transaction.get_connection(self.using)
        # Its own transaction only in autocommit mode outside any atomic block: under manual
        # transactions (AUTOCOMMIT=False, set_autocommit(False)) atomic() opens and commits nothing.
        own = connection.get_autocommit() and not connection.in_atomic_block
        call.touch(self)
        committed: LedgerEntry | None = None
        commit = _Commit()
        try:
            with transaction.atomic(using=self.using):  # a savepoint inside the caller's transaction
                if own:
                    # Django runs on_commit callbacks in order, after a COMMIT that succeeded: an
                    # error raised once this one ran is a callback's, not the COMMIT's.
                    transaction.on_commit(commit.succeeded, using=self.using)
                committed, value = self._record(call, fn)
                if own and committed is not None:
                    transaction.set_rollback(True, using=self.using)  # a lost race commits nothing
                elif own:
                    commit.reached(connections[self.using].run_on_commit)
        except BaseException as failed:
            if not commit.at:
                # Raised inside the block (fn, its outcome): Django rolled its savepoint, or run_once's
                # own transaction, back; no transaction holds our row any more.
                call.rolled_back()
                raise
            if commit.done or not isinstance(failed, DatabaseError):
                raise
            # The COMMIT's answer was lost or wrong about what happened: ask the database.
            committed = self._settle_commit(call, failed)
            if committed is None:
                commit.run_callbacks()  # ours committed: the on_commit work fn registered runs after all
        call.ended(committed=own, answered_by=committed)
        return value if committed is None else call.answer(committed)

    def _record(self, call: LedgerCall, fn: Callable[[], T]) -> tuple[LedgerEntry | None, T]:
        """The row, then ``fn`` and its outcome, in the transaction (or savepoint) open on the alias.

        Returns (None, fn's value) when fn ran, or (the committed entry, None) when the primary key
        refused the row: another attempt committed it first. Nothing is committed here.
        """
        identity = call.identity
        entries = self._entries()
        try:
            self._insert(call, call.nonce)
        except IntegrityError:
            return self._committed(identity), None  # type: ignore[return-value]
        value = fn()
        payload, content_type, encoding = encode_result(value, call.serializer)
        stored = entries.filter(id=self._id(identity), nonce=call.nonce).update(
            outcome=State.COMPLETED.value, payload=payload, content_type=content_type, content_encoding=encoding
        )
        if stored != 1:
            raise ConfigurationError(f"fn deleted the ledger row of {identity} that run_once wrote before it")
        return None, value

    def _insert(self, call: LedgerCall, nonce: str | None) -> None:
        """The identity's row, in a savepoint of its own: a refused INSERT leaves the rest usable."""
        identity = call.identity
        with transaction.atomic(using=self.using):
            self._entries().create(
                id=self._id(identity),
                namespace=self.namespace,
                scope=identity.scope,
                task_name=identity.task_name,
                key=identity.key,
                task_id=call.task_id,
                fingerprint=call.fingerprint,
                nonce=nonce,
                outcome=UNSETTLED,
                committed_at=Now(),
            )

    def _committed(self, identity: Identity) -> LedgerEntry:
        """The row that made the primary key refuse ours: this transaction's view, else a fresh one
        (a snapshot older than the winner's commit, under REPEATABLE READ, does not show it, and
        SERIALIZABLE may cancel the read for the conflict)."""
        try:
            with transaction.atomic(using=self.using):  # SERIALIZABLE may refuse the read itself
                entry = self._read(identity)
        except DatabaseError:
            entry = None
        entry = entry or self._on_own_connection(lambda: self._read(identity))
        if entry is None:
            raise ConfigurationError(
                f"the ledger's primary key refused {identity} but namespace {self.namespace!r} holds no row of it"
            )
        return entry

    def _settle_commit(self, call: LedgerCall, failed: DatabaseError) -> LedgerEntry | None:
        """What the database holds after an ambiguous COMMIT: None when our row committed, the
        winner's entry when another did; ``failed`` is raised again when none did or nobody knows.

        A probe INSERT of the identity, on a connection of its own, waits for any transaction still
        holding it, then fails on the primary key (a row is committed: read it) or succeeds (none
        is: roll the probe back).
        """
        identity = call.identity
        deadline = time.monotonic() + self.commit_check_seconds
        pause = 0.05
        while True:
            try:
                known, entry = self._on_own_connection(lambda: self._probe(call, deadline))
                break
            except DatabaseError as exc:
                if time.monotonic() + pause >= deadline:
                    logger.warning("could not ask the ledger about %s: %s", telemetry.shown(identity), exc)
                    known, entry = False, None
                    break
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
        committed: LedgerEntry | None = after_ambiguous_commit(identity, call.nonce, failed, known, entry)
        return committed

    def _probe(self, call: LedgerCall, deadline: float) -> tuple[bool, LedgerEntry | None]:
        identity = call.identity
        with transaction.atomic(using=self.using):
            with bounded(connections[self.using], deadline - time.monotonic()):
                try:
                    self._insert(call, None)
                except IntegrityError:
                    return True, self._committed(identity)
            transaction.set_rollback(True, using=self.using)  # the probe never commits
            return True, None

    def _refuse_second_call(self, call: LedgerCall) -> None:
        used = call.attempt.ledger_nonce
        if used is None:
            return
        if used != COMMITTED:  # the first call joined a transaction: does its row still stand?
            rows = self._entries().filter(id=self._id(call.identity), nonce=used)
            if not rows.exists():
                return  # its transaction rolled back: this call starts over
        raise second_call(call.identity)

    # ---- an attempt whose row is on a transaction it joined --------------------------------------

    def stands(self, attempt: Any) -> bool:
        """Whether the attempt's row is committed (asked on a connection of its own).

        Raises:
            LedgerUnavailableError: the database did not answer within ``read_timeout_seconds``.
        """
        rows = self._entries().filter(id=self._id(attempt.identity), nonce=attempt.ledger_nonce)
        try:
            return bool(self._on_own_connection(rows.exists, self.read_timeout_seconds))
        except TimeoutError as exc:
            raise LedgerUnavailableError(f"the ledger did not answer about {attempt.identity} in time") from exc

    # ---- reads ----------------------------------------------------------------------------------

    def lookup(self, identity: Identity) -> LedgerEntry | None:
        """The committed outcome of ``identity`` in this ledger's namespace, or None."""
        return self._read(identity)

    def completed(self, identity: Identity, fingerprint: str | None) -> LedgerEntry | None:
        """The entry of this very call (``fingerprint``) if its outcome is committed, else None;
        bounded by ``read_timeout_seconds``, on a connection of its own whose statements and lock
        waits are bounded by it too. A read stuck past its timeout makes the next ones fail fast
        until it ends.

        Raises:
            LedgerUnavailableError: the database could not be reached, or did not answer in time.
            ConfigurationError: the ledger table does not exist (run ``manage.py migrate``).
            django.db.DatabaseError: any other database error (a missing column, a privilege).
        """
        if fingerprint is None:
            return None
        stuck = self._stuck
        if stuck is not None and stuck.is_alive():
            raise LedgerUnavailableError(
                f"the ledger could not be asked about {telemetry.shown(identity)}: an earlier read is still stuck on it"
            )
        try:
            entry = self._on_own_connection(lambda: self._checked_read(identity), self.read_timeout_seconds)
        except TimeoutError as exc:
            raise LedgerUnavailableError(
                f"the ledger did not answer about {telemetry.shown(identity)} within {self.read_timeout_seconds:g}s "
                "(read_timeout_seconds)"
            ) from exc
        except _DOWN as exc:
            raise LedgerUnavailableError(
                f"the ledger could not be asked about {telemetry.shown(identity)}: {exc}"
            ) from exc
        if entry is None or entry.outcome != State.COMPLETED.value or entry.fingerprint != fingerprint:
            return None
        return entry

    def _checked_read(self, identity: Identity) -> LedgerEntry | None:
        connection = connections[self.using]
        with bounded(connection, self.read_timeout_seconds):  # on a connection a pool may hand on next
            if not self._table_checked:  # a mistake, not an outage: never counted as "down"
                table = self._entries().model._meta.db_table
                if table not in connection.introspection.table_names():
                    raise ConfigurationError(
                        f"the ledger table {table!r} does not exist on database {self.using!r}: "
                        f"run manage.py migrate celery_idem --database={self.using}"
                    )
                self._table_checked = True
            return self._read(identity)

    def _read(self, identity: Identity) -> LedgerEntry | None:
        entry: LedgerEntry | None = (
            self._entries()
            .filter(
                id=self._id(identity),
                namespace=self.namespace,
                scope=identity.scope,
                task_name=identity.task_name,
                key=identity.key,
            )
            .first()
        )
        return entry

    # ---- helpers --------------------------------------------------------------------------------

    def _entries(self) -> QuerySet[LedgerEntry]:
        """The ledger's rows on its database (the model is imported once Django's apps are ready:
        a ledger is made where the Celery app is, which loads before them)."""
        from .models import LedgerEntry

        return LedgerEntry.objects.using(self.using)

    def _id(self, identity: Identity) -> uuid.UUID:
        """The row's key: :func:`~celery_idem.records.identity_id` with RFC 4122's variant and version
        bits set (MariaDB's UUID type refuses other variants; 122 bits of SHA-256 remain)."""
        return uuid.UUID(bytes=identity_id(self.namespace, *identity).bytes, version=5)

    def _check_alias(self) -> None:
        if self.using not in connections.settings:
            raise ConfigurationError(
                f"DjangoLedger(using={self.using!r}): settings.DATABASES has no such alias "
                f"(it has {', '.join(sorted(connections.settings))})"
            )

    def _on_own_connection(self, read: Callable[[], T], timeout: float | None = None) -> T:
        """``read()`` on a thread of its own, so on a connection of its own (Django's connections
        are per thread), closed after; a ``timeout`` bounds the wait (TimeoutError)."""
        answer: list[T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                answer.append(read())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                failure.append(exc)
            finally:
                connections[self.using].close()

        reader = threading.Thread(target=run, name="celery-idem-ledger-read", daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            self._stuck = reader  # until it ends, the next bounded read fails fast instead of piling up
            raise TimeoutError(f"no answer within {timeout:g}s")
        if failure:
            raise failure[0]
        return answer[0]


class _Commit:
    """What run_once knows of its own transaction's COMMIT."""

    def __init__(self) -> None:
        self.at = False  # the block ended with our row and fn's writes: what follows is the COMMIT
        self.done = False  # the COMMIT succeeded (Django ran our first on_commit callback)
        self._callbacks: list[Any] = []

    def reached(self, callbacks: list[Any]) -> None:
        self.at = True
        self._callbacks = list(callbacks)

    def succeeded(self) -> None:
        self.done = True

    def run_callbacks(self) -> None:
        """The on_commit callbacks of a transaction found committed after its COMMIT raised (Django's
        rollback after the failed COMMIT dropped them), as Django runs them."""
        for _, callback, robust in self._callbacks:
            if callback == self.succeeded:
                continue
            if not robust:
                callback()
                continue
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - robust callbacks are logged, as Django does
                logger.error("Error calling %s in on_commit() (%s).", getattr(callback, "__qualname__", callback), exc)
