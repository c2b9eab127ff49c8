"""``celery-idem demo``: celery-idem's guarantees, shown on a real worker in under a minute."""

from __future__ import annotations

from .runner import main, run_demo

__all__ = ["main", "run_demo"]
