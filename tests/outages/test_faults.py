"""Fault injection at every store call (tests/faults.py), through a real worker where one is involved.

Every cell of (call site, fault kind, on_store_error) checks, with the side effect counted outside the
library (an INCR in the task body; rows of a business table for the ledger task):

(a) the effect happened at most once (exactly once where the call succeeds, or with the ledger);
(b) the caller saw the outcome or a documented error within a bounded ``get`` (never a hang);
(c) once the store is healthy again, one reconciler run leaves no record PENDING or IN_PROGRESS.

The reconciler of (c) runs "later": on a second store over the same data whose injected clock is
ahead by more than any lease of these tasks, so no test waits for a lease to run out.

Cells: claim (producer), acquire, renew (heartbeat), complete, fail, release by owner token (a
Celery retry) and release by task id (the task_revoked hook) through one in-process worker per
on_store_error value on Redis, and a ledger task there; the reconciler's writes directly; every fault
kind (the SQL ones too) on every store operation directly on Redis, SQLite and PostgreSQL. The
worker cells with a PostgreSQL store and the SQL fault kinds are in test_faults_sql.py.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from addresses import REDIS_BACKEND_URL, REDIS_BROKER_URL
from celery import signals
from celery.contrib.testing.worker import start_worker
from celery.exceptions import TaskRevokedError
from conftest import REDIS_URL, require_server
from faults import REDIS_FAULTS, SQL_FAULTS, Fault, Injector, Plan
from shop import COUNTER_URL, effects_key, make_app, payments_table
from workers import execute_as_worker

from celery_idem import Idempotency, IdempotentTask, PermanentError, State, StoreUnavailableError
from celery_idem.reconciler import Reconciler
from celery_idem.records import Identity
from celery_idem.stores import RedisStore, SQLStore, Store

BROKER = REDIS_BROKER_URL
BACKEND = REDIS_BACKEND_URL
GET = 20  # seconds a caller waits for an outcome: a bound, not a benchmark
LEASE = 0.9  # seconds: the heartbeat renews every 0.3 s
LATER = 7200  # seconds the "later" reconciler's clock is ahead: past every lease and PENDING timeout
UNSETTLED = (State.PENDING, State.IN_PROGRESS)


# ---- the cells ---------------------------------------------------------------------------------------

# site -> (store method the fault hits, does on_store_error decide what happens there)
SITES = {
    "claim": ("claim", True),
    "acquire": ("acquire", True),
    "renew": ("renew", False),
    "complete": ("complete", False),
    "fail": ("fail", False),
    "release_owner": ("release", False),
    "release_task_id": ("release", False),
}


@dataclass(frozen=True)
class Cell:
    site: str
    fault: Fault
    on_store_error: str

    @property
    def method(self) -> str:
        return SITES[self.site][0]

    def __str__(self) -> str:
        # Lost replies are named as what they are: the store ran the call, the caller never heard.
        fault = "ran_but_reply_lost" if self.fault is Fault.LOST_REPLY else self.fault.value
        return f"{self.site}-{fault}-{self.on_store_error}"


def cells(sites: Any, faults: Any, modes: Any = ("raise", "proceed")) -> list[Any]:
    """Every (site, fault, mode) where the mode matters; elsewhere only the default, "raise"."""
    out = []
    for mode in modes:  # outermost: the cells of one worker run together, so it starts once
        for site in sites:
            if mode == "raise" or SITES[site][1]:
                for fault in faults:
                    cell = Cell(site, fault, mode)
                    out.append(pytest.param(cell, id=str(cell)))
    return out


# ---- one worker per on_store_error, on Redis -----------------------------------------------------------


@dataclass
class World:
    app: Any
    idem: Idempotency
    store: Store
    faults: Injector
    prefix: str
    counter: redis.Redis
    published: list[str]
    later: Store  # the same data, read by a clock LATER seconds ahead
    later_faults: Injector | None = None
    payments: sa.Table | None = None
    ledger_engine: sa.Engine | None = None

    def task(self, name: str) -> Any:
        return self.app.tasks[name]

    def effects(self, task: str, key: str) -> int:
        return int(self.counter.get(effects_key(self.prefix, task, key)) or 0)

    def payments_for(self, order_id: int) -> int:
        assert self.payments is not None and self.ledger_engine is not None
        with self.ledger_engine.connect() as connection:
            query = sa.select(sa.func.count()).select_from(self.payments).where(self.payments.c.order_id == order_id)
            return int(connection.execute(query).scalar_one())

    def reconcile_later(self) -> Any:
        """One reconciler run at a time past every lease (the store is healthy)."""
        reconciler = Reconciler(self.idem)
        reconciler.store = self.later
        return reconciler.run()

    def unsettled(self, task: str, key: str) -> State | None:
        record = self.store.get(Identity("", task, key))
        return record.state if record is not None and record.state in UNSETTLED else None


def _register_tasks(app: Any, prefix: str, counter: redis.Redis) -> None:
    task = functools.partial(app.task, shared=False, base=IdempotentTask, bind=True)
    policy = {"lease_seconds": LEASE, "pending_timeout_seconds": 60}

    def effect(self: Any) -> None:
        counter.incr(effects_key(prefix, self.name, self.request.idempotency_key))

    @task(name="faults.work", idempotency=policy)
    def work(self: Any, order_id: int, hold: float = 0.0) -> dict[str, Any]:
        time.sleep(hold)
        effect(self)
        return {"order": order_id, "task_id": self.request.id}

    @task(name="faults.declined", idempotency=policy)
    def declined(self: Any, order_id: int) -> None:
        effect(self)
        raise PermanentError(f"card declined for order {order_id}")

    @task(
        name="faults.retried",
        idempotency=policy,
        autoretry_for=(ConnectionError,),
        max_retries=2,
        default_retry_delay=0,
    )
    def retried(self: Any, order_id: int) -> dict[str, Any]:
        if self.request.retries == 0:
            raise ConnectionError("payment provider unreachable")  # before the effect: a Celery retry
        effect(self)
        return {"order": order_id, "retries": self.request.retries}


def _world(app: Any, store: Store, later: Store, prefix: str, injector: Injector) -> Iterator[World]:
    counter = redis.Redis.from_url(COUNTER_URL)
    _register_tasks(app, prefix, counter)
    published: list[str] = []

    def sent(sender: Any = None, headers: Any = None, **_: Any) -> None:
        published.append(headers["id"])

    signals.before_task_publish.connect(sent, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=20):
            yield World(app, Idempotency.of(app), store, injector, prefix, counter, published, later)
    finally:
        signals.before_task_publish.disconnect(sent)


def _redis_world(mode: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    require_server("redis")
    prefix = f"f{uuid.uuid4().hex[:10]}"
    store = RedisStore.from_url(REDIS_URL, key_prefix=prefix)
    skew = store.now() - time.time()  # leases are the server's time: "later" is later than the server
    later = RedisStore(store.client, key_prefix=prefix, clock=lambda: time.time() + skew + LATER)
    injector = Injector(store)
    ledger_url = f"sqlite:///{tmp_path_factory.mktemp('ledger')}/ledger.db"
    app = make_app(
        broker=BROKER,
        backend=BACKEND,
        store=store,
        prefix=prefix,
        queue=prefix,
        ledger_url=ledger_url,
        on_store_error=mode,
        inspect_timeout_seconds=0.5,
    )
    ledger = Idempotency.of(app).settings.ledger
    ledger.create_schema()
    payments = payments_table(prefix)
    payments.create(ledger.engine)
    for world in _world(app, store, later, prefix, injector):
        world.payments, world.ledger_engine = payments, ledger.engine
        world.later_faults = Injector(later)
        yield world
    wipe_redis(store)


@pytest.fixture(scope="module")
def raise_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A worker with on_store_error="raise" (the default)."""
    yield from _redis_world("raise", tmp_path_factory)


