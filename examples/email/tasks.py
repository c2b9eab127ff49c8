"""The email worker side: a Celery app with celery-idem and the ``email.send_receipt`` task.

``send_receipt`` is keyed by its order (``key_args=["order_id"]``): a call without an
idempotency key is identified by the fingerprint of ``order_id`` alone, so every call, message or
redelivery for one order sends one email, and the rest get the first one's outcome. The identity
also becomes the Message-ID, so a mail server or client can de-duplicate on its side too.
"""

from __future__ import annotations

import dataclasses
import mailbox
import os
import tempfile
from collections.abc import Mapping
from email.message import EmailMessage
from typing import Any

from celery import Celery

from celery_idem import Idempotency, idempotent_task

SEND_RECEIPT = "email.send_receipt"
ENV_PREFIX = "EMAIL_"


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings from ``EMAIL_<FIELD>`` environment variables; the defaults are localhost services."""

    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = "redis://127.0.0.1:6379/1"
    idempotency_store: str = "redis://127.0.0.1:6379/2"
    queue: str = "email"
    key_prefix: str = "idem"
    outbox: str = os.path.join(tempfile.gettempdir(), "celery-idem-outbox")  # a Maildir
    sender: str = "shop@example.com"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        environ = os.environ if environ is None else environ
        values = {f.name: environ.get(ENV_PREFIX + f.name.upper()) for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if value})

    def to_env(self) -> dict[str, str]:
        return {ENV_PREFIX + name.upper(): str(value) for name, value in dataclasses.asdict(self).items()}


def open_outbox(path: str) -> mailbox.Maildir:
    """The outbox: a Maildir (one file per message, written atomically; safe for parallel writers)."""
    return mailbox.Maildir(path, create=True)


def make_celery(config: Config | None = None) -> Celery:
    config = config or Config.from_env()
    app = Celery("email", broker=config.broker_url, backend=config.result_backend, set_as_current=False)
    app.conf.update(
        task_default_queue=config.queue,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=86400,
    )
    Idempotency(app, store=config.idempotency_store, key_prefix=config.key_prefix)

    @idempotent_task(
        app=app,
        shared=False,  # bound to this app only: a process may hold several (tests do)
        bind=True,
        name=SEND_RECEIPT,
        acks_late=True,  # redelivered if the worker dies while sending: the store keeps it to one email
        key_args=["order_id"],  # one receipt per order, whatever the address
        ttl_seconds=30 * 86400,  # remember sent receipts for 30 days
    )
    def send_receipt(self: Any, order_id: str, to: str) -> dict[str, Any]:
        message = EmailMessage()
        message["From"] = config.sender
        message["To"] = to
        message["Subject"] = f"Your receipt for order {order_id}"
        message["Message-ID"] = f"<{self.request.idempotency_key}@receipts.example.com>"
        message.set_content(f"Thank you for your order {order_id}.\n")
        # With a real server this is: with smtplib.SMTP(host, port) as smtp: smtp.send_message(message)
        outbox_key = open_outbox(config.outbox).add(message)
        return {"order_id": order_id, "to": to, "message_id": message["Message-ID"], "outbox_key": outbox_key}

    return app


def dispose(app: Celery) -> None:
    """Close the idempotency store, if it was opened."""
    idem = Idempotency.of(app)
    if "store" in idem.__dict__:
        idem.store.close()
