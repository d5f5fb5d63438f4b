"""Runs of staging memory written straight from it by the local direct writer
(``write_unbuffered`` on memory registered with ``note_huge_pages``): the bytes, the offsets, the
padding the file checksum covers, where a run breaks, failures, and the registry's lifetime."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _memory import huge_page_arena

from ckptmgr import CheckpointManager
from ckptmgr._async import Stager
from ckptmgr.dcp.tensor_bytes import tensor_memoryview
from ckptmgr.errors import StorageError
from ckptmgr.storage import local
from ckptmgr.storage.local import LocalStorage

KIB = 1 << 10
MIB = 1 << 20


def _direct_writer(root: Path, size_hint: int) -> local._DirectWriter:
    w = LocalStorage(str(root)).open_writer("f", size_hint=size_hint)
    if not isinstance(w, local._DirectWriter):
        w.abort()
        pytest.skip("no O_DIRECT on this file system")
    return w


@pytest.fixture
def arena() -> Iterator[tuple[mmap.mmap, int]]:
    """2 MiB of page-aligned memory registered as huge pages, filled with random bytes."""
    with huge_page_arena(2 * MIB) as a:
        yield a


def _slot(m: mmap.mmap, start: int, n: int) -> memoryview:
    return memoryview(m)[start:start + n]


def _count_pieces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = local._DirectWriter._pwrite

    def counting(self: local._DirectWriter, view: memoryview, offset: int) -> None:
        sizes.append(len(view))
        real(self, view, offset)

    monkeypatch.setattr(local._DirectWriter, "_pwrite", counting)
    return sizes


def test_adjacent_slots_are_one_run_with_zero_padding(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arena: tuple[mmap.mmap, int]) -> None:
    """Page-aligned slots (as staging lays them out) whose tails are zeros: one run, pieces
    larger than any item, the tails' zeros are the file's padding, offsets follow the memory."""
    m, _ = arena
    monkeypatch.setattr(local, "_RUN_PIECE", 64 * KIB)
    monkeypatch.setattr(local, "_DIRECT_MAX_WRITE", 128 * KIB)
    sizes = _count_pieces(monkeypatch)
    slots = [(0, 10_000), (12_288, 300_000), (315_392, 8192), (323_584, 5), (327_680, 700_001)]
    for (start, n), nxt in zip(slots, [*[s for s, _ in slots[1:]], None], strict=True):
        end = nxt if nxt is not None else -(-(start + n) // 4096) * 4096
        m[start + n:end] = bytes(end - start - n)  # zero tails, as fresh staging memory has
    w = _direct_writer(tmp_path, 2 * MIB)
    starts = [w.write_unbuffered(_slot(m, s, n), m) for s, n in slots]
    assert starts == [s for s, _ in slots]  # offsets follow the memory: one run
    w.write(b"end")
    w.commit()
    blob = (tmp_path / "f").read_bytes()
    last = slots[-1][0] + slots[-1][1]
    assert blob == bytes(m[:last]) + b"end"
    assert max(sizes) == 128 * KIB  # pieces span several items


def test_a_run_breaks_on_dirty_padding_gaps_and_copied_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arena: tuple[mmap.mmap, int]) -> None:
    """The file holds exactly the memory's items; padding is zeros wherever the memory's gap
    was not (never the bytes of a dirty gap), and a run never spans copied bytes."""
    m, _ = arena
    monkeypatch.setattr(local, "_RUN_PIECE", 64 * KIB)
    w = _direct_writer(tmp_path, 2 * MIB)
    m[10_000:12_288] = b"\x01" * 2288  # a dirty tail after the first slot
    a = w.write_unbuffered(_slot(m, 0, 10_000), m)
    b = w.write_unbuffered(_slot(m, 12_288, 50_000), m)  # gap not zeros: a new run
    w.write(b"xyz")  # copied bytes close the run
    c = w.write_unbuffered(_slot(m, 65_536, 70_000), m)
    d = w.write_unbuffered(_slot(m, 200_000, 9000), m)  # a gap of more than 4 KiB
    e = w.write_unbuffered(_slot(m, 100_000, 9000), m)  # behind the run: a new one
    w.commit()
    blob = (tmp_path / "f").read_bytes()
    for off, (s, n) in zip([a, b, c, d, e], [(0, 10_000), (12_288, 50_000), (65_536, 70_000),
                                             (200_000, 9000), (100_000, 9000)], strict=True):
        assert blob[off:off + n] == bytes(m[s:s + n])
    assert a == 0 and b == 12_288 and blob[10_000:12_288] == bytes(2288)
    assert blob[62_288:62_291] == b"xyz" and c == 65_536
    pads = [blob[62_291:65_536], blob[135_536:d], blob[d + 9000:e]]
    assert all(p == bytes(len(p)) for p in pads)  # zero padding only


def test_plain_memory_is_copied_unless_copy_all_is_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory nobody registered (a tensor of the caller's) is copied by default; with COPY_ALL
    off, items over _SMALL_COPY are written from it."""
    src = torch.randint(0, 256, (3 * MIB,), dtype=torch.uint8)
    for copy_all in (True, False):
        monkeypatch.setattr(local, "COPY_ALL", copy_all)
        sizes = _count_pieces(monkeypatch)
        w = _direct_writer(tmp_path, 4 * MIB)
        w.write(b"q")
        start = w.write_unbuffered(tensor_memoryview(src[1:]), src)
        w.commit()
        blob = (tmp_path / "f").read_bytes()
        assert blob[start:] == bytes(src[1:].numpy())
        if copy_all:
            assert start == 1
        else:
            assert (src[1:].data_ptr() - start) % 4096 == 0  # aligned as its address
            assert max(sizes) >= 2 * MIB  # the middle straight from memory
        monkeypatch.undo()


