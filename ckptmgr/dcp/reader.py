"""Our DCP ``StorageReader``: reads straight into destination tensors and verifies every item.

Call order (DCP's, per restore):
1) (all ranks) ``read_metadata`` returns the metadata the manager already read and validated;
   ``set_up_storage_reader``, ``prepare_local_plan``
2) (coordinator) ``prepare_global_plan``
3) (all ranks) ``read_data``: check the size of every file the plan touches before reading any
   bytes; decode Python values from tagged JSON (pickle only when ``trusted``); then, on the
   calling thread, resolve every tensor item's destination: the tensor itself when it is a whole
   contiguous CPU tensor of the stored dtype, else a buffer that is narrowed and copied afterwards.
   The reads, sorted by file and offset, are cut into ``num_threads`` runs of about equal bytes;
   each run's thread reads adjacent items with one ``preadv`` per 4 MiB (scattering into the
   destinations) and checksums each piece while it is in cache. Destinations are committed to the
   planner on the calling thread, in order, once every read of a window succeeded. Buffered
   destinations are bounded: at most 512 MiB of buffers are held at once (a window).
"""

from __future__ import annotations

import io
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptmgr._values import MAX_VALUE_BYTES, decode_value
from ckptmgr.dcp._bytes import Hasher, checksum, tensor_memoryview
from ckptmgr.dcp._metadata_json import ItemLocation
from ckptmgr.dcp._streams import Stopped, run_streams, split_runs
from ckptmgr.dcp.planner import CkptLoadPlanner
from ckptmgr.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptmgr.layout import join
from ckptmgr.manifest import Manifest
from ckptmgr.storage import RangeReads, Storage

__all__ = ["DEFAULT_NUM_THREADS", "CkptStorageReader"]

DEFAULT_NUM_THREADS = 2
"""Read streams per rank when the caller does not choose: two keep the disk busy while the other
thread checksums (measured in docs/performance.md)."""
_BATCH = 16 << 20  # bytes per vectored read (2 streams x 16 MiB: as fast or faster than 4 MiB here)
_BATCH_ITEMS = 256
_MIN_STREAM_BYTES = 64 << 20
_MAX_BUFFERED = 512 << 20  # bytes of staging buffers held at once for non-direct destinations


@dataclass
class _TensorRead:
    """One stored chunk and where its bytes go."""

    idx: MetadataIndex
    loc: ItemLocation
    items: list[ReadItem]
    dest: torch.Tensor  # the destination itself (direct) or a buffer of the stored chunk
    direct: bool
    ok: bool = True
    hasher: Hasher | None = field(default=None, repr=False)


