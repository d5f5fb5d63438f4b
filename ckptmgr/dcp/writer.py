"""Our DCP ``StorageWriter``: raw tensor bytes in large sequential writes, JSON metadata, and the
commit protocol of DESIGN.md section 5.

Call order (DCP's, per save):
1) (all ranks) ``set_up_storage_writer``, ``prepare_local_plan``
2) (coordinator) ``prepare_global_plan``
3) (all ranks) ``write_data``: split this rank's items into ``num_threads`` runs of about equal
   bytes (one stream each, only when every stream gets at least 256 MiB), and write each run to
   ``data-<attempt>-r<rank>-<index>.bin`` in the write directory: Python values are encoded first
   (on the calling thread, so an unsafe value fails before any byte is written); tensors are
   resolved on the stream's thread, small ones coalesced into one ``writev`` per 8 MiB, large ones
   hashed and written in 4 MiB pieces while the piece is in cache. Each item and each file get an
   xxh3-64 checksum, computed in that same pass. The files are fsynced; locations go in the results.
4) (coordinator, after every rank's ``write_data`` returned) ``finish``: write the metadata JSON,
   then the manifest, then make it visible: rename the staging directory into place (POSIX), or
   write the manifest object last (object stores, overwrite). Until that last step nothing of the
   new attempt is visible to ``all_steps`` or ``restore``.

CPU share: by default one stream per rank, so a background save uses at most one core for its
checksums and copies (the local storage writes with direct I/O from a second, mostly sleeping
thread), and no kernel time on page-cache writeback. Stream threads are ckptmgr's own and can run
at a raised nice value (``io_nice``); the default is 0 because a reniced writer, starved by a busy
training loop, took 5x longer and cost the loop as much compute (docs/performance.md). The calling
thread is never reniced.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptmgr._values import MAX_VALUE_BYTES, NotRepresentableError, encode_value
from ckptmgr._version import __version__
from ckptmgr.dcp._bytes import Hasher, checksum, lower_thread_priority, tensor_memoryview
from ckptmgr.dcp._metadata_json import ItemLocation, encode_metadata
from ckptmgr.dcp._streams import Stopped, run_streams, split_runs
from ckptmgr.dcp.planner import item_bytes
from ckptmgr.errors import ConfigError, UnsafeCheckpointError
from ckptmgr.layout import data_file_name, join, metadata_file_name
from ckptmgr.manifest import FileEntry, Manifest, utc_now_iso
from ckptmgr.step_store import CommitPlan, StepStore
from ckptmgr.storage import Storage, VectoredWriter

__all__ = ["DEFAULT_IO_NICE", "DEFAULT_NUM_THREADS", "CkptStorageWriter", "CommitPlan"]

log = logging.getLogger("ckptmgr")
_FILE_MARK = "\x00ckptmgr-file:"

# Items up to _SMALL bytes are coalesced into one vectored write per _BATCH bytes (or _BATCH_ITEMS
# items); larger ones are hashed and written in _PIECE pieces, so the write copies from cache.
_SMALL = 1 << 20
_BATCH = 8 << 20
_BATCH_ITEMS = 256
_PIECE = 4 << 20
# A second stream only pays off with enough bytes for each (measured in docs/performance.md).
_MIN_STREAM_BYTES = 256 << 20
DEFAULT_NUM_THREADS = 1
"""Streams per rank when the caller does not choose: one saturates the local disk measured here."""
DEFAULT_IO_NICE = 0
"""Nice increment of the stream threads when the caller does not choose."""


def _item_size(item: WriteItem, encoded: Mapping[MetadataIndex, tuple[bytes, str]]) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return len(encoded[item.index][0])
    return item_bytes(item)  # the chunk's bytes, not the whole tensor's


class CkptStorageWriter(StorageWriter):
    """Writes one save attempt of one rank; the coordinator's instance also commits it."""

    def __init__(self, storage: Storage, plan: CommitPlan, rank: int, *,
                 trusted: bool = False, num_threads: int | None = None,
                 io_nice: int | None = None, fence: Callable[[], None] | None = None) -> None:
        """
        Args:
            storage: where the step is written.
            plan: the coordinator's decision for this attempt (same on every rank).
            rank: this rank.
            trusted: allow values that need pickle.
            num_threads: streams (threads, files) per rank; None: :data:`DEFAULT_NUM_THREADS`.
            io_nice: raise the nice value of the stream threads by this much (0: leave it;
                None: :data:`DEFAULT_IO_NICE`); meant for background saves, so that training
                keeps its cores.
            fence: called by the coordinator right before the step becomes visible; raises
                to stop the commit (a writer that lost the root's lease).
        """
        super().__init__()
        self.storage = storage
        self.plan = plan
        self.rank = rank
        self.trusted = trusted
        self.num_threads = max(1, num_threads or DEFAULT_NUM_THREADS)
        self.io_nice = DEFAULT_IO_NICE if io_nice is None else io_nice
        self.fence = fence
        self.is_coordinator = False
        self.manifest: Manifest | None = None
        self.bytes_written = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None, save_id=self.plan.attempt)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def _encode_object(self, fqn: str, obj: Any) -> tuple[bytes, str]:
        try:
            data, enc = encode_value(obj), "json"
        except NotRepresentableError as e:
            if not self.trusted:
                raise UnsafeCheckpointError(
                    f"{fqn!r} holds {type(obj).__name__}, which needs pickle: {e}; store plain "
                    "values or tensors, or pass trusted=True to save (and to restore)") from e
            buf = io.BytesIO()
            torch.save(obj, buf)
            data, enc = buf.getvalue(), "pickle"
        if len(data) > MAX_VALUE_BYTES:
            # A restore refuses what claims more (it would allocate first): refuse it now.
            raise ConfigError(
                f"state value {fqn!r} ({type(obj).__name__}) takes {len(data)} bytes stored, more "
                f"than the {MAX_VALUE_BYTES} bytes a Python value may; store large data as a "
                "tensor")
        return data, enc

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            fut.set_result([])
            return fut
        encoded: dict[MetadataIndex, tuple[bytes, str]] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                obj = planner.lookup_object(item.index)  # type: ignore[attr-defined]
                encoded[item.index] = self._encode_object(item.index.fqn, obj)
        items = list(plan.items)
        sizes = [_item_size(i, encoded) for i in items]
        starts = split_runs(sizes, self.num_threads, _MIN_STREAM_BYTES)
        bounds = list(zip(starts, [*starts[1:], len(items)], strict=True))
        runs = [items[a:b] for a, b in bounds]
        run_bytes = [sum(sizes[a:b]) for a, b in bounds]
        outcome = run_streams(
            lambda i, stop: self._write_stream(i, runs[i], run_bytes[i], planner, encoded, stop),
            len(runs), name="ckptmgr-write", always_thread=self.io_nice > 0,
            thread_setup=lambda: lower_thread_priority(self.io_nice))
        results: list[WriteResult] = []
        self.bytes_written = 0
        for index, (stream_results, entry) in enumerate(outcome):
            results.extend(stream_results)
            self.bytes_written += entry.size
            results.append(WriteResult(
                index=MetadataIndex(f"{_FILE_MARK}{self.rank}:{index}"), size_in_bytes=entry.size,
                storage_data=(self.rank, entry)))
        fut.set_result(results)
        return fut

    def _write_stream(self, index: int, items: list[WriteItem], nbytes: int, planner: SavePlanner,
                      encoded: Mapping[MetadataIndex, tuple[bytes, str]],
                      stop: threading.Event) -> tuple[list[WriteResult], FileEntry]:
        """Write ``items`` (about ``nbytes``) in order to data file ``index``; returns their
        results and the file."""
        name = data_file_name(self.plan.attempt, self.rank, index)
        writer = self.storage.open_writer(join(self.plan.write_dir, name), size_hint=nbytes)
        writev = writer.writev if isinstance(writer, VectoredWriter) else None
        file_hash = Hasher()
        results: list[WriteResult] = []
        pending: list[memoryview] = []
        alive: list[Any] = []  # owners of the memory that ``pending`` views
        pending_bytes = 0
        pos = 0

        def flush() -> None:
            nonlocal pending_bytes
            if not pending:
                return
            if writev is not None:
                writev(pending)
            else:
                writer.write(pending[0] if len(pending) == 1 else b"".join(pending))
            pending.clear()
            alive.clear()
            pending_bytes = 0

        try:
            for item in items:
                if stop.is_set():
                    raise Stopped
                owner: Any
                if item.type == WriteItemType.BYTE_IO:
                    owner, enc = encoded[item.index]
                    mv = memoryview(owner)
                else:
                    t = planner.resolve_data(item)
                    assert isinstance(t, torch.Tensor), "tensor item resolved to bytes"
                    t = t.detach()
                    if t.device.type != "cpu":
                        t = t.cpu()
                    owner = t.contiguous()
                    mv = tensor_memoryview(owner)
                    enc = "raw"
                n = len(mv)
                if n <= _SMALL:
                    item_sum = checksum(mv)
                    file_hash.update(mv)
                    pending.append(mv)
                    alive.append(owner)
                    pending_bytes += n
                    if pending_bytes >= _BATCH or len(pending) >= _BATCH_ITEMS:
                        flush()
                else:
                    flush()
                    h = Hasher()
                    for off in range(0, n, _PIECE):
                        piece = mv[off:off + _PIECE]
                        h.update(piece)
                        file_hash.update(piece)
                        writer.write(piece)
                    item_sum = h.value()
                results.append(WriteResult(index=item.index, size_in_bytes=n,
                                           storage_data=ItemLocation(name, pos, n, item_sum, enc)))
                pos += n
            flush()
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        return results, FileEntry(name, pos, file_hash.value())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Write metadata and manifest, then make the step visible."""
        p = self.plan
        locations: dict[MetadataIndex, ItemLocation] = {}
        files: list[FileEntry] = []
        bytes_per_rank: dict[int, int] = {r: 0 for r in range(p.world_size)}
        for rank_results in results:
            for wr in rank_results:
                if wr.index.fqn.startswith(_FILE_MARK):
                    rank, entry = wr.storage_data
                    files.append(entry)
                    bytes_per_rank[rank] = bytes_per_rank.get(rank, 0) + entry.size
                else:
                    locations[wr.index] = wr.storage_data
        metadata.storage_data = locations
        md_bytes = encode_metadata(metadata)
        md_name = metadata_file_name(p.attempt)
        self.storage.write_bytes(join(p.write_dir, md_name), md_bytes)
        files.append(FileEntry(md_name, len(md_bytes), checksum(md_bytes)))
        bytes_per_rank[self.rank] = bytes_per_rank.get(self.rank, 0) + len(md_bytes)
        manifest = Manifest(
            step=p.step, time=utc_now_iso(), attempt=p.attempt, world_size=p.world_size,
            metadata_file=md_name, files=tuple(sorted(files, key=lambda f: f.path)),
            bytes_per_rank=bytes_per_rank,
            versions={"ckptmgr": __version__, "torch": torch.__version__,
                      "python": sys.version.split()[0]},
            metrics=dict(p.metrics), metadata=dict(p.metadata), mesh=p.mesh,
            byteorder=sys.byteorder,
        )
        StepStore(self.storage).commit(p, manifest, self.fence)
        self.manifest = manifest
