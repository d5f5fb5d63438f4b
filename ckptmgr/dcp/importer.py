"""Planning the import of a checkpoint written by plain DCP (``torch.distributed.checkpoint.save``).

An import reads the source with DCP's public ``FileSystemReader`` and saves it again through our
writer, in one process (no process group). Three pieces make that possible without holding the
whole state in memory:

1) :class:`CachedMetadataReader` unpickles the source's ``.metadata`` once for the many loads;
2) :func:`nest_items` puts DCP's flat items back in their containers, so that our own flattening
   (which stores lists of plain values as one value) decides the keys restore looks up;
3) :class:`LazyImportPlanner` is our save planner over placeholder (meta) tensors: each tensor is
   loaded from the source only when the writer asks for it, a batch at a time.

The source's ``.metadata`` and values are pickle: callers read them only for a trusted source.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ckptmgr.dcp.compat import dcp_load
from ckptmgr.dcp.planner import CkptSavePlanner

__all__ = ["CachedMetadataReader", "LazyImportPlanner", "nest_items"]


class CachedMetadataReader(FileSystemReader):
    """DCP's FileSystemReader that unpickles ``.metadata`` once for the many loads of an import."""

    _cached: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached is None:
            self._cached = super().read_metadata(*args, **kwargs)
        return self._cached


def _nbytes(meta: TensorStorageMetadata) -> int:
    return math.prod(meta.size) * torch.empty((), dtype=meta.properties.dtype).element_size()


class LazyImportPlanner(CkptSavePlanner):
    """Our save planner over placeholder (meta) tensors; each tensor is read from the DCP source
    only when the writer asks for it, a batch of up to ``batch_bytes`` bytes (at least one
    tensor) at a time.

    Args:
        reader: the DCP source.
        sources: our flat key -> the source's key, for every tensor, in the order of the state.
        metas: the source's tensor metadata, by the source's key.
        batch_bytes: the most tensor bytes loaded per DCP read (one larger tensor is still read).
        on_bytes: called with the bytes of each tensor handed to the writer.
    """

    def __init__(self, reader: FileSystemReader, sources: Mapping[str, str],
                 metas: Mapping[str, TensorStorageMetadata], *, batch_bytes: int,
                 on_bytes: Callable[[int], None]) -> None:
        super().__init__()
        self._reader = reader
        self._sources = dict(sources)  # our flat key -> the DCP key, in state order
        self._order = list(sources)
        self._pos = {k: i for i, k in enumerate(self._order)}
        self._metas = metas
        self._cache: dict[str, torch.Tensor] = {}
        self._batch_bytes = batch_bytes
        self._on_bytes = on_bytes

    def _load_batch(self, first: str) -> None:
        self._cache.clear()  # drop the previous batch before allocating the next
        batch: dict[str, torch.Tensor] = {}
        size = 0
        for key in self._order[self._pos[first]:]:
            meta = self._metas[self._sources[key]]
            nbytes = _nbytes(meta)
            if batch and size + nbytes > self._batch_bytes:
                break
            batch[self._sources[key]] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            size += nbytes
        dcp_load(batch, self._reader, DefaultLoadPlanner(), None)
        ours = {v: k for k, v in self._sources.items()}
        self._cache = {ours[k]: t for k, t in batch.items()}

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = super().lookup_object(index)
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            if index.fqn not in self._cache:
                self._load_batch(index.fqn)
            obj = self._cache.pop(index.fqn)
            self._on_bytes(obj.numel() * obj.element_size())
        return obj


def _set_path(root: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    cur: Any = root
    for key, nxt in itertools.pairwise(path):
        default: Any = [] if isinstance(nxt, int) else {}
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                cur[key] = default
            cur = cur[key]
        else:
            cur = cur.setdefault(key, default)
    last = path[-1]
    if isinstance(cur, list):
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value


def nest_items(items: Mapping[str, Any], mappings: Any) -> dict[str, Any]:
    """DCP's flat items back in their nested containers (by the save's ``planner_data``); the flat
    items themselves when the map is missing or does not fit."""
    if not isinstance(mappings, Mapping):
        return dict(items)
    paths = {k: mappings.get(k) for k in items}
    if not all(isinstance(p, tuple) and p and isinstance(p[0], str) and all(
            isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool) and x >= 0)
            for x in p) for p in paths.values()):
        return dict(items)
    root: dict[str, Any] = {}
    try:
        for k, value in items.items():
            _set_path(root, paths[k], value)  # type: ignore[arg-type]
    except (TypeError, IndexError, KeyError, AttributeError):
        return dict(items)
    return root
