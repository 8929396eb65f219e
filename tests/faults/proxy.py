"""A small TCP proxy in front of PostgreSQL that can drop a client right after a commit.

It speaks just enough of the frontend/backend protocol (PostgreSQL docs 55.2, "Message Flow")
to find message boundaries: after the startup packet every message is one type byte and a
big-endian int32 length. When ``drop_after_commit`` is armed (optionally with ``arm(marker)``:
only a statement whose text contains ``marker``), the next request that ends a transaction —
a simple-Query COMMIT, or any statement sent while the session is idle, which runs as its own
implicit transaction and commits before the server answers (sql.db's ``one_statement``
transitions) — is forwarded; everything the server answers from then until its
ReadyForQuery says "idle" is swallowed, and the client's socket is closed: the transaction
committed, the client never hears. (Inside an explicit transaction the answers are passed on
until the COMMIT's.) ``ReplyDrop`` is that decision, shared with tests/faults/chaos_proxy.py.

Armed with ``stall=True`` the proxy does what a stalled pooler or middlebox does instead: the
answer is swallowed but the client's connection stays open (TCP keepalives are answered by
the kernel as usual), so the client waits for an answer that never comes. ``refuse(marker,
sqlstate, message)`` makes the proxy answer the next request containing ``marker`` with that
error itself, never forwarding it, as PgBouncer does with its own errors (08P01 and kin); or,
with no SQLSTATE, swallow it and never answer (a pooler stalled before the server).

``close_clients()`` cuts every connection open at that moment, both sides; with
``reset=True`` as a reset (SO_LINGER 0, as ``ss -K`` gives the socket it kills): the client
sees its connection fail, the server side (PostgreSQL or PgBouncer) sees its client gone, and
a server session busy with a statement goes on with it regardless. ``hold_replies()`` stops
passing the server's answers on until the next cut (they wait in the proxy), so that a
statement can commit without its client hearing of it. Connections made after a cut go
through as usual.
"""

from __future__ import annotations

import socket
import struct
import threading

SSL_REQUEST, GSSENC_REQUEST = 80877103, 80877104


