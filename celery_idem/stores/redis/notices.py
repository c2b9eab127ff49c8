"""Notices: how a waiting handle hears that a record settled, was freed or was removed.

The scripts that do so ``PUBLISH`` an empty message on the channel named by the record key
(``lua/_prelude.lua``); :func:`watch` subscribes there. A notice is only a hint to read the record
again. Each subscription holds a connection of the store's pool while its handle waits, so a store
lends at most ``WATCHES`` of them at once (half of a bounded pool); a waiter without one polls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..spi import Wait

__all__ = ["WATCHES", "slots", "watch"]

logger = logging.getLogger("celery_idem.store")

WATCHES = 32
"""At most this many waiting handles of one store subscribe at once (each holds a connection of the
store's pool while it waits); more wait by polling. A bounded pool (``?max_connections=N``) lends
at most half of its connections to them."""


def slots(client: Any) -> threading.BoundedSemaphore:
    """The subscriptions a store on ``client`` lends its waiting handles."""
    bound = getattr(getattr(client, "connection_pool", None), "max_connections", None)
    return threading.BoundedSemaphore(min(WATCHES, bound // 2) if isinstance(bound, int) else WATCHES)


@contextmanager
def watch(client: Any, channel: str, free: threading.BoundedSemaphore, what: object) -> Iterator[Wait]:
    """A :class:`~celery_idem.stores.spi.Wait` woken by a message on ``channel``. A subscription
    that fails, or breaks while waiting, or finds no slot in ``free`` turns the waits into sleeps
    (``notices`` False: the waiter polls). The slot and the connection are given back however the
    watch ends, a ``BaseException`` included (gevent's and eventlet's timeouts are one)."""
    pubsub: Any = None
    slot = False
    holder = Wait(time.sleep, notices=False)

    def wait(seconds: float) -> None:
        nonlocal pubsub
        if pubsub is None:
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        try:
            # The subscription's confirmation comes first and reads as None: wait on past it.
            while pubsub.get_message(timeout=max(deadline - time.monotonic(), 0.0)) is None:
                if time.monotonic() >= deadline:
                    return
        except Exception as exc:  # noqa: BLE001 - a notice is a hint: the waiter polls from here on
            logger.debug("notices for %s broke (%s): polling", what, exc)
            _close_quietly(pubsub)
            pubsub = None
            holder.notices = False
            time.sleep(max(deadline - time.monotonic(), 0.0))

    try:
        slot = free.acquire(blocking=False)
        if slot:
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel)
                holder = Wait(wait, notices=True)
            except Exception as exc:  # noqa: BLE001 - as above: without a notice the waiter polls
                logger.debug("no notices for %s (%s): polling", what, exc)
                _close_quietly(pubsub)
                pubsub = None
        yield holder
    finally:
        _close_quietly(pubsub)
        if slot:
            free.release()


def _close_quietly(pubsub: Any) -> None:
    if pubsub is not None:
        try:
            pubsub.close()
        except Exception:  # noqa: BLE001, S110 - the connection is dropped either way
            pass
