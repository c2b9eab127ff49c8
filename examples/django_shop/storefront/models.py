"""The shop's business rows. A Payment has no unique constraint on its order on purpose: only the
ledger stands between a second execution of the charge and a second payment."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    amount = models.IntegerField()
    status = models.CharField(max_length=16, default="new")


class Payment(models.Model):
    order_id = models.IntegerField()
    amount = models.IntegerField()
    task_id = models.CharField(max_length=255)
