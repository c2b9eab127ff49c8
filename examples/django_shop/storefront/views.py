"""Checkout: the client's ``Idempotency-Key`` header becomes the charge's idempotency key, and the
charge is published when the order's transaction commits."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from celery_idem import InvalidKeyError

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
            order = Order.objects.select_for_update().get(pk=order_id)
            # Claimed and published when this transaction commits; a rollback sends nothing.
            charge.apply_async_on_commit((order.pk,), idempotency_key=key)
    except Order.DoesNotExist:
        return JsonResponse({"error": f"no order {order_id}"}, status=404)
    except InvalidKeyError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"order": order_id, "idempotency_key": key}, status=202)