def wipe_redis(store: RedisStore) -> None:
    keys = list(store.client.scan_iter(match=f"{{{store.key_prefix}:*", count=1000))
    if keys:
        store.client.delete(*keys)
    store.close()


@pytest.fixture
def key() -> str:
    return f"k-{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def _no_leftover_plans(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("raise_world",):
        if name in request.fixturenames:
            request.getfixturevalue(name).faults.clear()


def _call(task: Any, args: tuple[Any, ...], key: str) -> tuple[Any, Any]:
    """(result, what the caller saw): the outcome, a documented error, or StoreUnavailableError at
    publish (result None). A get past GET seconds fails the test: that is a hang."""
    try:
        result = task.apply_async(args, idempotency_key=key)
    except StoreUnavailableError as exc:
        assert exc.key == key
        return None, exc
    try:
        return result, result.get(timeout=GET)
    except (PermanentError, TaskRevokedError) as exc:
        return result, exc


def _drive(world: World, cell: Cell, key: str) -> None:
    """The whole life of one cell: call (and call again if the caller was refused), then check (a)-(c)."""
    assert cell.on_store_error == world.idem.settings.on_store_error
    plan = world.faults.arm(Plan(cell.method, cell.fault, key=key))
    name, args, expected_effects = {
        "fail": ("faults.declined", (1,), 1),
        "release_owner": ("faults.retried", (1,), 1),
        "renew": ("faults.work", (1, LEASE * 0.7), 1),
    }.get(cell.site, ("faults.work", (1,), 1))
    task = world.task(name)

    if cell.site == "release_task_id":
        _drive_revoked(world, task, key, plan)
        return

    result, seen = _call(task, args, key)
    # (b) the caller saw a clear error or the outcome
    if cell.site == "claim" and cell.on_store_error == "raise":
        assert isinstance(seen, StoreUnavailableError), seen
        # The caller retries the same call: it runs, under a task id a message carries.
        result, seen = _call(task, args, key)
    assert result is not None
    assert result.id in world.published, "the caller holds a task id no message carries"
    if cell.site == "fail":
        assert isinstance(seen, PermanentError)
    else:
        assert isinstance(seen, dict) and seen["order"] == 1, seen
    assert plan.fired == 1, f"the fault never fired ({plan})"
    # (a) once
    assert world.effects(name, key) == expected_effects
    # (c) nothing stuck after one reconciler run, with the store healthy again
    world.reconcile_later()
    assert world.unsettled(name, key) is None
    # and a later duplicate never runs the body again
    again, seen_again = _call(task, args, key)
    assert again is not None and again.deduplicated
    assert world.effects(name, key) == expected_effects


