"""Raw byte views of CPU tensors, the checksum we use (xxh3-64, 9-12 GB/s on one core here), and
the CPU-share knob of ckptmgr's I/O threads."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

import torch
import xxhash

__all__ = ["CHECKSUM_ALGO", "Hasher", "checksum", "lower_thread_priority", "tensor_memoryview"]

CHECKSUM_ALGO = "xxh3_64"


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of contiguous CPU tensor ``t``'s memory (no copy).

    The caller keeps ``t`` alive while the view is used.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_memoryview needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def checksum(data: memoryview | bytes) -> str:
    """``"xxh3_64:<16 hex>"`` of ``data``."""
    return f"{CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(data)}"


class Hasher:
    """Streaming :func:`checksum` over several chunks."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        """Add ``data``."""
        self._h.update(data)

    def value(self) -> str:
        """The checksum of everything added so far."""
        return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"


def lower_thread_priority(nice: int) -> bool:
    """Raise the calling thread's nice value by ``nice`` (Linux: per thread); True if it did.

    Only ever called on threads ckptmgr creates and ends itself: an unprivileged process can raise
    a nice value but never lower it again, so the training thread is never touched.
    """
    if nice <= 0 or not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
        return True
    return False
