"""Copies into the bounce buffers made on the I/O threads (``_DirectWriter(io_copies=True)``,
``ckptmgr.storage.local.COPY_IN_IO_THREADS``): the same file as copies on the caller's thread
for random sequences of writes, sources kept alive until copied, and failures or an abort with
copies still queued leaving no file, no thread and every bounce buffer back in the pool."""

from __future__ import annotations

import mmap
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _memory import huge_page_arena

from ckptmgr import CheckpointManager
from ckptmgr.dcp.tensor_bytes import tensor_memoryview
from ckptmgr.errors import StorageError
from ckptmgr.storage import local
from ckptmgr.storage.local import LocalStorage

KIB = 1 << 10
MIB = 1 << 20


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> local._BouncePool:
    p = local._BouncePool()
    monkeypatch.setattr(local, "_BOUNCE_POOL", p)
    return p


def _writer(root: Path, size_hint: int, io_copies: bool) -> local._DirectWriter:
    storage = LocalStorage(str(root))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | local._O_DIRECT
    try:
        fd = os.open(root / "f", flags, 0o644) if local._O_DIRECT else -1
    except OSError:
        fd = -1
    if fd < 0:
        pytest.skip("no O_DIRECT on this file system")
    return local._DirectWriter(storage, "f", fd, local.direct_buffer_size(size_hint), size_hint,
                               io_copies=io_copies)


def _copy_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that made deferred copies."""
    names: list[str] = []
    real = local._make_copies

    def recording(copies: list[local._Copy]) -> None:
        if copies:
            names.append(threading.current_thread().name)
        real(copies)

    monkeypatch.setattr(local, "_make_copies", recording)
    return names


def _write_and_fail(w: local._DirectWriter, count: int, match: str) -> None:
    """Write ``count`` random 3 MiB tensors and commit, which must fail with StorageError
    ``match``; the writer is aborted then, as the dcp writer does when a write raises."""
    parts = [torch.randint(0, 256, (3 * MIB,), dtype=torch.uint8) for _ in range(count)]
    with pytest.raises(StorageError, match=match):
        try:
            for t in parts:
                w.write_unbuffered(tensor_memoryview(t), t)
            w.commit()
        except StorageError:
            w.abort()
            raise


def _play(w: local._DirectWriter, seed: int, arena: tuple[mmap.mmap, int]) -> bytes:
    """Random writes (small and large, writable and read-only, temporaries dropped at once,
    staging slots registered as huge pages); returns the bytes the file must hold."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    m, _ = arena
    out = bytearray()
    slot = 0
    for _ in range(rng.randrange(4, 24)):
        kind = rng.random()
        n = rng.choice([1, 100, 4095, 40 * KIB, 64 * KIB, 65 * KIB + 7, 300 * KIB, 1 * MIB + 3,
                        5 * MIB + 1])
        if kind < 0.15:
            data = rng.randbytes(min(n, 200 * KIB))
            w.write(data)  # read-only: copied at once
            out += data
        elif kind < 0.3 and slot + n + 4 * KIB <= len(m):
            # A staging slot (page-aligned, zero tail): written from its memory as a run.
            view = memoryview(m)[slot:slot + n]
            start = w.write_unbuffered(view, m)
            out += bytes(start - len(out))  # the padding the run adds
            out += view
            slot = -(-(slot + n) // 4096) * 4096
        else:
            t = torch.randint(0, 256, (n + rng.randrange(0, 9),), dtype=torch.uint8,
                              generator=gen)
            t = t[rng.randrange(0, 9):]  # any address alignment
            expect = bytes(t.numpy())
            start = w.write_unbuffered(tensor_memoryview(t), t)
            assert start == len(out)
            out += expect
            del t  # freed now unless the writer keeps it alive until copied (refcounts)
    return bytes(out)


@pytest.fixture
def arena() -> Iterator[tuple[mmap.mmap, int]]:
    """8 MiB of staging-like memory (random bytes, registered as huge pages)."""
    with huge_page_arena(8 * MIB) as a:
        yield a


@pytest.mark.parametrize("seed", range(12))
def test_io_copies_write_what_caller_copies_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: local._BouncePool,
        arena: tuple[mmap.mmap, int], seed: int) -> None:
    """The same random writes give the same file with either copy placement, and with
    io_copies the large copies really ran on the I/O threads (or, for a file of one buffer, at
    commit on the caller's)."""
    files = {}
    for io_copies in (False, True):
        names = _copy_threads(monkeypatch)
        w = _writer(tmp_path, 6 * MIB, io_copies)
        expect = _play(w, seed, arena)
        w.commit()
        files[io_copies] = (tmp_path / "f").read_bytes()
        assert files[io_copies] == expect, (seed, io_copies)
        if not io_copies:
            assert names == []
        else:
            assert all(n.startswith("ckptmgr-io-") or n == "MainThread" for n in names), names
        monkeypatch.setattr(local, "_make_copies", local._make_copies)
    assert files[False] == files[True]
    assert sum(len(v) for v in pool._idle.values()) == local._COPY_NBUF


