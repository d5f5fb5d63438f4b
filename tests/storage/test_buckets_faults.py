"""Transient and permanent faults on real bucket servers, injected by a loopback proxy.

The clients' own retries are turned off on S3 (botocore ``max_attempts=0``, s3fs ``retries=1``) so
that what is tested is ckptmgr's retry loop; gcsfs's built-in retries cannot be turned off and are
left on. The retry policy is shortened so the tests take seconds.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _procs import Zygote
from _servers import S3_ERROR_BODIES, Fault, FaultProxy, MotoS3

from ckptmgr import CheckpointManager, SaveError, StorageError
from ckptmgr.storage import _retry, open_storage

BUCKET = "ckpt-tests"
GCS_503 = b'{"error": {"code": 503, "message": "injected"}}'


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> _retry.RetryPolicy:
    policy = _retry.RetryPolicy(max_attempts=4, initial_backoff_s=0.02, max_backoff_s=0.1,
                                total_timeout_s=20.0)
    monkeypatch.setattr(_retry, "DEFAULT_POLICY", policy)
    # s3fs's own retry loop (SlowDown, connection errors) is a class attribute, not an option.
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    return policy


@pytest.fixture
def s3_proxy(moto_s3: MotoS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_s3.endpoint_url)
    yield proxy
    proxy.stop()


def _s3_opts(server: MotoS3, proxy: FaultProxy) -> dict[str, Any]:
    return server.storage_options(endpoint_url=proxy.url,
                                  config_kwargs={"retries": {"max_attempts": 0}})


def _url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((2000,), v), "extra": {"v": v}}


def _zeros() -> dict[str, Any]:
    return {"w": torch.zeros(2000), "extra": {"v": -1.0}}


def test_transient_faults_on_every_request_kind_are_retried(
        moto_s3: MotoS3, s3_proxy: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    url = _url()
    opts = _s3_opts(moto_s3, s3_proxy)
    faults = [
        s3_proxy.add(Fault(lambda m, p: m == "GET" and "list-type=2" in p, times=1, status=503,
                           body=S3_ERROR_BODIES[503])),
        s3_proxy.add(Fault(lambda m, p: m == "PUT" and "/data-" in p, times=2, status=503,
                           body=S3_ERROR_BODIES[503])),
        s3_proxy.add(Fault(lambda m, p: m == "PUT" and "/metadata-" in p, times=1, reset=True)),
        # The manifest's conditional create lands, then the answer is lost: the retry meets
        # "exists" and must recognise its own object.
        s3_proxy.add(Fault(lambda m, p: m == "PUT" and p.endswith("/commit.json"), times=1,
                           status=500, body=S3_ERROR_BODIES[500], forward=True)),
    ]
    caplog.set_level("INFO", logger="ckptmgr")
    with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
        mgr.save(1, _state(1.0))
        assert mgr.all_steps() == [1]
    read_faults = [
        s3_proxy.add(Fault(lambda m, p: m == "GET" and "/data-" in p, times=1, reset=True)),
        s3_proxy.add(Fault(lambda m, p: m == "GET" and p.endswith("/commit.json"), times=1,
                           status=500, body=S3_ERROR_BODIES[500])),
    ]
    with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
        out = _zeros()
        mgr.restore(1, out)
        assert torch.equal(out["w"], _state(1.0)["w"]) and out["extra"] == {"v": 1.0}
    for f in faults + read_faults:
        assert f.times == 0, f  # every injected fault was hit
    assert any("retrying" in r.getMessage() for r in caplog.records)


def test_permanent_failure_is_a_storage_error_and_keeps_the_last_step(
        moto_s3: MotoS3, s3_proxy: FaultProxy, fast_retries: _retry.RetryPolicy,
        caplog: pytest.LogCaptureFixture) -> None:
    url = _url()
    opts = _s3_opts(moto_s3, s3_proxy)
    caplog.set_level("INFO", logger="ckptmgr")
    with CheckpointManager(url, save_interval=1, max_to_keep=1, storage_options=opts) as mgr:
        mgr.save(1, _state(1.0))
        fault = s3_proxy.add(Fault(lambda m, p: m == "PUT" and "/2/data-" in p, times=10**6,
                                   status=500, body=S3_ERROR_BODIES[500]))
        caplog.clear()
        with pytest.raises(SaveError) as ei:
            mgr.save(2, _state(2.0))
        assert fault.hits == fast_retries.max_attempts  # bounded in count ...
        # ... and in time: the backoff waits the loop announced fit in the policy's budget
        waits = [float(m.group(1)) for r in caplog.records
                 if (m := re.search(r"retrying in ([0-9.]+) s", r.getMessage()))]
        assert len(waits) == fast_retries.max_attempts - 1, waits
        assert sum(waits) <= fast_retries.total_timeout_s, waits
        assert any("giving up after" in r.getMessage() for r in caplog.records)
        err = ei.value.__cause__
        assert isinstance(err, StorageError), repr(err)
        assert "/2/data-" in str(err) and url in str(err)  # names the object
        assert err.__cause__ is not None and not isinstance(err.__cause__, StorageError)
        assert mgr.all_steps() == [1]
        fault.times = 0
        out = _zeros()
        mgr.restore(1, out)
        assert torch.equal(out["w"], _state(1.0)["w"])
    with CheckpointManager(url, save_interval=1, max_to_keep=1, storage_options=opts) as mgr:
        assert mgr.all_steps() == [1]
        mgr.save(3, _state(3.0))
        assert mgr.all_steps() == [3]


def test_permanent_listing_failure_names_the_root(moto_s3: MotoS3,
                                                  s3_proxy: FaultProxy) -> None:
    url = _url()
    st = open_storage(url, _s3_opts(moto_s3, s3_proxy))
    s3_proxy.add(Fault(lambda m, p: "list-type=2" in p, times=10**6, status=503,
                       body=S3_ERROR_BODIES[503]))
    with pytest.raises(StorageError, match="list failed for s3://ckpt-tests/") as ei:
        st.scan_root("commit.json")
    assert ei.value.__cause__ is not None


def test_not_found_is_not_retried(moto_s3: MotoS3, s3_proxy: FaultProxy) -> None:
    st = open_storage(_url(), _s3_opts(moto_s3, s3_proxy))
    with s3_proxy.counting() as reqs, pytest.raises(StorageError) as ei:
        st.read_bytes("1/missing", 0, 10)
    assert isinstance(ei.value.__cause__, FileNotFoundError)
    assert len(reqs) == 1, reqs


@pytest.mark.slow
def test_gcs_transient_faults(fake_gcs: Any) -> None:
    proxy = FaultProxy(fake_gcs.endpoint_url)
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}"
    try:
        opts = fake_gcs.storage_options(endpoint_url=proxy.url)
        faults = [
            proxy.add(Fault(lambda m, p: m == "POST" and "/upload/" in p and "data-" in p,
                            times=1, status=503, body=GCS_503)),
            proxy.add(Fault(lambda m, p: m == "GET" and "alt=media" in p and "data-" in p,
                            times=1, reset=True)),
        ]
        with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
            mgr.save(1, _state(1.0))
            out = _zeros()
            mgr.restore(1, out)
            assert torch.equal(out["w"], _state(1.0)["w"])
        assert [f.times for f in faults] == [0, 0]
    finally:
        proxy.stop()


_WRITER = textwrap.dedent("""
    import os, sys, torch
    from ckptmgr import CheckpointManager
    from ckptmgr.storage import fsspec_storage
    fsspec_storage.PART_SIZE = 5 * 2**20
    url, endpoint, key, secret = sys.argv[1:5]
    opts = {"endpoint_url": endpoint, "key": key, "secret": secret}
    with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
        mgr.save(1, {"w": torch.ones(1000)})
        print("committed 1", flush=True)
        mgr.save(2, {"w": torch.randn(12 * 2**20 // 4), "v": torch.ones(1000)})
    print("unreachable: step 2 committed", flush=True)
""")


@pytest.mark.slow
def test_writer_killed_mid_upload_leaves_last_step_restorable(
        moto_s3: MotoS3, s3_proxy: FaultProxy, zygote: Zygote) -> None:
    url = _url()
    # Part uploads of step 2 are held in the proxy until the test lets them go: the writer is
    # surely mid-upload when killed.
    stall = s3_proxy.add(Fault(lambda m, p: m == "PUT" and "/2/data-" in p and "partNumber" in p,
                               times=10**6, hold=threading.Event()))
    proc = zygote.spawn([url, s3_proxy.url, moto_s3.key, moto_s3.secret], code=_WRITER,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90  # a guard against hanging, not a speed check
        while not stall.arrived.wait(0.1):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the writer never started uploading step 2"
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        assert stall.hold is not None
        stall.hold.set()
    assert "committed 1" in out and "unreachable" not in out
    stall.times = 0
    opts = moto_s3.storage_options()
    with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
        assert mgr.all_steps() == [1]
        out_state = {"w": torch.zeros(1000)}
        mgr.restore(1, out_state)
        assert torch.equal(out_state["w"], torch.ones(1000))
        mgr.save(3, {"w": torch.full((1000,), 3.0)})
        assert mgr.all_steps() == [1, 3]


# ------------------------------------------------------------------ the retry loop, in isolation


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_transient_classification() -> None:
    import errno

    import aiohttp
    from gcsfs.retry import HttpError

    transient = [
        _client_error(503, "SlowDown"), _client_error(500, "InternalError"),
        _client_error(400, "RequestTimeout"), ConnectionResetError(), TimeoutError(),
        aiohttp.ServerDisconnectedError(), HttpError({"code": 502, "message": "bad gateway"}),
        OSError(errno.ECONNRESET, "reset"),
    ]
    wrapped = OSError(errno.EIO, "wrapped")  # s3fs's translation keeps the ClientError as cause
    wrapped.__cause__ = _client_error(503, "ServiceUnavailable")
    transient.append(wrapped)
    permanent = [
        FileNotFoundError("x"), FileExistsError("x"), PermissionError("x"),
        _client_error(403, "AccessDenied"), _client_error(404, "NoSuchKey"),
        _client_error(412, "PreconditionFailed"), HttpError({"code": 404, "message": "nope"}),
        ValueError("bad"), EOFError("short"),
    ]
    for e in transient:
        assert _retry.is_transient(e), repr(e)
    for e in permanent:
        assert not _retry.is_transient(e), repr(e)


def test_retries_are_bounded_in_count_and_time(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    now = [0.0]
    monkeypatch.setattr(_retry.time, "sleep", lambda s: (sleeps.append(s), now.__setitem__(
        0, now[0] + s)))
    monkeypatch.setattr(_retry.time, "monotonic", lambda: now[0])
    calls = []

    def failing() -> None:
        calls.append(1)
        raise ConnectionResetError("reset")

    policy = _retry.RetryPolicy(max_attempts=5, initial_backoff_s=1.0, max_backoff_s=3.0,
                                total_timeout_s=1000.0)
    with pytest.raises(ConnectionResetError):
        _retry.call_with_retries(failing, what="op", policy=policy)
    assert len(calls) == 5 and len(sleeps) == 4
    for s, base in zip(sleeps, [1.0, 2.0, 3.0, 3.0], strict=True):  # backoff, capped, jittered
        assert base / 2 <= s <= base
    calls.clear()
    short = _retry.RetryPolicy(max_attempts=50, initial_backoff_s=1.0, max_backoff_s=3.0,
                               total_timeout_s=7.0)
    now[0] = 0.0
    with pytest.raises(ConnectionResetError):
        _retry.call_with_retries(failing, what="op", policy=short)
    assert now[0] <= 7.0 and 2 <= len(calls) < 10  # the deadline, not the count, stopped it
    calls.clear()

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("x")

    with pytest.raises(FileNotFoundError):
        _retry.call_with_retries(missing, what="op", policy=policy)
    assert len(calls) == 1  # permanent: no retry


def test_a_store_gone_for_good_fails_the_whole_save_within_one_budget(
        moto_s3: MotoS3, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Many attempts allowed per call, so only the operation's shared budget can stop the loops
    # of the upload parts that fail in parallel (before it, each part had a budget of its own).
    policy = _retry.RetryPolicy(max_attempts=10**6, initial_backoff_s=0.02, max_backoff_s=0.05,
                                total_timeout_s=0.6)
    monkeypatch.setattr(_retry, "DEFAULT_POLICY", policy)
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    url = _url()
    opts = _s3_opts(moto_s3, s3_proxy)
    caplog.set_level("INFO", logger="ckptmgr")
    state = {"w": torch.arange(6 * 2**20, dtype=torch.float32)}  # 24 MiB: several parts
    with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
        fault = s3_proxy.add(Fault(lambda m, p: m == "PUT" and "partNumber" in p, times=10**9,
                                   status=500, body=S3_ERROR_BODIES[500]))
        caplog.clear()
        with pytest.raises(SaveError):
            mgr.save(1, state)
        assert fault.hits >= 2
        waits = [float(m.group(1)) for r in caplog.records
                 if (m := re.search(r"retrying in ([0-9.]+) s", r.getMessage()))]
        parts = {m.group(1) for r in caplog.records
                 if (m := re.search(r"upload part (\d+)", r.getMessage()))}
        assert len(parts) >= 2, parts  # several calls retried ...
        assert sum(waits) <= policy.total_timeout_s, (sum(waits), waits)  # ... on one budget
        assert any("retry budget is spent" in r.getMessage() for r in caplog.records)
        assert mgr.all_steps() == []
