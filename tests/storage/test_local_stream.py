"""Streamed direct reads of local files (``LocalStorage.stream_into``, ckptmgr/storage/_stream.py):
the bytes, the order, the ends of files, failures, early stops, and when a stream is declined."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointManager
from ckptmgr.errors import CorruptCheckpointError, StorageError
from ckptmgr.storage import StreamReads, _stream, local
from ckptmgr.storage.local import LocalStorage

KIB = 1 << 10
MIB = 1 << 20


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 64 KiB and a ring of two: every request crosses blocks and the I/O threads
    wait for the copy, as they do for a multi-GiB restore."""
    monkeypatch.setattr(_stream, "BLOCK", 64 * KIB)
    monkeypatch.setattr(_stream, "_RING", 2)


def _io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ckptmgr-read-io")]


def _stream_fails(store: LocalStorage, reqs: list[tuple[str, int, memoryview]],
                  match: str) -> None:
    """Streaming ``reqs`` raises StorageError matching ``match``, and no I/O thread is left."""
    stream = store.stream_into(reqs)
    assert stream is not None
    with pytest.raises(StorageError, match=match):
        list(stream)
    assert _io_threads() == []


def _files(root: Path, sizes: dict[str, int], seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    out = {}
    for name, n in sizes.items():
        data = rng.randbytes(n)
        (root / name).write_bytes(data)
        out[name] = data
    return out


def _requests(files: dict[str, bytes], rng: random.Random) -> list[tuple[str, int, memoryview]]:
    """Sorted runs of each file: adjacent, with gaps small and large, unaligned, empty ones, and
    an overlap (a request that starts before the previous one ended)."""
    reqs: list[tuple[str, int, memoryview]] = []
    for name, data in files.items():
        pos = 0
        while pos < len(data):
            n = min(len(data) - pos, rng.choice([0, 1, 7, 4095, 4096, 5000, 70 * KIB, 300 * KIB]))
            reqs.append((name, pos, memoryview(bytearray(n))))
            pos += n + rng.choice([0, 0, 0, 3, 4096, 2 * MIB])
            if rng.random() < 0.05 and pos > 10:
                pos -= 10  # overlaps the previous request
    return reqs


def test_stream_fills_every_request_in_order(tmp_path: Path, small_blocks: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "DIRECT_READ", True)
    files = _files(tmp_path, {"a": 3 * MIB + 123, "b": 64 * KIB, "c": 1, "d": 5 * MIB})
    store = LocalStorage(str(tmp_path))
    assert isinstance(store, StreamReads)
    for seed in range(4):
        reqs = _requests(files, random.Random(seed))
        if seed == 3:
            reqs.reverse()  # any order: out-of-order requests are extents of their own
        stream = store.stream_into(reqs)
        assert stream is not None
        assert list(stream) == list(range(len(reqs)))
        for name, offset, buf in reqs:
            assert bytes(buf) == files[name][offset:offset + len(buf)], (seed, name, offset)
    assert _io_threads() == []


def test_stream_into_tensor_memory_of_any_dtype(tmp_path: Path, small_blocks: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "DIRECT_READ", True)
    files = _files(tmp_path, {"f": 2 * MIB})
    dests = [torch.empty(1000, dtype=torch.float32), torch.empty(333, dtype=torch.float16),
             torch.empty(0, dtype=torch.int64), torch.empty(70000, dtype=torch.uint8)]
    reqs = []
    pos = 17
    for t in dests:
        view = memoryview(t.numpy()).cast("B") if t.numel() else memoryview(bytearray(0))
        reqs.append(("f", pos, view))
        pos += len(view)
    stream = LocalStorage(str(tmp_path)).stream_into(reqs)
    assert stream is not None and list(stream) == [0, 1, 2, 3]
    for (_, offset, _), t in zip(reqs, dests, strict=True):
        n = t.numel() * t.element_size()
        assert t.numpy().tobytes() == files["f"][offset:offset + n]


def test_file_shorter_than_a_request_is_a_storage_error(tmp_path: Path, small_blocks: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "DIRECT_READ", True)
    _files(tmp_path, {"short": 100 * KIB})
    reqs = [("short", 0, memoryview(bytearray(60 * KIB))),
            ("short", 60 * KIB, memoryview(bytearray(60 * KIB)))]
    stream = LocalStorage(str(tmp_path)).stream_into(reqs)
    assert stream is not None
    got = []
    with pytest.raises(StorageError, match=r"short: file ends at byte 102400, wanted 122880"):
        for k in stream:
            got.append(k)
    assert got == [0]  # the whole first request came before the error
    assert _io_threads() == []


def test_missing_file_is_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "DIRECT_READ", True)
    _files(tmp_path, {"a": 4 * KIB})
    reqs = [("a", 0, memoryview(bytearray(4 * KIB))), ("gone", 0, memoryview(bytearray(1)))]
    _stream_fails(LocalStorage(str(tmp_path)), reqs, r"read failed for .*/gone: No such file")


