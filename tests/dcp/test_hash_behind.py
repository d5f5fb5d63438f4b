"""Checksums made behind the copies on a thread of their own (``ckptmgr.dcp.writer.HASH_BEHIND``,
``_HashBehind``): the same item and file checksums as hashing on the stream's thread, every
item verified, and a failed or stopped write leaving no hashing thread behind."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptmgr import CheckpointManager
from ckptmgr.codec.layout import MANIFEST_NAME
from ckptmgr.codec.manifest import decode_manifest
from ckptmgr.dcp import writer
from ckptmgr.errors import CkptmgrError, StorageError
from ckptmgr.storage import local
from ckptmgr.tools.inspect import verify_steps


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(700_000, generator=g)
    return {
        "big": big,
        "view": big[1::3],  # not contiguous: written from a copy the writer makes
        "mid": torch.randn(3, 70_001, generator=g),
        "small": torch.arange(9, dtype=torch.int16),
        "half": torch.randn(50_000, generator=g).half(),
        "config": {"lr": 0.5, "name": "run", "sizes": [1, 2, 3]},
        "empty": torch.empty(0),
    }


def _hashing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptmgr-hash"]


@pytest.mark.parametrize("copy_all", [True, False], ids=["copy-all", "from-memory"])
def test_checksums_behind_equal_checksums_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 copy_all: bool) -> None:
    """One state saved with each placement of the hashing: every item's checksum and every data
    file's checksum are the same, both steps verify, and both restore bit-exact."""
    monkeypatch.setattr(local, "DIRECT_IO", True)
    monkeypatch.setattr(local, "COPY_ALL", copy_all)
    state = _state(1)
    root = tmp_path / "run"
    started: list[int] = []
    real = writer._HashBehind.__init__

    def counting(self: writer._HashBehind) -> None:
        started.append(1)
        real(self)

    monkeypatch.setattr(writer._HashBehind, "__init__", counting)
    with CheckpointManager(str(root), save_interval=1) as mgr:
        for step, behind in ((1, False), (2, True)):
            monkeypatch.setattr(writer, "HASH_BEHIND", behind)
            mgr.save(step, state)
        if not started:
            pytest.skip("no O_DIRECT on this file system: the storage takes no item whole")
        for step in (1, 2):
            out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                   for k, v in state.items()}
            mgr.restore(step, out)
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(out[k], v), (step, k)
    assert [v.ok for v in verify_steps(str(root), [1, 2])] == [True, True]
    sums = []
    for step in (1, 2):
        m = decode_manifest((root / str(step) / MANIFEST_NAME).read_bytes())
        data = [f for f in m.files if f.path.startswith("data-")]
        sums.append(sorted((f.size, f.checksum) for f in data))
    assert sums[0] == sums[1]
    assert not _hashing_threads()


def test_a_failed_write_leaves_no_hashing_thread(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails mid-file (a fault this disk cannot be made to produce): the save
    raises our error, nothing is committed, and the hashing thread has ended."""
    monkeypatch.setattr(local, "DIRECT_IO", True)
    monkeypatch.setattr(writer, "HASH_BEHIND", True)
    calls = {"n": 0}
    real = local._DirectWriter.write_unbuffered

    def failing(self: local._DirectWriter, data: memoryview, keep: object = None) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise StorageError("disk full (injected)")
        return real(self, data, keep)

    monkeypatch.setattr(local._DirectWriter, "write_unbuffered", failing)
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        with pytest.raises(CkptmgrError, match="disk full"):
            mgr.save(1, _state(2))
        assert mgr.all_steps() == []
    if calls["n"] < 3:
        pytest.skip("no O_DIRECT on this file system")
    assert not _hashing_threads()


def test_hash_behind_stops_and_raises() -> None:
    """stop drops what is queued and joins; a failure on the thread is raised by value."""
    h = writer._HashBehind()
    data = bytearray(b"x" * 1000)
    slot = h.item(memoryview(data), data)
    assert h.value() == writer.checksum(memoryview(data))  # the file: this one item
    assert h.sums[slot] == writer.checksum(memoryview(data))
    h.stop()  # a no-op after value
    broken = writer._HashBehind()
    broken.item(memoryview(b"abc"), None)
    broken.sums.clear()  # the slot the thread fills is gone: it fails with IndexError
    with pytest.raises(IndexError):
        broken.value()
    broken.stop()
    stopped = writer._HashBehind()
    stopped.stop()
    assert not _hashing_threads()
