"""Checkout: the client's ``Idempotency-Key`` header becomes the charge's idempotency key, and the
charge is staged in the outbox in the order's transaction: published when it commits (by this
process at once, or by ``manage.py celery_idem_relay`` if this process dies first), never if it
rolls back."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from celery_idem import InvalidKeyError
from celery_idem.contrib.django.outbox import outbox

from .models import Order
from .tasks import charge


@csrf_exempt
@require_POST
def checkout(request: HttpRequest, order_id: int) -> JsonResponse:
    key = request.headers.get("Idempotency-Key")
    if not key:
        return JsonResponse({"error": "an Idempotency-Key header is required"}, status=400)
    try:
        with transaction.atomic():
            # A row of this transaction: published after the commit; a rollback (no such order)
            # sends nothing. Written first: on SQLite before Django 5.1 (no IMMEDIATE transactions)
            # a transaction that reads before it writes fails at once when another connection (the
            # store's heartbeat) committed in between; one that writes first waits its turn.
            handle = outbox.apply_async(charge, (order_id,), idempotency_key=key)
            Order.objects.select_for_update().get(pk=order_id)
    except Order.DoesNotExist:
        return JsonResponse({"error": f"no order {order_id}"}, status=404)
    except InvalidKeyError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"order": order_id, "idempotency_key": key, "task_id": handle.id}, status=202)
