"""This process's memory mappings, as the kernel reports them (Linux /proc/self/smaps)."""

from __future__ import annotations


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
