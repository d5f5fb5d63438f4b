"""Object stores, against real servers on 127.0.0.1 (the Storage contract itself runs on them
in tests/storage/test_storage.py): multipart writes and ranged read-ahead; the commit protocol on
buckets; listing in O(1) requests; the manager end to end with storage_options; a missing backend.

Server differences the tests pin (the code handles both behaviours):
- SeaweedFS answers a failed conditional create (``If-None-Match: *``) with a 412 that s3fs turns
  into a plain ``OSError(EINVAL)``; AWS, moto and fake-gcs-server give ``FileExistsError``.
- moto checks no signatures; SeaweedFS does (a wrong secret is refused).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
import torch
from _servers import FakeGcs, FaultProxy, MotoS3, S3Server

import ckptmgr
from ckptmgr import CheckpointManager, StorageError
from ckptmgr.storage import Storage, fsspec_storage, open_storage

BUCKET = "ckpt-tests"
SERVERS = ["moto", "seaweedfs", "gcs"]


def _server(request: pytest.FixtureRequest, name: str) -> Any:
    return request.getfixturevalue({"moto": "moto_s3", "seaweedfs": "seaweed_s3",
                                    "gcs": "fake_gcs"}[name])


def _url(server: Any) -> str:
    scheme = "gs" if isinstance(server, FakeGcs) else "s3"
    return f"{scheme}://{BUCKET}/{uuid.uuid4().hex}"


def _prefixes_with_objects(server: Any, url: str) -> list[str]:
    fs = server.fs()
    fs.invalidate_cache()
    base = url.split("://", 1)[1]
    return sorted({p[len(base) + 1:].split("/", 1)[0] for p in fs.find(base)})


def _cleanup(server: Any, url: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        server.fs().rm(url.split("://", 1)[1], recursive=True)


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest) -> Any:
    """Each bucket server (started once per session)."""
    return _server(request, request.param)


@pytest.fixture
def bucket_url(server: Any) -> Iterator[str]:
    """A fresh prefix in the test bucket of ``server``."""
    url = _url(server)
    yield url
    _cleanup(server, url)


@pytest.fixture
def storage(server: Any, bucket_url: str) -> Storage:
    """The contract suite's storage, on a bucket server, through open_storage + storage_options."""
    return open_storage(bucket_url, server.storage_options())


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts and read blocks small enough that tens of MiB exercise the parallel paths
    (5 MiB is S3's smallest allowed part)."""
    monkeypatch.setattr(fsspec_storage, "PART_SIZE", 5 * 2**20)
    monkeypatch.setattr(fsspec_storage, "READ_BLOCK_SIZE", 2**20)
    monkeypatch.setattr(fsspec_storage, "WRITE_BLOCK_SIZE", 4 * 2**20)


# ---------------------------------------------------------------------------------- storage


def test_exclusive_create_raises_file_exists_on_every_server(storage: Storage) -> None:
    # SeaweedFS's 412 arrives as OSError(EINVAL); it must still read as "exists".
    storage.write_bytes("1/commit.json", b"one", exclusive=True)
    with pytest.raises(StorageError) as ei:
        storage.write_bytes("1/commit.json", b"two", exclusive=True)
    assert isinstance(ei.value.__cause__, FileExistsError), repr(ei.value.__cause__)
    assert "1/commit.json" in str(ei.value)
    assert storage.read_bytes("1/commit.json") == b"one"


@pytest.mark.slow
def test_large_object_multipart_and_read_ahead(storage: Storage, small_blocks: None,
                                               server: Any, bucket_url: str) -> None:
    n = 13 * 2**20 + 12345  # three 5 MiB parts (the last one short) on S3
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator()
                         .manual_seed(0)).numpy().tobytes()
    w = storage.open_writer("7/data.bin")
    mv = memoryview(data)
    for pos in range(0, n, 3 * 2**20 + 17):  # writes that straddle part boundaries
        w.write(mv[pos:pos + 3 * 2**20 + 17])
    w.commit()
    assert storage.list_files("7") == {"data.bin": n}
    # whole, item by item forward (read-ahead), jumps, the tail
    buf = bytearray(n)
    storage.read_into("7/data.bin", 0, memoryview(buf))
    assert buf == data
    pos = 0
    for size in [1, 100, 2**20, 2**20 - 1, 3 * 2**20 + 5, 7, 4 * 2**20]:
        part = bytearray(size)
        storage.read_into("7/data.bin", pos, memoryview(part))
        assert part == data[pos:pos + size], (pos, size)
        pos += size
    # The vectored reader the DCP reader uses: forward batches, then a jump back.
    assert isinstance(storage, fsspec_storage.FsspecStorage)
    with storage.open_reader("7/data.bin") as reader:
        pos = 5
        for sizes in ([10, 2**20, 3], [3 * 2**20], [1] * 300, [2**20 + 1, 5 * 2**20]):
            bufs = [bytearray(k) for k in sizes]
            reader.readv_into(pos, [memoryview(b) for b in bufs])
            assert b"".join(bufs) == data[pos:pos + sum(sizes)], (pos, sizes)
            pos += sum(sizes)
        back = bytearray(100)
        reader.readv_into(17, [memoryview(back)])
        assert back == data[17:117]
    for off, size in [(9 * 2**20 + 3, 2**20), (2**20, 10), (n - 5, 5), (0, 2**20 + 1)]:
        part = bytearray(size)
        storage.read_into("7/data.bin", off, memoryview(part))
        assert part == data[off:off + size], (off, size)
    with pytest.raises(StorageError, match=r"7/data\.bin"):
        storage.read_into("7/data.bin", n - 2, memoryview(bytearray(5)))
    assert storage.read_bytes("7/data.bin", n - 10, 10) == data[-10:]
    if not isinstance(server, FakeGcs):
        fs = server.fs()
        bucket = BUCKET
        key = bucket_url.split("://", 1)[1][len(bucket) + 1:] + "/7/data.bin"
        assert fs.call_s3("head_object", Bucket=bucket, Key=key)["ContentLength"] == n


