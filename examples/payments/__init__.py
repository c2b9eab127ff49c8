"""A payments service: a web endpoint that takes charges with an ``Idempotency-Key`` header, and a
Celery task that records each payment once in PostgreSQL, with the ledger, in the same transaction.

- ``examples.payments.config``: settings from ``PAYMENTS_*`` environment variables.
- ``examples.payments.tasks``: ``make_celery(config)``, the ``payments.charge`` task, the tables.
- ``examples.payments.celery_app``: the app ``celery -A`` loads (worker and beat).
- ``examples.payments.web``: the Flask app (``create_app``).
- ``python -m examples.payments initdb``: creates the tables.
"""
