"""Django, configured once per test process for celery_idem.contrib.django's tests (imported by
each of them; not a conftest.py, whose module name would shadow tests/conftest.py): the app
installed, an in-memory SQLite database (transactions and on_commit work on it)."""

from __future__ import annotations

import pytest

django = pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

from django.conf import settings  # noqa: E402

if not settings.configured:
    settings.configure(
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "celery_idem.contrib.django"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        USE_TZ=True,
    )
    django.setup()