def test_large_files_copy_on_the_io_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            pool: local._BouncePool) -> None:
    """Items over _DEFER_MIN that fill several buffers: their copies run on the I/O threads,
    items under it are copied by the caller at once."""
    names = _copy_threads(monkeypatch)
    deferred: list[int] = []
    real = local._make_copies

    def sizes(copies: list[local._Copy]) -> None:
        deferred.extend(len(src) for _, src, _ in copies)
        real(copies)

    monkeypatch.setattr(local, "_make_copies", sizes)
    w = _writer(tmp_path, 16 * MIB, io_copies=True)
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8)
             for n in (3 * MIB + 5, 1000, 7 * MIB, local._DEFER_MIN - 1, 6 * MIB)]
    for t in parts:
        w.write_unbuffered(tensor_memoryview(t), t)
    w.commit()
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(t.numpy()) for t in parts)
    assert sum(deferred) == sum(t.numel() for t in parts if t.numel() >= local._DEFER_MIN)
    assert names and not [n for n in names if n == "MainThread"][1:]  # at most commit's
    del names


def test_a_copy_before_a_staging_run_and_in_a_one_buffer_file(
        tmp_path: Path, pool: local._BouncePool, arena: tuple[mmap.mmap, int]) -> None:
    """A deferred copy still in the buffer when a run starts (the buffer's bytes go out as a
    private copy) or when a file of one buffer commits (written inline): made first."""
    m, _ = arena
    t = torch.randint(0, 256, (100 * KIB,), dtype=torch.uint8)
    w = _writer(tmp_path, 4 * MIB, io_copies=True)
    w.write_unbuffered(tensor_memoryview(t), t)
    assert w._copies  # deferred, under _COPY_BELOW: the run start copies the buffer privately
    start = w.write_unbuffered(memoryview(m)[:MIB], m)
    w.commit()
    blob = (tmp_path / "f").read_bytes()
    assert blob[:len(t)] == bytes(t.numpy()) and blob[start:] == m[:MIB]
    assert not any(blob[len(t):start])
    w = _writer(tmp_path, 200 * KIB, io_copies=True)
    w.write_unbuffered(tensor_memoryview(t), t)
    assert w._copies and not w._threads
    w.commit()
    assert (tmp_path / "f").read_bytes() == bytes(t.numpy())


@pytest.mark.parametrize("seed", range(6))
def test_abort_with_copies_queued(tmp_path: Path, pool: local._BouncePool,
                                  arena: tuple[mmap.mmap, int], seed: int) -> None:
    """An abort at a random point (copies deferred in the open buffer, others queued or being
    made): no file, no I/O thread, every bounce buffer back once."""
    w = _writer(tmp_path, 6 * MIB, io_copies=True)
    rng = random.Random(seed)
    parts = [torch.randint(0, 256, (rng.randrange(64 * KIB, 3 * MIB),), dtype=torch.uint8)
             for _ in range(rng.randrange(1, 6))]
    for t in parts:
        w.write_unbuffered(tensor_memoryview(t), t)
    threads = list(w._threads)
    w.abort()
    assert not (tmp_path / "f").exists()
    assert not [t for t in threads if t.is_alive()]
    assert sum(len(v) for v in pool._idle.values()) == local._COPY_NBUF


