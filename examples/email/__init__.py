"""An email sender: ``send_receipt(order_id, to)`` sends one receipt per order, however often the
call is duplicated or its message redelivered. "Sending" writes to a Maildir outbox.

- ``examples.email.tasks``: ``make_celery(config)``, the ``email.send_receipt`` task, the outbox.
- ``examples.email.celery_app``: the app ``celery -A`` loads.
- ``python -m examples.email send|redeliver|outbox``: drive it from a shell.

Import it as ``examples.email`` (from the repository root): put ``examples/`` itself on sys.path
and this package would shadow the standard library's ``email``.
"""
