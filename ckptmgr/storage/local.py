"""Local-disk storage on POSIX calls: fsync of files and directories, atomic renames.

Large files go to disk at device speed and with little CPU, and never fill the page cache (a
training job's data-set cache matters more than a checkpoint's). Two byte paths:
- direct I/O, where the file system takes ``O_DIRECT`` (Linux ext4, xfs, ...): no page cache, so
  the kernel spends no CPU on dirty accounting, writeback and reclaim. By default every item is
  copied into six bounce buffers (4-64 MiB: 1/64 of the file), private mappings backed by huge
  pages and kept for the next file (:class:`_BouncePool`): a direct write from 2 MiB pages pins
  512x fewer pages and reaches the disk as requests of its largest size, where a write from a
  tensor's own 4 KiB pages went out as ~1 MiB requests (docs/performance.md, "Huge pages").
  Items lying in memory registered as huge pages (``note_huge_pages``: a background save's
  staging mapping) are written from it instead, adjacent ones as one run of 32-64 MiB writes
  (``write_unbuffered``: the file is padded so their offset has their address's alignment;
  the zeros between staging slots are that padding). With ``COPY_ALL`` off, large items of any
  memory are written from it, and three buffers of 1/32 of the file take the rest. Eight I/O
  threads keep several writes in flight in a preallocated file;
- buffered writes with early writeback: the kernel is asked to start writing each chunk as soon
  as it is written (``sync_file_range``), at most a bounded window is dirty, and pages already on
  disk are dropped (``posix_fadvise(DONTNEED)``), so the disk is busy from the first chunk
  instead of only at the final fsync. Always, where ``O_DIRECT`` is refused (tmpfs, macOS).

Which of the two is faster depends on the disk, and on a virtual disk on the hour (the same
disk's direct and streaming floors swapped places between runs: docs/performance.md), so it is
chosen by measurement, per file system and process (:class:`_PathChooser`): every file of at
least ``_MEASURE_MIN`` bytes is timed from open to fsync; the first such file is a warm-up, written
direct and not counted (a process's first save also pays for allocating its staging and bounce
buffers: a background save's first direct file measured 0.88 GB/s against 2.5-2.9 later, which
made the buffered path look faster for the next five saves); the next four alternate
direct, buffered, direct, buffered, later ones take the path whose recent files wrote faster (by
the median of the last ``_RECENT``; direct on a tie within 5%, for its lower CPU and untouched
page cache), and every ``_EXPLORE_EVERY``-th one takes the other path, so a disk that changed is
noticed. Nothing is written to measure (no probe file): the checkpoints' own files are the
measurement. Smaller files take the path chosen so far.
Readers use ``preadv`` to scatter one contiguous file range into several destination buffers;
a large read of files not in the page cache is streamed instead (``stream_into``): direct reads of
8 MiB blocks into huge-page buffers, read ahead by two I/O threads and copied into the caller's
buffers (``ckptmgr/storage/_stream.py``; ``DIRECT_READ``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import queue
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ckptmgr._threads import finish_surely
from ckptmgr.errors import StorageError
from ckptmgr.storage._stream import StreamEOF, resident_share, stream_into, switch_to_buffered
from ckptmgr.storage.base import RootEntry

__all__ = ["LocalReader", "LocalStorage", "open_regular"]

T = TypeVar("T")
_CHUNK = 64 * 1024 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Writeback is started every _WB_STEP bytes; at most _WB_WINDOW bytes are dirty or in flight.
# Measured here (virtio disk, 1 GiB): 8 MiB / 128 MiB streamed at 1.9-2.1 GB/s against 1.1 GB/s for
# write-everything-then-fsync; larger windows were no faster.
_WB_STEP = 8 * 1024 * 1024
_WB_WINDOW = 128 * 1024 * 1024
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_IOV_MAX = 512  # below every platform's IOV_MAX (1024 on Linux)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
DIRECT_IO: bool | None = None
"""The byte path of local files: None (default) chooses by measurement (module docstring); True
writes with ``O_DIRECT`` wherever the file system takes it; False never does (tests, A/B runs)."""
DIRECT_READ: bool | None = None
"""Large reads (``stream_into``): None (default) streams them with direct reads when they total
at least ``_STREAM_MIN`` bytes and most of their pages are not in the page cache; True streams
every read the caller offers (tests, A/B runs); False never does (buffered ``preadv``)."""
# Below this a restore is a few reads whose latency, not the page cache's CPU, is the cost.
_STREAM_MIN = 32 * 1024 * 1024
_RESIDENT_PROBES = 8  # pages looked up (mincore) to tell a cold read from a warm one
# Files this large are timed and take part in the choice; smaller ones are dominated by fixed costs
# (open, fsync, the host's write cache) and say little about streaming speed.
_MEASURE_MIN = 64 * 1024 * 1024
_RECENT = 5  # files per path whose speeds are compared (the median: one slow outlier is ignored)
_EXPLORE_EVERY = 16  # every 16th large file takes the path not chosen, to notice a changed disk
_PREFER_DIRECT = 1.05  # buffered must write this much faster to be chosen
_DIRECT_ALIGN = 4096  # offsets, lengths and addresses: a multiple of every common block size
# 64 MiB writes: on this machine's throttled virtio disk the floor took 3.3 s/GiB with 8 MiB writes
# and 1.9 s/GiB with 64 MiB; our save went from 1.96x to 1.15x the floor (2 GiB, performance.md).
# The buffers (three) are host memory on top of the state being saved: sized to 1/32 of the file,
# between _DIRECT_BUF_MIN and _DIRECT_BUF, they add at most ~9% of the file and 192 MiB.
_DIRECT_BUF = 64 * 1024 * 1024
_DIRECT_BUF_MIN = 8 * 1024 * 1024
_DIRECT_NBUF = 3  # one being filled, one being written, one spare
# Several writes in flight: on this machine's virtual disk one 64 MiB write at a time left the
# queue empty between writes; writes straight from tensor memory (no copy) with 4 in flight took
# 1 GiB in 1.10x the dd floor's time where the copying writer with one in flight took 1.89x, at
# 0.19 s of CPU instead of 0.46 s. Eight in flight, with the bounce buffer's bytes copied before
# each large item (_COPY_BELOW), wrote 1 GiB of 816 tensors in 0.92x the time of four without the
# copy here (median of 10 interleaved pairs), and eight took 0.93x the time of four on a 16-core
# GPU host's virtual disk; one took 1.39x (docs/performance.md, "Choosing the byte path").
_DIRECT_THREADS = 8
_DIRECT_MAX_WRITE = 64 * 1024 * 1024  # one write of the caller's memory at most
# Before an unbuffered write, the bounce buffer's few bytes (padding, a head, small items) go out
# as a private copy when they are under this size, so the buffer is free at once: handing the
# buffer itself made the producer wait for one of the three buffers before every large item,
# which capped the writes in flight at about five whatever the number of I/O threads. Alone, with
# four threads, it was neutral (0.90x-1.05x in three A/B runs): it is what lets eight pay off.
_COPY_BELOW = 256 * 1024
_ZEROS = bytes(_DIRECT_ALIGN)  # padding of unbuffered writes
# With COPY_ALL off, items up to this size are copied (as before runs: they were batched).
_SMALL_COPY = 1024 * 1024
# A run of unbuffered memory goes to the I/O threads in pieces once this much of it is waiting,
# so that the disk is busy while the caller hashes what it handed over.
_RUN_PIECE = 32 * 1024 * 1024
# Copy every item into the bounce buffers (never write from the caller's memory), which are
# private mappings backed by huge pages and kept for the next file (_BOUNCE_POOL). Measured
# (1 GiB, 816 tensors, interleaved pairs; docs/performance.md): a save 0.89x and 0.77x the time
# of writing from the tensors' own memory, a background save (from huge-page staging) 0.94x.
COPY_ALL = True
_COPY_NBUF = 6  # bounce buffers per file when every item is copied
# When every item is copied, at most this many bounce buffers are being written at once, so
# that the other filled ones wait ready: this disk completes writes in batches (five or six
# 16 MiB writes ending within 1 ms), and with every filled buffer in flight the caller then
# refilled them one at a time while the disk had one or two writes, or none. Measured
# (docs/performance.md, "Round 5"): four I/O threads, the same cap, took 0.925 [0.84-1.00] the
# time of eight, 30/40 pairs. None: no cap (up to all six).
COPY_IN_FLIGHT: int | None = _COPY_NBUF - 2
_COPY_DIV = 64  # each 1/64 of the file: the six hold under 10% of it
_COPY_BUF_MIN = 4 * 1024 * 1024
_POOL_IDLE_MAX = 512 * 1024 * 1024  # idle bounce buffers kept for the next file, in bytes
# Copy write_unbuffered's items into the bounce buffers on the I/O thread that then writes the
# buffer (several buffers' copies side by side while the caller hashes) instead of on the
# caller's thread. Off: it takes more CPU in all (memory is read twice out of cache: 1 GiB took
# 0.278 s of CPU instead of 0.232 s) and lost on 2 cores whether the disk or the CPUs set the
# pace (1.10x and 1.03x the time, 3/10 and 2/10 pairs; docs/performance.md, "Round 5"). It is
# there to be measured where the caller's copy and hashes, not the disk, may set the pace (a
# many-core host with a fast disk: benchmarks/disk_ab.sh pairs it). Pieces under _DEFER_MIN
# are always copied by the caller.
COPY_IN_IO_THREADS = False
_DEFER_MIN = 64 * 1024


class _BouncePool:
    """Page-aligned private mappings advised to use huge pages (Linux THP), kept between files:
    a new mapping's first touch costs page faults (and for huge pages possibly compaction)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[int, list[mmap.mmap]] = {}
        self._idle_bytes = 0

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            free = self._idle.get(nbytes)
            if free:
                self._idle_bytes -= nbytes
                return free.pop()
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        m = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                m.madvise(mmap.MADV_HUGEPAGE)
        return m

    def give(self, m: mmap.mmap) -> None:
        """Keep ``m`` for the next file; idle buffers of other sizes make room first (file
        sizes drift: the newest size is the likeliest next), and what does not fit is unmapped."""
        drop = []
        with self._lock:
            for size in [n for n in self._idle if n != len(m)]:
                while self._idle[size] and self._idle_bytes + len(m) > _POOL_IDLE_MAX:
                    drop.append(self._idle[size].pop())
                    self._idle_bytes -= size
                if not self._idle[size]:
                    del self._idle[size]
            if self._idle_bytes + len(m) <= _POOL_IDLE_MAX:
                self._idle.setdefault(len(m), []).append(m)
                self._idle_bytes += len(m)
            else:
                drop.append(m)
        for d in drop:
            with contextlib.suppress(BufferError):  # still exported: unmapped when garbage
                d.close()