def _drive_revoked(world: World, task: Any, key: str, plan: Plan) -> None:
    """The task_revoked hook releases by task id: a message revoked before it runs."""
    from celery.worker import state

    task_id = str(uuid.uuid4())
    state.revoked.add(task_id)  # what the revoke command does in the (in-process) worker, without a broadcast
    result = task.apply_async((1,), idempotency_key=key, task_id=task_id)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=GET)
    _until(lambda: plan.fired == 1)
    assert world.effects(task.name, key) == 0
    world.reconcile_later()
    assert world.unsettled(task.name, key) is None
    # the key is free again: a new call runs once
    result, seen = _call(task, (1,), key)
    assert isinstance(seen, dict) and world.effects(task.name, key) == 1


def _until(predicate: Any, seconds: float = GET) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.mark.parametrize("cell", cells(SITES, REDIS_FAULTS, ("raise",)))
def test_a_fault_at_a_store_call_never_doubles_loses_or_hangs(raise_world: World, cell: Cell, key: str) -> None:
    _drive(raise_world, cell, key)


# ---- the ledger: exactly once ------------------------------------------------------------------------

LEDGER_CELLS = [
    pytest.param(site, fault, id=str(Cell(site, fault, "raise")))
    for site in ("claim", "acquire", "complete")
    for fault in (Fault.REFUSED, Fault.LOST_REPLY, Fault.UNEXPECTED)
]


@pytest.mark.parametrize(("site", "fault"), LEDGER_CELLS)
def test_a_fault_around_a_ledger_task_leaves_exactly_one_payment(
    raise_world: World, site: str, fault: Fault, key: str
) -> None:
    world = raise_world
    plan = world.faults.arm(Plan(SITES[site][0], fault, key=key))
    order = int(uuid.uuid4().int % 1_000_000_000)
    pay = world.task("shop.pay")
    result, seen = _call(pay, (order, 100), key)
    if site == "claim":
        assert isinstance(seen, StoreUnavailableError)
        result, seen = _call(pay, (order, 100), key)  # the caller retries
    assert seen == {"paid": 100, "order": order}
    assert plan.fired == 1
    # exactly once, in the business database and in the body's own count
    assert world.payments_for(order) == 1
    assert world.effects("shop.pay", key) == 1
    world.reconcile_later()
    assert world.unsettled("shop.pay", key) is None


