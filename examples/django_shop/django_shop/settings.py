"""Settings of the django_shop example.

The database comes from the environment, so the same project runs on SQLite (the default, a file
beside this one) and PostgreSQL or MariaDB:

    DJANGO_SHOP_DB=postgresql://127.0.0.1:5432/test   (optionally DJANGO_SHOP_DB_SCHEMA=<schema>)
    DJANGO_SHOP_DB=mysql://root@127.0.0.1:3306/test
    DJANGO_SHOP_DB=sqlite:////tmp/shop.sqlite3

Celery and celery-idem read everything under the ``CELERY_`` namespace (``django_shop/celery.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import django

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SHOP_SECRET_KEY", "django-shop-example-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_SHOP_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_idem.contrib.django",  # the ledger's model and migration, admin, system checks
    "storefront",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "django_shop.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"
USE_TZ = True


def database(url: str) -> dict[str, Any]:
    """A DATABASES entry from a URL (postgresql://, mysql://, sqlite:///path)."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        entry: dict[str, Any] = {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parts.path or str(BASE_DIR / "shop.sqlite3"),
        }
        if django.VERSION >= (5, 1):
            # Write transactions take the write lock at BEGIN. A deferred one (Django's default) that
            # reads first, as checkout does, cannot write once another connection has committed since
            # its read (SQLite's "database is locked" at once, no waiting): celery-idem's heartbeat
            # writes to this file from its own thread when the store is django://.
            entry["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}
        return entry
    engine = {"postgresql": "postgresql", "mysql": "mysql"}[parts.scheme]
    if engine == "mysql":
        try:
            import MySQLdb  # noqa: F401 - mysqlclient, Django's own driver
        except ImportError:  # PyMySQL, pure Python, standing in for it
            import pymysql

            pymysql.install_as_MySQLdb()
    entry: dict[str, Any] = {
        "ENGINE": f"django.db.backends.{engine}",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }
    schema = os.environ.get("DJANGO_SHOP_DB_SCHEMA")
    if engine == "postgresql" and schema:
        entry["OPTIONS"] = {"options": f"-c search_path={schema}"}
    return entry


DATABASES = {"default": database(os.environ.get("DJANGO_SHOP_DB", f"sqlite:///{BASE_DIR / 'shop.sqlite3'}"))}

# Celery, the Django way: app.config_from_object("django.conf:settings", namespace="CELERY")
CELERY_BROKER_URL = os.environ.get("DJANGO_SHOP_BROKER", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("DJANGO_SHOP_QUEUE", "celery")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# celery-idem: the store (the fast lock and outcome cache) and its settings
CELERY_IDEMPOTENCY_STORE = os.environ.get("DJANGO_SHOP_STORE", "redis://127.0.0.1:6379/0")
CELERY_IDEMPOTENCY_KEY_PREFIX = os.environ.get("DJANGO_SHOP_KEY_PREFIX", "django-shop")
CELERY_IDEMPOTENCY_TTL_SECONDS = 24 * 3600
