"""A call staged in an outbox, whatever the database library: what the caller's transaction writes,
and what the relay does with it once that transaction committed.

Staging (in the caller's transaction) checks the call as ``apply_async`` would before anything is
written, decides its task id and its identity, and hands back the handle of that task id. Nothing
touches the store or the broker: a transaction that rolls back leaves nothing behind.

Relaying (after the commit, any number of times) calls the task's own ``apply_async`` with the
staged task id and identity, so the claim is made then. A relay that dies after publishing and
before deleting the row publishes again: the claim finds the record of that task id and publishes
nothing, unless the record is still PENDING under it (the first publish may never have reached the
broker), in which case it publishes a copy of the same task id, which a worker treats as a
redelivery. The effect happens once; the message arrives at least once.

The mark (a row's ``taken_at``), one rule for every outbox: **a relay took this row then and may
have published it, and nothing since has told whether it did.** A pass sets it when it takes a row
that has none (the database's time), and keeps one it finds: a relay died with the row, and no later
pass can learn what that relay did. The mark goes only when that is settled: the row is published
(deleted); the pass that set it ends knowing it did not publish (its publish raised: the row is put
off or dead, :attr:`RelayReport.unmarked`); or an operator gives the row back
(:meth:`Outbox.retry_dead`, the admin's action), deciding that it is to be sent again. A row whose
mark is older than its key's TTL and whose key has no record is refused (:class:`AmbiguousRelay`),
never published blind; a failed pass over it (the store timing out at that check) keeps the mark.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from celery.exceptions import NotRegistered
from celery.utils.time import maybe_iso8601
from kombu.exceptions import DecodeError
from kombu.utils import json as kombu_json

from .. import telemetry
from ..calls import MAX_CALL_BYTES, published_options
from ..errors import (
    ConfigurationError,
    DuplicateTaskError,
    InvalidKeyError,
    PayloadMismatchError,
    SerializationError,
)
from ..protocol import BYPASS_HEADER, KEY_HEADER, SCOPE_HEADER
from ..publish import resending
from ..result import bind_handle

__all__ = [
    "FINAL_ERRORS",
    "AmbiguousRelay",
    "Outbox",
    "RelayReport",
    "Staged",
    "Taken",
    "backoff_seconds",
    "given_back",
    "killed",
    "put_off",
    "relay_call",
    "relay_rows",
    "stage_call",
]

logger = logging.getLogger("celery_idem.outbox")

VERSION = 1
# Options that belong to the caller's process, never to a call kept in a table.
_REFUSED = ("producer", "connection", "publisher", "result_cls", "add_to_parent", "retries", "retry_policy")


class AmbiguousRelay(Exception):
    """A relay died with this call in flight longer ago than its key's TTL, and the key has no
    record: the call may have run and its record expired, or never have been claimed."""


# A staged call the relay can never publish: kept as dead (the dead letter), with the reason.
FINAL_ERRORS: tuple[type[BaseException], ...] = (
    NotRegistered,
    AmbiguousRelay,
    PayloadMismatchError,
    DuplicateTaskError,
    InvalidKeyError,
    ConfigurationError,
    SerializationError,
    DecodeError,
)


class Staged(NamedTuple):
    """What an outbox row holds: the call's task id and task name, and the call as JSON."""

    task_id: str
    task_name: str
    body: bytes