_BOUNCE_POOL = _BouncePool()


def _fresh_pool_in_child() -> None:
    # A child forked while a thread held the pool's lock would inherit it locked; its idle
    # buffers are copy-on-write copies of the parent's, not worth keeping.
    global _BOUNCE_POOL
    _BOUNCE_POOL = _BouncePool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_pool_in_child)


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn: Any = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_fallocate = _load_fallocate()


def _preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes for ``fd`` (Linux ``fallocate``; never glibc's emulation, which
    writes zeros). Advisory: a file system without it just extends the file as it is written."""
    if _fallocate is not None:
        _fallocate(fd, 0, 0, size)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn: Any = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sync_file_range = _load_sync_file_range()


def _drop_cache(fd: int, offset: int, length: int) -> None:
    # Advisory only: pages still dirty stay; a failure changes nothing that matters.
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


_Timer = Callable[[int, float], None]  # (bytes, seconds) of a committed file


class _PathChooser:
    """Direct or buffered writes for the large files of one file system, by the speed its own
    recent files reached (module docstring). Thread-safe: streams and ranks' threads share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._speeds: dict[bool, list[float]] = {True: [], False: []}  # direct? -> bytes/s
        self._large = 0  # large files handed a path so far

    def _best(self) -> bool:
        d, b = self._speeds[True], self._speeds[False]
        if len(d) < 2 or len(b) < 2:
            return True
        return not _median(b) > _PREFER_DIRECT * _median(d)

    def choose(self, size_hint: int | None) -> tuple[bool, bool]:
        """(direct?, time this file?) for a new file of about ``size_hint`` bytes."""
        with self._lock:
            if size_hint is None or size_hint < _MEASURE_MIN:
                return self._best(), False
            self._large += 1
            if self._large == 1:
                # The warm-up, handed out first (the slowest to finish, when files are written
                # together): first allocations, first page faults. Direct, not timed.
                return True, False
            d, b = self._speeds[True], self._speeds[False]
            if len(d) < 2 or len(b) < 2:
                return len(d) <= len(b), True  # direct, buffered, direct, buffered
            best = self._best()
            return (not best if self._large % _EXPLORE_EVERY == 0 else best), True

    def record(self, direct: bool, nbytes: int, seconds: float) -> None:
        """A timed file of ``nbytes`` took ``seconds`` from open to fsync on that path."""
        if seconds <= 0 or nbytes < _MEASURE_MIN:
            return
        with self._lock:
            recent = self._speeds[direct]
            recent.append(nbytes / seconds)
            del recent[:-_RECENT]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


