"""django-celery-outbox's relay (``manage.py celery_outbox_relay``) on the interop project, in a
process of its own. ``DCO_RELAY_HOLD=1`` holds it after a batch was published, before its rows are
deleted: its ``delete_published`` prints ``published <row ids>`` and waits forever, inside the
transaction that would have deleted them, for the test to SIGKILL it there. Its rows are picked up
again ``--stale-timeout-seconds`` (1) after this relay took them, by the next relay."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from contrib_django import dco_app  # noqa: F401 - sets Django up first
from django.core.management import call_command
from django_celery_outbox.relay._mutations import RelayMutations

if os.environ.get("DCO_RELAY_HOLD") == "1":
    delete_published = RelayMutations.delete_published

    def published_then_hold(self: Any, message_ids: list[int]) -> None:
        if message_ids:
            print(f"published {message_ids}", flush=True)
            threading.Event().wait()
        delete_published(self, message_ids)

    RelayMutations.delete_published = published_then_hold  # type: ignore[method-assign]

call_command("celery_outbox_relay", "--idle-time", "0.1", "--stale-timeout-seconds", "1", *sys.argv[1:])
