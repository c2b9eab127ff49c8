"""A TCP proxy for the chaos tests: put it between a client and a server to slow the link down or
cut it.

``delay`` holds every chunk that goes either way for that many seconds, so a request-reply round
trip takes at least twice as long. ``cut(seconds)`` closes every open connection and refuses new
ones (accepted, then closed at once) until the time is up: what a client sees when a link drops.
``mute(seconds)`` lets requests through but drops the server's replies meanwhile: a request that
the server carried out, whose answer the client never gets. ``hold(seconds)`` keeps every chunk
either way until the time is up, then delivers it: a link that stalls without breaking.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from services import free_port


class Proxy:
    """A threaded TCP proxy from a free loopback port to ``upstream_port``."""

    def __init__(self, upstream_port: int, *, delay: float = 0.0) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.delay = delay
        self.port = free_port()
        self._cut_until = 0.0
        self._mute_until = 0.0
        self._hold_until = 0.0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _is_cut(self) -> bool:
        return time.monotonic() < self._cut_until

    def cut(self, seconds: float) -> None:
        """Drop every connection now and refuse new ones for ``seconds``."""
        with self._lock:
            self._cut_until = time.monotonic() + seconds
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def mute(self, seconds: float) -> None:
        """Drop what the server sends for ``seconds``; requests still reach it."""
        self._mute_until = time.monotonic() + seconds

    def hold(self, seconds: float) -> None:
        """Keep what goes either way for ``seconds``, then let it through (nothing is lost)."""
        self._hold_until = time.monotonic() + seconds

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut(0)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._is_cut():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            # The timeout bounds the connect only: a link idle for 5 s is not a dead one (found by the
            # task-level model: the proxy itself closed every connection idle that long).
            server.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for source, target, replies in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pipe, args=(source, target, replies), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, replies: bool) -> None:
        try:
            while True:
                chunk = source.recv(65536)
                if not chunk:
                    break
                if self.delay:
                    time.sleep(self.delay)
                while time.monotonic() < self._hold_until:
                    time.sleep(0.01)
                if self._is_cut():
                    break
                if replies and time.monotonic() < self._mute_until:
                    continue
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                self._open.discard(source)
                self._open.discard(target)
