"""A worker's rendezvous against an API on loopback that answers from another release."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.registry import JobRequest, Registry
from reduction_appliance.dataplane.wire import VERSION
from reduction_appliance.plugin.rendezvous import RendezvousError, register


@contextmanager
def api_answering(answer: dict[str, object]) -> Iterator[str]:
    """An HTTP server on loopback that answers every POST with `answer`; its "host:port"."""
    body = json.dumps(answer).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(201)
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
            yield f"127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            thread.join()


def described() -> dict[str, object]:
    plan = Registry(parse({})).plan(JobRequest("j", 2), cookie=3, secret="s", now=0.0)
    return plan.describe(parse({}), member=True).to_json()


@pytest.mark.parametrize("version", [None, VERSION - 1, VERSION + 1])
def test_an_appliance_speaking_another_datagram_format_is_refused_by_name(
        version: int | None) -> None:
    answer = described()
    if version is None:  # an appliance from before the field existed
        del answer["wire_version"]
    else:
        answer["wire_version"] = version
    with api_answering(answer) as where, \
            pytest.raises(RendezvousError, match=rf"speaks datagram format v{version or 2}, "
                                                 rf"this worker v{VERSION}"):
        register(where, "j", 2, timeout_s=5)


def test_the_same_format_is_accepted() -> None:
    with api_answering(described()) as where:
        info = register(where, "j", 2, timeout_s=5)
    assert (info.name, info.world_size, info.secret) == ("j", 2, None)
