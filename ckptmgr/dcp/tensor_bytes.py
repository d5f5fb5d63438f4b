"""Raw byte views of CPU tensors, the gate that holds a writer back from staging memory whose
copy is still running, and the CPU-share knob of ckptmgr's I/O threads.

The checksum over those bytes is torch-free, in :mod:`ckptmgr.codec.checksum`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Protocol

import torch

__all__ = ["StagingGate", "close_gate", "lower_thread_priority", "open_gate", "tensor_memoryview",
           "wait_staged"]


class StagingGate(Protocol):
    """Copies into staging memory that may still be running (``ckptmgr._async``)."""

    def wait_ready(self, address: int) -> None:
        """Return once the copy into the staging buffer holding ``address`` (if any of this
        gate's) has landed; raise if staging failed."""


_GATES: list[StagingGate] = []
_GATES_LOCK = threading.Lock()


def open_gate(gate: StagingGate) -> None:
    """``gate``'s buffers are being copied: :func:`wait_staged` waits on them until closed."""
    with _GATES_LOCK:
        _GATES.append(gate)


def close_gate(gate: StagingGate) -> None:
    """``gate``'s copies have all ended (landed, or failed and said so to their waiters)."""
    with _GATES_LOCK:
        if gate in _GATES:
            _GATES[:] = [g for g in _GATES if g is not gate]


def wait_staged(t: torch.Tensor) -> None:
    """Before reading ``t``'s bytes: wait until a staging copy still running into the memory
    ``t`` views has landed. Nothing to wait for (no gate open, or ``t`` is no staging buffer
    being copied): returns at once. A background save starts writing while the caller's thread
    still copies the state into staging (``ckptmgr._async``); its writer calls this for every
    tensor before it reads, hashes or hands over its memory.

    Raises:
        SaveError: the copy into ``t``'s buffer failed (from the gate).
    """
    if not _GATES:
        return
    with _GATES_LOCK:
        gates = list(_GATES)
    address = t.data_ptr()
    for gate in gates:
        gate.wait_ready(address)


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
