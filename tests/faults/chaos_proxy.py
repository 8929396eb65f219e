"""The chaos run's TCP proxy: CommitDroppingProxy's behaviour (tests/faults/proxy.py), with
connection ends that behave like a real socket's.

When ``drop_after_commit`` is armed, the next request that ends a transaction (a COMMIT, or a
statement sent while the session is idle: its own implicit transaction) is forwarded; the
server's answer is swallowed and the client's connection is cut (the transaction committed,
the client never hears), and the server's session is ended too, as if the client had gone.
Which answer to swallow is ``proxy.ReplyDrop``'s decision, shared with CommitDroppingProxy.

Why not CommitDroppingProxy itself: there, when one direction ends, the other direction's
thread may still be blocked in ``recv`` on a socket the first one ``close()``d. Closing a
file descriptor does not wake a thread blocked on it (Linux), so the client's TCP connection
stays open with nobody forwarding: a query sent on it then waits forever (psycopg has no
socket timeout), and a server session whose client died stays "idle in transaction" with its
row locks. Both stalled whole chaos runs. Here every end is a ``shutdown(SHUT_RDWR)`` of both
sockets first, which wakes the other thread and sends the peer its end of file.
"""

from __future__ import annotations

import socket
import struct
import threading
from urllib.parse import urlsplit

from .conftest import upstream_of
from .proxy import ReplyDrop, pass_startup, read_message


class ChaosProxy:
    """Listen on 127.0.0.1 (ephemeral port) and forward to ``upstream`` (a Unix socket path
    or (host, port)); ``db_url`` is the URL of database ``database`` through the proxy."""

    def __init__(self, upstream: str | tuple[str, int], database: str):
        self.upstream = upstream
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.db_url = (f"postgresql://postgres@127.0.0.1:{self.port}/{database}"
                       "?sslmode=disable&gssencmode=disable&connect_timeout=5")
        self.drop_after_commit = threading.Event()
        self.marker: bytes | None = None  # ReplyDrop reads it; the chaos run never sets one
        self.commits_dropped = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="chaos-proxy-accept", daemon=True).start()

    @classmethod
    def in_front_of(cls, db_url: str) -> "ChaosProxy":
        """A proxy in front of the server and database of ``db_url``."""
        return cls(upstream_of(db_url), urlsplit(db_url).path.lstrip("/"))

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        self._closed.set()
        self.listener.close()
        with self._lock:
            socks = list(self._open)
        for s in socks:
            _cut(s)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                family = socket.AF_UNIX if isinstance(self.upstream, str) else socket.AF_INET
                server = socket.socket(family, socket.SOCK_STREAM)
                server.connect(self.upstream)
            except OSError:
                _cut(client)
                continue
            with self._lock:
                self._open |= {client, server}
            conn = _Pair(self, client, server)
            for pump in (conn.pump_server, conn.pump_client):
                threading.Thread(target=pump, name="chaos-proxy-pump", daemon=True).start()

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)


def _cut(sock: socket.socket) -> None:
    """End a connection so that its peer and any thread blocked on it notice at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Pair:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: ChaosProxy, client: socket.socket, server: socket.socket):
        self.proxy = proxy
        self.client = client
        self.server = server
        self.drop = ReplyDrop(proxy.drop_after_commit, proxy)
        self._lock = threading.Lock()
        self._pumps = 2  # the last pump to exit closes both sockets

    def end(self) -> None:
        """Cut both sides: wakes the other pump, and each peer reads its end of file."""
        _cut(self.client)
        _cut(self.server)

    def _exit(self) -> None:
        with self._lock:
            self._pumps -= 1
            is_last = self._pumps == 0
        if is_last:
            self.proxy._forget(self.client, self.server)
            self.client.close()
            self.server.close()

    def pump_server(self) -> None:
        try:
            while True:
                out = self.drop.server_message(*read_message(self.server))
                if out is None:
                    break  # the dropped commit's answer: it committed; the client never hears
                if out:
                    self.client.sendall(out)
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            self.end()
            self._exit()

    def pump_client(self) -> None:
        try:
            pass_startup(self.client, self.server)
            while True:
                kind, body = read_message(self.client)
                self.drop.client_message(kind, body)
                self.server.sendall(kind + struct.pack("!I", len(body) + 4) + body)
        except (OSError, ConnectionError, struct.error):
            self.end()
        finally:
            self._exit()
