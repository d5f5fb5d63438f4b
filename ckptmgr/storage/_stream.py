"""Streamed reads of local files: many ranges, read ahead with ``O_DIRECT`` into huge-page
buffers by two I/O threads and copied into the caller's buffers, in order.

Why (docs/performance.md, "Restore by direct reads"): a buffered restore of 1 GiB spent 0.14-0.35 s
of kernel time filling and copying out of the page cache (262,144 pages allocated, inserted,
copied) on the thread that also checksums, and took 1.25-1.50x the cold-read floor. Direct reads
of 8 MiB blocks into buffers of 2 MiB pages reach the disk as its largest requests, cost almost no
kernel time (0.01-0.03 s per GiB), and leave the calling thread one ``memmove`` per byte: the same
restore in 0.93-0.97x the floor's time. The kernel's read-ahead does nothing for direct reads, so
the I/O threads read up to ``_RING`` blocks ahead of the copy.

Only :mod:`ckptmgr.storage.local` uses this (``LocalStorage.stream_into``), which decides when a
stream is worth it (large, not in the page cache, the file system takes ``O_DIRECT``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["BLOCK", "StreamEOF", "resident_share", "stream_into", "switch_to_buffered"]

BLOCK = 8 * 1024 * 1024
"""Bytes per direct read: two of the disk's largest requests here (``max_sectors_kb`` 4096).
4, 8 and 16 MiB took 0.460, 0.440 and 0.447 s for 1 GiB (6 cold restores each, medians)."""
_RING = 4  # blocks read ahead of the copy (32 MiB of buffers, kept in the bounce pool)
_THREADS = 2  # I/O threads: two reads in flight; one took 0.431 s, two 0.440 s here (noise)
_ALIGN = 4096  # offsets, lengths and addresses of direct reads
# Requests of one file closer than this are read as one extent (the padding between them too):
# a request costs the disk more than 1 MiB of sequential bytes.
_MERGE_GAP = 1024 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def switch_to_buffered(fd: int, err: OSError, refused: bool) -> None:
    """After ``err`` from a direct read or write of ``fd``: re-raise it, unless it is a file
    system refusing ``O_DIRECT`` on a file it opened with it (EINVAL) and this I/O was not
    refused before (``refused``); then ``fd`` is switched to buffered I/O (unless another thread
    did so already: its I/O may have been refused before the switch) and the caller retries."""
    if err.errno != errno.EINVAL or refused:
        raise err
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & _O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)


class Pool(Protocol):
    """Where the ring's buffers come from and go back to (the local writers' bounce pool)."""

    def take(self, nbytes: int) -> mmap.mmap: ...

    def give(self, m: mmap.mmap) -> None: ...


class StreamEOF(EOFError):
    """A file ended before the bytes a request needs (``path`` names it)."""

    def __init__(self, path: str, end: int, want: int) -> None:
        super().__init__(f"file ends at byte {end}, wanted {want}")
        self.path = path


@dataclass
class _Extent:
    path: str
    start: int  # aligned
    end: int  # aligned, exclusive
    first: int  # index of its first request
    last: int  # index past its last request


@dataclass
class _Block:
    extent: int
    start: int
    length: int
    got: int = 0
    error: BaseException | None = None


def _extents(requests: Sequence[tuple[str, int, memoryview]]) -> list[_Extent]:
    """Group requests (in the caller's order) into aligned extents of one file each: a request
    joins the previous extent when it starts at or after the previous request's end, within
    ``_MERGE_GAP`` of it, in the same file."""
    out: list[_Extent] = []
    prev_end = -1
    for i, (path, offset, buf) in enumerate(requests):
        start = offset - offset % _ALIGN
        end = -(-(offset + len(buf)) // _ALIGN) * _ALIGN
        last = out[-1] if out else None
        if (last is not None and last.path == path and offset >= prev_end
                and start <= last.end + _MERGE_GAP):
            last.end = max(last.end, end)
            last.last = i + 1
        else:
            out.append(_Extent(path, start, end, i, i + 1))
        prev_end = offset + len(buf)
    return out


def stream_into(requests: Sequence[tuple[str, int, memoryview]], open_file: Callable[[str], int],
                pool: Pool) -> Iterator[int]:
    """Fill each request's buffer with the bytes of its file from its offset; yield the index of
    each request once its buffer is whole, in the order given.

    ``requests`` are ``(path, offset, buffer)`` (byte-format buffers); ``open_file(path)`` opens a
    file for reading (``O_DIRECT`` where it can: a read the file system refuses direct is retried
    buffered). Closing the iterator early stops and joins the I/O threads; the buffers come from
    and go back to ``pool``.

    Raises:
        OSError: a read failed (its ``filename`` is the request's path).
        StreamEOF: a file ended before a request's bytes.
    """
    extents = _extents(requests)
    blocks = [_Block(e, pos, min(BLOCK, x.end - pos))
              for e, x in enumerate(extents) for pos in range(x.start, x.end, BLOCK)]
    # The block after which each file is read no more: its descriptor is closed then (a restore
    # of shared chunks reads thousands of small files).
    last_of = {extents[b.extent].path: i for i, b in enumerate(blocks)}
    ring = [pool.take(BLOCK) for _ in range(min(_RING, len(blocks)))]
    views = [memoryview(m) for m in ring]
    ready = [threading.Event() for _ in blocks]
    free = threading.Semaphore(len(ring))
    lock = threading.Lock()
    fds: dict[str, int] = {}
    state = {"next": 0, "closing": False}

    def fd_of(path: str) -> int:
        with lock:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = open_file(path)
            return fd

    def read_block(b: _Block, view: memoryview) -> None:
        path = extents[b.extent].path
        try:
            fd = fd_of(path)
            refused = False
            while b.got < b.length:
                try:
                    n = os.preadv(fd, [view[b.got:b.length]], b.start + b.got)
                except OSError as e:  # took O_DIRECT at open, not this read: go buffered
                    switch_to_buffered(fd, e, refused)
                    refused = True
                    continue
                if n == 0:
                    break  # the end of the file: the copy checks what the requests needed
                b.got += n
        except OSError as e:
            e.filename = path  # the storage's relative path, not the OS one
            b.error = e
        except BaseException as e:  # handed to the consumer, never lost
            b.error = e

    def worker() -> None:
        while True:
            free.acquire()
            with lock:
                i = state["next"]
                if state["closing"] or i >= len(blocks):
                    free.release()  # wake the next worker so that it sees the end too
                    return
                state["next"] = i + 1
            # The semaphore admits block i only after blocks up to i - len(ring) were copied
            # out, so its slot is free.
            read_block(blocks[i], views[i % len(ring)])
            ready[i].set()

    threads = [threading.Thread(target=worker, name=f"ckptmgr-read-io-{k}", daemon=True)
               for k in range(min(_THREADS, len(blocks)))]
    try:
        for t in threads:
            t.start()
        i = 0  # the next block
        for e, ext in enumerate(extents):
            r = ext.first  # the next request of this extent to fill
            while i < len(blocks) and blocks[i].extent == e:
                b = blocks[i]
                ready[i].wait()
                if b.error is not None:
                    raise b.error
                src = views[i % len(ring)]
                end = b.start + b.got
                while r < ext.last:
                    path, offset, buf = requests[r]
                    n = len(buf)
                    lo, hi = max(offset, b.start), min(offset + n, b.start + b.length)
                    if hi > lo:
                        if hi > end:
                            raise StreamEOF(path, end, offset + n)
                        buf[lo - offset:hi - offset] = src[lo - b.start:hi - b.start]
                    if offset + n > b.start + b.length:
                        break  # continues in the next block
                    yield r
                    r += 1
                if last_of[ext.path] == i:
                    with lock:
                        fd = fds.pop(ext.path, None)
                    if fd is not None:
                        os.close(fd)
                free.release()
                i += 1
            yield from range(r, ext.last)  # empty requests of an extent with no bytes to read
    finally:
        with lock:
            state["closing"] = True
        for _ in threads:
            free.release()
        for t in threads:
            t.join()
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        for v in views:
            v.release()
        for m in ring:
            pool.give(m)


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
_PAGE = mmap.PAGESIZE


def resident_share(points: Sequence[tuple[str, int]],
                   open_file: Callable[[str], int]) -> float | None:
    """The share of ``(absolute path, offset)`` pages held in the page cache (``mincore`` on a
    private mapping of each page: no I/O is started); None where that cannot be asked: the kernel
    reports every page of a file this process neither owns nor may write as resident (a guard
    against cache side channels), so such files are never asked about.
    ``open_file(path)`` opens a file for reading (never a FIFO or a link: the caller's rule)."""
    if _LIBC is None or not points:
        return None
    held = asked = 0
    for path, offset in points:
        try:
            fd = open_file(path)
            try:
                st = os.fstat(fd)
                if os.geteuid() not in (0, st.st_uid) and not os.access(path, os.W_OK):
                    return None
                size = st.st_size
                at = min(offset, max(size - 1, 0)) // mmap.ALLOCATIONGRANULARITY
                at *= mmap.ALLOCATIONGRANULARITY
                if size <= at:
                    continue
                with mmap.mmap(fd, min(_PAGE, size - at), access=mmap.ACCESS_COPY,
                               offset=at) as m:
                    probe = (ctypes.c_char * 1).from_buffer(m)
                    vec = (ctypes.c_ubyte * 1)()
                    ok = _LIBC.mincore(ctypes.addressof(probe), 1, vec) == 0
                    del probe
            finally:
                os.close(fd)
        except (OSError, ValueError, BufferError):
            return None
        if ok:
            asked += 1
            held += vec[0] & 1
    return held / asked if asked else None