_CHOOSERS: dict[int, _PathChooser] = {}  # st_dev -> its chooser
_CHOOSERS_LOCK = threading.Lock()


def _forget_choosers_in_child() -> None:
    # A child forked while another thread held a chooser's lock (or this one) would inherit it
    # locked and hang at its first large file: it starts with fresh locks and measures anew.
    global _CHOOSERS_LOCK
    _CHOOSERS_LOCK = threading.Lock()
    _CHOOSERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_choosers_in_child)


def _chooser_for(directory: str) -> _PathChooser | None:
    """The chooser of the file system holding ``directory``; None when it cannot be stat'ed."""
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return None
    with _CHOOSERS_LOCK:
        return _CHOOSERS.setdefault(dev, _PathChooser())


def _next_batch(views: list[memoryview], i: int) -> list[memoryview]:
    """Views ``i, i+1, ...`` for one vectored call: at most _IOV_MAX of them and _CHUNK bytes."""
    batch: list[memoryview] = []
    total = 0
    for v in views[i:i + _IOV_MAX]:
        if total + len(v) > _CHUNK:
            if not batch:
                batch.append(v[:_CHUNK])
            break
        batch.append(v)
        total += len(v)
    return batch


def _consume(views: list[memoryview], i: int, n: int) -> int:
    """Advance past ``n`` transferred bytes; a partly transferred view is shortened in place."""
    while n and i < len(views):
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


class _LocalWriter:
    """A file written by chunks, with early, bounded writeback (see the module docstring)."""

    def __init__(self, storage: LocalStorage, path: str, timer: _Timer | None = None) -> None:
        self._storage = storage
        self._path = path
        self._abs = storage.abspath(path)
        self._timer = timer
        self._t0 = time.perf_counter()
        self._fd: int | None = storage._call(
            "open for writing", path,
            lambda: os.open(self._abs, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644))
        self._pos = 0  # bytes written
        self._started = 0  # writeback started for [0, _started)
        self._settled = 0  # written back and dropped from the cache for [0, _settled)
        self._stream = _sync_file_range is not None

    def write(self, data: memoryview | bytes) -> None:
        """Append ``data``."""
        self.writev([data])

    def writev(self, bufs: Sequence[memoryview | bytes]) -> None:
        """Append ``bufs`` in order, with as few system calls as possible (``writev``)."""
        assert self._fd is not None, "write after commit/abort"
        fd = self._fd
        views = [memoryview(b).cast("B") for b in bufs]
        views = [v for v in views if len(v)]

        def _write() -> None:
            i = 0
            while i < len(views):
                n = os.writev(fd, _next_batch(views, i))
                self._pos += n
                i = _consume(views, i, n)
                self._writeback(fd)

        self._storage._call("write", self._path, _write)

    def _writeback(self, fd: int) -> None:
        if not self._stream or _sync_file_range is None:
            return
        if self._pos - self._started >= _WB_STEP:
            if _sync_file_range(fd, self._started, self._pos - self._started, _SFR_WRITE) != 0:
                self._stream = False  # e.g. a file system without it: plain writes then fsync
                return
            self._started = self._pos
        if self._started - self._settled > _WB_WINDOW:
            end = self._started - _WB_WINDOW // 2
            flags = _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER
            if _sync_file_range(fd, self._settled, end - self._settled, flags) != 0:
                self._stream = False
                return
            _drop_cache(fd, self._settled, end - self._settled)
            self._settled = end

    def commit(self) -> None:
        """fsync and close; the file's pages are then dropped from the page cache."""
        assert self._fd is not None, "commit after commit/abort"
        fd, self._fd = self._fd, None
        try:
            self._storage._call("fsync", self._path, lambda: os.fsync(fd))
            if self._timer is not None:
                self._timer(self._pos, time.perf_counter() - self._t0)
            if self._stream:
                _drop_cache(fd, 0, 0)
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Close and remove the partial file; never raises."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.unlink(self._abs)


_WHOLE_BUF = 8 * 1024 * 1024  # the largest bounce buffer of LocalStorage.write_file, per thread
_bounce = threading.local()


