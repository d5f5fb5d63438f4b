"""Our DCP ``StorageReader``: reads straight into destination tensors and verifies every item.

Call order (DCP's, per restore):
1) (all ranks) ``read_metadata`` returns the metadata the manager already read and validated;
   ``set_up_storage_reader``, ``prepare_local_plan``
2) (coordinator) ``prepare_global_plan``
3) (all ranks) ``read_data``: check the size of every file the plan touches before reading any
   bytes, then read each stored item once (into the destination when it is a whole contiguous CPU
   tensor of the same dtype, else into a buffer that is narrowed and copied), verify its checksum,
   and decode Python values from tagged JSON (pickle only when ``trusted``).
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptmgr._values import decode_value
from ckptmgr.dcp._bytes import checksum, tensor_memoryview
from ckptmgr.dcp._metadata_json import ItemLocation
from ckptmgr.dcp.planner import CkptLoadPlanner
from ckptmgr.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptmgr.layout import join
from ckptmgr.manifest import Manifest
from ckptmgr.storage import Storage

__all__ = ["CkptStorageReader"]


class CkptStorageReader(StorageReader):
    """Reads one committed step for one rank."""

    def __init__(self, storage: Storage, step_dir: str, manifest: Manifest, metadata: Metadata,
                 *, verify: bool = True, trusted: bool = False) -> None:
        super().__init__()
        self.storage = storage
        self.step_dir = step_dir
        self.manifest = manifest
        self.metadata = metadata
        self.verify = verify
        self.trusted = trusted
        self.bytes_read = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def _corrupt(self, msg: str, path: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"step {self.manifest.step}: {path}: {msg}; the checkpoint is damaged, restore another "
            "step", step=self.manifest.step, path=path)

    def _location(self, index: MetadataIndex) -> ItemLocation:
        loc = (self.metadata.storage_data or {}).get(index)
        if loc is None:
            raise self._corrupt(f"no stored bytes for {index.fqn!r} at {index.offset}",
                                self.manifest.metadata_file)
        return loc  # type: ignore[no-any-return]

    def _check_sizes(self, files: set[str]) -> None:
        listed = self.storage.list_files(self.step_dir)
        for f in sorted(files):
            try:
                entry = self.manifest.file(f)
            except KeyError:
                raise self._corrupt("not listed in the manifest", f) from None
            actual = listed.get(f)
            if actual is None:
                raise self._corrupt("file is missing", f)
            if actual != entry.size:
                raise self._corrupt(f"size is {actual} bytes, the manifest says {entry.size} "
                                    "(truncated or overwritten)", f)

    def _verify(self, loc: ItemLocation, data: memoryview | bytes, fqn: str) -> None:
        if self.verify and checksum(data) != loc.checksum:
            raise self._corrupt(f"checksum mismatch in the bytes of {fqn!r}", loc.file)

    def _read(self, loc: ItemLocation, buf: memoryview) -> None:
        self.storage.read_into(join(self.step_dir, loc.file), loc.offset, buf)
        self.bytes_read += len(buf)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        groups: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
        for ri in plan.items:
            groups[ri.storage_index].append(ri)
        located = {idx: self._location(idx) for idx in groups}
        self._check_sizes({loc.file for loc in located.values()})
        order = sorted(groups, key=lambda i: (located[i].file, located[i].offset))
        for idx in order:
            loc, items = located[idx], groups[idx]
            if items[0].type == LoadItemType.BYTE_IO:
                self._read_value(loc, items, planner)
            else:
                self._read_tensor(idx, loc, items, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_value(self, loc: ItemLocation, items: list[ReadItem], planner: LoadPlanner) -> None:
        fqn = items[0].storage_index.fqn
        if loc.enc == "pickle" and not self.trusted:
            raise UnsafeCheckpointError(
                f"{fqn!r} was stored with pickle; pass trusted=True to restore it only if you "
                "trust who wrote this checkpoint", step=self.manifest.step)
        buf = bytearray(loc.length)
        self._read(loc, memoryview(buf))
        self._verify(loc, memoryview(buf), fqn)
        value: Any
        if loc.enc == "json":
            try:
                value = decode_value(bytes(buf))
            except ValueError as e:
                raise self._corrupt(f"value of {fqn!r} does not decode: {e}", loc.file) from e
        else:
            value = torch.load(io.BytesIO(buf), weights_only=False)
        for ri in items:
            if isinstance(planner, CkptLoadPlanner):
                planner.load_value(ri, value)
            else:
                raise UnsafeCheckpointError("CkptStorageReader needs a CkptLoadPlanner")

    def _read_tensor(self, idx: MetadataIndex, loc: ItemLocation, items: list[ReadItem],
                     planner: LoadPlanner) -> None:
        fqn = idx.fqn
        md = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise self._corrupt(f"{fqn!r} is not a tensor in the metadata", loc.file)
        chunk = None
        offsets = tuple(idx.offset) if idx.offset is not None else (0,) * len(md.size)
        for c in md.chunks:
            if tuple(c.offsets) == offsets:
                chunk = c
                break
        if chunk is None:
            raise self._corrupt(f"no chunk of {fqn!r} at offsets {list(offsets)}", loc.file)
        dtype = md.properties.dtype
        numel = 1
        for s in chunk.sizes:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes != loc.length:
            raise self._corrupt(f"{fqn!r} needs {nbytes} bytes, the metadata says {loc.length}",
                                loc.file)
        if len(items) == 1 and list(items[0].storage_offsets) == [0] * len(chunk.sizes) and (
                list(items[0].lengths) == list(chunk.sizes)):
            target = planner.resolve_tensor(items[0]).detach()
            if (target.device.type == "cpu" and target.dtype == dtype
                    and target.is_contiguous() and target.numel() == numel):
                view = tensor_memoryview(target)
                self._read(loc, view)
                self._verify(loc, view, fqn)
                planner.commit_tensor(items[0], target)
                return
        buf = torch.empty(tuple(chunk.sizes), dtype=dtype)
        view = tensor_memoryview(buf)
        self._read(loc, view)
        self._verify(loc, view, fqn)
        for ri in items:
            src = buf
            for dim, (off, length) in enumerate(zip(ri.storage_offsets, ri.lengths, strict=True)):
                src = src.narrow(dim, off, length)
            target = planner.resolve_tensor(ri).detach()
            target.copy_(src)
            planner.commit_tensor(ri, target)
