"""Reading the ledger: the committed entry of an identity, as a duplicate's replay, ``get()``, the
handler settling a failure and the reconciler ask for it (:meth:`LedgerReads.completed`, bounded by
``read_timeout_seconds``)."""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from .. import telemetry
from ..errors import ConfigurationError, LedgerUnavailableError
from ..outcome import JSON_ONLY
from ..records import Identity, State
from ..stores.deadline import Watchdog, socket_of
from .calls import decode_entry
from .table import LedgerTable

__all__ = ["LedgerEntry", "LedgerReads"]

# Errors that say the database is down or unreachable, not that a statement is wrong.
_DOWN = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError, OSError)
_WATCHDOG = Watchdog()


class LedgerEntry:
    """A committed outcome as the ledger holds it."""

    __slots__ = ("content_encoding", "content_type", "fingerprint", "identity", "nonce", "outcome", "result", "task_id")

    def __init__(self, row: Any) -> None:
        self.identity = Identity(row.scope, row.task_name, row.key)
        self.nonce: str | None = row.nonce  # the run_once call that wrote it (None: written before nonces)
        self.task_id: str = row.task_id
        self.fingerprint: str = row.fingerprint
        self.outcome: str = row.outcome  # COMPLETED, or IN_PROGRESS: committed before run_once stored the result
        self.result: bytes | None = bytes(row.result) if row.result is not None else None
        self.content_type: str | None = row.content_type
        self.content_encoding: str | None = row.content_encoding

    def value(self, accept: Collection[str] = JSON_ONLY) -> Any:
        """The committed result, decoded only from a content type in ``accept`` (the app's
        :attr:`~celery_idem.Idempotency.accepted_content_types`).

        Raises:
            SerializationError: the entry's content type is not accepted, or it does not decode.
        """
        return decode_entry(self, accept)


class LedgerReads(LedgerTable):
    """The reads of a ledger: an identity's row, and the committed entry of one call."""

    def _read(self, connection: sa.Connection, identity: Identity) -> LedgerEntry | None:
        row = connection.execute(sa.select(self.table).where(self._where(identity))).one_or_none()
        return None if row is None else LedgerEntry(row)

    def lookup(self, identity: Identity) -> LedgerEntry | None:
        """The committed outcome of ``identity`` in this ledger's namespace, or None."""
        self._check_columns()
        with self.engine.connect() as connection:
            return self._read(connection, identity)

    def completed(self, identity: Identity, fingerprint: str | None) -> LedgerEntry | None:
        """The entry of this very call (``fingerprint``) if its outcome is committed, else None.

        The one rule every reader applies where the store and the ledger disagree: the ledger wins.
        Bounded by ``read_timeout_seconds``, however the database fails to answer.

        Raises:
            LedgerUnavailableError: the database could not be reached, or did not answer in time.
            sqlalchemy.exc.SQLAlchemyError: any other database error (a missing table, a privilege).
        """
        if fingerprint is None:
            return None
        entry = self._bounded_lookup(identity)
        if entry is None or entry.outcome != State.COMPLETED.value or entry.fingerprint != fingerprint:
            return None
        return entry

    def _bounded_lookup(self, identity: Identity) -> LedgerEntry | None:
        """:meth:`lookup` within ``read_timeout_seconds``: on a thread of its own, so neither a
        connect nor a server gone silent holds the caller (a silent PostgreSQL socket is also cut
        off by the watchdog, which ends the thread)."""
        answer: list[LedgerEntry | None] = []
        failure: list[BaseException] = []

        def read() -> None:
            try:
                self._check_columns()
                if not self._columns_checked:  # a mistake, not an outage: never counted as "down"
                    raise ConfigurationError(
                        f"the ledger table {self.table.name!r} does not exist: run Ledger.create_schema() "
                        "(or the migration that creates it)"
                    )
                with (
                    self.engine.connect() as connection,
                    _WATCHDOG.guard(socket_of(connection), self.read_timeout_seconds),
                ):
                    answer.append(self._read(connection, identity))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                failure.append(exc)

        reader = threading.Thread(target=read, name="celery-idem-ledger-read", daemon=True)
        reader.start()
        reader.join(self.read_timeout_seconds)
        if reader.is_alive():
            raise LedgerUnavailableError(
                f"the ledger did not answer about {telemetry.shown(identity)} within {self.read_timeout_seconds:g}s "
                "(read_timeout_seconds)"
            )
        if failure:
            if isinstance(failure[0], _DOWN):
                why = telemetry.described(failure[0])  # the driver's message: no statement parameters
                raise LedgerUnavailableError(
                    f"the ledger could not be asked about {telemetry.shown(identity)}: {why}"
                ) from failure[0]
            raise failure[0]
        return answer[0]
