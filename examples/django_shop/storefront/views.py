"""Checkout: the client's ``Idempotency-Key`` header becomes the charge's idempotency key.

``POST /checkout/<order_id>/`` stages the charge in the outbox, in the order's transaction: published
when it commits (by this process at once, or by ``manage.py celery_idem_relay`` if this process dies
first), never if it rolls back. ``POST /checkout/<order_id>/on-commit/`` is the same checkout with
``apply_async_on_commit`` (no relay: a process that dies between the commit and the publish loses it).

Both answer a reused key at request time, before anything is staged (``charge.prior_call``, one read
of the key's record): the key of another order is refused with 422, and a retry of a request is
handed the original call's task id. The charge is claimed after the commit, so a transaction that
rolls back leaves the key free.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from celery_idem import InvalidKeyError, PayloadMismatchError
from celery_idem.contrib.django.outbox import outbox

from .models import Order
from .tasks import charge


@csrf_exempt
@require_POST
def checkout(request: HttpRequest, order_id: int) -> JsonResponse:
    return _checkout(request, order_id, outbox.apply_async)


@csrf_exempt
@require_POST
def checkout_on_commit(request: HttpRequest, order_id: int) -> JsonResponse:
    return _checkout(request, order_id, lambda task, args, **options: task.apply_async_on_commit(args, **options))


def _checkout(request: HttpRequest, order_id: int, stage: Any) -> JsonResponse:
    key = request.headers.get("Idempotency-Key")
    if not key:
        return JsonResponse({"error": "an Idempotency-Key header is required"}, status=400)
    try:
        with transaction.atomic():
            # A key already used answers now: the call it repeats, or a refusal (other arguments).
            handle = charge.prior_call((order_id,), idempotency_key=key)
            if handle is None:
                # A row (or an on-commit call) of this transaction: claimed and published after the
                # commit; a rollback (no such order) sends nothing and leaves the key free. Written
                # first: on SQLite before Django 5.1 (no IMMEDIATE transactions) a transaction that
                # reads before it writes fails at once when another connection (the store's
                # heartbeat) committed in between; one that writes first waits its turn.
                handle = stage(charge, (order_id,), idempotency_key=key)
            Order.objects.select_for_update().get(pk=order_id)
    except Order.DoesNotExist:
        return JsonResponse({"error": f"no order {order_id}"}, status=404)
    except InvalidKeyError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    except PayloadMismatchError:
        return _reused(key)
    # A call deferred to the commit learns there what a look before could not see: a request with
    # this key that committed meanwhile (its call is then the one handed back, or a refusal).
    error = getattr(handle, "error", None)
    if isinstance(error, PayloadMismatchError):
        return _reused(key)
    if error is not None:  # the store or the broker was down at the commit: nothing was sent
        return JsonResponse({"error": "the charge could not be queued; retry with the same key"}, status=503)
    return JsonResponse({"order": order_id, "idempotency_key": key, "task_id": handle.id}, status=202)


def _reused(key: str) -> JsonResponse:
    """422 Unprocessable Content: the key was first used for another request (the IETF draft
    "The Idempotency-Key HTTP Header Field" answers so; 409 Conflict is its answer to a request
    whose first use is still being processed, which a look at the store cannot tell apart)."""
    message = f"Idempotency-Key {key!r} was used for another request; a new request needs a new key"
    return JsonResponse({"error": message}, status=422)
