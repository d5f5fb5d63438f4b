"""A chaos proxy for object-store servers: seeded random faults on a share of the requests.

:class:`ChaosProxy` is a threaded HTTP/1.1 proxy on 127.0.0.1 in front of an S3 (or GCS) server.
Each request is, with probability ``rate``, given one fault drawn from ``kinds``:

- ``reset``: the connection is reset (TCP RST) before the request reaches the server;
- ``reset-after``: the request reaches the server (it takes effect), then the connection is
  reset, so the client sees a failure for a request that succeeded;
- ``500`` / ``503``: an S3 error answer (InternalError / SlowDown) instead of the server's;
- ``slow``: the answer comes after a random pause (up to ``slow_s``);
- ``truncate``: the server's answer goes out with its full ``Content-Length`` but only part of
  the body, then the connection closes;
- ``hang``: the request is read (the connection accepted, the request never forwarded) and never
  answered: the connection stays open and silent until ``hang_s`` has passed or the proxy stops,
  then it is reset. A store that hangs rather than refuses: only the client's own connect/read
  time-outs end such a request (Trust I defect 15).

The draws come from one seeded generator; requests on several threads arrive in an order the seed
does not fix, so a seed reproduces the mix of faults, not the exact sequence.
``tests/_servers.py``'s ``FaultProxy`` is the deterministic sibling (one chosen request).
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

from faults._common import TESTS

assert TESTS  # importing _common put tests/ on the path: _servers comes from there
from _servers import (  # noqa: E402
    S3_ERROR_BODIES,
    ProxyHandler,
    serve_http,
)

KINDS = ("reset", "reset-after", "500", "503", "slow", "truncate")
EXTRA_KINDS = ("hang",)
"""Kinds a proxy knows but does not draw unless asked (a hang costs a client time-out each)."""


class ChaosProxy:
    """See the module docstring. ``enabled`` turns the faults on and off (forwarding goes on)."""

    def __init__(self, upstream: str, *, seed: int = 0, rate: float = 0.05,
                 kinds: tuple[str, ...] = KINDS, slow_s: float = 0.3, hang_s: float = 600.0,
                 spare: Callable[[str, str], bool] | None = None) -> None:
        unknown = set(kinds) - set(KINDS) - set(EXTRA_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: "
                             f"{KINDS + EXTRA_KINDS}")
        self.rate, self.kinds, self.slow_s, self.hang_s = rate, kinds, slow_s, hang_s
        self._stopped = threading.Event()  # releases the hanging requests
        self.enabled = True
        self.spare = spare  # (method, path) -> True: never given a fault
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        up_host, up_port = upstream.split("://", 1)[1].rsplit(":", 1)
        proxy = self

        class Handler(ProxyHandler):
            upstream = (up_host, int(up_port))

            def _reset(self) -> None:
                # SO_LINGER 0: close() sends RST, the client sees a connection reset.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.close_connection = True

            def _handle(self) -> None:
                body = self._body()
                kind, pause = proxy._draw(self.command, self.path)
                if kind == "reset":
                    self._reset()
                    return
                if kind == "hang":
                    # Accepted, read, never answered: the client waits for its own time-out.
                    proxy._stopped.wait(proxy.hang_s)
                    self._reset()
                    return
                if kind in ("500", "503"):
                    data = S3_ERROR_BODIES[int(kind)]
                    self.send_response(int(kind))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                resp, data = self._forward(body)
                if kind == "reset-after":
                    self._reset()
                    return
                if kind == "slow":
                    time.sleep(pause)  # the fault itself: a slow answer
                self._answer_headers(resp, data)
                if self.command == "HEAD":
                    return
                if kind == "truncate" and len(data) > 1:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self._reset()
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self._server, self.url, self._thread = serve_http(Handler, "chaos-proxy")

    def _draw(self, method: str, path: str) -> tuple[str | None, float]:
        with self._lock:
            self.requests += 1
            if not self.enabled or (self.spare is not None and self.spare(method, path)):
                return None, 0.0
            if self._rng.random() >= self.rate:
                return None, 0.0
            kind = self._rng.choice(self.kinds)
            self.injected[kind] += 1
            return kind, self._rng.uniform(0.0, self.slow_s)

    def stop(self) -> None:
        """Stop serving (hanging requests are reset)."""
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