def stage_call(
    task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any]
) -> tuple[Staged, Any]:
    """The row for a call of ``task``, and the handle the caller gets: that of the staged task id
    (a call the relay finds deduplicated is published under it anyway, and the worker replays the
    original's outcome into it).

    Raises:
        InvalidKeyError: the key or scope breaks the rule (or the policy requires a key).
        SerializationError: the call is not JSON, or is over 64 KiB.
        TypeError: an option that belongs to this process (a producer, a connection).
    """
    options = dict(options)
    for name in _REFUSED:
        if options.pop(name, None) is not None:
            raise TypeError(f"{name}= cannot be staged in an outbox: the relay publishes with its own")
    task_id = str(options.pop("task_id", None) or uuid.uuid4())
    countdown = options.pop("countdown", None)
    if countdown is not None and options.get("eta") is None:
        # As Celery turns a countdown into an ETA when it publishes: counted from the call.
        options["eta"] = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=float(countdown))
    handler = getattr(task, "idempotency_handler", None)
    identity = None
    headers = dict(options.get("headers") or {})
    key = options.pop(KEY_HEADER, headers.get(KEY_HEADER))
    scope = options.pop(SCOPE_HEADER, headers.get(SCOPE_HEADER))
    bypass = options.pop(BYPASS_HEADER, headers.get(BYPASS_HEADER)) is False
    if handler is not None and not bypass:
        # The identity is decided now, as apply_async would decide it here, and rides in the row.
        args, kwargs = handler.as_sent(args, kwargs, options)
        fp = handler.fingerprint(args, kwargs)
        handler.called(keyed=key is not None)
        if key is None and scope is None:
            key, scope = handler.running_identity(fp)
        identity = handler.identify(key, scope, fp)
        headers = {**headers, KEY_HEADER: identity.key, **({SCOPE_HEADER: identity.scope} if identity.scope else {})}
    elif bypass:
        headers[BYPASS_HEADER] = False
    kept = published_options({**options, "headers": headers})
    for name in ("eta",):
        if isinstance(options.get(name), datetime.datetime):
            kept[name] = options[name].isoformat()
    document = {"v": VERSION, "args": list(args or ()), "kwargs": dict(kwargs or {}), "options": kept}
    try:
        body = str(kombu_json.dumps(document)).encode("utf-8")  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"a call of {task.name!r} cannot be staged: it is not JSON ({exc})") from exc
    if len(body) > MAX_CALL_BYTES:
        raise SerializationError(f"a call of {task.name!r} is {len(body)} bytes, over the outbox's {MAX_CALL_BYTES}")
    handle = task.AsyncResult(task_id)
    if handler is not None and identity is not None:
        handle = bind_handle(handle, identity, handler.idem, deduplicated=False)
    return Staged(task_id, task.name, body), handle


class Taken(NamedTuple):
    """An outbox row a relay took: its call, its failed publishes so far, and how old the mark it
    found is (None when it found none: this pass set it; see the module's docstring)."""

    id: Any
    task_id: str
    task_name: str
    body: bytes
    attempts: int
    orphaned_for: float | None = None


def relay_call(app: Any, row: Taken) -> Any:
    """Publish a staged call through its task's ``apply_async``: claimed now, under its task id.

    Raises:
        NotRegistered: no task of that name in ``app``.
        DecodeError: the row is not a staged call.
        AmbiguousRelay: see the class (the operator decides).
        PayloadMismatchError, DuplicateTaskError: the claim refused the call (a final answer).
        Exception: whatever publishing raised (the broker or the store down: tried again later).
    """
    task = app.tasks[row.task_name]
    try:
        document = kombu_json.loads(bytes(row.body))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"outbox row {row.task_id} cannot be read ({exc})") from exc
    if not isinstance(document, dict) or document.get("v") != VERSION:
        raise DecodeError(f"outbox row {row.task_id} is in an unknown format")
    options = dict(document.get("options") or {})
    if isinstance(options.get("eta"), str):
        options["eta"] = maybe_iso8601(options["eta"])
    if row.orphaned_for is not None:
        _check_orphan(task, row.orphaned_for, options.get("headers") or {})
    args, kwargs = list(document.get("args") or ()), dict(document.get("kwargs") or {})
    with resending(row.task_id):
        return task.apply_async(args, kwargs, task_id=row.task_id, **options)


def _check_orphan(task: Any, orphaned_for: float, headers: Mapping[str, Any]) -> None:
    """Within its key's TTL, a dead relay's call is published again and its claim decides (the
    record of that task id, or none because the claim never landed). Past the TTL, a key with no
    record cannot tell "never claimed" from "ran, and its record expired": the row is refused."""
    handler = getattr(task, "idempotency_handler", None)
    if handler is None or headers.get(BYPASS_HEADER) is False:
        return  # not deduplicated anyway: at least once
    ttl = handler.policy.ttl_seconds
    if orphaned_for < ttl:
        return
    identity = handler.identify(headers.get(KEY_HEADER), headers.get(SCOPE_HEADER), "")
    if handler.idem.store.get(identity) is None:
        raise AmbiguousRelay(
            f"a relay died with this call in flight {orphaned_for:.0f}s ago, longer than its key's TTL "
            f"({ttl:.0f}s), and the key has no record: it may have run, or never have been published; "
            "check, then give it back to the relay or delete it"
        )