def read_message(sock: socket.socket) -> tuple[bytes, bytes]:
    """One protocol message (type byte, body) from ``sock``. Raises ConnectionError at EOF."""
    kind = recv_exact(sock, 1)
    length = struct.unpack("!I", recv_exact(sock, 4))[0]
    return kind, recv_exact(sock, length - 4)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``. Raises ConnectionError if it closes first."""
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def pass_startup(client: socket.socket, server: socket.socket) -> None:
    """Forward the client's startup packets (SSLRequest / GSSENCRequest / StartupMessage, which
    have no type byte) to the server."""
    while True:
        length = struct.unpack("!I", recv_exact(client, 4))[0]
        body = recv_exact(client, length - 4)
        server.sendall(struct.pack("!I", length) + body)
        if struct.unpack("!I", body[:4])[0] not in (SSL_REQUEST, GSSENC_REQUEST):
            return


class ReplyDrop:
    """Per connection: which server answer to swallow once the proxy is armed.

    ``client_message`` is called with each client message before it is forwarded; it starts
    the watch on the request that will end a transaction. ``server_message`` is called with
    each server message and returns the bytes to send to the client now, or None when the
    transaction's end was swallowed and the connection must be cut.
    """

    def __init__(self, armed: threading.Event, proxy) -> None:
        self.armed = armed
        self.proxy = proxy           # has ``marker`` (bytes or None) and a ``_lock``
        self.idle = False            # the server's last ReadyForQuery said "idle"
        self.watching = False
        self.held: list[bytes] = []
        self.statements: dict[bytes, bytes] = {}  # prepared statement name -> text

    def client_message(self, kind: bytes, body: bytes) -> None:
        text = b""
        if kind == b"Q":
            text = body
        elif kind == b"P":
            name, rest = body.split(b"\x00", 1)
            text = self.statements[name] = rest.split(b"\x00", 1)[0]
        elif kind == b"B":
            text = self.statements.get(body.split(b"\x00", 2)[1], b"")
        starts_request = kind in (b"Q", b"P", b"B")
        is_commit = kind == b"Q" and body.rstrip(b"\x00").strip().upper() == b"COMMIT"
        with self.proxy._lock:
            marker = self.proxy.marker
            if (not self.watching and self.armed.is_set() and starts_request
                    and (is_commit or self.idle) and (marker is None or marker in text)):
                self.armed.clear()
                self.proxy.marker = None
                self.watching = True
        if starts_request:
            self.idle = False

    def server_message(self, kind: bytes, body: bytes) -> bytes | None:
        message = kind + struct.pack("!I", len(body) + 4) + body
        if kind == b"Z":
            status = body[:1]
            self.idle = status == b"I"
            if self.watching:
                if status == b"I":  # the transaction is over: its answer goes nowhere
                    with self.proxy._lock:
                        self.proxy.commits_dropped += 1
                    return None
                out, self.held = b"".join(self.held) + message, []  # inside BEGIN: go on
                if status == b"E":
                    self.watching = False
                return out
        if self.watching:
            self.held.append(message)
            return b""
        return message


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
        self.marker: bytes | None = None
        self.commits_dropped = 0
        self.stall = False
        self.refusal: tuple[bytes, str | None, str | None] | None = None
        self.refused = 0
        self._links: set[tuple[socket.socket, socket.socket]] = set()
        self._replies = threading.Event()
        self._replies.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database: str) -> str:
        return (f"postgresql://postgres@127.0.0.1:{self.port}/{database}"
                "?sslmode=disable&gssencmode=disable&connect_timeout=5")

    def close(self) -> None:
        self._closed.set()
        self.listener.close()

    def close_clients(self, *, reset: bool = False) -> int:
        """Cut every connection open through the proxy now (both sides; with ``reset`` as a
        TCP reset); returns how many there were."""
        with self._lock:
            links, self._links = self._links, set()
        if reset:
            # on every socket before any is shut down: a pump woken by the first shutdown
            # closes the other socket itself, and that must be a reset too
            for s in (s for link in links for s in link if s.family != socket.AF_UNIX):
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
        for client, server in links:
            self._close(client, server)
        self._replies.set()  # a held pump wakes to find its sockets closed, and ends
        return len(links)

    def hold_replies(self) -> None:
        """Stop passing the server's answers on, until the next ``close_clients``."""
        self._replies.clear()

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.connect(self.upstream)
        return s

    def arm(self, marker: str | None = None, *, stall: bool = False) -> None:
        """Drop the end of the next transaction (only a statement containing ``marker``);
        with ``stall`` keep the client's connection open, answering nothing more on it."""
        with self._lock:
            self.marker = marker.encode() if marker else None
            self.stall = stall
        self.drop_after_commit.set()

    def refuse(self, marker: str, sqlstate: str | None, message: str | None = None) -> None:
        """Answer the next request whose text contains ``marker`` (sent while the session is
        idle) with an ErrorResponse of ``sqlstate`` and ``message``; it never reaches the
        server. ``sqlstate`` None: swallow the next request containing ``marker`` (idle or
        inside a transaction) and answer nothing at all."""
        with self._lock:
            self.refusal = (marker.encode(), sqlstate, message)

    def _refusal_for(self, kind: bytes, body: bytes, drop: ReplyDrop) -> bytes | None:
        """The error to answer instead of forwarding, when this message starts the refused
        request; None otherwise."""
        if kind == b"Q":
            text = body
        elif kind == b"P":
            text = body.split(b"\x00", 1)[1]
        else:
            return None
        with self._lock:
            # an error is answered with ReadyForQuery "idle", so only to a request sent idle;
            # a request swallowed whole may come at any point
            if (self.refusal is None or self.refusal[0] not in text
                    or (self.refusal[1] is not None and not drop.idle)):
                return None
            _, sqlstate, message = self.refusal
            self.refusal = None
            self.refused += 1
        if sqlstate is None:
            return b""
        fields = b"".join(code + value.encode() + b"\x00" for code, value in
                          ((b"S", "ERROR"), (b"V", "ERROR"), (b"C", sqlstate), (b"M", message)))
        body = fields + b"\x00"
        return b"E" + struct.pack("!I", len(body) + 4) + body + b"Z" + struct.pack("!I", 5) + b"I"

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
                self._links.add((client, server))
            drop = ReplyDrop(self.drop_after_commit, self)
            threading.Thread(target=self._pump_server, args=(server, client, drop), daemon=True).start()
            threading.Thread(target=self._pump_client, args=(client, server, drop), daemon=True).start()

    def _close(self, client: socket.socket, server: socket.socket) -> None:
        with self._lock:
            self._links.discard((client, server))
        for s in (client, server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass

    def _pump_server(self, server: socket.socket, client: socket.socket, drop: ReplyDrop) -> None:
        try:
            while True:
                out = drop.server_message(*read_message(server))
                if out is None:
                    if self.stall:
                        # the client hears nothing more, and its socket stays open until it
                        # gives up on it (its own close ends _pump_client, which closes both)
                        while True:
                            read_message(server)
                    break
                if out:
                    self._replies.wait()  # held back; a cut closes the client first: dropped
                    client.sendall(out)
        except (OSError, ConnectionError, struct.error):
            pass
        self._close(client, server)

    def _pump_client(self, client: socket.socket, server: socket.socket, drop: ReplyDrop) -> None:
        try:
            pass_startup(client, server)
            refusing: bytes | None = None
            while True:
                kind, body = read_message(client)
                if refusing is None:
                    refusing = self._refusal_for(kind, body, drop)
                if refusing is not None:
                    # swallow the request up to its end (Sync, or the simple Query itself),
                    # then answer it with the error
                    if kind in (b"S", b"Q"):
                        if refusing:
                            client.sendall(refusing)
                            refusing = None
                        # else: swallowed, nothing is ever answered on this connection
                    continue
                drop.client_message(kind, body)
                server.sendall(kind + struct.pack("!I", len(body) + 4) + body)
        except (OSError, ConnectionError, struct.error):
            pass
        self._close(client, server)
