"""The Storage contract, one suite run against every backend: a local directory, ``memory://``,
and the bucket servers on 127.0.0.1 (moto and SeaweedFS for S3, fake-gcs-server for GCS; started
once per session by conftest.py, skipped with the reason when one cannot start)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest

from ckptmgr.errors import BackendNotInstalledError, ConfigError, StorageError
from ckptmgr.storage import Storage, is_not_found, open_storage, redact_url

BUCKET = "ckpt-tests"
_SERVER_FIXTURES = {"s3": "moto_s3", "s3-seaweedfs": "seaweed_s3", "gcs": "fake_gcs"}


@pytest.fixture(params=["local", "memory", "s3", "gcs", "s3-seaweedfs"])
def storage(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[Storage]:
    """A fresh, empty root on each backend (bucket servers through ``storage_options``)."""
    kind = request.param
    if kind == "local":
        yield open_storage(os.path.join(tmp_path, "root"))
        return
    if kind == "memory":
        url = f"memory://storage-tests/{uuid.uuid4().hex}"
        yield open_storage(url)
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
        return
    server = request.getfixturevalue(_SERVER_FIXTURES[kind])
    scheme = "gs" if kind == "gcs" else "s3"
    prefix = f"{BUCKET}/{uuid.uuid4().hex}"
    yield open_storage(f"{scheme}://{prefix}", server.storage_options())
    with contextlib.suppress(FileNotFoundError):
        server.fs().rm(prefix, recursive=True)


def test_empty_root(storage: Storage) -> None:
    assert storage.scan_root("commit.json") == []
    assert storage.list_files("1") == {}
    assert not storage.exists("1")


def test_write_read_list(storage: Storage) -> None:
    storage.makedirs("5")
    w = storage.open_writer("5/data.bin")
    w.write(b"hello ")
    w.write(memoryview(b"world"))
    w.commit()
    storage.write_bytes("5/commit.json", b"{}")
    storage.makedirs("6")
    storage.write_bytes("6/data.bin", b"x")
    assert storage.read_bytes("5/data.bin") == b"hello world"
    assert storage.read_bytes("5/data.bin", 6, 5) == b"world"
    buf = bytearray(5)
    storage.read_into("5/data.bin", 0, memoryview(buf))
    assert bytes(buf) == b"hello"
    assert storage.size("5/data.bin") == 11
    assert storage.list_files("5") == {"data.bin": 11, "commit.json": 2}
    entries = {e.name: e for e in storage.scan_root("commit.json")}
    assert entries["5"].has_marker and entries["5"].is_dir
    assert not entries["6"].has_marker


def test_short_read_is_an_error(storage: Storage) -> None:
    storage.makedirs("1")
    storage.write_bytes("1/f", b"abc")
    with pytest.raises(StorageError):
        storage.read_bytes("1/f", 1, 10)
    with pytest.raises(StorageError) as ei:
        storage.read_bytes("1/missing")
    assert is_not_found(ei.value) and "1/missing" in str(ei.value)


def test_exclusive_write(storage: Storage) -> None:
    storage.makedirs("1")
    storage.write_bytes("1/m", b"a", exclusive=True)
    with pytest.raises(StorageError):
        storage.write_bytes("1/m", b"b", exclusive=True)
    assert storage.read_bytes("1/m") == b"a"
    storage.write_bytes("1/m", b"c")
    assert storage.read_bytes("1/m") == b"c"


def test_abort_leaves_nothing(storage: Storage) -> None:
    storage.makedirs("1")
    w = storage.open_writer("1/partial")
    w.write(b"x" * 100)
    w.abort()
    assert not storage.exists("1/partial")


def test_remove(storage: Storage) -> None:
    storage.makedirs("1")
    storage.write_bytes("1/a", b"a")
    storage.write_bytes("1/b", b"b")
    storage.remove("1/a")
    assert storage.list_files("1") == {"b": 1}
    storage.remove("1", recursive=True)
    assert not storage.exists("1")
    storage.remove("1", recursive=True)  # absent is fine


def test_local_rename_and_symlinks(tmp_path: os.PathLike[str]) -> None:
    st = open_storage(os.path.join(tmp_path, "r"))
    assert st.supports_rename
    st.makedirs(".tmp-1-x")
    st.write_bytes(".tmp-1-x/commit.json", b"{}")
    st.rename(".tmp-1-x", "1")
    st.fsync_dir("")
    assert st.read_bytes("1/commit.json") == b"{}"
    st.makedirs("2")
    st.write_bytes("2/f", b"1")
    with pytest.raises(StorageError):
        st.rename("1", "2")  # never replaces a non-empty directory
    os.symlink(os.path.join(tmp_path, "r", "1"), os.path.join(tmp_path, "r", "3"))
    entries = {e.name: e for e in st.scan_root("commit.json")}
    assert entries["3"].is_symlink and not entries["3"].is_dir
    assert st.is_symlink("3")


def test_open_storage_errors(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        open_storage("nope://x")
    with pytest.raises(ConfigError, match="storage_options"):
        open_storage(str(tmp_path), {"key": "secret"})
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(BackendNotInstalledError, match=r"ckptmgr\[s3\]"):
            open_storage("s3://bucket/x")


@pytest.mark.parametrize("url,shown", [
    ("s3://AKIA:secretkey@bucket/x", "s3://***@bucket/x"),
    ("https://user:pw@host/p?sig=abc&x=1", "https://***@host/p?sig=***&x=1"),
    ("gs://bucket/run", "gs://bucket/run"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