def backoff_seconds(attempts: int, *, base: float = 2.0, cap: float = 300.0) -> float:
    """How long a row waits after its ``attempts``-th failed publish (doubling, capped)."""
    return float(min(cap, base * 2 ** min(max(attempts - 1, 0), 32)))


# What each way a pass or an operator ends with a row writes to it, for every outbox's table
# (``now`` and ``later`` are the database's clock). Only a give-back and RelayReport.unmarked
# touch the mark.
def put_off(attempts: int, error: str, later: Any) -> dict[str, Any]:
    """A failed publish: tried again at ``later``."""
    return {"attempts": attempts, "last_error": error, "available_at": later}


def killed(attempts: int, error: str) -> dict[str, Any]:
    """Moved to the dead letter."""
    return {"attempts": attempts, "last_error": error, "dead": True}


def given_back(now: Any) -> dict[str, Any]:
    """A dead row an operator gives back: due now, its tries from zero, and its mark gone."""
    return {"dead": False, "attempts": 0, "available_at": now, "taken_at": None}


@dataclass
class RelayReport:
    """What one relay pass did: rows published (and deleted), put off after a failure, and moved
    to the dead letter (a final refusal, or ``max_attempts`` failures); and of the last two, the
    rows whose mark this pass set, which lose it (it knows it did not publish them; a mark it found
    stays: see the module's docstring)."""

    published: list[Any] = field(default_factory=list)
    failed: list[tuple[Any, int, str]] = field(default_factory=list)  # (row id, attempts, error)
    dead: list[tuple[Any, int, str]] = field(default_factory=list)
    unmarked: list[Any] = field(default_factory=list)

    def __str__(self) -> str:
        return f"published {len(self.published)}, put off {len(self.failed)}, dead {len(self.dead)}"


def relay_rows(app: Any, rows: Iterable[Taken], *, max_attempts: int) -> RelayReport:
    """Publish each row's call; say which rows to delete, to put off, and to move to the dead
    letter (whose handles are answered with the error, in the result backend)."""
    report = RelayReport()
    for row in rows:
        try:
            relay_call(app, row)
        except FINAL_ERRORS as exc:
            logger.error("outbox: task %s (%s) can never be published: %s", row.task_id, row.task_name, _logged(exc))
            report.dead.append((row.id, row.attempts + 1, _describe(exc)))
            _answer(app, row.task_id, exc)
        except Exception as exc:  # the broker or the store down, or anything else: tried again later
            attempts = row.attempts + 1
            if attempts >= max_attempts:
                logger.error(
                    "outbox: task %s (%s) failed %d times, moved to the dead letter: %s",
                    row.task_id,
                    row.task_name,
                    attempts,
                    _logged(exc),
                )
                report.dead.append((row.id, attempts, _describe(exc)))
                _answer(app, row.task_id, exc)
            else:
                logger.warning(
                    "outbox: task %s (%s) not published (try %d of %d): %s",
                    row.task_id,
                    row.task_name,
                    attempts,
                    max_attempts,
                    _logged(exc),
                )
                report.failed.append((row.id, attempts, _describe(exc)))
        else:
            report.published.append(row.id)
            continue
        if row.orphaned_for is None:
            report.unmarked.append(row.id)
    return report