# ---- every fault kind on every store operation, directly: the store's own mapping ---------------------

OPERATIONS = ("claim", "acquire", "renew", "complete", "fail", "release", "get")


# On MySQL/MariaDB a serialization failure is InnoDB's deadlock, which the store runs again: one is
# no outage there (test_a_deadlock_at_every_store_operation_is_run_again_then_an_outage).
MYSQL_FAULTS = tuple(f for f in SQL_FAULTS if f is not Fault.SERIALIZATION)


def _stores() -> list[Any]:
    return [
        pytest.param(kind, fault, id=f"{kind}-{fault.value}")
        for kind, faults in (
            ("redis", REDIS_FAULTS),
            ("sqlite", SQL_FAULTS),
            ("postgresql", SQL_FAULTS),
            ("mariadb", MYSQL_FAULTS),
        )
        for fault in faults
    ]


@pytest.mark.parametrize(("kind", "fault"), _stores())
def test_every_fault_at_every_store_operation_is_store_unavailable(
    kind: str, fault: Fault, tmp_path: Any, prefix: str
) -> None:
    from conftest import make_store, wipe

    from celery_idem.errors import StoreUnavailableError as Unavailable
    from celery_idem.records import ErrorInfo

    store = make_store(kind, tmp_path, prefix)
    if isinstance(store, SQLStore):
        store.create_schema()
    faults = Injector(store)
    try:
        for operation in OPERATIONS:
            identity = Identity("", "faults.direct", f"{operation}-{uuid.uuid4().hex[:8]}")
            taken = store.acquire(identity, "fp", "t1", lease_seconds=30, ttl_seconds=60)
            assert taken.record is not None
            owner = taken.record.owner
            call = {
                "claim": lambda i=identity: store.claim(
                    Identity("", i.task_name, i.key + "c"), "fp", "t2", pending_seconds=30, ttl_seconds=60
                ),
                "acquire": lambda i=identity: store.acquire(
                    Identity("", i.task_name, i.key + "a"), "fp", "t3", lease_seconds=30, ttl_seconds=60
                ),
                "renew": lambda i=identity, o=owner: store.renew(i, o, lease_seconds=30),
                "complete": lambda i=identity, o=owner: store.complete(i, o, b"1"),
                "fail": lambda i=identity, o=owner: store.fail(i, o, ErrorInfo.from_exception(ValueError("x"))),
                "release": lambda i=identity, o=owner: store.release(i, o),
                "get": lambda i=identity: store.get(i),
            }[operation]
            plan = faults.arm(Plan(operation, fault))
            with pytest.raises(Unavailable) as caught:
                call()
            assert plan.fired == 1 and caught.value.__cause__ is not None
            faults.clear()
            if fault is Fault.LOST_REPLY and operation in ("complete", "fail", "release"):
                # the server ran it: the record moved although the caller heard nothing
                after = store.get(identity)
                assert after is None or after.state.settled
            else:
                assert call() is not None  # healthy again: the next call answers
    finally:
        faults.clear()
        wipe(store)


