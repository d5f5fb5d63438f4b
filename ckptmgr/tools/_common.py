"""What every command of :mod:`ckptmgr.tools` shares: progress reporting, step resolution, and
reading a step's manifest and metadata the way the manager does (JSON only, every path checked to
stay inside its step directory).

Step directories are read, committed and deleted only through :class:`ckptmgr.step_store.StepStore`
(the manager uses the same one), so the CLI and the manager raise the same errors for the same
input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import xxhash

from ckptmgr.codec.dtypes import DTYPE_ITEMSIZE
from ckptmgr.codec.layout import is_shared_chunk_path, join, shared_chunk_digest
from ckptmgr.errors import (
    StorageError,
)
from ckptmgr.step_store import StepStore
from ckptmgr.storage import Storage, is_not_found
from ckptmgr.tools.listing import format_bytes as format_bytes  # re-exported

# torch (and ckptmgr.dcp, which imports it) only where tensors are handled: ``ckptmgr cp``,
# ``prune``, ``inspect`` and ``verify`` use this module and start without importing torch.
if TYPE_CHECKING:
    import torch

    from ckptmgr.codec.metadata import ItemLocation, MetadataDoc

_CHUNK = 16 * 1024 * 1024  # read buffer of verify and copy


def stored_path(step_dir: str, name: str) -> str:
    """Where a file that a step's manifest or metadata names lives, relative to the root: a
    shared chunk (``chunks/<32 hex>``, ``reuse_unchanged=True``) is root-relative, any other
    name is a file of the step directory."""
    return name if is_shared_chunk_path(name) else join(step_dir, name)


class DigestCheck:
    """The xxh3-128 of a shared chunk's bytes, fed piece by piece, against the name it is stored
    under: the chunk's name is that digest (:func:`ckptmgr.codec.checksum.content_digest`, of the
    whole chunk at once), so bytes that do not match it are not the chunk the name promises."""

    def __init__(self, path: str) -> None:
        self.expected = shared_chunk_digest(path)
        self._h = xxhash.xxh3_128()

    def update(self, data: memoryview | bytes) -> None:
        self._h.update(data)

    def mismatch(self) -> str | None:
        """None when the bytes fed match the name, else the reason."""
        got = self._h.hexdigest()
        if got == self.expected:
            return None
        return f"content does not match the chunk's name (its xxh3-128 is {got})"


def _file_sizes(storage: Storage, step_dir: str, paths: Iterable[str],
                shared: dict[str, int] | None = None) -> dict[str, int | None]:
    """Actual sizes of ``paths`` (relative to ``step_dir``, or root-relative shared chunks);
    None for a missing file. ``shared``: the root's shared chunks as listed already
    (:meth:`~ckptmgr.step_store.StepStore.shared_sizes`), else listed here when one is asked."""
    listed = storage.list_files(step_dir)
    out: dict[str, int | None] = {}
    for p in paths:
        if is_shared_chunk_path(p):
            if shared is None:
                shared = StepStore(storage).shared_sizes()
            out[p] = shared.get(p)
            continue
        if "/" not in p:
            out[p] = listed.get(p)
            continue
        try:
            out[p] = storage.size(join(step_dir, p))
        except StorageError as e:
            if not is_not_found(e):
                raise
            out[p] = None
    return out


def _locations(md: MetadataDoc) -> dict[tuple[str, tuple[int, ...] | None], ItemLocation]:
    """Every stored item of ``md`` by (key, chunk offsets or None for a value)."""
    return {(fqn, offsets): loc for fqn, offsets, loc in md.locations()}


def _natural(key: str) -> list[tuple[int, int | str]]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _element_size(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype, or the metadata's name of one)."""
    if isinstance(dtype, str):
        return DTYPE_ITEMSIZE[dtype]
    return dtype.itemsize



