"""The HTTP part of the tests' fake servers: a threaded server on 127.0.0.1 that answers every
POST with JSON from :meth:`JsonServer.handle`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class JsonServer:
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        # Checks for shutdown every 50 ms (the default 0.5 s is what stopping each test's
        # server would wait).
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                        daemon=True)

    def handle(self, path: str, content_type: str, raw: bytes) -> tuple[int, Any]:
        raise NotImplementedError

    def closing(self) -> None:
        """Called before the server shuts down: release what waits."""

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.closing()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