class _RangeReader:
    """Vectored range reads of one file: the storage's own reader when it has
    :class:`RangeReads`, else ranged reads of the whole span scattered into the buffers (one
    request per span on object stores)."""

    def __init__(self, storage: Storage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._native = storage.open_reader(path) if isinstance(storage, RangeReads) else None

    def readv_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        if self._native is not None:
            self._native.readv_into(offset, bufs)
        elif len(bufs) == 1:
            self._storage.read_into(self._path, offset, bufs[0])
        else:
            data = memoryview(self._storage.read_bytes(self._path, offset,
                                                       sum(len(b) for b in bufs)))
            pos = 0
            for b in bufs:
                b[:] = data[pos:pos + len(b)]
                pos += len(b)

    def close(self) -> None:
        if self._native is not None:
            self._native.close()


class CkptStorageReader(StorageReader):
    """Reads one committed step for one rank."""

    listed: dict[str, int] | None = None
    """The step directory's file sizes as the coordinator listed them for every rank (set by the
    caller); None: this rank lists the step itself before reading."""

    def __init__(self, storage: Storage, step_dir: str, manifest: Manifest, metadata: Metadata,
                 *, verify: bool = True, trusted: bool = False,
                 num_threads: int | None = None) -> None:
        """
        Args:
            storage: where the step is.
            step_dir: the step's directory under the storage root.
            manifest: the step's manifest (already read and checked).
            metadata: the step's metadata (already read and checked).
            verify: check every item's checksum.
            trusted: allow values stored with pickle.
            num_threads: read streams per rank; None: :data:`DEFAULT_NUM_THREADS`.
        """
        super().__init__()
        self.num_threads = max(1, num_threads or DEFAULT_NUM_THREADS)
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
        listed = self.listed if self.listed is not None else self.storage.list_files(
            self.step_dir)
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
        for idx, loc in located.items():
            # Checked before allocating a buffer of loc.length bytes or reading anything: a
            # value's claim is bounded, and every claim must lie within the bytes the file has
            # in storage (its listed size matched the manifest above).
            if groups[idx][0].type == LoadItemType.BYTE_IO and loc.length > MAX_VALUE_BYTES:
                raise self._corrupt(
                    f"value {idx.fqn!r} claims {loc.length} bytes, more than the "
                    f"{MAX_VALUE_BYTES} a stored Python value may take", loc.file)
            size = self.manifest.file(loc.file).size
            if loc.offset + loc.length > size:
                raise self._corrupt(
                    f"bytes [{loc.offset}, {loc.offset + loc.length}) of {idx.fqn!r} lie beyond "
                    f"the end of the file ({size} bytes)", loc.file)
        order = sorted(groups, key=lambda i: (located[i].file, located[i].offset))
        window: list[_TensorRead] = []
        buffered = 0
        for idx in order:
            loc, items = located[idx], groups[idx]
            if items[0].type == LoadItemType.BYTE_IO:
                self._read_value(loc, items, planner)
                continue
            read = self._plan_tensor(idx, loc, items, planner)
            if not read.direct:
                if buffered + loc.length > _MAX_BUFFERED and window:
                    self._run_window(window, planner)
                    window, buffered = [], 0
                buffered += loc.length
            window.append(read)
        if window:
            self._run_window(window, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan_tensor(self, idx: MetadataIndex, loc: ItemLocation, items: list[ReadItem],
                     planner: LoadPlanner) -> _TensorRead:
        """(calling thread) Check the stored chunk and choose its destination."""
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
                return _TensorRead(idx, loc, items, target, direct=True)
        return _TensorRead(idx, loc, items, torch.empty(tuple(chunk.sizes), dtype=dtype),
                           direct=False)

    def _run_window(self, reads: list[_TensorRead], planner: LoadPlanner) -> None:
        """Read ``reads`` (sorted by file and offset) on up to ``num_threads`` streams, then
        check and commit them on the calling thread, in order."""
        starts = split_runs([r.loc.length for r in reads], self.num_threads, _MIN_STREAM_BYTES)
        runs = [reads[a:b] for a, b in zip(starts, [*starts[1:], len(reads)], strict=True)]
        run_streams(lambda i, stop: self._read_run(runs[i], stop), len(runs),
                    name="ckptmgr-read")
        for r in reads:
            if not r.ok:
                raise self._corrupt(f"checksum mismatch in the bytes of {r.idx.fqn!r}", r.loc.file)
        for r in reads:
            self.bytes_read += r.loc.length
            if r.direct:
                planner.commit_tensor(r.items[0], r.dest)
                continue
            for ri in r.items:
                src = r.dest
                for dim, (off, length) in enumerate(
                        zip(ri.storage_offsets, ri.lengths, strict=True)):
                    src = src.narrow(dim, off, length)
                target = planner.resolve_tensor(ri).detach()
                target.copy_(src)
                planner.commit_tensor(ri, target)

    def _read_run(self, reads: list[_TensorRead], stop: threading.Event) -> None:
        """(stream thread) Read one run: adjacent items of a file in one vectored read per
        _BATCH bytes; each piece is checksummed right after it lands."""
        readers: dict[str, _RangeReader] = {}
        # (read, view of its destination) pieces of the batch being built; they are adjacent.
        batch: list[tuple[_TensorRead, memoryview, bool]] = []
        batch_file = ""
        batch_start = batch_end = 0

        def flush() -> None:
            nonlocal batch
            if not batch:
                return
            if stop.is_set():
                raise Stopped
            reader = readers.get(batch_file)
            if reader is None:
                reader = readers[batch_file] = _RangeReader(
                    self.storage, join(self.step_dir, batch_file))
            reader.readv_into(batch_start, [view for _, view, _ in batch])
            if self.verify:
                for r, view, last in batch:
                    if r.hasher is None:
                        r.hasher = Hasher()
                    r.hasher.update(view)
                    if last:
                        r.ok = r.hasher.value() == r.loc.checksum
                        r.hasher = None
            batch = []

        try:
            for r in reads:
                mv = tensor_memoryview(r.dest)
                n = len(mv)
                if batch and (r.loc.file != batch_file or r.loc.offset != batch_end
                              or len(batch) >= _BATCH_ITEMS):
                    flush()
                if not batch:
                    batch_file, batch_start = r.loc.file, r.loc.offset
                    batch_end = batch_start
                if n == 0:
                    r.ok = not self.verify or checksum(b"") == r.loc.checksum
                    continue
                pos = 0
                while pos < n:
                    take = min(n - pos, _BATCH - (batch_end - batch_start))
                    batch.append((r, mv[pos:pos + take], pos + take == n))
                    pos += take
                    batch_end += take
                    if batch_end - batch_start >= _BATCH:
                        flush()
                        batch_file, batch_start = r.loc.file, batch_end
            flush()
        finally:
            for reader in readers.values():
                reader.close()

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
