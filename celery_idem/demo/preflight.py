"""What the demo needs, checked before it starts anything: a missing extra or a server that cannot be
reached is one line that says which, not a worker's tracebacks."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from celery import Celery
from kombu.connection import Connection
from kombu.utils.url import maybe_sanitize_url

from ..errors import ConfigurationError, StoreUnavailableError
from ..stores import store_from_url

__all__ = ["problem", "shown"]

#: How long a server may take to answer the check.
CHECK_SECONDS = 10.0

SQL_EXTRA = (
    "the demo needs celery-idem[sql]: its payments and ledger are a SQLite file, and so is its default "
    "store (pip install 'celery-idem[sql]')"
)


def problem(*, broker: str | None, backend: str | None, store: str | None) -> str | None:
    """Why the demo cannot run with this wiring, in one line; None when it can. ``None`` URLs are the
    embedded defaults (files in the work directory), which need only the ``sql`` extra."""
    try:
        import sqlalchemy  # noqa: F401 - only whether it is installed
    except ImportError:
        return SQL_EXTRA
    checks: list[tuple[str, str | None, Callable[[str], None]]] = [
        ("store", store, _store),
        ("broker", broker, _broker),
        ("result backend", backend, _backend),
    ]
    for what, url, check in checks:
        if url is None:
            continue
        if url.partition("://")[0].lower() in IN_ONE_PROCESS:
            return (
                f"the {what} {shown(url)} lives inside one process, and the demo's worker is another: "
                f"leave --{what.split()[-1]} out for the embedded one, or name a server"
            )
        if (reason := _within(CHECK_SECONDS, check, url)) is not None:
            return f"cannot use the {what} at {shown(url)}: {reason}"
    return None


#: URL schemes of stores, brokers and backends that a second process cannot reach.
IN_ONE_PROCESS = ("memory", "cache+memory", "cache")


def shown(url: str) -> str:
    """A URL as the demo prints it: its password masked (and no traceback for one that cannot be read)."""
    try:
        return str(maybe_sanitize_url(url))
    except Exception:  # noqa: BLE001 - a URL kombu cannot parse (a port that is no number)
        scheme, _, rest = url.partition("://")
        return f"{scheme}://**@{rest.rpartition('@')[2]}" if "@" in rest else url


def _within(seconds: float, check: Callable[[str], None], url: str) -> str | None:
    """Run ``check(url)`` on a thread of its own: the reason it failed, or None. A server that neither
    answers nor refuses (a dropped packet, a firewall) is not waited for longer than ``seconds``."""
    failure: list[str] = []

    def run() -> None:
        try:
            check(url)
        except ConfigurationError as exc:
            failure.append(_one_line(str(exc)))
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is why the demo cannot run
            failure.append(_reason(exc))

    thread = threading.Thread(target=run, name="celery-idem-demo-check", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return f"no answer within {seconds:g} s"
    return failure[0] if failure else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, StoreUnavailableError) and exc.__cause__ is not None:
        exc = exc.__cause__  # what the server said, not the store's account of its call
    return f"{type(exc).__name__}: {_one_line(str(exc))}"


def _one_line(text: str) -> str:
    """A message on one line, without SQLAlchemy's link to its error page, at most 300 characters."""
    text = re.sub(r"\(Background on this error at: [^)]*\)", "", text)
    return " ".join(text.split())[:300] or "no message"


def _store(url: str) -> None:
    store = store_from_url(url, key_prefix="celery-idem-demo-check", timeout_seconds=5)
    try:
        store.ping()
    finally:
        store.close()


def _broker(url: str) -> None:
    with Connection(url, connect_timeout=5) as connection:  # type: ignore[no-untyped-call]
        connection.ensure_connection(max_retries=1)
        # A virtual transport (Redis) connects on its first channel.
        connection.default_channel  # noqa: B018 - the attribute opens it


def _backend(url: str) -> None:
    app = Celery("celery-idem-demo-check", backend=url, set_as_current=False)
    app.conf.update(redis_socket_connect_timeout=5, redis_socket_timeout=5, result_backend_always_retry=False)
    try:
        app.backend.get_task_meta("celery-idem-demo-check")
    finally:
        app.close()
