"""What every ledger's ``run_once`` does around its transaction, whatever the database library
(SQLAlchemy's :class:`~celery_idem.ledger.Ledger`, the Django ORM's
:class:`~celery_idem.contrib.django.ledger.DjangoLedger`): whose call it is, taken from the
handler's attempt and never from the request; what the attempt remembers of the row; and what a
row another attempt committed means for this call. Imports no database library."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import attempts, telemetry
from ..errors import ConfigurationError, PayloadMismatchError
from ..outcome import JSON_ONLY, decode_result, serializer_of
from ..protocol import BYPASS_HEADER, request_header
from ..records import IdempotencyRecord, Identity, State

__all__ = [
    "COMMITTED",
    "UNSETTLED",
    "CommittedEntry",
    "LedgerCall",
    "decode_entry",
    "joined",
    "second_call",
    "warn_if_unread",
]

logger = logging.getLogger("celery_idem.ledger")

# What an attempt remembers of its run_once call (Attempt.ledger_nonce): the nonce of the row it
# stands on, or this when that row is known to be committed (None: it stands on no row, its call
# never made one or rolled it back).
COMMITTED = "committed"
# A row's outcome until run_once stores fn's result with it; committed so only if fn ended the transaction.
UNSETTLED = State.IN_PROGRESS.value


class CommittedEntry(Protocol):
    """A ledger row as every reader sees it, whichever ledger holds it."""

    @property
    def identity(self) -> Identity: ...
    @property
    def task_id(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def outcome(self) -> str: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def content_encoding(self) -> str | None: ...
    @property
    def result(self) -> bytes | None: ...

    def value(self, accept: Collection[str] = ...) -> Any: ...


@dataclass
class LedgerCall:
    """One ``run_once`` call of a running idempotent task."""

    task: Any
    attempt: attempts.Attempt
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def of(cls, task: Any, ledger: str) -> LedgerCall | None:
        """The call of ``task``'s running attempt; None for a call made with ``idempotency=False``
        (its ``fn`` runs without a row).

        Raises:
            ConfigurationError: ``task`` is not running under celery-idem.
        """
        # The identity and the call from the handler's attempt, never from the request: a message
        # header becomes a request attribute, so a forged one could name another identity.
        attempt = attempts.current(task)
        if attempt is not None:
            return cls(task, attempt)
        if _bypassed(task.request):
            logger.debug("bypassed call of %s (task_id=%s): fn runs without a ledger row", task.name, task.request.id)
            return None
        raise ConfigurationError(
            f"{ledger}.run_once must be called from the body of an idempotent task; {task.name!r} "
            "is not running under celery-idem (is its base IdempotentTask?)"
        )

    @property
    def identity(self) -> Identity:
        return self.attempt.identity

    @property
    def fingerprint(self) -> str:
        return self.attempt.fingerprint

    @property
    def task_id(self) -> str:
        return str(self.task.request.id or "")

    @property
    def serializer(self) -> str:
        return serializer_of(self.task, self.task.app.conf)

    def touch(self, ledger: Any) -> None:
        """Mark the attempt before its row can commit: an attempt whose COMMIT's fate is unknown has
        touched the ledger, and the handler leaves such an attempt's failure to the reconciler."""
        self.attempt.ledger_nonce, self.attempt.ledger = self.nonce, ledger
        warn_if_unread(ledger, self.task)

    def ended(self, committed: bool, answered_by: CommittedEntry | None = None) -> None:
        """What the attempt stands on once run_once is done: a row known committed (its own
        transaction's, or another attempt's that refused ours there), else the row in the transaction
        it joined: its own, or the one that refused ours, which the joined transaction may hold
        uncommitted (an earlier call in it). The handler asks the ledger about that row's nonce."""
        answering = getattr(answered_by, "nonce", None) if answered_by is not None else None
        self.attempt.ledger_nonce = COMMITTED if committed else (answering or self.nonce)

    def rolled_back(self) -> None:
        """run_once raised after rolling its row back (its SAVEPOINT, or its own transaction): no
        transaction holds a row of this call, so none can commit it later, even one it joined that
        goes on. The attempt stands on no row, and its failure is classed by the task's policy like
        any other (a permanent one stored FAILED, a retryable one freeing the key), never taken for a
        row that may still commit."""
        self.attempt.ledger_nonce = None

    def answer(self, committed: CommittedEntry) -> Any:
        """What this call returns when another attempt committed the identity's row first.

        Raises:
            PayloadMismatchError: the row belongs to other arguments.
            ConfigurationError: the row was committed without an outcome.
        """
        identity = self.identity
        if committed.fingerprint != self.fingerprint:
            raise PayloadMismatchError(
                f"the ledger holds a committed outcome of {identity} for other arguments",
                key=identity.key,
                task_name=identity.task_name,
                task_id=committed.task_id,
            )
        if committed.outcome != State.COMPLETED.value:
            raise ConfigurationError(
                f"the ledger row of {identity} (task {committed.task_id}) was committed without an outcome: "
                "that attempt's fn ended the ledger's transaction (a commit on its connection) before run_once "
                "stored the outcome, so its effect may be partial; check it, then delete the row to run the call again"
            )
        # The settings' accepted content types, through the task's handler (the ledger sits below
        # the extension and never imports it).
        return committed.value(self.task.idempotency_handler.idem.accepted_content_types)


