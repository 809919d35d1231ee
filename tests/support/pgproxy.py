"""A TCP proxy in front of PostgreSQL that can swallow the answer to a sink's COMMIT, or, as a
flaky network, the answers to a share of all COMMITs and other statements."""

from __future__ import annotations

import random
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


# Server messages after which a statement's answer is complete (ReadyForQuery), or after which
# the server waits for the client (CopyIn/CopyOut/CopyBoth responses).
_ANSWERED = frozenset(b"ZGHW")


@dataclass
class Drop:
    """One connection the proxy cut after the server had answered a COMMIT (kind "commit") or
    another statement (kind "reply")."""

    connection: int
    reply_bytes: int
    at: float
    kind: str = "commit"
    what: str = ""  # the statement whose answer was lost (for a COMMIT: its transaction's first)


@dataclass
class _Conn:
    number: int
    client: socket.socket
    server: socket.socket
    saw_marker_insert: bool = False
    tx_matches: bool = False
    drop_pending: bool = False
    drop_kind: str = "commit"
    drop_what: str = ""
    statement: str = ""  # the last statement sent
    tx_first: str = ""  # the open transaction's first statement (BEGIN, SET, fence aside)
    extended_commit: bool = False  # a COMMIT parsed with the extended protocol awaits its Sync
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
        self.commits = 0  # COMMITs the clients sent (either protocol)
        self._lose_commit = 0.0
        self._lose_reply = 0.0
        self._lose_commit_of: list[str] = []
        self._rng = random.Random(0)
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

    def flaky(self, commits: float = 0.0, replies: float = 0.0, seed: int = 0) -> None:
        """Act as a flaky network: forward each COMMIT, and with probability `commits` wait for
        the server's answer (so it committed) and cut the connection instead of forwarding it;
        likewise, with probability `replies`, any other statement (simple Query or extended
        Sync). Seeded, so a run can be repeated; `flaky()` turns it off."""
        with self._lock:
            self._lose_commit = commits
            self._lose_reply = replies
            self._rng = random.Random(seed)

    def lose_commit_of(self, first_statement: str, count: int = 1) -> None:
        """Cut the answer to the COMMIT of the next `count` transactions whose first statement
        (besides BEGIN, SET and the ledger's heartbeat) starts with `first_statement`."""
        with self._lock:
            self._lose_commit_of.extend([first_statement.upper()] * count)

    def _chosen_commit(self, conn: _Conn) -> bool:
        with self._lock:
            if self._lose_commit_of and conn.tx_first.upper().startswith(self._lose_commit_of[0]):
                self._lose_commit_of.pop(0)
                return True
        return False

    def lost(self, kind: str | None = None) -> int:
        """How many answers the proxy swallowed (of one kind: "commit" or "reply")."""
        with self._lock:
            return sum(1 for d in self.drops if kind is None or d.kind == kind)

    def _chance(self, probability: float) -> bool:
        if probability <= 0:
            return False
        with self._lock:
            return self._rng.random() < probability

    def _drop_next_answer(self, conn: _Conn, kind: str) -> None:
        conn.drop_kind = kind
        if kind != "commit":  # a COMMIT's transaction was named when it ended
            conn.drop_what = conn.statement
        conn.drop_pending = True

    def _saw_statement(self, conn: _Conn, query: bytes) -> None:
        text = " ".join(query.decode(errors="replace").split())[:80]
        conn.statement = text
        upper = text.upper()
        if upper.startswith(("COMMIT", "END", "ROLLBACK", "ABORT")):
            return
        fence = upper.startswith("UPDATE ONCEFLOW.JOBS SET HEARTBEAT_AT")
        if not conn.tx_first and not fence and not upper.startswith(("BEGIN", "SET")):
            conn.tx_first = text

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
        """Track the transaction's marker insert; arm the drop on its COMMIT. As a flaky network,
        decide for each COMMIT and each other statement whether its answer is lost."""
        self._flaky(conn, kind, payload)
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

    def _flaky(self, conn: _Conn, kind: bytes, payload: bytes) -> None:
        if kind == b"Q":
            self._saw_statement(conn, payload.rstrip(b"\x00").strip())
        elif kind == b"P":
            parts = payload.split(b"\x00", 2)
            self._saw_statement(conn, parts[1].strip() if len(parts) > 1 else b"")
        if conn.drop_pending:
            return
        if kind == b"Q":
            query = payload.rstrip(b"\x00").strip().upper()
            chosen = query.startswith((b"COMMIT", b"END")) and self._chosen_commit(conn)
            if query.startswith((b"COMMIT", b"END", b"ROLLBACK", b"ABORT")):
                self._transaction_ends(conn)
            if query.startswith((b"COMMIT", b"END")):
                with self._lock:
                    self.commits += 1
                if chosen or self._chance(self._lose_commit):
                    self._drop_next_answer(conn, "commit")
            elif self._chance(self._lose_reply):
                self._drop_next_answer(conn, "reply")
        elif kind == b"P":
            # Parse: statement name, NUL, query text, NUL, parameter types.
            parts = payload.split(b"\x00", 2)
            query = parts[1].strip().upper() if len(parts) > 1 else b""
            if query.startswith((b"COMMIT", b"END")):
                conn.extended_commit = True
        elif kind == b"S":
            if conn.extended_commit:
                conn.extended_commit = False
                chosen = self._chosen_commit(conn)
                self._transaction_ends(conn)
                with self._lock:
                    self.commits += 1
                if chosen or self._chance(self._lose_commit):
                    self._drop_next_answer(conn, "commit")
            elif self._chance(self._lose_reply):
                self._drop_next_answer(conn, "reply")

    def _transaction_ends(self, conn: _Conn) -> None:
        conn.drop_what = conn.tx_first
        conn.tx_first = ""

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
        withheld = b""
        try:
            while True:
                data = conn.server.recv(65536)
                if not data:
                    break
                if conn.drop_pending:
                    # Withhold the answer until the server has finished the statement (so a
                    # COMMIT has committed), then cut the connection without forwarding it.
                    withheld += data
                    if not _answered(withheld):
                        continue
                    with self._lock:
                        self.drops.append(
                            Drop(
                                conn.number,
                                len(withheld),
                                time.time(),
                                conn.drop_kind,
                                conn.drop_what,
                            )
                        )
                    break
                conn.client.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()


def _answered(data: bytes) -> bool:
    """Whether the server messages in `data` (from a message boundary) include the end of a
    statement's answer; an unframeable stream counts as answered."""
    at = 0
    while at + 5 <= len(data):
        kind = data[at]
        (length,) = struct.unpack("!I", data[at + 1 : at + 5])
        if length < 4:
            return True
        if kind in _ANSWERED:
            return True
        at += 1 + length
    return False
