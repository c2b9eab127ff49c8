"""SQLStore's older table layouts, as tests build them: layout 1 (every field as text, the identity
as the primary key), frozen here since the package no longer builds it, with rows in every state."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from celery_idem.stores.sql.engine import server_clock


def layout_1_table(name: str) -> sa.Table:
    """The records table as celery-idem 0.x up to layout 1 made it (frozen here: the package no
    longer builds it)."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("namespace", sa.String(64), primary_key=True),
        sa.Column("scope", sa.String(255), primary_key=True),
        sa.Column("task_name", sa.String(255), primary_key=True),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("lease_expires_at", sa.Double, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Column("ttl_seconds", sa.Double, nullable=False),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("content_type", sa.String(128), nullable=True),
        sa.Column("content_encoding", sa.String(64), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("call", sa.LargeBinary, nullable=True),
        sa.Column("linger_until", sa.Double, nullable=True),
        sa.Column("previous_task_id", sa.String(255), nullable=True),
        sa.Index(f"ix_{name}_lease", "namespace", "lease_expires_at"),
        sa.Index(f"ix_{name}_expires", "expires_at"),
    )


def layout_1_rows(now: float) -> list[dict[str, Any]]:
    task_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    base = {"namespace": "idem", "scope": "", "task_name": "shop.charge", "attempt": 1, "created_at": now - 5}
    base |= {"updated_at": now - 1, "ttl_seconds": 600.0, "result": None, "content_type": None}
    base |= {"content_encoding": None, "error": None, "call": None, "linger_until": None, "previous_task_id": None}
    fp = "ab" * 32
    return [
        base
        | {"key": "claimed", "fingerprint": fp, "state": "PENDING", "task_id": task_id, "attempt": 0}
        | {"owner": uuid.uuid4().hex, "lease_expires_at": now + 60, "expires_at": now + 660, "call": b"[[1], {}]"},
        base
        | {"key": "running", "fingerprint": fp, "state": "IN_PROGRESS", "task_id": other, "owner": "a" * 32}
        | {"lease_expires_at": now + 30, "expires_at": now + 630, "previous_task_id": task_id, "linger_until": now + 3},
        base
        | {"key": "paid", "fingerprint": fp, "state": "COMPLETED", "task_id": "my-own-task-id", "owner": "b" * 32}
        | {"lease_expires_at": None, "expires_at": now + 599, "result": b'{"ok": true}'}
        | {"content_type": "application/json", "content_encoding": "utf-8"},
        base
        | {"key": "refused", "fingerprint": "a custom fingerprint", "state": "FAILED", "task_id": other}
        | {"owner": "c" * 32, "lease_expires_at": None, "expires_at": now + 599, "result": b"\x80\x04K\x01."}
        | {"content_type": "application/x-python-serialize", "content_encoding": "binary"}
        | {"error": '{"type": "ValueError", "module": "builtins", "message": "no", "args": ["no"]}'},
        base
        | {"key": "gone", "fingerprint": fp, "state": "COMPLETED", "task_id": other, "owner": "d" * 32}
        | {"lease_expires_at": None, "expires_at": now - 1},
        base
        | {"namespace": "other", "key": "paid", "fingerprint": fp, "state": "COMPLETED", "task_id": other}
        | {"owner": "e" * 32, "lease_expires_at": None, "expires_at": now + 599},
    ]


def make_layout_1(engine: sa.Engine, name: str) -> list[dict[str, Any]]:
    old = layout_1_table(name)
    old.metadata.create_all(engine)
    with engine.begin() as connection:
        now = float(connection.execute(sa.select(server_clock(engine.dialect.name))).scalar_one())
        rows = layout_1_rows(now)
        connection.execute(sa.insert(old), rows)
    return rows


def drop(engine: sa.Engine, *names: str) -> None:
    with engine.begin() as connection:
        for name in names:
            connection.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
