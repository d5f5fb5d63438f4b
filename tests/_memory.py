"""This process's memory mappings, as the kernel reports them (Linux /proc/self/smaps), and
memory registered as huge pages for the local direct writer."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator


def vma_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping that holds address ``ptr`` ("hg": advised to use huge pages)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


@contextlib.contextmanager
def huge_page_arena(nbytes: int) -> Iterator[tuple[mmap.mmap, int]]:
    """``nbytes`` of page-aligned memory of random bytes, registered with the local storage as
    huge pages (as a background save's staging is) while the block runs: (mapping, address)."""
    from ckptmgr.storage import local

    m = mmap.mmap(-1, nbytes)
    m[:] = os.urandom(nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    local.note_huge_pages(addr, len(m))
    try:
        yield m, addr
    finally:
        local.forget_huge_pages(addr)
