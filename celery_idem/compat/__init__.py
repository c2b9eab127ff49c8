"""Drop-in replacements for other Celery deduplication libraries (DESIGN §7): an app moves to
celery-idem by changing its import line, and keeps its peer's configuration.

- :mod:`celery_idem.compat.once`: celery-once's ``QueueOnce``;
- :mod:`celery_idem.compat.singleton`: celery-singleton's ``Singleton``.

Each maps its peer's options onto a mode (docs/modes.md) and a policy; docs/migration.md lists what
behaves differently from the peer, on purpose.
"""
