"""Checksums made behind the copies on a thread of their own (``ckptmgr.dcp.writer.HASH_BEHIND``,
``HashBehind``): the same item and file checksums as hashing on the stream's thread, every
item verified, and a failed or stopped write leaving no hashing thread behind."""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptmgr import CheckpointManager
from ckptmgr.codec.layout import MANIFEST_NAME
from ckptmgr.codec.manifest import decode_manifest
from ckptmgr.dcp import hash_behind, writer
from ckptmgr.errors import CkptmgrError, SaveError, StorageError
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
    real = hash_behind.HashBehind.__init__

    def counting(self: hash_behind.HashBehind, piece: int) -> None:
        started.append(1)
        real(self, piece)

    monkeypatch.setattr(hash_behind.HashBehind, "__init__", counting)
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
    h = hash_behind.HashBehind(writer._PIECE)
    data = bytearray(b"x" * 1000)
    slot = h.item(memoryview(data), data)
    assert h.value() == writer.checksum(memoryview(data))  # the file: this one item
    assert h.sums[slot] == writer.checksum(memoryview(data))
    h.stop()  # a no-op after value
    broken = hash_behind.HashBehind(writer._PIECE)
    broken.item(memoryview(b"abc"), None)
    broken.sums.clear()  # the slot the thread fills is gone: it fails with IndexError
    with pytest.raises(IndexError):
        broken.value()
    broken.stop()
    stopped = hash_behind.HashBehind(writer._PIECE)
    stopped.stop()
    assert not _hashing_threads()


def test_a_hashing_thread_that_cannot_start_leaves_no_open_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the hashing thread was started after open_writer and before the try that
    aborts the writer, so a thread that could not start (a process at its thread limit) left the
    direct writer open: its descriptor, and with it the unlinked preallocated file's space."""
    monkeypatch.setattr(local, "DIRECT_IO", True)
    monkeypatch.setattr(writer, "HASH_BEHIND", True)
    opened: list[local._DirectWriter] = []
    real_init = local._DirectWriter.__init__

    def recording(self: local._DirectWriter, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(local._DirectWriter, "__init__", recording)
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "ckptmgr-hash":
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    state = {"big": torch.randn(2_000_000), "small": torch.arange(5)}
    root = tmp_path / "run"
    with (CheckpointManager(str(root), save_interval=1) as mgr,
          pytest.raises(SaveError, match="can't start new thread")):
        mgr.save(1, state)
    if not opened:
        pytest.skip("no O_DIRECT on this file system")
    still_open = [w for w in opened if w._fd is not None]
    leaked = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            leaked.append(target)
    for w in still_open:  # clean up after the assertion's evidence is taken
        w.abort()
    assert not still_open and not leaked, (still_open, leaked)


def test_an_interrupt_while_stopping_still_joins_the_hashing_thread() -> None:
    """Found by review: a Ctrl-C between taking the thread and sending it the end of the queue
    left it running (reading the caller's memory after the save returned)."""
    h = hash_behind.HashBehind(writer._PIECE)
    real = h._queue
    sent: list[object] = []

    class Interrupted:
        def put(self, job: Any) -> None:
            if job is None and not sent:
                sent.append(job)
                raise KeyboardInterrupt
            real.put(job)

        def get(self) -> Any:
            return real.get()

    h._queue = Interrupted()  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            h.value()
        assert not _hashing_threads()
    finally:
        real.put(None)  # a thread left by a regression ends here


def test_a_starved_hashing_thread_holds_a_bounded_backlog(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At most BEHIND_MAX bytes wait for the hashing thread: beyond, the stream waits (a GPU
    tensor's host copy is kept alive until hashed)."""
    monkeypatch.setattr(hash_behind, "BEHIND_MAX", 1000)
    monkeypatch.setattr(hash_behind, "BEHIND_BATCH", 1)  # each item handed over on its own
    gate = threading.Event()
    real = writer.Hasher.update

    def slow(self: Any, data: Any) -> None:
        assert gate.wait(30), "the gate never opened"
        real(self, data)

    monkeypatch.setattr(writer.Hasher, "update", slow)
    h = hash_behind.HashBehind(writer._PIECE)
    try:
        blocks = [bytearray(600) for _ in range(4)]
        h.item(memoryview(blocks[0]), blocks[0])
        h.item(memoryview(blocks[1]), blocks[1])  # 600 queued: still room
        third = threading.Thread(target=h.item, args=(memoryview(blocks[2]), blocks[2]))
        third.start()
        third.join(0.5)
        assert third.is_alive()  # 1200 queued: it waits for the thread
        gate.set()
        third.join(30)
        assert not third.is_alive()
        h.item(memoryview(blocks[3]), blocks[3])
        h.value()
        assert h.sums == [writer.checksum(memoryview(b)) for b in blocks]
    finally:
        gate.set()
        h.stop()


def test_small_items_go_over_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Items are handed to the hashing thread in batches of BEHIND_BATCH bytes (one hand-over
    per tiny item cost more in GIL hand-offs than the hashing saved), in order, and the rest at
    value()."""
    monkeypatch.setattr(hash_behind, "BEHIND_BATCH", 1000)
    handed: list[int] = []
    h = hash_behind.HashBehind(writer._PIECE)
    real = h._queue

    class Counting:
        def put(self, batch: Any) -> None:
            if batch is not None:
                handed.append(len(batch))
            real.put(batch)

        def get(self) -> Any:
            return real.get()

    h._queue = Counting()  # type: ignore[assignment]
    blocks = [bytearray(bytes([i]) * 300) for i in range(7)]
    for i, b in enumerate(blocks):
        if i == 3:
            h.pad(bytes(5))
        h.item(memoryview(b), b)
    assert handed == [5]  # three items, the padding and a fourth item: 1205 bytes >= 1000
    whole = b"".join([*map(bytes, blocks[:3]), bytes(5), *map(bytes, blocks[3:])])
    assert h.value() == writer.checksum(memoryview(whole))
    assert handed == [5, 3]  # the rest at value()
    assert h.sums == [writer.checksum(memoryview(b)) for b in blocks]
    h.stop()