def test_read_error_mid_stream_stops_every_thread(tmp_path: Path, small_blocks: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An EIO on the third block (a fault this disk cannot be made to produce): the consumer
    gets a StorageError, the I/O threads end, and the ring's buffers go back to the pool."""
    monkeypatch.setattr(local, "DIRECT_READ", True)
    pool = local._BouncePool()
    monkeypatch.setattr(local, "_BOUNCE_POOL", pool)
    _files(tmp_path, {"a": 1 * MIB})
    real = os.preadv
    calls = []

    def failing(fd: int, bufs: list[memoryview], offset: int, *flags: int) -> int:
        calls.append(offset)
        if offset == 2 * 64 * KIB:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(_stream.os, "preadv", failing)
    stream = LocalStorage(str(tmp_path)).stream_into([("a", 0, memoryview(bytearray(1 * MIB)))])
    assert stream is not None
    with pytest.raises(StorageError, match=r"read failed for .*/a: Input/output error"):
        list(stream)
    assert _io_threads() == []
    assert sum(len(v) for v in pool._idle.values()) == 2  # both ring buffers are back
    assert max(calls) < 1 * MIB  # stopped: not every block was read


def test_closing_early_joins_the_threads(tmp_path: Path, small_blocks: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "DIRECT_READ", True)
    pool = local._BouncePool()
    monkeypatch.setattr(local, "_BOUNCE_POOL", pool)
    _files(tmp_path, {"a": 2 * MIB})
    reqs = [("a", i * 64 * KIB, memoryview(bytearray(64 * KIB))) for i in range(32)]
    stream = LocalStorage(str(tmp_path)).stream_into(reqs)
    assert stream is not None
    assert next(stream) == 0
    assert _io_threads()  # reading ahead
    stream.close()  # type: ignore[attr-defined]
    assert _io_threads() == []
    assert sum(len(v) for v in pool._idle.values()) == 2


def test_a_read_refused_direct_is_retried_buffered(tmp_path: Path, small_blocks: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that takes O_DIRECT at open but refuses a read (EINVAL): that file is read
    buffered from there on, with the same bytes."""
    monkeypatch.setattr(local, "DIRECT_READ", True)
    files = _files(tmp_path, {"a": 300 * KIB})
    real = os.preadv
    refused = []

    def picky(fd: int, bufs: list[memoryview], offset: int, *flags: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & local._O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(_stream.os, "preadv", picky)
    buf = memoryview(bytearray(300 * KIB))
    stream = LocalStorage(str(tmp_path)).stream_into([("a", 0, buf)])
    assert stream is not None and list(stream) == [0]
    assert bytes(buf) == files["a"]
    assert 1 <= len(refused) <= 2  # each I/O thread may meet the refusal once


def test_declined_when_small_cached_or_switched_off(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStorage(str(tmp_path))
    big = local._STREAM_MIN
    _files(tmp_path, {"big": big, "small": 4 * KIB})
    req = [("big", 0, memoryview(bytearray(big)))]
    monkeypatch.setattr(local, "DIRECT_READ", None)
    assert store.stream_into([("small", 0, memoryview(bytearray(4 * KIB)))]) is None
    # Just written through the page cache and read: cached, so the copy is cheaper.
    with open(tmp_path / "big", "rb") as f:
        f.read()
    assert _stream.resident_share([(str(tmp_path / "big"), 0)], local.open_regular) == 1.0
    assert store.stream_into(req) is None
    # Dropped from the cache: streamed.
    fd = os.open(tmp_path / "big", os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    share = _stream.resident_share([(str(tmp_path / "big"), o) for o in range(0, big, 4 * MIB)],
                                   local.open_regular)
    if share is None or share >= 0.5:
        pytest.skip("the page cache of this file system cannot be dropped here")
    stream = store.stream_into(req)
    assert stream is not None and list(stream) == [0]
    monkeypatch.setattr(local, "DIRECT_READ", False)
    assert store.stream_into(req) is None
    assert store.stream_into([]) is None


def test_declined_where_o_direct_is_refused(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs before Linux 6.6 and some FUSE file systems refuse O_DIRECT at open (EINVAL): the
    reader reads buffered (a stand-in refuses the open: this kernel's file systems take it)."""
    monkeypatch.setattr(local, "DIRECT_READ", True)
    _files(tmp_path, {"a": 4 * KIB})
    real = local.open_regular

    def refuse(path: str, flags: int = 0) -> int:
        if flags & local._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags)

    monkeypatch.setattr(local, "open_regular", refuse)
    assert LocalStorage(str(tmp_path)).stream_into([("a", 0, memoryview(bytearray(4)))]) is None


@pytest.mark.parametrize("direct_read", [True, False])
def test_restore_streams_bit_exact_and_finds_corruption(
        tmp_path: Path, small_blocks: None, monkeypatch: pytest.MonkeyPatch,
        direct_read: bool) -> None:
    """A restore through the manager, streamed or not: every dtype, a non-contiguous target (a
    buffer, then copied), an empty tensor, a value; then one flipped byte is a checksum error."""
    monkeypatch.setattr(local, "DIRECT_READ", direct_read)
    calls = []
    real = local.stream_into
    monkeypatch.setattr(local, "stream_into",
                        lambda *a: (calls.append(len(a[0])), real(*a))[1])
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(40)}
    state |= {"half": torch.randn(333, generator=g).half(), "ids": torch.arange(5000),
              "mask": torch.rand(777, generator=g) > 0.5, "empty": torch.empty(0),
              "grid": torch.randn(64, 48, generator=g), "step": 12}
    mgr = CheckpointManager(str(tmp_path / "root"), save_interval=1)
    try:
        mgr.save(1, state)
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                  for k, v in state.items()}
        target["grid"] = torch.zeros(48, 64).t()  # non-contiguous: read into a buffer
        mgr.restore(1, target)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(target[k], v), k
        assert target["step"] == 12
        assert bool(calls) is direct_read
        data = max((p for p in (tmp_path / "root").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            mgr.restore(1, target)
    finally:
        mgr.close()
    assert _io_threads() == []


def test_fifos_and_links_never_block_or_get_followed(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A step directory holding a FIFO or a symbolic link where a data file should be (crafted or
    damaged): nothing blocks on the FIFO, nothing reads through the link."""
    monkeypatch.setattr(local, "DIRECT_READ", True)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real").write_bytes(b"x" * 8192)
    os.symlink(tmp_path / "real", tmp_path / "link")
    store = LocalStorage(str(tmp_path))
    assert _stream.resident_share([(str(tmp_path / "fifo"), 0)], local.open_regular) is None
    # Declined (not a regular file), and the buffered reader refuses it.
    assert store.stream_into([("fifo", 0, memoryview(bytearray(10)))]) is None
    with pytest.raises(StorageError, match="FIFO"):
        store.read_into("fifo", 0, memoryview(bytearray(10)))
    _stream_fails(store, [("link", 0, memoryview(bytearray(10)))], r"read failed for .*/link")


def test_each_file_is_closed_once_read(tmp_path: Path, small_blocks: None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of small files (a restore of shared chunks) never hold thousands of
    descriptors: a file is closed once its last block is copied out."""
    monkeypatch.setattr(local, "DIRECT_READ", True)
    files = _files(tmp_path, {f"c{i:03d}": 5000 + i for i in range(200)})
    opened: list[int] = []
    real_open = local.LocalStorage._open_direct

    def counting(self: LocalStorage, path: str) -> int:
        fd = real_open(self, path)
        opened.append(fd)
        return fd

    monkeypatch.setattr(local.LocalStorage, "_open_direct", counting)
    reqs = [(name, 0, memoryview(bytearray(len(data)))) for name, data in files.items()]
    stream = LocalStorage(str(tmp_path)).stream_into(reqs)
    assert stream is not None
    peak = 0
    for k in stream:
        still_open = sum(1 for fd in set(opened) if _is_open(fd))
        peak = max(peak, still_open)
        assert bytes(reqs[k][2]) == files[reqs[k][0]]
    assert len(opened) == 200 and peak <= 2 + _stream._RING


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to read a file as another user")
def test_files_of_another_user_are_never_probed(tmp_path: Path) -> None:
    """The kernel reports every page of a file the caller neither owns nor may write as resident
    (a side-channel guard): such files (a base checkpoint another account wrote) are not asked
    about, so their restores still stream instead of always reading buffered."""
    path = tmp_path / "theirs.bin"
    path.write_bytes(os.urandom(1 * MIB))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o644)
    code = ("import sys; from ckptmgr.storage import _stream, local; "
            f"print(_stream.resident_share([({str(path)!r}, 0)], local.open_regular))")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd="/", env={**os.environ, "HOME": "/"})
    if out.returncode != 0 and "Permission denied" in out.stderr:
        pytest.skip(f"the interpreter is not readable by another user: {out.stderr[-200:]}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
    assert _stream.resident_share([(str(path), 0)], local.open_regular) == 0.0  # the owner asks


def test_two_io_threads_refused_direct_at_once_both_go_buffered(
        tmp_path: Path, small_blocks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both I/O threads' direct reads are refused before either has switched the file to
    buffered: each retries buffered (the second used to find the switch done and raise)."""
    monkeypatch.setattr(local, "DIRECT_READ", True)
    files = _files(tmp_path, {"a": 300 * KIB})
    real = os.preadv
    both = threading.Barrier(2, timeout=10)
    first: set[int] = set()

    def racing(fd: int, bufs: list[memoryview], offset: int, *flags: int) -> int:
        me = threading.get_ident()
        if me not in first:
            first.add(me)
            both.wait()  # both reads were issued direct
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(_stream.os, "preadv", racing)
    buf = memoryview(bytearray(300 * KIB))
    stream = LocalStorage(str(tmp_path)).stream_into([("a", 0, buf)])
    assert stream is not None and list(stream) == [0]
    assert bytes(buf) == files["a"] and len(first) == 2


def test_two_writer_threads_refused_direct_at_once_both_go_buffered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct writer's I/O threads likewise: two writes refused before the switch both
    retry buffered, and the file is whole."""
    monkeypatch.setattr(local, "_DIRECT_BUF", 65536)
    monkeypatch.setattr(local, "_COPY_BUF_MIN", 65536)
    w = LocalStorage(str(tmp_path)).open_writer("f", size_hint=1 * MIB)
    if not isinstance(w, local._DirectWriter):
        w.abort()
        pytest.skip("no O_DIRECT on this file system")
    real = os.pwrite
    both = threading.Barrier(2, timeout=10)
    first: set[int] = set()

    def racing(fd: int, data: memoryview, offset: int) -> int:
        me = threading.get_ident()
        if me not in first and len(first) < 2:
            first.add(me)
            both.wait()
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", racing)
    data = os.urandom(1 * MIB)
    w.write(data)
    w.commit()
    assert (tmp_path / "f").read_bytes() == data and len(first) == 2
