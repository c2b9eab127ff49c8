"""The admin of ``celery_idem.contrib.django``: the store's records, read-only, and two actions.

The records live in the store (Redis, PostgreSQL, ...), not in Django's database: the page reads them
through the ``Idempotency`` of the project's Celery app (``celery.current_app``, which the project's
``proj/__init__.py`` sets as Celery's Django guide does). It lists at most :data:`LIMIT` records,
filters by state and task, searches by key and task id, and offers, each behind its permission:

- **Release** (``celery_idem.change_record``): free a stuck record (PENDING, or IN_PROGRESS past
  its lease), so the next call with its key runs: one write fenced by the task id read from it, so
  a record that completed or was taken over meanwhile is never deleted. A settled record, or one
  still running under its lease, is not released.
- **Reconcile** (``celery_idem.reconcile_record``): run the reconciler on the selection; records
  whose lease still runs are left alone.

The ledger's entries are listed read-only (``LedgerEntry``): they are the record of what committed.
The outbox's entries (``OutboxEntry``) are listed read-only too, with one action behind
``celery_idem.change_outboxentry``: give dead ones back to the relay, which sends them again on its
next pass, even one a relay that died may have published (``DjangoOutbox.retry_dead`` says what
that risks; the page warns when the selection holds such entries).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import current_app
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from ...errors import IdempotencyError
from ...extension import Idempotency
from ...records import IdempotencyRecord, Identity, State
from ...runtime import installed_on
from .models import LedgerEntry, OutboxEntry, Record

__all__ = ["LIMIT", "LedgerEntryAdmin", "OutboxEntryAdmin", "RecordAdmin"]

if TYPE_CHECKING:  # ModelAdmin is generic to django-stubs, not at runtime
    _RecordAdmin = admin.ModelAdmin[Record]
    _LedgerEntryAdmin = admin.ModelAdmin[LedgerEntry]
    _OutboxEntryAdmin = admin.ModelAdmin[OutboxEntry]
else:
    _RecordAdmin = _LedgerEntryAdmin = _OutboxEntryAdmin = admin.ModelAdmin

LIMIT = 500  # records read per page view (on Redis, listing scans the key space)


@admin.register(Record)
class RecordAdmin(_RecordAdmin):
    """The store's records: a list with filters, a search, and the two actions."""

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        return [path("", self.admin_site.admin_view(self.changelist_view), name=name)]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_reconcile_permission(self, request: HttpRequest) -> bool:
        user: Any = request.user
        return bool(user.has_perm(f"{self.opts.app_label}.reconcile_record"))

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        app = current_app._get_current_object()
        idem = installed_on(app)
        if request.method == "POST" and isinstance(idem, Idempotency):
            self._act(request, idem)
            return HttpResponseRedirect(request.get_full_path())
        if request.method == "POST":
            raise PermissionDenied
        state, task, query = request.GET.get("state", ""), request.GET.get("task", ""), request.GET.get("q", "").strip()
        records: list[IdempotencyRecord] = []
        store, error = "", ""
        if not isinstance(idem, Idempotency):
            error = f"celery-idem is not installed on the Celery app {app.main!r} (celery.current_app)"
        else:
            try:
                store = repr(idem.store)
                records = idem.store.records(state=State(state) if state else None, task_name=task or None, limit=LIMIT)
            except (IdempotencyError, ValueError) as exc:
                error = f"the store could not be read: {exc}"
        if query:
            records = [r for r in records if query in r.key or query == r.task_id]
        context = {
            **self.admin_site.each_context(request),
            "title": "Idempotency records",
            "opts": self.opts,
            "rows": [_row(record) for record in records],
            "states": [s.value for s in State],
            "tasks": sorted({record.task_name for record in records} | ({task} if task else set())),
            "state": state,
            "task": task,
            "q": query,
            "limit": LIMIT,
            "error": error,
            "store": store,
            "can_release": self.has_change_permission(request),
            "can_reconcile": self.has_reconcile_permission(request),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/celery_idem/record/change_list.html", context)

    def _act(self, request: HttpRequest, idem: Idempotency) -> None:
        try:
            self._run_action(request, idem)
        except IdempotencyError as exc:
            messages.error(request, f"The store could not be changed: {exc}")

    def _run_action(self, request: HttpRequest, idem: Idempotency) -> None:
        action = request.POST.get("action", "")
        selected = [identity for value in request.POST.getlist("selected") if (identity := _identity(value))]
        if not selected:
            messages.warning(request, "Select records first.")
            return
        if action == "release":
            if not self.has_change_permission(request):
                raise PermissionDenied
            self._release(request, idem, selected)
        elif action == "reconcile":
            if not self.has_reconcile_permission(request):
                raise PermissionDenied
            report = idem.reconcile(identities=selected)
            messages.success(
                request,
                f"Reconciled {report.scanned} of {len(selected)} selected (the others' leases still run): "
                f"{report.completed} completed, {report.failed} failed, {report.released} released, "
                f"{report.requeued} requeued, {report.left} left.",
            )
        else:
            messages.error(request, f"Unknown action {action!r}.")

    def _release(self, request: HttpRequest, idem: Idempotency, selected: list[Identity]) -> None:
        """One fenced write per record: the store frees it only while it is PENDING, or IN_PROGRESS
        past its lease, under the task id read from it; a record that completed or was taken over
        since the page was read is LOST to the write, never deleted."""
        released, kept = 0, 0
        for identity in selected:
            record = idem.store.get(identity)
            if record is None:
                continue
            if idem.store.release(identity, record.task_id, fence="task_id").ok:
                released += 1
            else:
                kept += 1
        messages.success(request, f"Released {released} record(s).")
        if kept:
            messages.warning(
                request,
                f"{kept} record(s) were not released: settled (their outcome stands) or still running under "
                "their lease.",
            )


@admin.register(LedgerEntry)
class LedgerEntryAdmin(_LedgerEntryAdmin):
    """The ledger's entries, read-only: the record of what committed."""

    list_display = ("key", "scope", "task_name", "outcome", "task_id", "committed_at", "namespace")
    list_filter = ("outcome", "task_name", "namespace")
    search_fields = ("key", "task_id")
    ordering = ("-committed_at",)
    exclude = ("payload",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(OutboxEntry)
class OutboxEntryAdmin(_OutboxEntryAdmin):
    """The outbox's entries: calls staged and not published yet, and the dead letter."""

    list_display = ("task_id", "task_name", "dead", "attempts", "available_at", "created_at", "taken", "last_error")
    list_filter = ("dead", "task_name")
    search_fields = ("task_id",)
    ordering = ("id",)
    exclude = ("body",)
    actions = ["retry"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [field.name for field in OutboxEntry._meta.fields if field.name != "body"]

    @admin.display(description="taken by a relay at", ordering="taken_at")
    def taken(self, entry: OutboxEntry) -> datetime | None:
        """The mark: a relay took the entry then and may have published it (one that died did not say)."""
        return entry.taken_at

    @admin.action(
        description="Give dead entries back to the relay (sent again, even if one ran)", permissions=["change"]
    )
    def retry(self, request: HttpRequest, queryset: Any) -> None:
        from .outbox import DjangoOutbox

        dead = [entry for entry in queryset if entry.dead]
        retried = DjangoOutbox(queryset.db).retry_dead([entry.pk for entry in dead])
        messages.success(request, f"{retried} dead entr{'y' if retried == 1 else 'ies'} given back to the relay.")
        marked = sum(entry.taken_at is not None for entry in dead)
        if marked:
            messages.warning(
                request,
                f"{marked} of them had been taken by a relay that died (AmbiguousRelay among them): it may have "
                "published them. They are sent again on the relay's next pass; one that ran and whose record has "
                "expired runs again.",
            )


def _row(record: IdempotencyRecord) -> dict[str, Any]:
    return {
        "value": json.dumps(list(record.identity)),
        "key": record.key,
        "scope": record.scope,
        "task_name": record.task_name,
        "state": record.state.value,
        "task_id": record.task_id,
        "updated_at": _when(record.updated_at),
        "lease_expires_at": _when(record.lease_expires_at),
        "expires_at": _when(record.expires_at),
    }


def _when(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=timezone.utc)


def _identity(value: str) -> Identity | None:
    """A selected row's identity, as the page wrote it; anything else is ignored."""
    try:
        parts = json.loads(value)
    except ValueError:
        return None
    if not (isinstance(parts, list) and len(parts) == 3 and all(isinstance(part, str) for part in parts)):
        return None
    return Identity(*parts)