@pytest.mark.parametrize("kind", ["mariadb", "django-mariadb"])
def test_a_deadlock_at_every_store_operation_is_run_again_then_an_outage(kind: str, tmp_path: Any, prefix: str) -> None:
    from conftest import make_store, wipe

    from celery_idem.records import ErrorInfo

    store = make_store(kind, tmp_path, prefix)
    assert isinstance(store, SQLStore)
    store.create_schema()
    faults = Injector(store)
    try:
        for operation in OPERATIONS:
            identity = Identity("", "faults.deadlock", f"{operation}-{uuid.uuid4().hex[:8]}")
            taken = store.acquire(identity, "fp", "t1", lease_seconds=30, ttl_seconds=60)
            assert taken.record is not None
            owner = taken.record.owner
            call = {
                "claim": lambda i=identity: store.claim(
                    Identity("", i.task_name, i.key + "c"), "fp", "t2", pending_seconds=30, ttl_seconds=60
                ),
                "acquire": lambda i=identity: store.acquire(
                    Identity("", i.task_name, i.key + "a"), "fp", "t3", lease_seconds=30, ttl_seconds=60
                ),
                "renew": lambda i=identity, o=owner: store.renew(i, o, lease_seconds=30),
                "complete": lambda i=identity, o=owner: store.complete(i, o, b"1"),
                "fail": lambda i=identity, o=owner: store.fail(i, o, ErrorInfo.from_exception(ValueError("x"))),
                "release": lambda i=identity, o=owner: store.release(i, o),
                "get": lambda i=identity: store.get(i),
            }[operation]
            # Given InnoDB picks this call as a deadlock's victim (it rolled all of it back) once
            plan = faults.arm(Plan(operation, Fault.SERIALIZATION))
            # Then the store runs it again, and the call answers as without the deadlock
            answer = call()
            assert plan.fired == 1 and answer is not None
            if operation in ("claim", "acquire"):
                assert answer.decision.value in ("NEW", "RUN")
            elif operation != "get":
                assert answer.ok
            faults.clear()
            # Given it is the victim on every try: an outage, never an answer
            again = Identity("", identity.task_name, identity.key + "x")
            with pytest.raises(StoreUnavailableError):
                _deadlocked_every_try(store, again)
            assert store.get(again) is None
    finally:
        faults.clear()
        wipe(store)


def _deadlocked_every_try(store: SQLStore, identity: Identity) -> None:
    """A claim whose every statement InnoDB rolls back as a deadlock's victim."""
    import pymysql

    def deadlock(*_: Any) -> None:
        raise pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock; try restarting transaction")

    sa.event.listen(store.engine, "before_cursor_execute", deadlock)
    try:
        store.claim(identity, "fp", "t9", pending_seconds=30, ttl_seconds=60)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", deadlock)


# ---- the reconciler's writes ----------------------------------------------------------------------------


RECONCILER_CELLS = [pytest.param("complete", fault, id=f"complete-{fault.value}") for fault in REDIS_FAULTS] + [
    # a release waits for inspect replies (0.5 s a run): the kinds that take different paths only
    pytest.param("release", fault, id=f"release-{fault.value}")
    for fault in (Fault.REFUSED, Fault.LOST_REPLY, Fault.BUSY, Fault.UNEXPECTED)
]


@pytest.mark.parametrize(("write", "fault"), RECONCILER_CELLS)
def test_a_fault_at_a_reconciler_write_never_stops_the_run_nor_sticks(
    raise_world: World, write: str, fault: Fault
) -> None:
    world = raise_world
    # Given two stale records of dead attempts: one whose backend holds SUCCESS, one with no evidence
    records = []
    for n in range(2):
        key, task_id = f"rk-{uuid.uuid4().hex}", str(uuid.uuid4())
        identity = Identity("", "faults.work", key)
        taken = world.store.acquire(identity, "fp", task_id, lease_seconds=LEASE, ttl_seconds=86400)
        assert taken.record is not None
        if write == "complete":
            world.app.backend.store_result(task_id, {"order": n}, "SUCCESS")
        records.append(identity)
    assert world.later_faults is not None
    plan = world.later_faults.arm(Plan(write, fault, key=records[0].key))
    # When one reconciler run's write of the first fails
    report = world.reconcile_later()
    # Then the run ends with a report, the second record is settled in that same run
    assert plan.fired == 1
    assert world.unsettled("faults.work", records[1].key) is None
    assert report.scanned >= 2
    # and one more run, with the store healthy, leaves nothing PENDING or IN_PROGRESS
    world.reconcile_later()
    assert all(world.unsettled("faults.work", identity.key) is None for identity in records)
    world.later_faults.clear()