def test_an_io_error_with_io_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    pool: local._BouncePool) -> None:
    """An EIO (a fault this disk cannot be made to produce) on a buffer whose copies were made
    on an I/O thread: the next write or commit raises StorageError, the later buffers' copies
    are skipped, and nothing is left."""
    real = os.pwrite

    def failing(fd: int, data: memoryview, offset: int) -> int:
        if offset >= 4 * MIB:
            raise OSError(5, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", failing)
    names = _copy_threads(monkeypatch)
    _write_and_fail(_writer(tmp_path, 16 * MIB, io_copies=True), 5, "Input/output error")
    assert names
    assert not (tmp_path / "f").exists()
    assert sum(len(v) for v in pool._idle.values()) == local._COPY_NBUF


def test_saves_with_copies_on_the_io_threads_restore_bit_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager's saves with the copies forced onto the I/O threads restore bit-exact."""
    monkeypatch.setattr(local, "DIRECT_IO", True)
    monkeypatch.setattr(local, "COPY_IN_IO_THREADS", True)
    names = _copy_threads(monkeypatch)
    g = torch.Generator().manual_seed(5)
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        states = {}
        for step in (1, 2):
            states[step] = {f"t{i}": torch.randn(300_000 + 17 * i, generator=g)
                            for i in range(5)}
            states[step]["small"] = torch.arange(7)
            mgr.save(step, states[step])
        for step, state in states.items():
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            mgr.restore(step, out)
            assert all(torch.equal(state[k], out[k]) for k in state), step
    if not names:
        pytest.skip("no O_DIRECT on this file system")


@pytest.mark.parametrize("cap", [4, None], ids=["capped", "uncapped"])
def test_one_filled_buffer_waits_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       pool: local._BouncePool, cap: int | None) -> None:
    """COPY_IN_FLIGHT: at most that many bounce buffers are written at once (the other filled
    ones wait ready for the first to end); with no cap every filled buffer is written at once."""
    monkeypatch.setattr(local, "COPY_IN_FLIGHT", cap)
    inside = 0
    most = 0
    cond = threading.Condition()
    release = threading.Event()
    real = local._DirectWriter._pwrite

    def gated(self: local._DirectWriter, view: memoryview, offset: int) -> None:
        nonlocal inside, most
        with cond:
            inside += 1
            most = max(most, inside)
            cond.notify_all()
        try:
            assert release.wait(60), "never released"
            real(self, view, offset)
        finally:
            with cond:
                inside -= 1

    monkeypatch.setattr(local._DirectWriter, "_pwrite", gated)
    data = torch.randint(0, 256, (40 * MIB,), dtype=torch.uint8)
    w = _writer(tmp_path, 40 * MIB, io_copies=False)
    assert w._bufsize == 4 * MIB
    worker = threading.Thread(target=w.write_unbuffered, args=(tensor_memoryview(data), data))
    worker.start()
    try:
        with cond:
            assert cond.wait_for(lambda: inside == (cap or local._COPY_NBUF), timeout=60)
            # Every buffer is filled and handed over; a cap keeps the last two from the disk.
            assert cond.wait_for(lambda: inside > (cap or 99), timeout=0.5) is False
    finally:
        release.set()
        worker.join()
    w.commit()
    assert most == (cap or local._COPY_NBUF)
    assert (tmp_path / "f").read_bytes() == bytes(data.numpy())


def test_a_failure_that_is_not_the_disks_fails_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: local._BouncePool) -> None:
    """A deferred copy that raises something other than OSError on an I/O thread (found by
    review: the thread died, the buffer went out unwritten, and commit succeeded with a hole):
    commit raises StorageError and removes the file."""
    def broken(copies: list[local._Copy]) -> None:
        if copies:
            raise BufferError("source released (injected)")

    monkeypatch.setattr(local, "_make_copies", broken)
    _write_and_fail(_writer(tmp_path, 16 * MIB, io_copies=True), 4, "source released")
    assert not (tmp_path / "f").exists()
    assert sum(len(v) for v in pool._idle.values()) == local._COPY_NBUF


def test_an_interrupt_while_aborting_still_joins_and_removes(
        tmp_path: Path, pool: local._BouncePool) -> None:
    """Found by review: a Ctrl-C while abort sent the I/O threads the end of their queue left
    threads unjoined (reading the caller's memory) and skipped the close, unlink and release."""
    w = _writer(tmp_path, 16 * MIB, io_copies=True)
    parts = [torch.randint(0, 256, (3 * MIB,), dtype=torch.uint8) for _ in range(3)]
    for t in parts:
        w.write_unbuffered(tensor_memoryview(t), t)
    threads = list(w._threads)
    assert threads
    real = w._work
    sent: list[object] = []

    class Interrupted:
        def put(self, job: object) -> None:
            if job is None and not sent:
                sent.append(job)
                raise KeyboardInterrupt
            real.put(job)  # type: ignore[arg-type]

        def get(self) -> object:
            return real.get()

    w._work = Interrupted()  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            w.abort()
        assert not [t for t in threads if t.is_alive()]
        assert w._fd is None and not (tmp_path / "f").exists()
        assert sum(len(v) for v in pool._idle.values()) == local._COPY_NBUF
    finally:
        for _ in threads:
            real.put(None)  # threads left by a regression end here