def test_aborted_multipart_leaves_no_object_and_no_upload(small_blocks: None, request:
                                                          pytest.FixtureRequest) -> None:
    server = _server(request, "seaweedfs")
    url = _url(server)
    st = open_storage(url, server.storage_options())
    w = st.open_writer("3/data.bin")
    w.write(b"x" * (11 * 2**20))  # two parts sent
    w.abort()
    assert not st.exists("3/data.bin")
    prefix = url.split("://", 1)[1][len(BUCKET) + 1:]
    uploads = server.fs().call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix)
    assert not uploads.get("Uploads"), uploads
    _cleanup(server, url)


def test_wrong_secret_is_refused_by_seaweedfs(request: pytest.FixtureRequest) -> None:
    server = _server(request, "seaweedfs")  # it checks signatures; moto would accept anything
    opts = server.storage_options(secret="not-the-secret-" + "x" * 20)
    with pytest.raises(StorageError) as ei:  # at the bucket check, or at the first write
        st = open_storage(_url(server), opts)
        st.write_bytes("1/f", b"x")
    assert "not-the-secret-" not in str(ei.value)


def _populate(server: Any, url: str, steps: int) -> None:
    base = url.split("://", 1)[1]
    objs = {f"{base}/{s}/commit.json": b"{}" for s in range(steps)}
    if isinstance(server, MotoS3):
        objs.update({f"{base}/{s}/data-x.bin": b"d" for s in range(steps)})
    objs[f"{base}/{steps}/data-x.bin"] = b"uncommitted"
    if isinstance(server, MotoS3):  # straight into moto's store: 1100 PUTs take ~25 s here
        server.put_objects(BUCKET, {k[len(BUCKET) + 1:]: v for k, v in objs.items()})
    else:
        server.fs().pipe(objs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moto", "gcs"])
def test_discovering_1000_steps_costs_o1_list_requests(request: pytest.FixtureRequest,
                                                       name: str) -> None:
    server = _server(request, name)
    url = _url(server)
    _populate(server, url, 1000)
    proxy = FaultProxy(server.endpoint_url)
    try:
        st = open_storage(url, server.storage_options(endpoint_url=proxy.url))
        with proxy.counting() as reqs:
            entries = st.scan_root("commit.json")
        assert sum(e.has_marker for e in entries) == 1000
        assert not next(e for e in entries if e.name == "1000").has_marker
        # 1000 keys per page (moto: 2001 objects, gcs: 1001): nothing per step.
        pages = 3 if isinstance(server, MotoS3) else 2
        assert len(reqs) == pages and all(m == "GET" for m, _ in reqs), reqs
        with proxy.counting() as reqs:
            mgr = CheckpointManager(url, save_interval=1,
                                    storage_options=server.storage_options(endpoint_url=proxy.url))
            assert len(mgr.all_steps()) == 1000 and mgr.latest_step() == 999
            mgr.close()
        # The bucket check, the writer lease (read, create, release: at most 10) and one
        # listing: nothing per step.
        assert len(reqs) <= 20, reqs
    finally:
        proxy.stop()  # no clean-up: 1000 deletes cost seconds; the servers keep all in memory


# ---------------------------------------------------------------------------------- manager


def _state(seed: int, n: int = 1000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(3, 3, generator=g)},
            "extra": {"epoch": seed, "name": "run"}}