def after_ambiguous_commit(
    identity: Identity, nonce: str, failed: BaseException, known: bool, entry: CommittedEntry | None
) -> Any:
    """What a COMMIT that raised did, once the database was asked (``known``: it answered; ``entry``:
    the identity's committed row): None when our row (``nonce``) committed, the winner's entry when
    another attempt's did; ``failed`` is raised again when none did or nobody knows."""
    if not known or entry is None:
        logger.warning(
            "COMMIT of %s failed (%s); %s",
            telemetry.shown(identity),
            telemetry.described(failed),
            "the ledger holds no row of it" if known else "the ledger could not be asked",
        )
        raise failed
    ours = getattr(entry, "nonce", None) == nonce
    logger.warning(
        "COMMIT of %s raised %s but %s row is committed: its outcome stands",
        telemetry.shown(identity),
        telemetry.described(failed),
        "its" if ours else "another attempt's",
    )
    return None if ours else entry


def joined(attempt: attempts.Attempt) -> bool:
    """Whether the attempt's ledger row stands on a transaction it joined, not known committed: the
    caller's (``session=``, or an ``atomic()`` block open around the run), which may still roll back."""
    return attempt.ledger is not None and attempt.ledger_nonce not in (None, COMMITTED)


def second_call(identity: Identity) -> ConfigurationError:
    """One ledger row per identity: a second call in an attempt whose first row stands is a bug."""
    return ConfigurationError(
        f"run_once was already called in this attempt of {identity}: the ledger keeps one "
        "outcome per identity, so a second call would be handed the first one's; do all of the "
        "attempt's writes in one fn"
    )


def warn_if_unread(ledger: Any, task: Any) -> None:
    """Once per ledger: the app's readers (duplicates' get(), the reconciler) ask only the
    ledger given to ``Idempotency(app, ledger=...)``; the worker asks the one run_once used."""
    if ledger._warned:
        return
    configured = task.idempotency_handler.idem.settings.ledger
    if configured is not ledger:
        ledger._warned = True
        logger.warning(
            "%s.run_once of %s writes to a ledger that app %r does not read (%s): pass it as "
            "Idempotency(app, ledger=...) so duplicates' results and the reconciler answer from it",
            type(ledger).__name__,
            task.name,
            task.app.main,
            "it has none" if configured is None else "it has another",
        )


def decode_entry(entry: CommittedEntry, accept: Collection[str] = JSON_ONLY) -> Any:
    """An entry's committed result, decoded only from a content type in ``accept``.

    Raises:
        SerializationError: the entry's content type is not accepted, or it does not decode.
    """
    return decode_result(
        IdempotencyRecord.model_construct(
            key=entry.identity.key,
            task_name=entry.identity.task_name,
            task_id=entry.task_id,
            result=entry.result,
            content_type=entry.content_type,
            content_encoding=entry.content_encoding,
        ),
        accept,
    )


def _bypassed(request: Any) -> bool:
    """Whether this run is a call made with ``idempotency=False`` (a plain function call is not)."""
    return (
        hasattr(request, "headers") and not request.called_directly and request_header(request, BYPASS_HEADER) is False
    )
