"""The app's migrations: they match its models (``makemigrations --check`` finds nothing to write),
and ``migrate`` gives every database the tables with the names the code and the docs use."""

from __future__ import annotations

import pytest

pytest.importorskip("django", reason="celery_idem.contrib.django needs the django extra")

import django_project  # noqa: E402 - configures Django for this module
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402


def test_the_migrations_match_the_models() -> None:
    call_command("makemigrations", "celery_idem", "--check", "--dry-run", verbosity=0)  # SystemExit(1) if not


@pytest.mark.parametrize("alias", django_project.ALIASES)
def test_migrate_creates_the_tables_with_their_pinned_index_and_constraint_names(alias: str) -> None:
    django_project.require_alias(alias)
    connection = connections[alias]
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
        assert {"celery_idem_ledgerentry", "celery_idem_outbox"} <= tables
        constraints = connection.introspection.get_constraints(cursor, "celery_idem_outbox")
    assert constraints["celery_idem_outbox_task_id_ix"]["columns"] == ["task_id"]
    assert constraints["celery_idem_outbox_due_ix"]["columns"] == ["dead", "available_at", "id"]