def _zeros(n: int = 1000) -> dict[str, Any]:
    return {"model": {"w": torch.zeros(n), "b": torch.zeros(3, 3)},
            "extra": {"epoch": -1, "name": ""}}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (torch.equal(a["model"]["w"], b["model"]["w"])
            and torch.equal(a["model"]["b"], b["model"]["b"]) and a["extra"] == b["extra"])


def test_manager_end_to_end_with_storage_options(server: Any, bucket_url: str) -> None:
    opts = server.storage_options()
    with CheckpointManager(bucket_url, save_interval=10, max_to_keep=2,
                           storage_options=opts) as mgr:
        assert mgr.all_steps() == []
        for step in range(0, 40):
            mgr.save_async(step, _state(step), metrics={"loss": 1.0 / (step + 1)})
        mgr.join()
        assert mgr.all_steps() == [20, 30]
    # close() saved the last step given (save_on_close), and retention kept 2.
    with CheckpointManager(bucket_url, save_interval=10, max_to_keep=2,
                           storage_options=opts) as mgr:
        assert mgr.all_steps() == [30, 39] and mgr.latest_step() == 39
        out = _zeros()
        mgr.restore(39, out)
        assert _same(out, _state(39))
        assert mgr.step_info(30).metrics == {"loss": 1.0 / 31}
    # Retention removed whole prefixes, not just manifests. Objects are counted, not `ls`
    # entries: SeaweedFS keeps listing an emptied prefix as a directory for minutes.
    assert _prefixes_with_objects(server, bucket_url) == ["30", "39"]


@pytest.mark.slow
def test_manager_large_state_round_trip(small_blocks: None, request: pytest.FixtureRequest
                                        ) -> None:
    # SeaweedFS: real multipart, signatures; many tensors so read-ahead crosses items.
    server = _server(request, "seaweedfs")
    url = _url(server)
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(1 + 37 * i, 1000, generator=g) for i in range(40)}
    with CheckpointManager(url, save_interval=1, storage_options=server.storage_options()) as mgr:
        mgr.save(1, state)
        total = mgr.step_info(1).total_bytes
        assert total > 25 * 2**20
        out = {k: torch.empty_like(v) for k, v in state.items()}
        mgr.restore(1, out)
        for k in state:
            assert torch.equal(out[k], state[k]), k
        part = {"t5": torch.empty_like(state["t5"]), "t33": torch.empty_like(state["t33"])}
        mgr.restore(1, part)
        assert torch.equal(part["t33"], state["t33"])
    _cleanup(server, url)


