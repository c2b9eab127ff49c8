"""What a ledger's run_once costs a task: the Django ORM's (DjangoLedger) against SQLAlchemy's
(Ledger), each writing one business row and its ledger row in one transaction, on the same database.

    python benchmarks/ledger.py                       # SQLite file and PostgreSQL, 300 calls each
    python benchmarks/ledger.py --databases sqlite --calls 1000 --json out.json

Each call runs through a real idempotent task (an eager app, the memory store: what is timed is
the task's call with its ledger, not a broker), a new key every call, so every call commits. The
two ledgers alternate in slices (``_common.rotated``) so the machine's drift lands on both. Reports
the latency per call (median, p99) and the process CPU per call, and the ratio of the medians.
PostgreSQL tables live in a schema of this run's own, dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import _common
import sqlalchemy as sa

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_shop"
TASK = "bench.pay"


def configure(database: str, home: str, schema: str) -> dict[str, Any]:
    """Django on one database (the example's storefront app for its Payment), migrated."""
    import django
    from django.conf import settings

    sys.path.insert(0, str(EXAMPLE))
    if database == "sqlite":
        entry: dict[str, Any] = {"ENGINE": "django.db.backends.sqlite3", "NAME": os.path.join(home, "bench.sqlite3")}
        url = f"sqlite:///{entry['NAME']}"
    else:
        parts = sa.engine.make_url(_common.POSTGRES_URL)
        entry = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parts.database,
            "USER": parts.username or "postgres",
            "HOST": parts.host or "127.0.0.1",
            "PORT": str(parts.port or 5432),
            "OPTIONS": {"options": f"-c search_path={schema}"},
        }
        url = _common.POSTGRES_URL
    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "celery_idem.contrib.django",
            "storefront",
        ],
        DATABASES={"default": entry},
        USE_TZ=True,
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {"url": url}


def apps(url: str, schema: str) -> tuple[Any, Any, Any]:
    from celery import Celery

    from celery_idem import Idempotency, IdempotentTask
    from celery_idem.contrib.django.ledger import DjangoLedger
    from celery_idem.ledger import Ledger

    options = {"connect_args": {"options": f"-c search_path={schema}"}} if url.startswith("postgresql") else {}
    engine = sa.create_engine(url, **options)
    sa_ledger = Ledger(engine, table_name="bench_ledger")
    sa_ledger.create_schema()
    payments = sa.Table(
        "bench_payments",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("order_id", sa.Integer),
        sa.Column("amount", sa.Integer),
        sa.Column("task_id", sa.String(255)),
    )
    payments.create(engine, checkfirst=True)
    dj_ledger = DjangoLedger()
    made = {}
    for name, ledger in (("django", dj_ledger), ("sqlalchemy", sa_ledger)):
        app = Celery(f"bench-{name}", set_as_current=False)
        app.conf.task_always_eager = True
        app.conf.task_eager_propagates = True
        Idempotency(app, ledger=ledger)
        if name == "django":
            from storefront.models import Payment

            def pay(self: Any, order_id: int, amount: int) -> Any:
                def effect() -> Any:
                    Payment.objects.create(order_id=order_id, amount=amount, task_id=self.request.id)
                    return {"paid": amount}

                return dj_ledger.run_once(self, effect)
        else:

            def pay(self: Any, order_id: int, amount: int) -> Any:
                def effect(session: Any) -> Any:
                    session.execute(
                        sa.insert(payments).values(order_id=order_id, amount=amount, task_id=self.request.id)
                    )
                    return {"paid": amount}

                return sa_ledger.run_once(self, effect)

        made[name] = app.task(base=IdempotentTask, bind=True, shared=False, name=TASK)(pay)
    return made["django"], made["sqlalchemy"], engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--databases", type=_common.choice_list(("sqlite", "postgresql")), default=["sqlite", "postgresql"]
    )
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if len(args.databases) > 1:  # Django configures once per process: one process per database
        import subprocess

        for database in args.databases:
            extra = ["--json", f"{args.json}.{database}"] if args.json else []
            command = [sys.executable, __file__, "--databases", database, "--calls", str(args.calls), *extra]
            subprocess.run(command, check=True)
        return 0
    database = args.databases[0]
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    home = tempfile.mkdtemp(prefix="celery-idem-bench-")
    if database == "postgresql":
        with sa.create_engine(_common.POSTGRES_URL).begin() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        url = configure(database, home, schema)["url"]
        django_task, sa_task, engine = apps(url, schema)
        tasks = {"django": django_task, "sqlalchemy": sa_task}
        timed = {name: _common.Timed() for name in tasks}
        keys = iter(range(10**9))
        rounds = 6
        for r in range(rounds):
            for name in _common.rotated(list(tasks), r):
                task = tasks[name]
                batch = [next(keys) for _ in _common.slice_of(args.calls, rounds, r)]
                run = _common.time_each(
                    lambda k, t=task, n=name: t.apply_async((k, 1), idempotency_key=f"k-{n}-{k}"), batch
                )
                timed[name].add(run)
        print(f"== {database}: {args.calls} calls per ledger, each a new key (one committed row pair)")
        summary = {}
        for name, run in timed.items():
            latency = _common.Latency.of(run.latencies_ns)
            cpu = run.cpu_ns / 1000 / len(run.latencies_ns)
            summary[name] = {"median_us": latency.median_us, "p99_us": latency.p99_us, "cpu_us": cpu}
            print(
                f"{name:>11}: median {latency.median_us:8.0f} µs  p99 {latency.p99_us:8.0f} µs  CPU {cpu:8.0f} µs/call"
            )
        ratio = summary["django"]["median_us"] / summary["sqlalchemy"]["median_us"]
        print(f"DjangoLedger / Ledger, median latency: {ratio:.2f}")
        if args.json:
            _common.write_json(
                args.json, {"database": database, "calls": args.calls, "ledgers": summary, "ratio": ratio}
            )
        engine.dispose()
    finally:
        from django.db import connections

        connections.close_all()
        if database == "postgresql":
            with sa.create_engine(_common.POSTGRES_URL).begin() as connection:
                connection.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return 0


if __name__ == "__main__":
    sys.exit(main())
