"""Staging memory shared with the writer process: anonymous shared-memory arenas (Linux memfd).

An :class:`Arena` is one ``memfd_create`` file mapped ``MAP_SHARED`` as a uint8 tensor; staging
buffers are views into it, aligned to pages. The training process creates arenas and hands their
file descriptors to its writer process over a Unix socket (``SCM_RIGHTS``); the writer maps the
same pages, so a staged copy reaches it without another copy and without a name in any file system:
the memory is freed when the last process holding it closes or dies (no leak on SIGKILL). Where
CUDA is available the arena is also registered as pinned memory, so device-to-host copies into it
are non-blocking.

Call order: the training process ``ArenaSet.allocate`` s buffers (one arena per call), stages into
them, sends :meth:`ArenaSet.unsent` arenas' descriptors before the job that refers to them,
:meth:`ArenaSet.locate` s each staged buffer (arena id, offset) for the job, and
:meth:`ArenaSet.retire_unused` s arenas no staged buffer uses any more. The writer process
:func:`attach` es each descriptor it receives and builds the same views with :func:`view`.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ckptmgr.errors import ConfigError

__all__ = ["ALIGN", "Arena", "ArenaSet", "ShmTensor", "attach", "pack", "require_shared_staging",
           "view"]

log = logging.getLogger("ckptmgr")

ALIGN = 4096  # buffers start on page boundaries
_IDS = itertools.count(1)


def require_shared_staging() -> None:
    """Raise ConfigError unless this platform has anonymous shared memory we can hand to another
    process (Linux memfd)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "memfd_create")):
        raise ConfigError("async_mode='process' needs Linux (anonymous shared memory, "
                          "memfd_create); use async_mode='thread' on this platform")


@dataclass(frozen=True)
class ShmTensor:
    """Where a staged tensor lies: ``arena`` id, byte ``offset``, ``shape`` and ``dtype``."""

    arena: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _map(fd: int, nbytes: int) -> torch.Tensor:
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


def view(base: torch.Tensor, ref: ShmTensor) -> torch.Tensor:
    """The tensor ``ref`` describes inside the mapped arena ``base``."""
    itemsize = torch.empty((), dtype=ref.dtype).element_size()
    n = itemsize
    for d in ref.shape:
        n *= d
    return base[ref.offset:ref.offset + n].view(ref.dtype).view(ref.shape)


def attach(fd: int, nbytes: int) -> torch.Tensor:
    """(writer process) Map an arena received as ``fd``; the descriptor is closed after."""
    try:
        return _map(fd, nbytes)
    finally:
        os.close(fd)


class Arena:
    """One shared-memory file mapped as ``nbytes`` of uint8 (pinned where CUDA is available)."""

    def __init__(self, nbytes: int) -> None:
        self.id = next(_IDS)
        self.nbytes = max(int(nbytes), ALIGN)
        self.fd: int | None = os.memfd_create("ckptmgr-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.base = _map(self.fd, self.nbytes)
        except BaseException:
            self.close()
            raise
        self.pinned = False
        if torch.cuda.is_available():  # page-lock it, so device-to-host copies are async
            err = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
               self.base.data_ptr(), self.nbytes, 0)
            self.pinned = int(err) == 0
            if not self.pinned:
                log.warning("could not pin %d bytes of shared staging memory (cuda error %s): "
                            "device-to-host copies will be synchronous", self.nbytes, err)

    def close(self) -> None:
        """Drop this process's descriptor (views keep the mapping until they are freed)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self.base.data_ptr())
            self.pinned = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], list[int], int]:
    """Buffers of the given shapes and dtypes laid out one after another in one block, each
    starting on a page: their byte offsets, their byte sizes and the block's size."""
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
             for shape, dt in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += _aligned(n)
    return offsets, sizes, total


class ArenaSet:
    """The arenas of one training process's staging buffers (used by one thread).

    Raises:
        ConfigError: this platform cannot share staging memory (:func:`require_shared_staging`).
    """

    def __init__(self) -> None:
        require_shared_staging()
        self._arenas: dict[int, Arena] = {}
        self._by_ptr: dict[int, Arena] = {}  # the arena's storage data pointer -> arena
        self._sent: set[int] = set()

    @property
    def pinned_nbytes(self) -> int:
        return sum(a.nbytes for a in self._arenas.values() if a.pinned)

    def allocate(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Buffers of the given shapes and dtypes, all views of one new arena."""
        offsets, _, total = pack(specs)
        arena = Arena(total)
        self._arenas[arena.id] = arena
        self._by_ptr[arena.base.untyped_storage().data_ptr()] = arena
        return [view(arena.base, ShmTensor(arena.id, off, tuple(shape), dt))
                for off, (shape, dt) in zip(offsets, specs, strict=True)]

    def locate(self, t: torch.Tensor) -> ShmTensor:
        """Where staged buffer ``t`` lies (it must be a view made by :meth:`allocate`)."""
        storage = t.untyped_storage().data_ptr()
        arena = self._by_ptr[storage]
        return ShmTensor(arena.id, t.data_ptr() - storage, tuple(t.shape), t.dtype)

    def unsent(self) -> list[Arena]:
        """Arenas the writer process has not received yet (marked as received)."""
        out = [a for i, a in self._arenas.items() if i not in self._sent]
        self._sent.update(a.id for a in out)
        return out

    def forget_sent(self) -> None:
        """The writer process was restarted: every arena must be sent again."""
        self._sent.clear()

    def retire_unused(self, live: Iterable[torch.Tensor]) -> list[int]:
        """Close the arenas no buffer in ``live`` uses; return their ids (tell the writer)."""
        used = {self._by_ptr[t.untyped_storage().data_ptr()].id for t in live}
        gone = [i for i in self._arenas if i not in used]
        for i in gone:
            arena = self._arenas.pop(i)
            self._by_ptr.pop(arena.base.untyped_storage().data_ptr(), None)
            arena.close()
        retired = [i for i in gone if i in self._sent]
        self._sent.difference_update(gone)
        return retired

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        self._by_ptr.clear()
        self._sent.clear()