def test_a_worker_process_installs_faults_from_its_environment(prefix: str) -> None:
    from faults import FAULTS_ENV, install_from_env

    require_server("redis")
    store = RedisStore.from_url(REDIS_URL, key_prefix=prefix)
    try:
        injector = install_from_env(store, {FAULTS_ENV: '[{"method": "get", "fault": "busy"}]'})
        assert injector is not None
        with pytest.raises(StoreUnavailableError, match="BUSY"):
            store.get(Identity("", "faults.env", "k"))
        assert store.get(Identity("", "faults.env", "k")) is None
    finally:
        wipe_redis(store)


# ---- a lost reply's give-back is bounded like every claim ------------------------------------------


def test_an_acquire_whose_reply_was_lost_gives_the_record_back_no_longer_than_its_message_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datetime

    from celery import Celery
    from celery import Task as CeleryTask

    from celery_idem import MemoryStore

    store = MemoryStore()
    app = Celery("lost-acquire-expiry", set_as_current=False, broker="memory://")
    Idempotency(app, store=store)

    @app.task(base=IdempotentTask, shared=False)
    def echo(x: int) -> int:
        return x

    real = store._acquire

    def reply_lost(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # applied on the server, then its reply is lost
        raise ConnectionError("connection reset while reading the reply")

    monkeypatch.setattr(store, "_acquire", reply_lost)
    republished: list[Any] = []
    monkeypatch.setattr(CeleryTask, "apply_async", lambda task, *a, **k: republished.append(task.request.expires))
    app.finalize()
    # Given a message that expires in 10 s, executed as a worker executes it
    expires = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=10)).isoformat()
    execute_as_worker(app, echo.name, "t-exp", expires=expires, idempotency_key="k")
    # Then the message went back to the broker, and the record it was given back as (PENDING) does
    # not outlive it by more than the grace: RabbitMQ drops an expired message without telling anyone
    assert republished and republished[0]
    record = store.get(Identity("", echo.name, "k"))
    assert record is not None and record.state is State.PENDING
    assert record.lease_expires_at is not None and record.lease_expires_at - time.time() <= 10 + 5 + 1


