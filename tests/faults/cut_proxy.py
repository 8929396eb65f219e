"""A TCP relay in front of PostgreSQL or PgBouncer whose client connections a test can cut.

Bytes pass both ways unread. ``cut()`` resets every connection open at that moment, both
sides (SO_LINGER 0: a reset, as ``ss -K`` gives the socket it kills): the client sees its
connection fail, the server side (PostgreSQL or PgBouncer) sees its client gone, and a server
session busy with a statement goes on with it regardless. ``hold_replies()`` stops passing
the server's bytes to the clients (they wait in the kernel), so that a statement can commit
without its client hearing of it. Connections made after a cut go through as usual.
"""

from __future__ import annotations

import socket
import struct
import threading


class CuttableProxy:
    """Listen on 127.0.0.1 (ephemeral port) and relay to ``upstream``: a Unix socket path or
    (host, port)."""

    def __init__(self, upstream: str | tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.cuts = 0
        self._open: set[tuple[socket.socket, socket.socket]] = set()
        self._replies = threading.Event()
        self._replies.set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="cut-proxy-accept", daemon=True).start()

    def url(self, database: str) -> str:
        """A libpq URL for ``database`` through this relay."""
        return (f"postgresql://postgres@127.0.0.1:{self.port}/{database}"
                "?sslmode=disable&gssencmode=disable&connect_timeout=5")

    def hold_replies(self) -> None:
        """Stop passing the server's bytes on, until the next ``cut``."""
        self._replies.clear()

    def cut(self) -> int:
        """Reset every connection open now, both sides; returns how many there were."""
        with self._lock:
            pairs, self._open = list(self._open), set()
            self.cuts += 1
        for pair in pairs:
            self._reset(*pair)
        self._replies.set()  # a held relay thread wakes to find its sockets closed, and ends
        return len(pairs)

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        self.cut()

    def _connect_upstream(self) -> socket.socket:
        family = socket.AF_UNIX if isinstance(self.upstream, str) else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.connect(self.upstream)
        return s

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = self._connect_upstream()
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.add((client, server))
            threading.Thread(target=self._relay, args=(client, server, False), daemon=True,
                             name="cut-proxy-up").start()
            threading.Thread(target=self._relay, args=(server, client, True), daemon=True,
                             name="cut-proxy-down").start()

    def _relay(self, src: socket.socket, dst: socket.socket, is_reply: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if is_reply:
                    self._replies.wait()  # held back; a cut closes dst first, so it is dropped
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open.discard((src, dst) if not is_reply else (dst, src))
        self._reset(src, dst)

    @staticmethod
    def _reset(*socks: socket.socket) -> None:
        for s in socks:
            try:
                if s.family != socket.AF_UNIX:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
