"""Optional storage capabilities: declared by protocols, checked with ``isinstance``, forwarded
truthfully by wrappers, and never needed: a storage without them saves and restores the same."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _faulty import FaultyStorage, wrap

import ckptmgr.storage
from ckptmgr import CheckpointManager, StorageError
from ckptmgr.dcp import reader as dcp_reader
from ckptmgr.storage import (
    AtomicRename,
    RangeReads,
    Storage,
    StorageWriter,
    StreamReads,
    VectoredWriter,
    open_storage,
)


@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://capability-tests/{uuid.uuid4().hex}"
    yield url
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _writer(storage: Storage, path: str) -> StorageWriter:
    storage.makedirs(path.rsplit("/", 1)[0])
    return storage.open_writer(path)


def test_backends_declare_their_capabilities(tmp_path: os.PathLike[str], memory_url: str) -> None:
    local = open_storage(os.path.join(tmp_path, "r"))
    mem = open_storage(memory_url)
    for st in (local, mem):
        assert isinstance(st, Storage) and isinstance(st, RangeReads)
        w = _writer(st, "1/f")
        assert isinstance(w, VectoredWriter)
        w.abort()
    assert isinstance(local, AtomicRename)
    assert not isinstance(mem, AtomicRename)  # object stores have no rename
    assert not hasattr(mem, "rename")


def test_wrapper_forwards_exactly_the_inner_capabilities(tmp_path: os.PathLike[str],
                                                        memory_url: str) -> None:
    local = wrap(open_storage(os.path.join(tmp_path, "r")))
    mem = wrap(open_storage(memory_url))
    assert isinstance(local, (Storage, FaultyStorage))
    assert isinstance(local, AtomicRename) and isinstance(local, RangeReads)
    assert isinstance(local, StreamReads) and not isinstance(mem, StreamReads)
    assert not isinstance(mem, AtomicRename) and isinstance(mem, RangeReads)
    assert not hasattr(mem, "rename") and not hasattr(mem, "stream_into")
    for st in (local, mem):
        w = _writer(st, "1/f")
        assert isinstance(w, VectoredWriter)
        w.writev([b"ab", memoryview(b"cd")])
        w.commit()
        assert st.read_bytes("1/f") == b"abcd"
    # What the wrapper forwards really works, and its faults reach the caller.
    local.makedirs(".tmp-2-x")
    local.write_bytes(".tmp-2-x/commit.json", b"{}")
    local.fsync_dir(".tmp-2-x")
    local.rename(".tmp-2-x", "2")
    assert local.read_bytes("2/commit.json") == b"{}"
    with mem.open_reader("1/f") as r:
        buf = bytearray(3)
        r.readv_into(1, [memoryview(buf)])
    assert bytes(buf) == b"bcd"
    local.fail_ops.add("rename")
    with pytest.raises(StorageError, match="injected"):
        local.rename("2", "3")
    buf = bytearray(4)
    stream = local.stream_into([("1/f", 0, memoryview(buf))])
    if stream is not None:  # declined for 4 bytes unless local.DIRECT_READ is True
        assert list(stream) == [0] and bytes(buf) == b"abcd"
    local.fail_ops.add("stream_into")
    with pytest.raises(StorageError, match="injected"):
        local.stream_into([("1/f", 0, memoryview(buf))])


def test_wrapper_hides_what_it_is_told_to_and_never_claims_more(
        tmp_path: os.PathLike[str]) -> None:
    bare = wrap(open_storage(os.path.join(tmp_path, "r")),
                hide=[AtomicRename, RangeReads, StreamReads, VectoredWriter])
    assert isinstance(bare, Storage)
    assert not isinstance(bare, AtomicRename) and not isinstance(bare, RangeReads)
    assert not isinstance(bare, StreamReads)
    w = _writer(bare, "1/f")
    assert not isinstance(w, VectoredWriter)
    w.write(b"xyz")
    w.commit()
    # Wrapping a wrapper: still only what the innermost storage can do.
    again = wrap(bare)
    assert not isinstance(again, AtomicRename) and not isinstance(again, RangeReads)
    assert type(wrap(bare)) is type(again)  # one class per set of capabilities


def test_reader_without_range_reads_scatters_ranges(tmp_path: os.PathLike[str]) -> None:
    st = open_storage(os.path.join(tmp_path, "r"))
    st.makedirs("1")
    data = bytes(range(200))
    st.write_bytes("1/f", data)
    for storage in (st, wrap(st, hide=[RangeReads])):
        r = dcp_reader._RangeReader(storage, "1/f")
        a, b = bytearray(10), bytearray(30)
        r.readv_into(50, [memoryview(a), memoryview(b)])
        r.readv_into(5, [memoryview(a)])
        r.close()
        assert bytes(a) == data[5:15] and bytes(b) == data[60:90]


def _patch_open_storage(monkeypatch: pytest.MonkeyPatch, **wrap_args: Any) -> list[Storage]:
    """Make every ckptmgr module open its storage through :func:`wrap`."""
    real = ckptmgr.storage.open_storage
    opened: list[Storage] = []

    def opener(*args: Any, **kwargs: Any) -> Storage:
        st = wrap(real(*args, **kwargs), **wrap_args)
        opened.append(st)
        return st

    for name, mod in list(sys.modules.items()):
        if name.startswith("ckptmgr") and getattr(mod, "open_storage", None) is real:
            monkeypatch.setattr(mod, "open_storage", opener)
    return opened


def test_save_and_restore_without_range_reads_or_vectored_writes(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    opened = _patch_open_storage(monkeypatch, hide=[RangeReads, VectoredWriter])
    state = {"w": torch.randn(300, 7), "b": torch.arange(1000), "extra": {"epoch": 3}}
    out = {"w": torch.zeros(300, 7), "b": torch.zeros(1000, dtype=torch.int64),
           "extra": {"epoch": 0}}
    with CheckpointManager(os.path.join(tmp_path, "r"), save_interval=1) as mgr:
        mgr.save(1, state)
        mgr.restore(1, out)
    assert opened and not any(isinstance(s, RangeReads) for s in opened)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["extra"] == {"epoch": 3}
