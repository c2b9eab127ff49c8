"""``python -m celery_idem demo``."""

from __future__ import annotations

from .demo import main

if __name__ == "__main__":
    main()
