"""An HTTP proxy in front of the local S3 server that can lose the answer to a PUT, or list
new objects late.

A lost answer: the PUT reaches the server and is carried out; the proxy then cuts the client's
connection instead of passing the answer on, as a network that fails after the request landed
does. Which PUTs lose their answer is chosen by a regular expression on the object's path and a
count. A late listing: objects whose key matches `hide_path` are left out of listings for
`hide_for_s` seconds after they were written, as an eventually consistent store does.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection"})


@dataclass
class LostAnswer:
    """One PUT carried out by the server whose answer the client never got."""

    path: str
    status: int


@dataclass
class S3Proxy:
    """Forward every request to `upstream` (`host:port`); lose the answers to the PUTs whose
    path matches `drop_path` from the `drop_from`-th match on, `drop_count` of them."""

    upstream: str
    drop_path: str | None = None
    drop_from: int = 1
    drop_count: int = 1
    hide_path: str | None = None
    hide_for_s: float = 0.0
    hidden: int = 0  # listing entries left out so far
    written: dict[str, float] = field(default_factory=dict)  # key (bucket/…) -> when
    lost: list[LostAnswer] = field(default_factory=list)
    puts: list[str] = field(default_factory=list)
    _matches: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> S3Proxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return None

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _forward(self) -> None:
                body = self._body()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                host, port = proxy.upstream.rsplit(":", 1)
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                path, _, query = self.path.partition("?")
                if self.command == "GET" and "list-type=2" in query:
                    bucket = path.strip("/").split("/", 1)[0]
                    data = proxy._late_listing(bucket, data)
                if self.command == "PUT":
                    proxy.written[path.lstrip("/")] = time.monotonic()
                    proxy.puts.append(path)
                    if proxy._should_drop(path):
                        proxy.lost.append(LostAnswer(path, reply.status))
                        # Reset, not a clean close: the client sees the connection fail.
                        self.connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        self.close_connection = True
                        return
                self.send_response(reply.status, reply.reason)
                for key, value in reply.getheaders():
                    # A HEAD answer's length is the object's, though it carries no body.
                    if key.lower() not in _HOP and (
                        key.lower() != "content-length" or self.command == "HEAD"
                    ):
                        self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def _late_listing(self, bucket: str, body: bytes) -> bytes:
        """The listing without the matching objects written less than `hide_for_s` ago."""
        if self.hide_path is None:
            return body
        now = time.monotonic()

        def keep(entry: re.Match[bytes]) -> bytes:
            key = re.search(rb"<Key>(.*?)</Key>", entry.group(0))
            name = f"{bucket}/{key.group(1).decode()}" if key else ""
            written = self.written.get(name)
            if (
                written is not None
                and now - written < self.hide_for_s
                and re.search(self.hide_path, "/" + name)
            ):
                self.hidden += 1
                return b""
            return entry.group(0)

        return re.sub(rb"<Contents>.*?</Contents>", keep, body, flags=re.S)

    def _should_drop(self, path: str) -> bool:
        if self.drop_path is None or not re.search(self.drop_path, path):
            return False
        with self._lock:
            self._matches += 1
            return self.drop_from <= self._matches < self.drop_from + self.drop_count

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
