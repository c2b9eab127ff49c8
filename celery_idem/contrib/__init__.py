"""Integrations with frameworks around Celery: ``celery_idem.contrib.django`` (a Django app)."""
