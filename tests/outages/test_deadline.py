"""The SQL store's client-side deadline (stores/deadline.py): a call blocked on a socket whose server
went silent is cut off at its own deadline, whatever other calls are waiting meanwhile."""

from __future__ import annotations

import socket
import threading
import time

from celery_idem.stores.deadline import Watchdog


def blocked_read(watchdog: Watchdog, seconds: float, outcome: list[float]) -> tuple[socket.socket, threading.Thread]:
    """A thread that reads from a socket nobody writes to, under ``seconds``; ``outcome`` gets how
    long its read blocked. Returns the silent peer (kept open) and the thread."""
    mine, peer = socket.socketpair()

    def read() -> None:
        started = time.monotonic()
        with watchdog.guard(mine.fileno(), seconds):
            try:
                mine.recv(1)
            except OSError:
                pass
        outcome.append(time.monotonic() - started)
        mine.close()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return peer, thread


def test_a_read_on_a_silent_socket_is_cut_off_at_its_deadline() -> None:
    watchdog, outcome = Watchdog(), []
    peer, thread = blocked_read(watchdog, 0.3, outcome)
    thread.join(timeout=10)
    assert outcome and outcome[0] >= 0.3, outcome
    peer.close()


def test_a_short_deadline_is_kept_while_the_watchdog_waits_for_a_long_one() -> None:
    # Given a call under a long deadline, which the watchdog sleeps toward
    watchdog, long_outcome, short_outcome = Watchdog(), [], []
    long_peer, long_thread = blocked_read(watchdog, 30.0, long_outcome)
    time.sleep(0.2)
    # When a call under a short deadline blocks meanwhile
    short_peer, short_thread = blocked_read(watchdog, 0.3, short_outcome)
    short_thread.join(timeout=10)
    # Then it is cut off at its own deadline, and the long one is still waiting
    assert short_outcome and short_outcome[0] >= 0.3, short_outcome
    assert not long_outcome and long_thread.is_alive()
    long_peer.close()  # the long read returns (end of stream)
    long_thread.join(timeout=10)
    short_peer.close()


def test_calls_that_end_in_time_leave_later_deadlines_kept() -> None:
    # Given many calls that end at once, then one that blocks (a steady stream, then a silent server)
    watchdog, outcome = Watchdog(), []
    for _ in range(200):
        a, b = socket.socketpair()
        with watchdog.guard(a.fileno(), 0.3):
            pass
        a.close()
        b.close()
    peer, thread = blocked_read(watchdog, 0.3, outcome)
    thread.join(timeout=10)
    assert outcome and outcome[0] >= 0.3, outcome
    peer.close()
