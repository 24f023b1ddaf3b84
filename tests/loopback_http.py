"""A quiet loopback HTTP server for tests that stand in for a serving engine."""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing and answers with :meth:`send_text`."""

    def log_message(self, *a):
        pass

    def send_text(self, body: str, code: int = 200, ctype: str = "application/json") -> None:
        """Answer ``code`` with ``body`` (UTF-8) as ``ctype``."""
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on 127.0.0.1 at a free port in a thread; yields the base URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
