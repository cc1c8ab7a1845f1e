"""A recording HTTP server on a loopback port, for tests: a decoy or a proxy.

It keeps every request it saw (method, path, headers, body) and what it answered, so a test can
assert what a real client sent and where: `RecordingServer()` answers every request with an
error; `RecordingServer(upstream=url)` forwards to the real server and streams the answer back.
"""
from __future__ import annotations

import http.server
import json
import socket
import threading
from dataclasses import dataclass, field

import httpx


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict
    body: bytes
    status: int | None = None  # what the client was answered
    answer: bytes = b""

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[dict]:
        """The SSE events of a streamed answer."""
        return [json.loads(line[6:]) for line in self.answer.decode().splitlines()
                if line.startswith("data: ")]


DECOY_ERROR = b'{"error": {"message": "decoy", "type": "server_error"}}'


@dataclass
class RecordingServer:
    """An HTTP server on a loopback port, in a thread, that records every request.

    With `upstream` unset it is a decoy answering `status` to everything (CONNECT included, so
    it can stand as an HTTPS proxy). With `upstream` set it forwards each request there
    unchanged and streams the answer back unchanged; `requests` keeps what the client sent.
    """
    upstream: str | None = None
    status: int = 500
    retry_after: int | None = None  # the decoy's Retry-After header, if any
    requests: list[Recorded] = field(default_factory=list)

    def __post_init__(self):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def handle(self):
                try:
                    super().handle()
                except (ConnectionResetError, BrokenPipeError):
                    pass  # the client gave up: nothing left to answer

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                rec = Recorded(self.command, self.path, dict(self.headers),
                               self.rfile.read(n) if n else b"")
                outer.requests.append(rec)
                if outer.upstream is None:
                    outer._refuse(self, rec)
                else:
                    outer._forward(self, rec)

            do_GET = do_POST = do_DELETE = do_PUT = do_HEAD = do_CONNECT = _handle

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def _refuse(self, handler, rec: Recorded) -> None:
        rec.status, rec.answer = self.status, DECOY_ERROR
        handler.send_response(self.status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(DECOY_ERROR)))
        if self.retry_after is not None:
            handler.send_header("Retry-After", str(self.retry_after))
        handler.end_headers()
        handler.wfile.write(DECOY_ERROR)

    def _forward(self, handler, rec: Recorded) -> None:
        headers = {k: v for k, v in handler.headers.items()
                   if k.lower() not in ("host", "content-length", "connection", "accept-encoding")}
        with httpx.stream(handler.command, self.upstream + handler.path, headers=headers,
                          content=rec.body, timeout=600) as r:
            rec.status = r.status_code
            handler.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                     "content-encoding"):
                    handler.send_header(k, v)
            # No Content-Length, HTTP/1.0: the body ends when the connection closes, so a
            # streamed answer goes through piece by piece.
            handler.send_header("Connection", "close")
            handler.end_headers()
            for piece in r.iter_raw():
                rec.answer += piece
                handler.wfile.write(piece)
                handler.wfile.flush()
        handler.close_connection = True

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
