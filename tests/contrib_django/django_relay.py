"""The Django outbox's relay in a process of its own, on the example project (``django_worker``'s
app and environment): one pass of ``DjangoOutbox().relay``; ``SHOP_RELAY_DIES=after_publish``
SIGKILLs it after its first publish returned, before the transaction that deletes the row commits
(``before_claim``: before its first claim); ``SHOP_RELAY_LEASE`` is how long the rows it took stay its own (seconds).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from contrib_django.django_worker import app  # noqa: F401 - sets Django up first

from celery_idem.contrib.django.outbox import DjangoOutbox
from celery_idem.outbox import staging

if os.environ.get("SHOP_RELAY_DIES") == "before_claim":
    staging.relay_call = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
elif os.environ.get("SHOP_RELAY_DIES") == "after_publish":
    relay_call = staging.relay_call

    def published_then_die(*args: Any, **kwargs: Any) -> Any:
        relay_call(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    staging.relay_call = published_then_die  # type: ignore[assignment]

print(DjangoOutbox(lease_seconds=float(os.environ.get("SHOP_RELAY_LEASE") or 60)).relay(app))
