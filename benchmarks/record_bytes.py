#!/usr/bin/env python
"""Bytes per settled record: what one COMPLETED record with a 33-byte JSON result takes in each store.

Run from the repository root::

    python benchmarks/record_bytes.py [--records N] [--stores redis,postgresql,sqlite] [--json out.json]

The records are written through celery-idem's public API, as an app writes them: N keyed calls
(``idempotency_key="order-00000001"``, ...) of an ``IdempotentTask`` run eagerly
(``task_always_eager``), each a claim, an acquire and a complete, leaving a COMPLETED record whose
result is ``{"order": <8 digits>, "paid": true}``, 33 bytes of JSON. Then, per store:

- Redis (a private ``redis-server`` on a free port unless ``--redis-url``): ``MEMORY USAGE <key>
  SAMPLES 0`` of every key under the run's prefix (every field counted), summed and per record; and
  the growth of ``INFO used_memory`` per record (keyspace and expiry entries, allocator rounding:
  private server only).
- PostgreSQL (a records table of the run's own): the growth of ``pg_total_relation_size`` (heap,
  indexes, TOAST and maps) per record after ``VACUUM ANALYZE`` (what autovacuum leaves: the space of
  the row versions the acquire and the complete replaced is reusable, not returned), and after
  ``VACUUM FULL`` (packed); and ``avg(pg_column_size(t.*))``, the row itself.
- SQLite (a file in a temporary directory): the growth of the file per record after ``VACUUM``.

Each also less the result's 33 bytes: what a record costs besides its result. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from _common import POSTGRES_URL, REDIS_URL, Machine, PrivateRedis, choice_list, log, remove_prefix, write_json
from celery import Celery

from celery_idem import Idempotency, IdempotentTask, State, Store, store_from_url
from celery_idem.stores import Identity

KINDS = ("redis", "postgresql", "sqlite")
TASK = "record_bytes.order"


def result_of(n: int) -> dict[str, Any]:
    return {"order": 10_000_000 + n, "paid": True}  # JSON as the task's serializer writes it: 33 bytes


def write_records(store: Store, n: int, ready: Callable[[], None]) -> tuple[int, float]:
    """N COMPLETED records through keyed eager calls, ``ready()`` called after a warm-up call (whose
    record is then forgotten); the result's size in bytes, and the seconds the N calls took."""
    app = Celery("record_bytes", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.task_always_eager = True
    idem = Idempotency(app, store=store, key_prefix=store.key_prefix)

    @app.task(base=IdempotentTask, name=TASK, shared=False)
    def order(i: int) -> dict[str, Any]:
        return result_of(i)

    warm = Identity("", TASK, "warm-up")
    order.apply_async((0,), idempotency_key=warm.key).get()  # connections, scripts, schema
    store.forget(warm)
    ready()
    started = time.perf_counter()
    for i in range(n):
        order.apply_async((i,), idempotency_key=f"order-{i:08d}").get()
    seconds = time.perf_counter() - started
    idem.disconnect()  # stops the liveness heartbeat the calls started
    counts = store.count_by_state()
    if counts.get(State.COMPLETED) != n or sum(counts.values()) != n:
        raise AssertionError(f"expected {n} COMPLETED records, the store holds {counts}")
    record = store.get(Identity("", TASK, "order-00000000"))
    assert record is not None and record.result is not None
    return len(record.result), seconds


def measure_redis(url: str, prefix: str, n: int, private: bool) -> dict[str, Any]:
    store = store_from_url(url, key_prefix=prefix)
    client = store.client  # type: ignore[attr-defined]
    before: dict[str, Any] = {}

    def ready() -> None:  # after the warm-up: scripts loaded, the heartbeat's liveness key written
        before["used_memory"] = int(client.info("memory")["used_memory"])
        before["keys"] = set(client.scan_iter(match=f"{{{prefix}:*", count=1000))

    try:
        result_bytes, seconds = write_records(store, n, ready)
        used_after = int(client.info("memory")["used_memory"])
        # The records are the keys the N calls added under the prefix (no layout is assumed).
        keys = [k for k in client.scan_iter(match=f"{{{prefix}:*", count=1000) if k not in before["keys"]]
        if len(keys) != n:
            log(f"  warning: the calls added {len(keys)} keys under the prefix, not {n}")
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
            pipe.memory_usage(key, samples=0)
        answers = pipe.execute()
        by_type: dict[str, list[int]] = {}
        for kind, usage in zip(answers[::2], answers[1::2], strict=True):
            by_type.setdefault(kind.decode() if isinstance(kind, bytes) else kind, []).append(int(usage))
        records = by_type.get("hash", [])
        encoding = client.object("encoding", keys[0]) if keys else None
        total = sum(sum(v) for v in by_type.values())
        rows = [row("redis", "MEMORY USAGE SAMPLES 0 of each record key, sum / records", total / n, result_bytes)]
        if private:
            grown = used_after - before["used_memory"]
            rows.append(row("redis", "INFO used_memory growth / records", grown / n, result_bytes))
        return {
            "rows": rows,
            "keys_by_type": {kind: len(v) for kind, v in by_type.items()},
            "memory_usage_sum": total,
            "record_hash_bytes_mean": sum(records) / len(records) if records else None,
            "encoding": encoding.decode() if isinstance(encoding, bytes) else encoding,
            "used_memory_growth": used_after - before["used_memory"] if private else None,
            "write_seconds": seconds,
        }
    finally:
        remove_prefix(store)
        store.close()


def measure_sql(kind: str, url: str, prefix: str, n: int) -> dict[str, Any]:
    import sqlalchemy as sa

    # A table of the run's own, so its rows take the default namespace, as an app's rows do.
    table = f"celery_idem_rb_{prefix}"
    store = store_from_url(url, key_prefix="idem", table_name=table, liveness_table_name=f"{table}_liveness")
    engine = store.engine  # type: ignore[attr-defined]
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")

    def sizes(vacuum: str) -> dict[str, int]:
        with auto.connect() as c:
            if kind == "postgresql":
                c.execute(sa.text(f'{vacuum} "{table}"'))
                q = "SELECT pg_total_relation_size(:t), pg_relation_size(:t), pg_indexes_size(:t)"
                total, heap, indexes = c.execute(sa.text(q), {"t": table}).one()
                return {"total": total, "heap": heap, "indexes": indexes, "toast_and_maps": total - heap - indexes}
            c.execute(sa.text("PRAGMA wal_checkpoint(TRUNCATE)"))
            c.execute(sa.text("VACUUM"))
            pages = c.execute(sa.text("PRAGMA page_count")).scalar_one()
            return {"total": pages * c.execute(sa.text("PRAGMA page_size")).scalar_one()}

    before: dict[str, dict[str, int]] = {}

    def ready() -> None:
        # The empty table (the warm-up's record forgotten) as each VACUUM leaves it: VACUUM FULL
        # drops the free-space and visibility maps that VACUUM makes, so each growth has its own start.
        if kind == "postgresql":
            before["VACUUM FULL"] = sizes("VACUUM FULL")
            before["VACUUM ANALYZE"] = sizes("VACUUM ANALYZE")
        else:
            before["VACUUM"] = sizes("VACUUM")

    try:
        result_bytes, seconds = write_records(store, n, ready)
        per = {}
        if kind == "postgresql":
            per["VACUUM ANALYZE"] = sizes("VACUUM ANALYZE")
            with engine.connect() as c:
                tuple_bytes = c.execute(sa.text(f'SELECT avg(pg_column_size(t.*)) FROM "{table}" t')).scalar_one()
            per["VACUUM FULL"] = sizes("VACUUM FULL")
        else:
            per["VACUUM"] = sizes("VACUUM")
        rows = []
        for how, after in per.items():
            grown = {part: (after[part] - before[how][part]) / n for part in after}
            parts = ", ".join(f"{part} {value:,.0f}" for part, value in grown.items() if part != "total")
            what = "pg_total_relation_size" if kind == "postgresql" else "database file"
            rows.append(
                row(
                    kind,
                    f"{what} growth / records, after {how}" + (f" ({parts})" if parts else ""),
                    grown["total"],
                    result_bytes,
                )
            )
        if kind == "postgresql":
            rows.append(row(kind, "avg(pg_column_size(t.*)): the row alone", float(tuple_bytes), result_bytes))
        return {"rows": rows, "before": before, "after": per, "write_seconds": seconds}
    finally:
        with auto.connect() as c:
            for name in (table, f"{table}_liveness"):
                c.execute(sa.text(f'DROP TABLE IF EXISTS "{name}"'))
        store.close()


def row(store: str, how: str, per_record: float, result_bytes: int) -> dict[str, Any]:
    return {
        "store": store,
        "how": how,
        "bytes_per_record": per_record,
        "result_bytes": result_bytes,
        "result_share": result_bytes / per_record,
        "bytes_without_result": per_record - result_bytes,
    }


def table(rows: list[dict[str, Any]], n: int) -> str:
    lines = [
        f"| store | measured as | bytes per record ({n:,} records) | result bytes | result's share "
        "| bytes per record less the result |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['store']} | {r['how']} | {r['bytes_per_record']:,.0f} | {r['result_bytes']} "
            f"| {r['result_share']:.1%} | {r['bytes_without_result']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=4000, help="COMPLETED records per store (4000)")
    parser.add_argument("--stores", type=choice_list(KINDS), default=["redis", "postgresql"], help="(redis,postgresql)")
    parser.add_argument("--redis-url", help=f"an external Redis instead of a private redis-server (e.g. {REDIS_URL})")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.records < 1:
        parser.error("--records must be at least 1")
    machine = Machine()
    prefix = f"rb{uuid.uuid4().hex[:10]}"
    details: dict[str, Any] = {}
    for kind in args.stores:
        log(f"{kind}: writing {args.records} records")
        if kind == "redis":
            server = None if args.redis_url else PrivateRedis()
            try:
                url = args.redis_url or f"{server.url}/0"  # type: ignore[union-attr]
                details[kind] = measure_redis(url, prefix, args.records, private=server is not None)
            finally:
                if server is not None:
                    server.stop()
        elif kind == "postgresql":
            details[kind] = measure_sql(kind, POSTGRES_URL, prefix, args.records)
        else:
            with tempfile.TemporaryDirectory(prefix="celery-idem-rb-") as workdir:
                url = f"sqlite:///{os.path.join(workdir, 'records.db')}"
                details[kind] = measure_sql(kind, url, prefix, args.records)
        log(f"  {details[kind]['write_seconds']:.1f} s")
    machine.finish()
    rows = [r for kind in args.stores for r in details[kind]["rows"]]
    print(table(rows, args.records))
    if "redis" in details:
        d = details["redis"]
        print(
            f"\nRedis: MEMORY USAGE summed over the {sum(d['keys_by_type'].values()):,} keys the calls added "
            f"({d['keys_by_type']}): {d['memory_usage_sum']:,} bytes; a record's encoding: {d['encoding']}"
        )
    print(f"\n{machine.summary()}")
    if args.json:
        write_json(args.json, {"meta": machine.meta(records=args.records), "rows": rows, "details": details})
    return 0


if __name__ == "__main__":
    sys.exit(main())