# Address ranges of memory backed by huge pages that its owner keeps mapped while registered
# (ckptmgr._async's staging buffers): the direct writer writes items lying there straight from it
# (no copy into the bounce buffers), adjacent items as one run of large writes.
WRITE_FROM_HUGE_PAGES = True
"""Write items lying in registered huge-page memory from it, adjacent ones as one run (False:
copy them into the bounce buffers as any other item; A/B runs)."""
_HUGE_SOURCES: tuple[tuple[int, int], ...] = ()
_HUGE_LOCK = threading.Lock()


def note_huge_pages(start: int, nbytes: int) -> None:
    """Register ``[start, start + nbytes)`` as memory backed by huge pages (its owner calls
    :func:`forget_huge_pages` before unmapping it). Only the choice between copying an item into
    the bounce buffers and writing it from its memory depends on it, never a byte of the file."""
    global _HUGE_SOURCES
    with _HUGE_LOCK:
        _HUGE_SOURCES = (*_HUGE_SOURCES, (start, start + nbytes))


def forget_huge_pages(start: int) -> None:
    """Drop the range registered at ``start`` (:func:`note_huge_pages`)."""
    global _HUGE_SOURCES
    with _HUGE_LOCK:
        _HUGE_SOURCES = tuple(r for r in _HUGE_SOURCES if r[0] != start)


def _in_huge_pages(addr: int, nbytes: int) -> bool:
    return any(lo <= addr and addr + nbytes <= hi for lo, hi in _HUGE_SOURCES)


