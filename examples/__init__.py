"""Runnable examples of celery-idem: ``examples.payments`` and ``examples.email`` (see their READMEs).

Run them from the repository root, so that ``examples`` is importable (``python -m celery -A ...``).
"""