@pytest.mark.parametrize("waits", [0, 7, 8])
def test_a_store_error_no_outage_mapping_knows_goes_back_to_the_broker_only_so_often(
    waits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Celery
    from celery import Task as CeleryTask

    from celery_idem import MemoryStore
    from celery_idem.protocol import OUTAGE_HEADER, SURPRISES_HEADER

    store = MemoryStore()
    app = Celery("poison-acquire", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=store)
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        runs.append(x)
        return x

    def refused(*args: Any, **kwargs: Any) -> Any:  # as a database refuses a value, every time
        raise ValueError("value too long for type character varying(255)")

    monkeypatch.setattr(store, "_acquire", refused)
    republished: list[Any] = []
    monkeypatch.setattr(CeleryTask, "apply_async", lambda task, *a, **k: republished.append(k.get("headers")))
    app.finalize()
    # Given a message that already went back to the broker ``waits`` times for this error (and more
    # often for a real outage before it)
    execute_as_worker(
        app, charge.name, f"t-{waits}", idempotency_key="k", **{OUTAGE_HEADER: 50, SURPRISES_HEADER: waits}
    )
    meta = app.backend.get_task_meta(f"t-{waits}")
    assert runs == []
    if waits < 8:
        # Then it goes back once more: an unknown error may still pass (fail closed, never lost)
        assert len(republished) == 1 and republished[0][SURPRISES_HEADER] == waits + 1
        assert republished[0][OUTAGE_HEADER] == 51  # a real outage's trips (50 here) never count
    else:
        # Then, after about 90 s of trips, the message fails with the error instead of looping forever
        assert republished == [] and meta["status"] == "FAILURE"
        assert isinstance(meta["result"], StoreUnavailableError) and "unexpected ValueError" in str(meta["result"])
    # and the claim under this task id, which no message will carry now, is given back (not kept an hour)
    if waits >= 8:
        assert store.get(Identity("", charge.name, "k")) is None


def test_a_real_outage_keeps_sending_the_message_back_however_long_it_lasts(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery
    from celery import Task as CeleryTask

    from celery_idem.protocol import OUTAGE_HEADER
    from celery_idem.stores import store_from_url

    down = store_from_url("redis://127.0.0.1:1/0", timeout_seconds=0.5)  # nothing listens: refused
    app = Celery("long-outage", set_as_current=False, broker="memory://", backend="cache+memory://")
    Idempotency(app, store=down)

    @app.task(base=IdempotentTask, shared=False)
    def charge(x: int) -> int:
        return x

    republished: list[Any] = []
    monkeypatch.setattr(CeleryTask, "apply_async", lambda task, *a, **k: republished.append(k.get("headers")))
    app.finalize()
    execute_as_worker(app, charge.name, "t-long", idempotency_key="k", **{OUTAGE_HEADER: 50})
    assert len(republished) == 1 and republished[0][OUTAGE_HEADER] == 51  # fail closed, never lost


# Trip counts far past any real outage (2**80 trips of 30 s outlast the universe), and headers a
# producer mangled: each reads as a sane count, and the message goes back with a bounded countdown.
_TRIP_HEADERS = {
    "million": (10**6, 30.0),
    "two_to_the_80": (2**80, 30.0),
    "not_a_number": ("abc", 1.0),
    "negative": (-3, 1.0),
    "fractional": (1.5, 2.0),
    "null": (None, 1.0),
}


def test_a_message_back_from_any_number_of_outage_trips_goes_back_again_and_never_fails(
    tmp_path: Any, prefix: str
) -> None:
    from celery import Celery
    from workers import Worker, wait_for

    from celery_idem.protocol import OUTAGE_HEADER, SURPRISES_HEADER

    # Given a real worker whose store is unreachable (nothing listens on port 1: refused)
    worker = Worker(tmp_path, BROKER, "redis://127.0.0.1:1/0", prefix, pool="solo", concurrency=1)
    producer = Celery("plain-producer", broker=BROKER, backend=BACKEND, set_as_current=False)
    try:
        # When messages arrive whose trip headers say they went back that often (or say nonsense)
        sent = {
            name: producer.send_task(
                "shop.charge",
                (1, 10),
                queue=prefix,
                headers={"idempotency_key": f"{prefix}-{name}", OUTAGE_HEADER: value, SURPRISES_HEADER: value},
            )
            for name, (value, _) in _TRIP_HEADERS.items()
        }

        def trips_of(task_id: str) -> list[str]:
            return [line for line in worker.output().splitlines() if task_id in line and "back to the broker" in line]

        for name, (_, delay) in _TRIP_HEADERS.items():
            task_id = sent[name].id
            # Then each goes back to the broker (received again under its id) after a countdown
            # the backoff bounds: the capped 30 s for the long outages, the first steps for the rest
            wait_for(lambda: trips_of(task_id), f"{name}: back to the broker", 60)  # noqa: B023
            assert f"back to the broker in {delay:g}s" in trips_of(task_id)[0], (name, trips_of(task_id))
            received = f"Task shop.charge[{task_id}] received"
            wait_for(lambda: worker.output().count(received) >= 2, f"{name}: received again", 60)  # noqa: B023
        # and none of them failed: the calls are kept, not consumed as failures
        for name, result in sent.items():
            assert result.state != "FAILURE", (name, result.result)
        assert "Traceback" not in worker.output()
    finally:
        worker.stop()
        for result in sent.values():
            result.forget()


@pytest.mark.parametrize(
    "value",
    [None, -3, 1.5, "abc", "²", "12", 10**6, 2**80, float("inf"), float("nan"), True, [1], b"3", "9" * 40, -1e308],
)
def test_any_trip_header_reads_as_a_bounded_count_and_a_capped_countdown(value: Any) -> None:
    from types import SimpleNamespace

    from celery_idem import outage

    # Given a message whose trip header holds anything a producer can put there
    request = SimpleNamespace(headers={"idempotency_store_waits": value}, properties={})
    # Then it reads as a count in [0, MAX_TRIPS], and the next countdown is in the backoff's range
    trips = outage.trips(request, "idempotency_store_waits")
    assert 0 <= trips <= outage.MAX_TRIPS
    assert outage.FIRST_DELAY_SECONDS <= outage.countdown(trips) <= outage.MAX_DELAY_SECONDS
