"""The shop app with pool children started by ``spawn``: ``celery -A spawn_shop worker``.

Its settings reach celery-idem only as ``Idempotency(app, store=..., key_prefix=...)`` in
:func:`shop.make_app` (or, with ``SPAWN_STORE_INSTANCE`` set, a Store instance), never through
``app.conf``: a spawned child rebuilds the app from its conf.
"""

from __future__ import annotations

import os

from shop import app

from celery_idem import Idempotency, store_from_url

app.conf.worker_pool_start_method = "spawn"
if os.environ.get("SPAWN_STORE_INSTANCE"):
    # A Store instance instead of its URL: it cannot travel to a spawned child.
    Idempotency(app, store=store_from_url(os.environ["SHOP_STORE"], key_prefix=os.environ["SHOP_PREFIX"]))

__all__ = ["app"]