def test_uncommitted_prefix_is_ignored_and_cleaned(request: pytest.FixtureRequest) -> None:
    server = _server(request, "moto")
    url = _url(server)
    opts = server.storage_options()
    with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
        mgr.save(1, _state(1))
    fs = server.fs()
    base = url.split("://", 1)[1]
    fs.pipe_file(f"{base}/5/data-0123456789ab-r00000-000.bin", b"partial upload")
    with CheckpointManager(url, save_interval=1, storage_options=opts) as mgr:
        assert mgr.all_steps() == [1]
        with pytest.raises(ckptmgr.IncompleteCheckpointError):
            mgr.restore(5, _zeros())
        mgr.save(7, _state(7))
        assert mgr.all_steps() == [1, 7]
    assert _prefixes_with_objects(server, url) == ["1", "7"]
    _cleanup(server, url)


def test_s3_credentials_from_url_userinfo(request: pytest.FixtureRequest) -> None:
    # SeaweedFS checks signatures: the save works only if key:secret@ reached the client.
    server = _server(request, "seaweedfs")
    path = f"{BUCKET}/{uuid.uuid4().hex}"
    url = f"s3://{quote(server.key, safe='')}:{quote(server.secret, safe='')}@{path}"
    with CheckpointManager(url, save_interval=1,
                           storage_options={"endpoint_url": server.endpoint_url}) as mgr:
        mgr.save(1, _state(1))
        assert server.secret not in mgr.path and mgr.path == f"s3://***@{path}"
        assert mgr.all_steps() == [1]
    _cleanup(server, f"s3://{path}")


def test_credentials_in_gs_url_are_refused_without_echo(
        request: pytest.FixtureRequest) -> None:
    with pytest.raises(ckptmgr.ConfigError) as ei:
        CheckpointManager("gs://user:Pl4nted-gs-secret@bucket/run", save_interval=1)
    assert "Pl4nted-gs-secret" not in str(ei.value)


def test_missing_backend_raises_with_the_pip_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # `fsspec.registry` the attribute is a read-only view; the module holds the dict.
    loaded = importlib.import_module("fsspec.registry")._registry
    for scheme in ("gs", "gcs", "s3", "s3a"):  # forget the loaded classes ...
        if scheme in loaded:
            monkeypatch.delitem(loaded, scheme)
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # ... and make their import fail
    monkeypatch.setitem(sys.modules, "s3fs", None)
    # ckptmgr is on no registry: the hint names the backend package (on PyPI), and the extra
    # only as an editable install from the clone.
    for url, package, extra in (("gs://bucket/run", "gcsfs", "gcs"),
                                ("s3://bucket/run", "s3fs", "s3")):
        with pytest.raises(ckptmgr.BackendNotInstalledError) as ei:
            CheckpointManager(url, save_interval=1)
        assert isinstance(ei.value, ImportError)
        assert f"pip install {package} " in str(ei.value)
        assert f'pip install -e ".[{extra}]"' in str(ei.value)
        assert "pip install 'ckptmgr" not in str(ei.value)


def test_server_proxy_counts_and_forwards(request: pytest.FixtureRequest) -> None:
    # The fault proxy used by test_buckets_faults.py forwards signed requests unchanged.
    server: S3Server = _server(request, "seaweedfs")
    proxy = FaultProxy(server.endpoint_url)
    try:
        fs = server.fs(endpoint_url=proxy.url)
        fs.pipe_file(f"{BUCKET}/proxy-check", b"abc")
        assert fs.cat_file(f"{BUCKET}/proxy-check") == b"abc"
        assert any(m == "PUT" for m, _ in proxy.requests)
    finally:
        proxy.stop()
