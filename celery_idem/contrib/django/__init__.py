"""celery-idem as a Django app: add ``"celery_idem.contrib.django"`` to ``INSTALLED_APPS``.

What it gives a project today: system checks (``manage.py check``) that find a celery-idem
configuration that cannot work or will not do what it seems to (:mod:`.checks`). Settings come from
Django's settings through Celery's own ``CELERY_`` namespace (``CELERY_IDEMPOTENCY_STORE``, ...),
which ``app.config_from_object("django.conf:settings", namespace="CELERY")`` maps to
``app.conf.idempotency_store``. Needs the ``django`` extra (Django 4.2 or 5.2).
"""
