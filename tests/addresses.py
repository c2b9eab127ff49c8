"""Every server the tests reach, in one place, from the environment (defaults: the loopback services
of the dev machine). A plain module: the worker and relay processes the tests start import it too,
and see the same addresses through the environment they inherit.

- ``CELERY_IDEM_TEST_REDIS_URL``          the store: redis://127.0.0.1:6379/15
- ``CELERY_IDEM_TEST_REDIS_BROKER_URL``   the Redis broker: redis://127.0.0.1:6379/14
- ``CELERY_IDEM_TEST_REDIS_BACKEND_URL``  the result backend: redis://127.0.0.1:6379/13
- ``CELERY_IDEM_TEST_REDIS_COUNTER_URL``  where task bodies count their effects: redis://127.0.0.1:6379/12
- ``CELERY_IDEM_TEST_REDIS_DEMO_BROKER_URL``, ``..._DEMO_BACKEND_URL``  the demo's own (it uses Celery's
  default queue): redis://127.0.0.1:6379/10 and /11
- ``CELERY_IDEM_TEST_POSTGRES_URL``       postgresql+psycopg://postgres@127.0.0.1:5432/test
- ``CELERY_IDEM_TEST_RABBITMQ_URL``       amqp://guest:guest@127.0.0.1:5672// (a vhost of one's own keeps
  the queues and the native delayed delivery exchanges of concurrent runs apart)
- ``CELERY_IDEM_TEST_MARIADB_URL``        mysql://root@127.0.0.1:3306/test

On a Redis shared with other suites, point the four Redis URLs at databases (or a server) of the
run's own. Every test writes under a key prefix of its own and removes what it wrote; none flushes
a database.
"""

from __future__ import annotations

import os

REDIS_URL = os.environ.get("CELERY_IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
REDIS_BROKER_URL = os.environ.get("CELERY_IDEM_TEST_REDIS_BROKER_URL", "redis://127.0.0.1:6379/14")
REDIS_BACKEND_URL = os.environ.get("CELERY_IDEM_TEST_REDIS_BACKEND_URL", "redis://127.0.0.1:6379/13")
REDIS_COUNTER_URL = os.environ.get("CELERY_IDEM_TEST_REDIS_COUNTER_URL", "redis://127.0.0.1:6379/12")
REDIS_DEMO_BROKER_URL = os.environ.get("CELERY_IDEM_TEST_REDIS_DEMO_BROKER_URL", "redis://127.0.0.1:6379/10")
REDIS_DEMO_BACKEND_URL = os.environ.get("CELERY_IDEM_TEST_REDIS_DEMO_BACKEND_URL", "redis://127.0.0.1:6379/11")
POSTGRES_URL = os.environ.get("CELERY_IDEM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
RABBITMQ_URL = os.environ.get("CELERY_IDEM_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
MARIADB_SERVER_URL = os.environ.get("CELERY_IDEM_TEST_MARIADB_URL", "mysql://root@127.0.0.1:3306/test")
