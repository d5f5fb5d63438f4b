"""Our DCP ``StorageWriter``: raw tensor bytes in one sequential file per rank, JSON metadata, and
the commit protocol of DESIGN.md section 5.

Call order (DCP's, per save):
1) (all ranks) ``set_up_storage_writer``, ``prepare_local_plan``
2) (coordinator) ``prepare_global_plan``
3) (all ranks) ``write_data``: write this rank's items to ``data-<attempt>-r<rank>-000.bin`` in the
   write directory, checksum each item and the file, fsync, and report locations in the results.
4) (coordinator, after every rank's ``write_data`` returned) ``finish``: write the metadata JSON,
   then the manifest, then make it visible: rename the staging directory into place (POSIX), or
   write the manifest object last (object stores, overwrite). Until that last step nothing of the
   new attempt is visible to ``all_steps`` or ``restore``.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptmgr._values import NotRepresentableError, encode_value
from ckptmgr._version import __version__
from ckptmgr.dcp._bytes import Hasher, checksum, tensor_memoryview
from ckptmgr.dcp._metadata_json import ItemLocation, encode_metadata
from ckptmgr.errors import UnsafeCheckpointError
from ckptmgr.layout import MANIFEST_NAME, data_file_name, join, metadata_file_name
from ckptmgr.manifest import FileEntry, Manifest, encode_manifest, utc_now_iso
from ckptmgr.storage import Storage

__all__ = ["CkptStorageWriter", "CommitPlan"]

log = logging.getLogger("ckptmgr")
_FILE_MARK = "\x00ckptmgr-file:"


@dataclass(frozen=True)
class CommitPlan:
    """What the coordinator decided for one save attempt (broadcast to every rank)."""

    step: int
    attempt: str
    write_dir: str
    step_dir: str
    staged: bool
    overwrite: bool
    world_size: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    mesh: Any = None


class CkptStorageWriter(StorageWriter):
    """Writes one save attempt of one rank; the coordinator's instance also commits it."""

    def __init__(self, storage: Storage, plan: CommitPlan, rank: int, *,
                 trusted: bool = False) -> None:
        super().__init__()
        self.storage = storage
        self.plan = plan
        self.rank = rank
        self.trusted = trusted
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
            return encode_value(obj), "json"
        except NotRepresentableError as e:
            if not self.trusted:
                raise UnsafeCheckpointError(
                    f"{fqn!r} holds {type(obj).__name__}, which needs pickle: {e}; store plain "
                    "values or tensors, or pass trusted=True to save (and to restore)") from e
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue(), "pickle"

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            fut.set_result(results)
            return fut
        name = data_file_name(self.plan.attempt, self.rank)
        path = join(self.plan.write_dir, name)
        writer = self.storage.open_writer(path)
        hasher = Hasher()
        pos = 0
        try:
            for item in plan.items:
                keep: Any
                if item.type == WriteItemType.BYTE_IO:
                    obj = planner.lookup_object(item.index)  # type: ignore[attr-defined]
                    keep, enc = self._encode_object(item.index.fqn, obj)
                    mv = memoryview(keep)
                else:
                    t = planner.resolve_data(item)
                    assert isinstance(t, torch.Tensor), "tensor item resolved to bytes"
                    t = t.detach()
                    if t.device.type != "cpu":
                        t = t.cpu()
                    keep = t.contiguous()
                    mv = tensor_memoryview(keep)
                    enc = "raw"
                hasher.update(mv)
                writer.write(mv)
                loc = ItemLocation(name, pos, len(mv), checksum(mv), enc)
                results.append(WriteResult(index=item.index, size_in_bytes=len(mv),
                                           storage_data=loc))
                pos += len(mv)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        self.bytes_written = pos
        results.append(WriteResult(
            index=MetadataIndex(f"{_FILE_MARK}{self.rank}"), size_in_bytes=pos,
            storage_data=(self.rank, FileEntry(name, pos, hasher.value()))))
        fut.set_result(results)
        return fut

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
        data = encode_manifest(manifest)
        if p.staged:
            self.storage.write_bytes(join(p.write_dir, MANIFEST_NAME), data)
            self.storage.fsync_dir(p.write_dir)
            self.storage.rename(p.write_dir, p.step_dir)
            self.storage.fsync_dir("")
        else:
            self.storage.write_bytes(join(p.step_dir, MANIFEST_NAME), data,
                                     exclusive=not p.overwrite)
        self.manifest = manifest
        log.debug("committed step %d (attempt %s) at %s", p.step, p.attempt, self.storage.url)
