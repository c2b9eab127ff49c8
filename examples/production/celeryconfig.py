"""The Celery and celery-idem settings we recommend for tasks whose effect must happen once (payments).

Load it with ``app.config_from_object("examples.production.celeryconfig")`` (copy it into your
project first). docs/guides/production.md gives the reason for every line, and
tests/worker/test_production_config.py runs a real worker with exactly these settings on RabbitMQ
and on Redis. Servers come from the environment; the defaults are the services on localhost.
"""

from __future__ import annotations

import os

from kombu import Exchange, Queue

# ---- servers ---------------------------------------------------------------------------------------
broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@localhost:5672//")
result_backend = os.environ.get("CELERY_RESULT_BACKEND", "redis://localhost:6379/1")
idempotency_store = os.environ.get("IDEMPOTENCY_STORE", "redis://localhost:6379/2")
RABBITMQ = broker_url.startswith(("amqp://", "amqps://", "pyamqp://"))
QUEUES = os.environ.get("CELERY_QUEUES", "payments").split(",")  # the first is the default queue

# ---- delivery: at least once, and never more held than run ----------------------------------------
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
worker_cancel_long_running_tasks_on_connection_loss = True
worker_eta_task_limit = 100
broker_connection_retry_on_startup = True
if RABBITMQ:
    # Quorum queues behind topic exchanges: replicated, and Celery's native delayed delivery for
    # countdown and ETA (a direct exchange would leave ETA messages held by workers).
    task_queues = [
        Queue(name, Exchange(name, type="topic"), routing_key=name, queue_arguments={"x-queue-type": "quorum"})
        for name in QUEUES
    ]
    broker_transport_options = {"confirm_publish": True}
else:
    task_queues = [Queue(name, Exchange(name), routing_key=name) for name in QUEUES]
    broker_transport_options = {"visibility_timeout": 2 * 3600}  # > the longest ETA + the longest task
task_default_queue = QUEUES[0]

# ---- time limits and shutdown ------------------------------------------------------------------------
task_soft_time_limit = 240
task_time_limit = 300
worker_soft_shutdown_timeout = 20.0

# ---- results -------------------------------------------------------------------------------------------
task_serializer = result_serializer = "json"
accept_content = result_accept_content = ["json"]
result_expires = 26 * 3600

# ---- celery-idem ------------------------------------------------------------------------------------------
idempotency_key_prefix = os.environ.get("IDEMPOTENCY_KEY_PREFIX", "payments")
idempotency_require_key = True
idempotency_ttl_seconds = 26 * 3600
idempotency_lease_seconds = 30
idempotency_pending_timeout_seconds = 3 * 3600
idempotency_on_store_error = "raise"
idempotency_reconcile_interval_seconds = 300
idempotency_stale_grace_seconds = 3600
