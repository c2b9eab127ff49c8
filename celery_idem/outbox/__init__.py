"""The transactional outbox: a call made inside a database transaction is written to an outbox
table in that transaction and published after the commit, by the committing process at once and by
a relay for whatever that missed. A rolled-back transaction never publishes; a committed one
always does, even when the process dies between the commit and the publish.

- :mod:`.staging`: what every outbox does, whatever the database library (the row's call, its
  identity and task id, publishing it through the task's own ``apply_async``);
- :class:`~celery_idem.outbox.sql.SQLOutbox`: the outbox on SQLAlchemy;
- :class:`~celery_idem.contrib.django.outbox.DjangoOutbox`: the outbox on the Django ORM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from .staging import RelayReport

__all__ = ["RelayReport", "SQLOutbox", "outbox_table"]

if TYPE_CHECKING:
    from .sql import SQLOutbox, outbox_table


def __getattr__(name: str) -> Any:
    """The SQLAlchemy outbox, imported on first use (the Django one needs no SQLAlchemy)."""
    if name not in ("SQLOutbox", "outbox_table"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import sqlalchemy  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigurationError("SQLOutbox needs SQLAlchemy: pip install 'celery-idem[sql]'") from exc
    from . import sql

    return getattr(sql, name)
