"""celery-idem as a Django app: add ``"celery_idem.contrib.django"`` to ``INSTALLED_APPS``.

What it gives a project: system checks (``manage.py check``) that find a celery-idem configuration
that cannot work or will not do what it seems to (:mod:`.checks`); the ledger on the ORM
(:mod:`.ledger`, its model and migration); the ``django://`` store on Django's database
(:mod:`.store`); the admin (:mod:`.admin`); and ``IdempotentDjangoTask`` (:mod:`.tasks`). Settings come from
Django's settings through Celery's own ``CELERY_`` namespace (``CELERY_IDEMPOTENCY_STORE``, ...),
which ``app.config_from_object("django.conf:settings", namespace="CELERY")`` maps to
``app.conf.idempotency_store``. Needs the ``django`` extra (Django 4.2 or 5.2).
"""
