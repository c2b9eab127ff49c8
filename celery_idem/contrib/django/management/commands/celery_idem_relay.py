"""``manage.py celery_idem_relay``: the outbox's relay, as a loop (or one pass with ``--once``)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError

from ...outbox import DjangoOutbox


class Command(BaseCommand):
    help = (
        "Publish the calls staged in celery-idem's outbox that the committing process did not "
        "(it died, or the broker was down). Safe to run several at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default=None, help="the database alias of the outbox (default: the router's)")
        parser.add_argument("--limit", type=int, default=100, help="rows per pass (default: 100)")
        parser.add_argument("--interval", type=float, default=1.0, help="seconds between passes that found nothing")
        parser.add_argument("--max-attempts", type=int, default=20, help="failed publishes before the dead letter")
        parser.add_argument(
            "--lease-seconds", type=float, default=60.0, help="how long taken rows stay this relay's (default: 60)"
        )
        parser.add_argument("--once", action="store_true", help="one pass, then exit")

    def handle(self, *args: Any, **options: Any) -> None:
        from celery import current_app

        outbox = DjangoOutbox(
            options["database"], max_attempts=options["max_attempts"], lease_seconds=options["lease_seconds"]
        )
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        while not stop.is_set():
            try:
                report = outbox.relay(current_app, limit=options["limit"])
            except DatabaseError as exc:  # the database down, or SQLite locked by another relay
                if options["once"]:
                    raise
                self.stderr.write(f"celery_idem_relay: the pass failed ({exc!r}); trying again")
                stop.wait(options["interval"])
                continue
            if report.published or report.failed or report.dead or options["once"]:
                self.stdout.write(f"celery_idem_relay: {report}")
            if options["once"]:
                return
            if len(report.published) < options["limit"]:
                stop.wait(options["interval"])
