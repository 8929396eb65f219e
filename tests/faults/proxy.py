"""A small TCP proxy in front of PostgreSQL that can drop a client right after its COMMIT.

It speaks just enough of the frontend/backend protocol (PostgreSQL docs 55.2, "Message Flow")
to find message boundaries in the client's stream: after the startup packet every message is
one type byte and a big-endian int32 length. When ``drop_after_commit`` is armed and the client
sends a simple Query whose text is COMMIT, the proxy forwards it to the server, waits for the
server's answer (so the commit has happened), swallows it and closes the client's socket —
the transaction committed, the client never hears.
"""

from __future__ import annotations

import socket
import struct
import threading


class CommitDroppingProxy:
    """Listen on 127.0.0.1 (ephemeral port) and forward to a Unix socket or TCP upstream."""

    def __init__(self, upstream: str | tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.drop_after_commit = threading.Event()
        self.commits_dropped = 0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database: str) -> str:
        return (f"postgresql://postgres@127.0.0.1:{self.port}/{database}"
                "?sslmode=disable&gssencmode=disable&connect_timeout=5")

    def close(self) -> None:
        self._closed.set()
        self.listener.close()

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.connect(self.upstream)
        return s

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = self._connect_upstream()
            swallow = threading.Event()  # set once this client's COMMIT is on its way
            threading.Thread(target=self._pump_server, args=(server, client, swallow), daemon=True).start()
            threading.Thread(target=self._pump_client, args=(client, server, swallow), daemon=True).start()

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _pump_server(self, server: socket.socket, client: socket.socket,
                     swallow: threading.Event) -> None:
        try:
            while True:
                data = server.recv(65536)
                if not data:
                    break
                if swallow.is_set():
                    # the answer to the dropped COMMIT: the commit is done; the client never hears
                    with self._lock:
                        self.commits_dropped += 1
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            # shut both directions down, so the other pump's blocked recv returns too
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    s.close()
                except OSError:
                    pass

    def _pump_client(self, client: socket.socket, server: socket.socket,
                     swallow: threading.Event) -> None:
        try:
            # startup packets (SSLRequest / GSSENCRequest / StartupMessage) have no type byte
            while True:
                length = struct.unpack("!I", self._recv_exact(client, 4))[0]
                body = self._recv_exact(client, length - 4)
                server.sendall(struct.pack("!I", length) + body)
                code = struct.unpack("!I", body[:4])[0]
                if code not in (80877103, 80877104):  # SSLRequest, GSSENCRequest
                    break
            while True:
                kind = self._recv_exact(client, 1)
                length = struct.unpack("!I", self._recv_exact(client, 4))[0]
                body = self._recv_exact(client, length - 4)
                is_commit = (kind == b"Q" and self.drop_after_commit.is_set()
                             and body.rstrip(b"\x00").strip().upper() == b"COMMIT")
                if is_commit:
                    self.drop_after_commit.clear()
                    swallow.set()
                server.sendall(kind + struct.pack("!I", length) + body)
                if is_commit:
                    return  # _pump_server closes the client once the commit has answered
        except (OSError, ConnectionError, struct.error):
            pass
        for s in (client, server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            client.close()
        except OSError:
            pass
