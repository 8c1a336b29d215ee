"""The HTTP part of the tests' fake servers: a threaded server on 127.0.0.1 that answers every
POST with JSON from :meth:`JsonServer.handle`; its lifecycle is pyworker.testing.LocalServer's,
shared with the fake model server."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from pyworker.testing import LocalServer


class JsonServer(LocalServer):
    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no delayed-ACK wait on kept-alive connections

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, value = owner.handle(self.path, self.headers.get("Content-Type") or "",
                                             raw)
                body = json.dumps(value).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (a bot that stopped polling)

        super().__init__(Handler)

    def handle(self, path: str, content_type: str, raw: bytes) -> tuple[int, Any]:
        raise NotImplementedError
