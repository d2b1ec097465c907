"""An appliance API stand-in on loopback for workers' rendezvous tests: answers each POST as
the test says (another release's replies, refusals, a busy appliance)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def fake_api(reply: Callable[[int], tuple[int, bytes]]) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on loopback answering the n-th POST (from 1) with `reply(n)`, a status
    and a JSON body; its "host:port" and the paths it was asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            asked.append(self.path)
            status, body = reply(len(asked))
            with contextlib.suppress(OSError):  # (a client that gave up on this one is gone)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{server.server_address[1]}", asked
        finally:
            server.shutdown()
            thread.join()
