"""The models of ``celery_idem.contrib.django``: :class:`LedgerEntry`, the ledger's table on the
Django ORM (:class:`~celery_idem.contrib.django.ledger.DjangoLedger` writes it), and
:class:`OutboxEntry`, the outbox's (:class:`~celery_idem.contrib.django.outbox.DjangoOutbox`)."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import datetime
from typing import Any

from django.db import models
from django.db.models.expressions import Combinable

from ...ledger.calls import decode_entry
from ...outcome import JSON_ONLY
from ...records import Identity

__all__ = ["LedgerEntry", "OutboxEntry"]


class LedgerEntry(models.Model):
    """One identity (in a namespace) whose effect committed, written in the business transaction.

    The primary key is SHA-256 over the length-prefixed identity, as a UUID (as the SQL store's
    rows are keyed): it decides a race on every database, MySQL's index-length limit included, and
    every read also matches the identity's text.
    """

    id: models.UUIDField[uuid.UUID | str, uuid.UUID] = models.UUIDField(
        primary_key=True, editable=False
    )  # DjangoLedger._id: SHA-256 of the identity
    namespace: models.CharField[str, str] = models.CharField(max_length=255)
    scope: models.CharField[str, str] = models.CharField(max_length=255, blank=True)
    task_name: models.CharField[str, str] = models.CharField(max_length=255)
    key: models.CharField[str, str] = models.CharField(max_length=255)
    task_id: models.CharField[str, str] = models.CharField(max_length=255)
    fingerprint: models.CharField[str, str] = models.CharField(max_length=64)
    # The run_once call that wrote it; None only on the probe that asks what an ambiguous COMMIT did.
    nonce: models.CharField[str | None, str | None] = models.CharField(max_length=64, null=True)
    # COMPLETED, or IN_PROGRESS while run_once has not stored fn's result with it yet.
    outcome: models.CharField[str, str] = models.CharField(max_length=16)
    payload: models.BinaryField[bytes | memoryview | None, bytes | memoryview | None] = models.BinaryField(
        null=True, db_column="result"
    )
    content_type: models.CharField[str | None, str | None] = models.CharField(max_length=128, null=True)
    content_encoding: models.CharField[str | None, str | None] = models.CharField(max_length=64, null=True)
    committed_at: models.DateTimeField[datetime | str | Combinable, datetime] = (
        models.DateTimeField()
    )  # the database's clock (Now()), never the worker's

    class Meta:
        db_table = "celery_idem_ledgerentry"
        verbose_name = "ledger entry"
        verbose_name_plural = "ledger entries"
        indexes = [models.Index(fields=["task_name", "committed_at"], name="celery_idem_ledger_task_ix")]

    def __str__(self) -> str:
        return f"{self.task_name} {self.key!r} ({self.outcome})"

    @property
    def identity(self) -> Identity:
        return Identity(self.scope, self.task_name, self.key)

    @property
    def result(self) -> bytes | None:
        """The encoded result, as bytes on every database (PostgreSQL hands back a memoryview)."""
        return None if self.payload is None else bytes(self.payload)

    def value(self, accept: Collection[str] = JSON_ONLY) -> Any:
        """The committed result, decoded only from a content type in ``accept``.

        Raises:
            SerializationError: the content type is not accepted, or the result does not decode.
        """
        return decode_entry(self, accept)


class Record(models.Model):
    """The store's records in the admin: no table (the records live in the store, Redis or SQL,
    which the admin reads through the app's ``Idempotency``); it carries the admin's permissions:
    ``view_record`` lists them, ``change_record`` releases one, ``reconcile_record`` runs the
    reconciler on a selection."""

    class Meta:
        managed = False
        default_permissions = ("view", "change")
        permissions = [("reconcile_record", "Can run the reconciler on idempotency records")]
        verbose_name = "idempotency record"
        verbose_name_plural = "idempotency records"


class OutboxEntry(models.Model):
    """A call staged in the caller's transaction, deleted once the relay published it; a ``dead``
    one is the dead letter (it can never be published, or failed ``max_attempts`` times), kept
    with its last error until an operator retries or deletes it."""

    id: models.BigAutoField[int, int] = models.BigAutoField(primary_key=True)  # the relay's order
    task_id: models.CharField[str, str] = models.CharField(max_length=255)
    task_name: models.CharField[str, str] = models.CharField(max_length=255)
    body: models.BinaryField[bytes | memoryview, bytes | memoryview] = models.BinaryField()  # the call as JSON
    created_at: models.DateTimeField[datetime | str | Combinable, datetime] = models.DateTimeField()
    # When the relay may try it (again): the database's clock, put off after each failed publish.
    available_at: models.DateTimeField[datetime | str | Combinable, datetime] = models.DateTimeField()
    attempts: models.PositiveIntegerField[int | Combinable, int] = models.PositiveIntegerField(default=0)
    last_error: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    dead: models.BooleanField[bool | Combinable, bool] = models.BooleanField(default=False)
    # When a relay took it and has not ended its pass over it yet (a relay that died did not).
    taken_at: models.DateTimeField[datetime | str | Combinable | None, datetime | None] = models.DateTimeField(
        null=True, blank=True
    )

    class Meta:
        db_table = "celery_idem_outbox"
        verbose_name = "outbox entry"
        verbose_name_plural = "outbox entries"
        indexes = [
            models.Index(fields=["dead", "available_at", "id"], name="celery_idem_outbox_due_ix"),
            # Not unique: a call staged twice under one chosen task id is published twice, and the
            # second finds the first's claim (the caller's transaction never fails on it).
            models.Index(fields=["task_id"], name="celery_idem_outbox_task_id_ix"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name} {self.task_id}{' (dead)' if self.dead else ''}"