def test_io_error_in_a_run_fails_the_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arena: tuple[mmap.mmap, int]) -> None:
    """An EIO on a run's piece (a fault this disk cannot be made to produce) reaches commit as
    StorageError, the partial file is removed, and the bounce buffers go back once."""
    m, _ = arena
    monkeypatch.setattr(local, "_RUN_PIECE", 64 * KIB)
    pool = local._BouncePool()
    monkeypatch.setattr(local, "_BOUNCE_POOL", pool)
    real = os.pwrite

    def failing(fd: int, data: memoryview, offset: int) -> int:
        if offset >= 256 * KIB:
            raise OSError(5, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", failing)
    w = _direct_writer(tmp_path, 2 * MIB)
    with pytest.raises(StorageError, match="Input/output error"):
        try:
            for k in range(8):
                w.write_unbuffered(_slot(m, k * 128 * KIB, 128 * KIB), m)
            w.commit()  # aborts itself when it fails
        except StorageError:
            w.abort()  # what the dcp writer does when a write raises
            raise
    assert not (tmp_path / "f").exists()
    assert sum(len(v) for v in pool._idle.values()) == local._COPY_NBUF


def test_staging_registers_its_memory_while_it_lives() -> None:
    before = len(local._HUGE_SOURCES)
    st = Stager()
    staged = st.stage({f"t{i}": torch.randn(100_000) for i in range(4)})
    if len(local._HUGE_SOURCES) == before:
        pytest.skip("no transparent huge pages here: staging uses plain memory")
    buf = next(iter(staged.values()))
    assert local._in_huge_pages(buf.data_ptr(), buf.numel() * 4)
    del staged, buf
    st.release()
    gc.collect()
    assert len(local._HUGE_SOURCES) == before


def test_background_save_from_staging_verifies_and_restores(tmp_path: Path) -> None:
    """A save_async of tensors of many sizes and dtypes (staged in one huge-page mapping, written
    as runs): ``verify`` checks every file checksum (padding included), restore is bit-exact;
    twice, so the second save reuses the staging of the first."""
    from ckptmgr import tools

    g = torch.Generator().manual_seed(1)
    state: dict[str, object] = {
        f"w{i}": torch.randn(5000 * (i % 7 + 1) + i, generator=g) for i in range(60)}
    state |= {"half": torch.randn(4097, generator=g).half(), "ids": torch.arange(100_003),
              "tiny": torch.tensor([1.5]), "step": 3}
    mgr = CheckpointManager(str(tmp_path / "root"), save_interval=1)
    try:
        for step in (1, 2):
            state["w0"] = torch.randn(5000, generator=g)  # the data changes between saves
            mgr.save_async(step, state)
            mgr.wait_until_finished()
            target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                      for k, v in state.items()}
            mgr.restore(step, target)
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(target[k], v), (step, k)
        results = tools.verify_steps(str(tmp_path / "root"), all_steps=True)
        assert [r.step for r in results] == [1, 2]
        assert all(not r.problems and r.files_checked for r in results), results
    finally:
        mgr.close()


def test_small_staged_items_never_pad_the_file_past_its_preallocation(tmp_path: Path) -> None:
    """Staging lays each tensor on a page of its own: a 64 KiB weight then three tiny tensors (a
    bias, a step counter, ...), 64 times. Every tiny item could continue the run over up to 4 KiB
    of zeros; the file stays within the padding the writer preallocated (size_hint // 64)."""
    layout, pos = [], 0
    for _ in range(64):
        for n in (64 * KIB, 256, 4, 4):
            layout.append((pos, n))
            pos += -(-n // 4096) * 4096
    m = mmap.mmap(-1, pos)
    for start, n in layout:
        m[start:start + n] = os.urandom(n)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    local.note_huge_pages(addr, len(m))
    try:
        hint = sum(n for _, n in layout)
        w = _direct_writer(tmp_path, hint)
        starts = [w.write_unbuffered(memoryview(m)[s:s + n], m) for s, n in layout]
        w.commit()
    finally:
        local.forget_huge_pages(addr)
    blob = (tmp_path / "f").read_bytes()
    assert len(blob) <= hint + hint // 64 + 4096, (len(blob), hint)
    for (s, n), at in zip(layout, starts, strict=True):
        assert blob[at:at + n] == bytes(m[s:s + n])


def test_an_io_error_stops_the_next_item(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arena: tuple[mmap.mmap, int]) -> None:
    """After a failed write, the next write_unbuffered raises (the caller stops hashing and
    queueing the rest), also when the item would continue a run."""
    m, _ = arena
    monkeypatch.setattr(local, "_RUN_PIECE", 64 * KIB)

    def failing(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local.os, "pwrite", failing)
    w = _direct_writer(tmp_path, 2 * MIB)
    w.write_unbuffered(_slot(m, 0, 128 * KIB), m)  # submitted: the I/O thread fails it
    w._stop()  # every submitted write has ended (and failed)
    with pytest.raises(StorageError, match="Input/output error"):
        w.write_unbuffered(_slot(m, 128 * KIB, 128 * KIB), m)
    w.abort()
    assert not (tmp_path / "f").exists()
