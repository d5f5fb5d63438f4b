"""Public read-only records: :class:`StepInfo` for a committed step, :class:`SaveStats` per save."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ckptmgr.codec.manifest import FileEntry, Manifest

__all__ = ["FileEntry", "SaveStats", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What the manifest of a committed step records.

    Attributes:
        step: the step number.
        time: commit time, UTC, ISO 8601 (``2026-11-22T08:00:00.000000Z``).
        world_size: number of ranks that saved it.
        metrics: the ``metrics`` passed to save.
        metadata: the ``metadata`` passed to save.
        files: every file of the step (path relative to the step directory, size, checksum).
        total_bytes: sum of the file sizes.
        bytes_per_rank: rank -> bytes that rank wrote.
        versions: ``{"ckptmgr": ..., "torch": ..., "python": ...}`` of the writer.
        mesh: the device mesh description when one was recorded, else None.
        format: ``"ckptmgr"`` for our steps; ``"dcp"`` for a step written by plain DCP
            (torch_xla's manager, torchtitan, ``dcp.save``): listed and never written or deleted
            by ckptmgr; its other fields are empty (its metadata is pickle, never read to list).
        tiers: which tiers hold the step: ``("durable",)``, ``("local",)`` or both
            (docs/multitier.md). For a step only on the local tier, ``files``, ``total_bytes``
            and ``bytes_per_rank`` are this rank's own.
    """

    step: int
    time: str
    world_size: int
    metrics: Mapping[str, float]
    metadata: Mapping[str, Any]
    files: tuple[FileEntry, ...]
    total_bytes: int
    bytes_per_rank: Mapping[int, int]
    versions: Mapping[str, str]
    mesh: Any = None
    format: str = "ckptmgr"
    tiers: tuple[str, ...] = ("durable",)

    @classmethod
    def foreign(cls, step: int) -> StepInfo:
        """The StepInfo of a step written by plain DCP (nothing of it is read)."""
        empty: Mapping[Any, Any] = MappingProxyType({})
        return cls(step=step, time="", world_size=0, metrics=empty, metadata=empty, files=(),
                   total_bytes=0, bytes_per_rank=empty, versions=empty, format="dcp")

    @classmethod
    def from_manifest(cls, m: Manifest) -> StepInfo:
        """The StepInfo of a parsed manifest."""
        return cls(
            step=m.step, time=m.time, world_size=m.world_size,
            metrics=MappingProxyType(dict(m.metrics)),
            metadata=MappingProxyType(dict(m.metadata)), files=m.files,
            total_bytes=m.total_bytes,
            bytes_per_rank=MappingProxyType(dict(m.bytes_per_rank)),
            versions=MappingProxyType(dict(m.versions)), mesh=m.mesh,
        )


@dataclass(frozen=True)
class SaveStats:
    """Figures of one save, as seen by this rank.

    Attributes:
        step: the step saved.
        blocking_s: seconds the training thread was blocked by the save call.
        write_s: seconds from the start of writing to the commit.
        bytes: bytes this rank wrote.
        total_bytes: bytes of the whole step (all ranks).
        throughput_bytes_per_s: ``total_bytes / write_s``.
        staging_bytes: bytes this rank copied into host staging buffers for this save (0 for a
            blocking save, which writes the live state).
        pinned_bytes: bytes of pinned (page-locked) host memory the staging buffers hold (0
            without CUDA); allocated at the first save and reused while the state's structure is
            unchanged.
        tier: where the step went: ``"durable"`` (the root) or ``"local"`` (the fast
            node-local tier).
    """

    step: int
    blocking_s: float
    write_s: float
    bytes: int
    total_bytes: int
    staging_bytes: int = 0
    pinned_bytes: int = 0
    tier: str = "durable"

    @property
    def throughput_bytes_per_s(self) -> float:
        """Whole-step bytes per second of writing."""
        return self.total_bytes / self.write_s if self.write_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every figure, throughput included, as a JSON-ready dict (what log records carry)."""
        out = dict(self.__dict__)
        out["throughput_bytes_per_s"] = self.throughput_bytes_per_s
        return out
