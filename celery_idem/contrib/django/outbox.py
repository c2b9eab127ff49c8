"""The transactional outbox on the Django ORM: :class:`DjangoOutbox`, and ``outbox``, the one on
the default database.

    from celery_idem.contrib.django.outbox import outbox

    with transaction.atomic():
        order = Order.objects.create(...)
        handle = outbox.apply_async(charge, (order.pk,), idempotency_key=f"order-{order.pk}")

The call is a row of ``celery_idem_outbox`` (model :class:`~celery_idem.contrib.django.models.OutboxEntry`,
migration ``0003_outbox``) written in the caller's transaction: if it rolls back, nothing was ever
claimed or published. (On a ``django://`` store of the same database the claim is written in that
transaction too, and rolls back with it: :meth:`DjangoOutbox.apply_async`.) When it commits, the
row is published at once (``transaction.on_commit``); whatever that misses (the process died, the
broker was down) the relay publishes: ``manage.py celery_idem_relay`` (a loop) or ``outbox.relay()``
from a beat task. Rows are taken
``SELECT ... FOR UPDATE SKIP LOCKED`` (PostgreSQL, MariaDB 10.6+, MySQL 8) and leased, so relays
share the work.

Each publish goes through the task's own ``apply_async`` under the staged task id and identity: a
relay that died after publishing and before deleting the row publishes again, and the claim makes
that a no-op (or a copy of the same task id while no worker has taken it). The effect happens once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from django.db import models, transaction
from django.db.models.functions import Coalesce, Now

from ...lookahead import claim_staged
from ...outbox.staging import Outbox, RelayReport, Taken, backoff_seconds, given_back, killed, put_off, stage_call
from .models import OutboxEntry

__all__ = ["DjangoOutbox", "outbox"]


class DjangoOutbox(Outbox):
    """A transactional outbox on a Django database.

    Args:
        using: the database alias whose transaction decides (the default database otherwise).
        max_attempts: failed publishes of one row before it moves to the dead letter.
        publish_on_commit: publish a staged call as soon as its transaction commits (the relay
            still publishes whatever that attempt did not).
        lease_seconds: how long rows a relay took stay its own; a relay that dies leaves them
            due again after this.
    """

    def __init__(
        self,
        using: str | None = None,
        *,
        max_attempts: int = 20,
        publish_on_commit: bool = True,
        lease_seconds: float = 60.0,
    ) -> None:
        super().__init__(max_attempts=max_attempts, publish_on_commit=publish_on_commit, lease_seconds=lease_seconds)
        self.using = using

    def _alias(self) -> str:
        from django.db import router

        return self.using or router.db_for_write(OutboxEntry)

    def apply_async(
        self, task: Any, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Any:
        """Stage ``task.apply_async(args, kwargs, **options)`` in the current transaction of the
        outbox's database and return the handle of its task id. Nothing is published before the
        commit (outside a transaction the row commits, and is published, at once). The claim is
        made by the relay after the commit; on a ``django://`` store of this database (PostgreSQL,
        SQLite) it is written now, in the transaction, and commits or rolls back with the row, so
        the call is answered here as ``apply_async`` answers it.

        Returns:
            The staged task id's handle; on a ``django://`` store of this database, for a call
            that repeats one already claimed, that call's handle instead (nothing is staged).

        Raises:
            InvalidKeyError: the key or scope breaks the rule, before anything is written.
            SerializationError: the call is not JSON, or is over 64 KiB.
            PayloadMismatchError: on a ``django://`` store of this database, the key was used for
                other arguments (the row is not written).
            DuplicateTaskError: the same, for a repeat of a task whose policy says ``on_duplicate="raise"``.
        """
        staged, handle = stage_call(task, args, kwargs, options)
        alias = self._alias()
        handler = getattr(task, "idempotency_handler", None)
        if handler is not None:
            # On a django:// store of this database the claim is written now, in this transaction.
            earlier = claim_staged(handler, handler.idem, args, kwargs, options, staged.task_id, alias)
            if earlier is not None:
                return earlier  # a repeat of a call already claimed: nothing to stage
        entry = OutboxEntry.objects.using(alias).create(
            task_id=staged.task_id,
            task_name=staged.task_name,
            body=staged.body,
            created_at=Now(),
            available_at=Now(),
        )
        if self.publish_on_commit:
            app = task.app
            transaction.on_commit(lambda: self._publish_now(app, entry.pk), using=alias)
        return handle

    def delay(self, task: Any, *args: Any, **kwargs: Any) -> Any:
        """``apply_async(task, args, kwargs)``."""
        return self.apply_async(task, args, kwargs)

    def relay(self, app: Any = None, *, limit: int = 100, ids: Collection[Any] | None = None) -> RelayReport:
        """Publish up to ``limit`` due rows, as :meth:`celery_idem.outbox.SQLOutbox.relay` does;
        ``app`` is Celery's current app when not given."""
        if app is None:
            from celery import current_app

            app = current_app
        return super().relay(app, limit=limit, ids=ids)

    def _take(self, limit: int, ids: Collection[Any] | None) -> list[Taken]:
        alias = self._alias()
        entries = OutboxEntry.objects.using(alias)
        with transaction.atomic(using=alias):
            due = entries.filter(dead=False, available_at__lte=Now())
            if ids is not None:
                due = due.filter(pk__in=list(ids))
            found = list(
                due.select_for_update(skip_locked=True)
                .order_by("id")
                .annotate(db_now=Now())
                .only("id", "task_id", "task_name", "body", "attempts", "taken_at")[:limit]
            )
            if found:
                entries.filter(pk__in=[row.pk for row in found]).update(
                    available_at=_later(self.lease_seconds), taken_at=Coalesce("taken_at", Now())
                )
        return [_taken(row) for row in found]

    def _settle(self, report: RelayReport) -> None:
        alias = self._alias()
        entries = OutboxEntry.objects.using(alias)
        with transaction.atomic(using=alias):
            if report.published:
                entries.filter(pk__in=report.published).delete()
            for row_id, attempts, error in report.failed:
                entries.filter(pk=row_id).update(**put_off(attempts, error, _later(backoff_seconds(attempts))))
            for row_id, attempts, error in report.dead:
                entries.filter(pk=row_id).update(**killed(attempts, error))
            if report.unmarked:
                entries.filter(pk__in=report.unmarked).update(taken_at=None)

    def _give_back(self, ids: Collection[Any] | None) -> int:
        dead = OutboxEntry.objects.using(self._alias()).filter(dead=True)
        if ids is not None:
            dead = dead.filter(pk__in=list(ids))
        return int(dead.update(**given_back(Now())))


def _taken(row: Any) -> Taken:
    """A row the relay took, with the age of the mark it had (None: it had none)."""
    orphaned_for = None if row.taken_at is None else max(0.0, (row.db_now - row.taken_at).total_seconds())
    return Taken(row.pk, row.task_id, row.task_name, bytes(row.body), row.attempts, orphaned_for)


def _later(seconds: float) -> Any:
    """The database's clock ``seconds`` from now."""
    return models.ExpressionWrapper(Now() + timedelta(seconds=seconds), output_field=models.DateTimeField())


outbox = DjangoOutbox()
