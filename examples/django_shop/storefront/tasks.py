"""The shop's tasks: the charge runs once per idempotency key, its payment row and the ledger row
committed together."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django_shop.celery import ledger

from celery_idem import IdempotentTask

from .models import Order, Payment


@shared_task(base=IdempotentTask, bind=True, name="storefront.charge")
def charge(self: Any, order_id: int) -> dict[str, Any]:
    order = Order.objects.get(pk=order_id)

    def effect() -> dict[str, Any]:
        payment = Payment.objects.create(order_id=order.pk, amount=order.amount, task_id=self.request.id)
        Order.objects.filter(pk=order.pk).update(status="paid")
        return {"order": order.pk, "payment": payment.pk, "amount": order.amount}

    return ledger.run_once(self, effect)