def _answer(app: Any, task_id: str, exc: BaseException) -> None:
    """The staged handle's answer: the error that put its call in the dead letter, stored for its
    task id while that id has no outcome (a call a dead relay published may have run)."""
    if isinstance(exc, AmbiguousRelay) or getattr(exc, "task_id", None) == task_id:
        return
    try:
        if app.backend.get_state(task_id) != "PENDING":  # Celery's "unknown"
            return
        app.backend.mark_as_failure(task_id, exc)
    except Exception as down:  # no result backend, or it is down: the row keeps the error
        # No traceback: it would chain the refusal being stored, whose text names the key.
        logger.warning(
            "outbox: could not store the dead letter's error for task %s: %s", task_id, telemetry.described(down)
        )


def _logged(exc: BaseException) -> str:
    """``exc`` for a log line: a claim's refusal by its type only, as its text names the key (the row's
    ``last_error`` keeps the text; :mod:`celery_idem.telemetry` says why logs carry no keys)."""
    if isinstance(exc, (PayloadMismatchError, DuplicateTaskError)):
        return f"{type(exc).__name__} (the row's last_error says more)"
    return telemetry.described(exc)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


class Outbox:
    """What every outbox does around its table (:class:`~celery_idem.outbox.sql.SQLOutbox`,
    :class:`~celery_idem.contrib.django.outbox.DjangoOutbox`): a relay pass takes rows in one
    short transaction (``_take``), publishes them with no transaction open, and settles them in a
    second one (``_settle``).

    Args:
        max_attempts: failed publishes of one row before it moves to the dead letter.
        publish_on_commit: publish a staged call as soon as its transaction commits (the relay
            still publishes whatever that attempt did not).
        lease_seconds: how long rows a relay took stay its own; a relay that dies leaves them
            due again after this.
    """

    def __init__(self, *, max_attempts: int = 20, publish_on_commit: bool = True, lease_seconds: float = 60.0) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1; got {max_attempts!r}")
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive; got {lease_seconds!r}")
        self.max_attempts = max_attempts
        self.publish_on_commit = publish_on_commit
        self.lease_seconds = float(lease_seconds)

    def relay(self, app: Any, *, limit: int = 100, ids: Collection[Any] | None = None) -> RelayReport:
        """Publish up to ``limit`` due rows (all, or those of ``ids``), oldest first. A short
        transaction takes them (locked ``SKIP LOCKED`` where the database has it, then leased for
        ``lease_seconds``: due again only if this relay dies); they are published with no
        transaction open (a store on the same database, or a task run eagerly, writes meanwhile);
        a second short transaction deletes the published ones, puts off the failed ones (doubling
        from 2 s up to 5 minutes) and keeps as dead a row that can never be published or failed
        ``max_attempts`` times. ``app`` resolves the task names."""
        rows = self._take(limit, ids)
        report = relay_rows(app, rows, max_attempts=self.max_attempts)
        if rows:
            self._settle(report)
        return report

    def retry_dead(self, ids: Collection[Any] | None = None) -> int:
        """Give dead rows (all, or those of ``ids``) back to the relay: its next pass publishes
        them, with their tries counted from zero; returns how many.

        This is the operator's decision to send them again: it also clears the mark of a relay
        that died with a row (``taken_at``), which is what refused an :class:`AmbiguousRelay`. If
        that relay did publish the call and its key's record has expired since, the call runs a
        second time: check first (the task's effect, the ledger), and delete a row that ran.
        """
        return self._give_back(ids)

    def _take(self, limit: int, ids: Collection[Any] | None) -> list[Taken]:
        """Lock and lease up to ``limit`` due rows, marking those with no mark; each row says how
        old the mark it had is."""
        raise NotImplementedError

    def _settle(self, report: RelayReport) -> None:
        """Delete the published rows, put off the failed ones (:func:`put_off`), keep the dead ones
        with their error (:func:`killed`), and clear the mark of ``report.unmarked``."""
        raise NotImplementedError

    def _give_back(self, ids: Collection[Any] | None) -> int:
        """Write :func:`given_back` to the dead rows (all, or those of ``ids``); how many."""
        raise NotImplementedError

    def _publish_now(self, app: Any, row_id: Any) -> None:
        try:
            self.relay(app, limit=1, ids=[row_id])
        except Exception:  # the relay publishes it later; the caller's commit stands
            logger.warning("outbox: could not publish row %s after its commit; the relay will", row_id, exc_info=True)
