"""Raw byte views of CPU tensors, and the CPU-share knob of ckptmgr's I/O threads.

The checksum over those bytes is torch-free, in :mod:`ckptmgr.codec.checksum`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

import torch

__all__ = ["lower_thread_priority", "tensor_memoryview"]


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
