"""The chaos run's TCP proxy: CommitDroppingProxy's behaviour (tests/faults/proxy.py), with
connection ends that behave like a real socket's.

When ``drop_after_commit`` is armed, the next simple-Query COMMIT that passes is forwarded; the
server's answer is swallowed and the client's connection is cut (the transaction committed,
the client never hears), and the server's session is ended too, as if the client had gone.

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

SSL_REQUEST, GSSENC_REQUEST = 80877103, 80877104


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
        self.swallow = threading.Event()  # this client's COMMIT is being dropped
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

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def pump_server(self) -> None:
        try:
            while True:
                data = self.server.recv(65536)
                if not data:
                    break
                if self.swallow.is_set():
                    # the answer to the dropped COMMIT: it committed; the client never hears
                    with self.proxy._lock:
                        self.proxy.commits_dropped += 1
                    break
                self.client.sendall(data)
        except OSError:
            pass
        finally:
            self.end()
            self._exit()

    def pump_client(self) -> None:
        try:
            # startup packets (SSLRequest / GSSENCRequest / StartupMessage) have no type byte
            while True:
                length = struct.unpack("!I", self._recv_exact(self.client, 4))[0]
                body = self._recv_exact(self.client, length - 4)
                self.server.sendall(struct.pack("!I", length) + body)
                if struct.unpack("!I", body[:4])[0] not in (SSL_REQUEST, GSSENC_REQUEST):
                    break
            while True:
                kind = self._recv_exact(self.client, 1)
                length = struct.unpack("!I", self._recv_exact(self.client, 4))[0]
                body = self._recv_exact(self.client, length - 4)
                is_commit = (kind == b"Q" and self.proxy.drop_after_commit.is_set()
                             and body.rstrip(b"\x00").strip().upper() == b"COMMIT")
                if is_commit:
                    self.proxy.drop_after_commit.clear()
                    self.swallow.set()
                self.server.sendall(kind + struct.pack("!I", length) + body)
                if is_commit:
                    return  # pump_server ends the pair once the COMMIT has been answered
        except (OSError, ConnectionError, struct.error):
            self.end()
        finally:
            self._exit()
