"""A TCP proxy in front of PostgreSQL that can swallow the answer to a sink's COMMIT."""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from psycopg import conninfo

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
MARKER_INSERT = b"INSERT INTO onceflow.sink_commits"


@dataclass
class Drop:
    """One connection the proxy cut after the server had answered a COMMIT."""

    connection: int
    reply_bytes: int
    at: float


@dataclass
class _Conn:
    number: int
    client: socket.socket
    server: socket.socket
    saw_marker_insert: bool = False
    tx_matches: bool = False
    drop_pending: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class PgProxy:
    """Forwards 127.0.0.1:<port> to the server of `server_dsn` (Unix socket or TCP).

    Armed with `arm(match)`, it watches the client's messages: in a transaction that inserts a
    sink commit marker whose bound parameters contain `match`, the simple-protocol `COMMIT` is
    forwarded, the proxy waits for the server's reply bytes (so the server has committed), then
    closes both sides without forwarding them: the client sees a COMMIT without an answer.
    """

    def __init__(self, server_dsn: str) -> None:
        info = conninfo.conninfo_to_dict(server_dsn)
        self.user = str(info.get("user") or "postgres")
        host = str(info.get("host") or "/tmp")
        port = int(info.get("port") or 5432)
        if host.startswith("/"):
            self._target: tuple[int, str | tuple[str, int]] = (
                socket.AF_UNIX,
                str(Path(host) / f".s.PGSQL.{port}"),
            )
        else:
            self._target = (socket.AF_INET, (host, port))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._armed: list[bytes | None] = []
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self.drops: list[Drop] = []
        self.connections = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="pgproxy", daemon=True)
        self._thread.start()

    def dsn(self, dbname: str) -> str:
        return (
            f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"
            " sslmode=disable gssencmode=disable"
        )

    def arm(self, match: bytes | None = None, count: int = 1) -> None:
        """Swallow the reply to the next `count` marker-writing COMMITs (with `match` bound)."""
        with self._lock:
            self._armed.extend([match] * count)

    @property
    def armed(self) -> int:
        with self._lock:
            return len(self._armed)

    def close(self) -> None:
        self._stopped.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()

    def __enter__(self) -> PgProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            family, address = self._target
            server = socket.socket(family, socket.SOCK_STREAM)
            try:
                server.connect(address)
            except OSError:
                client.close()
                server.close()
                continue
            for sock in (client, server):
                if family == socket.AF_INET or sock is client:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
                conn = _Conn(self.connections, client, server)
                self._conns.append(conn)
            threading.Thread(target=self._upstream, args=(conn,), daemon=True).start()
            threading.Thread(target=self._downstream, args=(conn,), daemon=True).start()

    def _take_arm(self, conn: _Conn) -> bool:
        with self._lock:
            if self._armed:
                self._armed.pop(0)
                return True
            return False

    def _inspect(self, conn: _Conn, kind: bytes, payload: bytes) -> None:
        """Track the transaction's marker insert; arm the drop on its COMMIT."""
        if kind == b"P" and MARKER_INSERT in payload:
            conn.saw_marker_insert = True
            with self._lock:
                wanted = self._armed[0] if self._armed else None
            if wanted is None and self._armed:
                conn.tx_matches = True
        elif kind == b"B" and conn.saw_marker_insert:
            with self._lock:
                wanted = self._armed[0] if self._armed else None
            if wanted is not None and wanted in payload:
                conn.tx_matches = True
        elif kind == b"Q":
            query = payload.rstrip(b"\x00").strip().upper()
            if query.startswith((b"COMMIT", b"ROLLBACK", b"END", b"ABORT")):
                if query.startswith((b"COMMIT", b"END")) and conn.tx_matches:
                    if self._take_arm(conn):
                        conn.drop_pending = True
                conn.saw_marker_insert = False
                conn.tx_matches = False

    def _upstream(self, conn: _Conn) -> None:
        buffer = b""
        startup = True
        try:
            while True:
                data = conn.client.recv(65536)
                if not data:
                    break
                buffer += data
                while True:
                    if startup:
                        if len(buffer) < 8:
                            break
                        (length,) = struct.unpack("!I", buffer[:4])
                        if len(buffer) < length:
                            break
                        (code,) = struct.unpack("!I", buffer[4:8])
                        message, buffer = buffer[:length], buffer[length:]
                        if code not in (_SSL_REQUEST, _GSSENC_REQUEST, _CANCEL_REQUEST):
                            startup = False
                    else:
                        if len(buffer) < 5:
                            break
                        (length,) = struct.unpack("!I", buffer[1:5])
                        if len(buffer) < 1 + length:
                            break
                        message, buffer = buffer[: 1 + length], buffer[1 + length :]
                        self._inspect(conn, message[:1], message[5:])
                    conn.server.sendall(message)
        except OSError:
            pass
        finally:
            conn.close()

    def _downstream(self, conn: _Conn) -> None:
        try:
            while True:
                data = conn.server.recv(65536)
                if not data:
                    break
                if conn.drop_pending:
                    with self._lock:
                        self.drops.append(Drop(conn.number, len(data), time.time()))
                    break
                conn.client.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()