def _bounce_buffer(nbytes: int) -> tuple[memoryview, int]:
    """This thread's page-aligned bounce buffer (a view and its address), at least
    ``min(nbytes, _WHOLE_BUF)`` bytes rounded up to whole MiB; kept for the thread's next file."""
    want = min(_WHOLE_BUF, max(1 << 20, -(-nbytes // (1 << 20)) << 20))
    have: mmap.mmap | None = getattr(_bounce, "map", None)
    if have is None or len(have) < want:
        have = _bounce.map = mmap.mmap(-1, want)
        _bounce.addr = ctypes.addressof(ctypes.c_char.from_buffer(have))
    return memoryview(have), _bounce.addr


def _write_aligned(fd: int, mv: memoryview) -> None:
    """Write ``mv`` at offset 0 of ``fd`` (opened with ``O_DIRECT``) through the bounce buffer,
    the last block padded, then truncated to ``len(mv)``; buffered after an EINVAL."""
    buf, addr = _bounce_buffer(len(mv))
    try:
        pos = 0
        while pos < len(mv):
            take = min(len(mv) - pos, len(buf))
            src = mv[pos:pos + take]
            if src.readonly:
                buf[:take] = src
            else:  # ctypes' memmove releases the GIL while it copies
                ctypes.memmove(addr, (ctypes.c_char * take).from_buffer(src), take)
            padded = -(-take // _DIRECT_ALIGN) * _DIRECT_ALIGN
            buf[take:padded] = _ZEROS[:padded - take]
            done = 0
            refused = False
            while done < padded:
                try:
                    done += os.pwrite(fd, buf[done:padded], pos + done)
                except OSError as e:  # accepted O_DIRECT at open, not this write: go buffered
                    switch_to_buffered(fd, e, refused)
                    refused = True
            pos += take
        if len(mv) % _DIRECT_ALIGN:
            os.ftruncate(fd, len(mv))
    finally:
        buf.release()


def direct_buffer_size(size_hint: int | None) -> int:
    """Bytes per direct-I/O buffer for a file of about ``size_hint`` bytes (None: the largest):
    1/(``_COPY_DIV`` when every item is copied, else 32) of it, rounded up to whole MiB, between
    ``_COPY_BUF_MIN`` (else ``_DIRECT_BUF_MIN``) and ``_DIRECT_BUF``."""
    if size_hint is None:
        return _DIRECT_BUF
    mib = 1 << 20
    want = -(-max(size_hint, 0) // (_COPY_DIV if COPY_ALL else 32) // mib) * mib
    least = _COPY_BUF_MIN if COPY_ALL else _DIRECT_BUF_MIN
    return max(min(least, _DIRECT_BUF), min(want, _DIRECT_BUF))


# A deferred copy into a bounce buffer: the destination address, the source, its memory's owner.
_Copy = tuple[int, memoryview, object]


def _make_copies(copies: list[_Copy]) -> None:
    for dst, src, _keep in copies:  # ctypes' memmove releases the GIL while it copies
        ctypes.memmove(dst, (ctypes.c_char * len(src)).from_buffer(src), len(src))


class _DirectWriter:
    """A file written with ``O_DIRECT`` (module docstring), by up to ``_DIRECT_THREADS`` I/O
    threads, several writes in flight.

    Two ways in:
    - ``write``/``writev`` copy into page-aligned bounce buffers; a full buffer goes to the I/O
      threads (a small file is written on ``commit``, inline);
    - :meth:`write_unbuffered` writes the caller's memory itself, no copy: the file is padded so
      the bytes land at an offset with the same alignment as their address, the unaligned head
      and tail go through the bounce buffer, and the aligned middle is written straight from
      memory. The caller keeps that memory alive and unchanged until ``commit``/``abort``
      returns.

    The file is preallocated to ``size_hint`` (``fallocate``), so ext4 takes the shared inode
    lock and the writes really run side by side. An I/O error is kept and raised by the next
    write or by ``commit``.
    """

    def __init__(self, storage: LocalStorage, path: str, fd: int,
                 bufsize: int = _DIRECT_BUF, size_hint: int | None = None,
                 timer: _Timer | None = None, *, io_copies: bool = False) -> None:
        self._timer = timer
        self._io_copies = io_copies
        self._t0 = time.perf_counter()
        self._bufsize = bufsize
        self._storage = storage
        self._path = path
        self._abs = storage.abspath(path)
        self._fd: int | None = fd
        nbuf = _COPY_NBUF if COPY_ALL else _DIRECT_NBUF
        self._maps = [_BOUNCE_POOL.take(bufsize) for _ in range(nbuf)]
        self._views = [memoryview(m) for m in self._maps]
        self._addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in self._maps]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(1, nbuf):
            self._free.put(i)
        # (bytes, file offset, bounce buffer to hand back or -1, object kept alive until written,
        # copies into that buffer to make first: (its address + offset, source, source's owner))
        self._work: queue.Queue[tuple[memoryview, int, int, object, list[_Copy]] | None] = (
            queue.Queue())
        self._copies: list[_Copy] = []  # copies into the buffer being filled, not made yet
        # Bounce buffers being written at once, at most (COPY_IN_FLIGHT)
        self._buffer_slots = (threading.BoundedSemaphore(COPY_IN_FLIGHT)
                              if COPY_ALL and COPY_IN_FLIGHT else None)
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._cur = 0  # the buffer being filled
        self._fill = 0  # bytes in it
        self._offset = 0  # file offset of the buffer being filled
        self._size = 0  # bytes accepted
        # The open run of unbuffered memory (write_unbuffered): its start and end addresses
        # (the start aligned: file offset self._offset) and what keeps that memory alive.
        self._run: tuple[int, int, list[object]] | None = None
        # Zero padding runs may still add (gaps between staging slots, alignment at a run's
        # start): the room preallocated for it, so the file never grows past its preallocation
        # (an extending direct write takes ext4's exclusive inode lock and stalls the others).
        self._pad_left = size_hint // 64 if size_hint else 0
        if size_hint:
            # Room for the padding of unbuffered writes too; trimmed by commit's ftruncate.
            _preallocate(fd, size_hint + size_hint // 64 + _DIRECT_ALIGN)

    def write(self, data: memoryview | bytes) -> None:
        """Append ``data``."""
        self.writev([data])

    def writev(self, bufs: Sequence[memoryview | bytes]) -> None:
        """Append ``bufs`` in order (copied into the bounce buffers)."""
        assert self._fd is not None, "write after commit/abort"
        self._close_run()
        for b in bufs:
            self._copy_in(memoryview(b).cast("B"))

    def _copy_in(self, mv: memoryview, *, counted: bool = False, keep: object = None,
                 defer: bool = False) -> None:
        """Copy ``mv`` into the bounce buffers (``counted``: its bytes are in ``_size``
        already, as a run's tail is). ``defer``: ``mv`` stays alive and unchanged until
        ``commit`` or ``abort`` (``keep`` holds its memory), so the I/O thread that writes a
        buffer makes its large copies (where this file's copies go there)."""
        pos, n = 0, len(mv)
        defer = defer and self._io_copies and not mv.readonly
        while pos < n:
            take = min(n - pos, self._bufsize - self._fill)
            piece = mv[pos:pos + take]
            if defer and take >= _DEFER_MIN:
                self._copies.append((self._addrs[self._cur] + self._fill, piece, keep))
            elif piece.readonly:
                self._views[self._cur][self._fill:self._fill + take] = piece
            else:  # ctypes' memmove releases the GIL while it copies
                ctypes.memmove(self._addrs[self._cur] + self._fill,
                               (ctypes.c_char * take).from_buffer(piece), take)
            self._fill += take
            self._size += 0 if counted else take
            pos += take
            if self._fill == self._bufsize:
                self._submit(self._fill)

    def write_unbuffered(self, data: memoryview, keep: object = None) -> int:
        """Append writable ``data``, from its own memory where that is faster than a copy;
        returns the file offset of its first byte.

        Written from memory (no copy): ``data`` lying in memory registered as huge pages
        (:func:`note_huge_pages`: staging buffers), and with ``COPY_ALL`` off any ``data`` over
        ``_SMALL_COPY``. The file is first padded with zeros (less than 4 KiB) so that the offset
        has the alignment of the address; the unaligned head and tail go through the bounce
        buffer. ``data`` that starts right after the previous call's (a gap of less than 4 KiB,
        all zeros, which then are the file's padding) extends that run: one run is written in
        pieces of up to 64 MiB, as a run of staging buffers reaches the disk as the largest
        requests it takes. Anything else is copied into the bounce buffers, on this thread or
        (the file's copy placement: ``COPY_IN_IO_THREADS``) on the I/O thread that writes them.

        ``data`` (and ``keep``, held until written) must stay alive and unchanged until
        ``commit`` or ``abort`` returns.
        """
        assert self._fd is not None, "write after commit/abort"
        self._raise_io_error()
        mv = memoryview(data).cast("B")
        n = len(mv)
        if mv.readonly or n == 0:
            start = self._size
            self.writev([mv])
            return start
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
        run = self._run
        huge = WRITE_FROM_HUGE_PAGES and _in_huge_pages(addr, n)
        if run is not None and (huge or not COPY_ALL):
            lo, hi, keeps = run
            gap = addr - hi
            # The gap lies in the page the run ends in (so in mapped memory).
            if 0 <= gap < _DIRECT_ALIGN and gap <= self._pad_left and (
                    gap == 0 or ctypes.string_at(hi, gap) == _ZEROS[:gap]):
                self._pad_left -= gap
                start = self._size + gap
                keeps.append(keep)
                self._run = (lo, addr + n, keeps)
                self._size = start + n
                self._submit_run(final=False)
                return start
        pad = (addr - self._size) % _DIRECT_ALIGN  # closing a run leaves _size as it is
        if (n < 2 * _DIRECT_ALIGN or (not huge and (COPY_ALL or n <= _SMALL_COPY))
                or (huge and pad > self._pad_left)):
            self._close_run()
            start = self._size
            self._copy_in(mv, keep=keep, defer=True)
            return start
        self._close_run()
        if huge:
            self._pad_left -= pad
        if pad:
            self._copy_in(memoryview(_ZEROS)[:pad])
        start = self._size
        head = -addr % _DIRECT_ALIGN
        if head:
            self._copy_in(mv[:head])
        if self._fill:  # aligned now: the buffer's bytes go before the run
            if self._fill < _COPY_BELOW:
                self._submit_copy()
            else:
                self._submit(self._fill)
        self._run = (addr + head, addr + n, [keep, data])
        self._size += n - head
        self._submit_run(final=False)
        return start

    def _submit_run(self, *, final: bool) -> None:
        """Hand the open run's aligned bytes to the I/O threads once ``_RUN_PIECE`` of them are
        waiting (``final``: all of them, the unaligned tail copied, and the run closed)."""
        run = self._run
        if run is None:
            return
        lo, hi, keeps = run
        ready = (hi - lo) // _DIRECT_ALIGN * _DIRECT_ALIGN
        if not final and ready < _RUN_PIECE:
            return
        self._start_threads()
        view = memoryview((ctypes.c_char * (hi - lo)).from_address(lo)).cast("B")
        for off in range(0, ready, _DIRECT_MAX_WRITE):
            piece = view[off:min(off + _DIRECT_MAX_WRITE, ready)]
            self._work.put((piece, self._offset, -1, keeps, []))
            self._offset += len(piece)
        if final:
            self._run = None
            if ready < hi - lo:
                self._copy_in(view[ready:], counted=True)
        else:
            self._run = (lo + ready, hi, keeps)

    def _close_run(self) -> None:
        self._submit_run(final=True)

    def _start_threads(self) -> None:
        while len(self._threads) < _DIRECT_THREADS:
            t = threading.Thread(target=self._io, name=f"ckptmgr-io-{len(self._threads)}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def _submit_copy(self) -> None:
        """Hand the bounce buffer's bytes (a multiple of the alignment) to the I/O threads as a
        page-aligned copy; the buffer is refilled from its start."""
        self._raise_io_error()
        self._start_threads()
        self._copy_now()
        copy = mmap.mmap(-1, self._fill)
        view = memoryview(copy)
        view[:] = self._views[self._cur][:self._fill]
        self._work.put((view, self._offset, -1, copy, []))
        self._offset += self._fill
        self._fill = 0

    def _copy_now(self) -> None:
        """Make the deferred copies into the buffer being filled, on this thread."""
        copies, self._copies = self._copies, []
        _make_copies(copies)

    def _submit(self, n: int) -> None:
        self._raise_io_error()
        self._start_threads()
        copies, self._copies = self._copies, []
        self._work.put((self._views[self._cur][:n], self._offset, self._cur, None, copies))
        self._offset += n
        self._cur = self._free.get()
        self._fill = 0

    def _io(self) -> None:
        """(I/O thread) Make each submitted piece's copies and write it; after an error only
        hand buffers back."""
        slots = self._buffer_slots
        while (item := self._work.get()) is not None:
            view, offset, buf, _keep, copies = item
            held = False
            try:
                if self._error is None:
                    _make_copies(copies)
                    if buf >= 0 and slots is not None:
                        slots.acquire()
                        held = True
                    self._pwrite(view, offset)
            except BaseException as e:  # any failure (not only the disk's) fails the file
                # Without its traceback: the frames would keep this write's view of a bounce
                # buffer exported after the buffer went back to the pool.
                self._error = self._error or e.with_traceback(None)
            finally:
                if held:
                    assert slots is not None
                    slots.release()
                del view, item, _keep, copies
                if buf >= 0:
                    self._free.put(buf)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        fd = self._fd
        assert fd is not None, "write after close"
        pos = 0
        refused = False
        while pos < len(view):
            try:
                pos += os.pwrite(fd, view[pos:], offset + pos)
            except OSError as e:  # accepted O_DIRECT at open, not this write: go buffered
                switch_to_buffered(fd, e, refused)
                refused = True

    def _raise_io_error(self) -> None:
        if self._error is not None:
            err = self._error
            why = (err.strerror if isinstance(err, OSError) else None) or err
            raise StorageError(f"write failed for {self._storage.url}/{self._path}: "
                               f"{why}") from err

    def _stop(self) -> None:
        """Wait until every submitted write has ended and the I/O threads are gone."""
        threads = self._threads
        sent = 0

        def wait() -> None:
            nonlocal sent
            while sent < len(threads):  # one end of the queue per thread, each sent once
                self._work.put(None)
                sent += 1
            for t in threads:
                t.join()

        # Whatever interrupts: an I/O thread may be copying from the caller's memory, which
        # the caller frees once this returns or raises.
        finish_surely(wait)
        self._threads = []

    def _release(self) -> None:
        """Hand the bounce buffers back to the pool, once (abort after a failed commit calls it
        again: a buffer given twice would reach two writers)."""
        views, self._views = self._views, []
        maps, self._maps = self._maps, []
        for v in views:
            v.release()
        for m in maps:
            _BOUNCE_POOL.give(m)

    def commit(self) -> None:
        """Write the rest (padded to the block size, then truncated), fsync and close."""
        assert self._fd is not None, "commit after commit/abort"
        fd = self._fd
        try:
            self._close_run()
            if self._fill:
                padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
                if not self._threads:
                    self._copy_now()
                    self._storage._call("write", self._path, lambda: self._pwrite(
                        self._views[self._cur][:padded], self._offset))
                else:
                    self._submit(padded)
            self._stop()
            self._raise_io_error()
            self._storage._call("truncate", self._path, lambda: os.ftruncate(fd, self._size))
            self._storage._call("fsync", self._path, lambda: os.fsync(fd))
        except BaseException:
            self.abort()
            raise
        if self._timer is not None:
            self._timer(self._size, time.perf_counter() - self._t0)
        self._fd = None
        os.close(fd)
        self._release()

    def abort(self) -> None:
        """Stop writing, close and remove the partial file; raises nothing of its own (an
        interrupt while the I/O threads are joined is raised once the file is gone)."""
        self._run = None
        self._copies = []
        try:
            self._stop()
        finally:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None
            with contextlib.suppress(OSError):
                os.unlink(self._abs)
            with contextlib.suppress(BufferError):
                self._release()


def open_regular(path: str, flags: int = 0) -> int:
    """Open ``path`` for reading (with the extra ``flags``) if it is a regular file; never
    blocks (a FIFO opened for reading waits for a writer; with O_NONBLOCK it opens at once and is
    refused here) and never follows a symbolic link.

    Raises:
        OSError: it is missing, a link, or not a regular file (a FIFO, device, socket,
            directory).
    """
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "a device")
            raise OSError(errno.EINVAL, f"it is {kind}, not a regular file; ckptmgr reads "
                          "regular files only: remove or rename it")
        if getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalReader:
    """One open file of a step, read by ranges: ``readv_into`` scatters a range into buffers."""

    def __init__(self, storage: LocalStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._fd: int | None = storage._call(
            "open", path, lambda: open_regular(storage.abspath(path)))

    def readv_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` in order with the bytes starting at ``offset`` (one ``preadv`` per batch).

        Raises:
            StorageError: the read failed or the file ends early.
        """
        assert self._fd is not None, "read after close"
        self._storage._readv_fd(self._fd, self._path, offset, bufs)

    def close(self) -> None:
        """Close the file; idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> LocalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalStorage:
    """A checkpoint root on a local (POSIX) file system.

    Capabilities: AtomicRename (rename, fsync_dir), RangeReads (open_reader); its writers are
    VectoredWriters.
    """

    # Only keeps older callers working until they check ``isinstance(storage, AtomicRename)``.
    supports_rename = True

    def __init__(self, root: str, *, display_url: str | None = None) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = display_url or self.root

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def abspath(self, path: str) -> str:
        """The absolute OS path of relative ``path``."""
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except OSError as e:
            where = f"{self.url}/{path}" if path else self.url
            raise StorageError(f"{what} failed for {where}: {e.strerror or e}") from e

    def scan_root(self, marker: str) -> list[RootEntry]:
        def _scan() -> list[RootEntry]:
            if not os.path.isdir(self.root):
                return []
            out = []
            with os.scandir(self.root) as it:
                for e in it:
                    link = e.is_symlink()
                    is_dir = e.is_dir(follow_symlinks=False)
                    has = False
                    if is_dir:
                        try:
                            st = os.lstat(os.path.join(e.path, marker))
                            has = stat.S_ISREG(st.st_mode)
                        except FileNotFoundError:
                            has = False
                    out.append(RootEntry(e.name, is_dir, link, has))
            return out

        return self._call("list", "", _scan)

    def list_dirs(self, path: str) -> list[str]:
        def _ls() -> list[str]:
            d = self.abspath(path)
            if not os.path.isdir(d):
                return []
            with os.scandir(d) as it:
                return sorted(e.name for e in it if not e.is_file(follow_symlinks=False))

        return self._call("list", path, _ls)

    def list_files(self, path: str) -> dict[str, int]:
        def _ls() -> dict[str, int]:
            d = self.abspath(path)
            if not os.path.isdir(d):
                return {}
            out = {}
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_file(follow_symlinks=False):
                            out[e.name] = e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue  # removed while listed (an overwrite dropping the old attempt)
            return out

        return self._call("list", path, _ls)

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.abspath(path))

    def size(self, path: str) -> int:
        return self._call("stat", path, lambda: os.lstat(self.abspath(path)).st_size)

    @contextlib.contextmanager
    def _open_read(self, path: str) -> Iterator[int]:
        fd = self._call("open", path, lambda: open_regular(self.abspath(path)))
        try:
            yield fd
        finally:
            os.close(fd)

    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        with self._open_read(path) as fd:
            if length is None:
                length = max(0, os.fstat(fd).st_size - start)
            buf = bytearray(length)
            self._read_fd(fd, path, start, memoryview(buf))
            return bytes(buf)

    def _read_fd(self, fd: int, path: str, offset: int, buf: memoryview) -> None:
        self._readv_fd(fd, path, offset, [buf])

    def _readv_fd(self, fd: int, path: str, offset: int, bufs: Sequence[memoryview]) -> None:
        views = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in bufs]
        views = [v for v in views if len(v)]
        want = offset + sum(len(v) for v in views)

        def _read() -> None:
            pos = offset
            i = 0
            while i < len(views):
                n = os.preadv(fd, _next_batch(views, i), pos)
                if n == 0:
                    raise EOFError(f"file ends at byte {pos}, wanted {want}")
                pos += n
                i = _consume(views, i, n)

        try:
            self._call("read", path, _read)
        except EOFError as e:
            raise StorageError(f"read failed for {self.url}/{path}: {e}") from e

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        with self._open_read(path) as fd:
            self._read_fd(fd, path, offset, buf)

    def open_reader(self, path: str) -> LocalReader:
        """``path`` opened for repeated range reads (close it, or use it as a context manager)."""
        return LocalReader(self, path)

    def stream_into(self, requests: Sequence[tuple[str, int, memoryview]]
                    ) -> Iterator[int] | None:
        """Stream ``requests`` with direct reads (:class:`~ckptmgr.storage.base.StreamReads`;
        module docstring); None when ``DIRECT_READ`` and the requests say buffered reads are
        better: ``O_DIRECT`` refused here, under ``_STREAM_MIN`` bytes, or mostly cached."""
        if DIRECT_READ is False or not _O_DIRECT or not requests:
            return None
        if DIRECT_READ is None:
            total = sum(len(b) for _, _, b in requests)
            if total < _STREAM_MIN:
                return None
            # Pages at evenly spaced bytes of the requests: a read of cached pages is a copy,
            # which a direct read would replace by a trip to the disk.
            points: list[tuple[str, int]] = []
            step, pos, k = total / _RESIDENT_PROBES, 0, 0
            for path, offset, buf in requests:
                while k < _RESIDENT_PROBES and k * step < pos + len(buf):
                    points.append((self.abspath(path), offset + max(0, int(k * step) - pos)))
                    k += 1
                pos += len(buf)
            share = resident_share(points, open_regular)
            if share is not None and share >= 0.5:
                return None
        try:  # a file system that refuses O_DIRECT (tmpfs) says so at open: read buffered
            os.close(open_regular(self.abspath(requests[0][0]), _O_DIRECT))
        except OSError as e:
            if e.errno == errno.EINVAL:
                return None
        return self._stream(requests)

    def _open_direct(self, path: str) -> int:
        full = self.abspath(path)
        try:
            return open_regular(full, _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return open_regular(full)

    def _stream(self, requests: Sequence[tuple[str, int, memoryview]]) -> Iterator[int]:
        views = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for _, _, b in requests]
        reqs = [(p, o, v) for (p, o, _), v in zip(requests, views, strict=True)]
        try:
            yield from stream_into(reqs, self._open_direct, _BOUNCE_POOL)
        except StreamEOF as e:
            raise StorageError(f"read failed for {self.url}/{e.path}: {e}") from e
        except OSError as e:
            path = e.filename if isinstance(e.filename, str) else ""
            raise StorageError(f"read failed for {self.url}/{path}: {e.strerror or e}") from e

    def open_writer(self, path: str,
                    size_hint: int | None = None) -> _LocalWriter | _DirectWriter:
        """A new file at ``path``: direct I/O or buffered, as :data:`DIRECT_IO` says or the
        file system's measurements chose (module docstring); buffered where ``O_DIRECT`` is
        refused. ``size_hint`` sizes the direct-I/O buffers (:func:`direct_buffer_size`) and
        decides whether this file is timed."""
        direct = bool(_O_DIRECT) and DIRECT_IO is not False
        chooser = None
        if direct and DIRECT_IO is None:
            chooser = _chooser_for(os.path.dirname(self.abspath(path)))
            if chooser is not None:
                direct, timed = chooser.choose(size_hint)
                if not timed:
                    chooser = None
        if direct:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | _O_DIRECT
            try:
                fd = os.open(self.abspath(path), flags, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: no O_DIRECT here (tmpfs, ...)
                    raise StorageError(f"open for writing failed for {self.url}/{path}: "
                                       f"{e.strerror or e}") from e
                chooser = None  # nothing to compare with on this file system
            else:
                timer = functools.partial(chooser.record, True) if chooser else None
                return _DirectWriter(self, path, fd, direct_buffer_size(size_hint), size_hint,
                                     timer, io_copies=COPY_IN_IO_THREADS)
        timer = functools.partial(chooser.record, False) if chooser else None
        return _LocalWriter(self, path, timer)

    def write_bytes(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        final = self.abspath(path)
        tmp = f"{final}.tmp-{os.getpid()}-{id(data):x}"

        def _write() -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            try:
                mv = memoryview(data)
                pos = 0
                while pos < len(mv):
                    pos += os.write(fd, mv[pos:])
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                if exclusive:
                    # link() fails if the name exists: an atomic create-if-absent.
                    os.link(tmp, final)
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._fsync_dir_abs(os.path.dirname(final))

        self._call("write", path, _write)

    def write_file(self, path: str, data: memoryview | bytes) -> None:
        """Write a whole file of ``data`` at ``path`` and make it durable (fsync): for a file
        whose bytes are all at hand (a shared chunk), much cheaper than a writer, whose
        per-file buffers and threads cost more than a few MiB take to write (4 MiB files:
        ~20 ms each that way, ~4 ms this way, here). ``O_DIRECT`` (unless :data:`DIRECT_IO`
        is False or the file system refuses it) through this thread's page-aligned bounce
        buffer, reused across files. Not atomic: write under a temporary name, then rename."""
        mv = memoryview(data).cast("B")
        final = self.abspath(path)
        direct = bool(_O_DIRECT) and DIRECT_IO is not False

        def _write() -> None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW
            try:
                fd = os.open(final, flags | (_O_DIRECT if direct else 0), 0o644)
                aligned = direct
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:  # EINVAL: no O_DIRECT here
                    raise
                fd, aligned = os.open(final, flags, 0o644), False
            try:
                if aligned:
                    _write_aligned(fd, mv)
                else:
                    pos = 0
                    while pos < len(mv):
                        pos += os.write(fd, mv[pos:])
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(final)
                raise
            os.close(fd)

        self._call("write", path, _write)

    def makedirs(self, path: str) -> None:
        self._call("mkdir", path, lambda: os.makedirs(self.abspath(path), exist_ok=True))

    def rename(self, src: str, dst: str) -> None:
        def _rename() -> None:
            d = self.abspath(dst)
            if os.path.lexists(d) and not (os.path.isdir(d) and not os.listdir(d)):
                raise FileExistsError(f"rename target exists: {dst}")
            os.rename(self.abspath(src), d)

        self._call("rename", f"{src} -> {dst}", _rename)

    @staticmethod
    def _fsync_dir_abs(d: str) -> None:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: str) -> None:
        self._call("fsync", path, lambda: self._fsync_dir_abs(self.abspath(path)))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        def _rm() -> None:
            p = self.abspath(path)
            if not os.path.lexists(p):
                return
            if os.path.isdir(p) and not os.path.islink(p):
                if not recursive:
                    raise IsADirectoryError(p)
                shutil.rmtree(p)
            else:
                os.unlink(p)

        self._call("remove", path, _rm)

    def is_symlink(self, path: str) -> bool:
        return os.path.islink(self.abspath(path))
