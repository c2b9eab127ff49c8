"""The Django settings of the django-celery-outbox interop project (tests/contrib_django/
test_django_celery_outbox.py), for its child processes only: django-celery-outbox's app is never
loaded in a test process (it brings sentry-sdk, structlog and datadog along).

``DCO_DB`` is ``sqlite:///path`` or ``postgresql://user@host:port/db``, with ``DCO_DB_SCHEMA`` the
schema of the test process on PostgreSQL.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

_db = urlsplit(os.environ["DCO_DB"])

if _db.scheme == "sqlite":
    _database = {"ENGINE": "django.db.backends.sqlite3", "NAME": _db.path, "OPTIONS": {"timeout": 20}}
else:
    _database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": _db.username or "postgres",
        "HOST": _db.hostname,
        "PORT": str(_db.port or 5432),
        "OPTIONS": {"options": f"-c search_path={os.environ['DCO_DB_SCHEMA']}"},
    }

DATABASES = {"default": _database}
INSTALLED_APPS = ["django.contrib.contenttypes", "django_celery_outbox"]
USE_TZ = True
SECRET_KEY = "celery-idem-tests"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CELERY_OUTBOX_APP = "contrib_django.dco_app.app"
MONITORING_METRICS_ENABLED = False  # django-celery-outbox's statsd metrics: nothing listens
