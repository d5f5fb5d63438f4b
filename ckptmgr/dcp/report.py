"""The compatibility report: what a restore will do, computed before any tensor is read.

:func:`compatibility_report` is a pure function of the checkpoint's DCP ``Metadata``, the flat state
being restored into (:func:`ckptmgr.dcp.state.flatten_state`) and the world sizes. It lists:

- the saved and current world size and device mesh;
- keys missing from the checkpoint and keys the checkpoint has that the state does not request;
- shape, dtype and kind (tensor vs Python value) mismatches, and tensors the checkpoint does not
  fully cover (DCP would leave the uncovered part as it was, silently);
- what will be resharded: tensors whose region on this rank is not exactly one saved chunk, so it
  is assembled from pieces of several saved chunks (or cut out of a bigger one).

Each rank computes its own report (its local regions differ); mismatches and missing keys are the
same on every rank. ``str(report)`` is the readable form the manager logs (INFO) or raises
(``StateMismatchError``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from ckptmgr.dcp.metadata import dtype_name, find_chunk, overlapping_chunks, stored_volume
from ckptmgr.dcp.shards import ShardedTensor, distinct_boxes

__all__ = ["CompatibilityReport", "Reshard", "compatibility_report", "describe_mesh"]

_SHOWN = 50  # lines of each kind spelled out in str(); the counts are always complete


def describe_mesh(flat: Mapping[str, Any]) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The device mesh(es) of the DTensors in ``flat`` as JSON-ready dicts (``shape``,
    ``dim_names``, ``device_type``); a list when there are several, None when there is none.

    Suitable for the manifest's ``mesh`` field, so a later restore can report the saved mesh.
    """
    from torch.distributed.tensor import DTensor

    seen: list[dict[str, Any]] = []
    for value in flat.values():
        if isinstance(value, ShardedTensor):
            described = value.describe()
            if described is not None and described not in seen:
                seen.append(described)
        elif isinstance(value, DTensor):
            mesh = value.device_mesh
            desc = {"shape": list(mesh.shape),
                    "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                    "device_type": mesh.device_type}
            if desc not in seen:
                seen.append(desc)
    if not seen:
        return None
    return seen[0] if len(seen) == 1 else seen


def _mesh_text(mesh: Any) -> str:
    if mesh is None:
        return "no mesh"
    meshes = mesh if isinstance(mesh, list) else [mesh]
    parts = []
    for m in meshes:
        # The saved mesh comes from the manifest (any JSON): anything but the shape we write is
        # shown as it is, never iterated.
        shape: Any = m.get("shape") or [] if isinstance(m, Mapping) else None
        names: Any = None
        if isinstance(shape, list):
            names = m.get("dim_names") or [f"dim{i}" for i in range(len(shape))]
        if not isinstance(names, list):
            parts.append(repr(m)[:200])
            continue
        dims = " x ".join(f"{n}={s}" for n, s in zip(names, shape, strict=False))
        parts.append(f"{m.get('device_type', '?')} mesh {dims}")
    return "; ".join(parts)


@dataclass(frozen=True)
class Reshard:
    """A tensor whose region on this rank is not stored as one saved chunk.

    Attributes:
        key: the flat key.
        saved_chunks: number of chunks the checkpoint stores for the whole tensor.
        local_regions: number of regions this rank loads (1, or more for some TP layouts).
        source_chunks: number of saved chunks those regions read from (0: an empty region).
    """

    key: str
    saved_chunks: int
    local_regions: int
    source_chunks: int

    def __str__(self) -> str:
        return (f"{self.key}: saved in {self.saved_chunks} chunk(s), this rank reads "
                f"{self.local_regions} region(s) from {self.source_chunks} of them")


@dataclass(frozen=True)
class CompatibilityReport:
    """What restoring a checkpoint into a state will do on this rank (see the module docstring).

    Attributes:
        step: the step being restored (None when unknown).
        saved_world_size, world_size: ranks that saved the step, ranks restoring it.
        saved_mesh, mesh: mesh descriptions (:func:`describe_mesh`), None when not recorded/none.
        loadable: keys that will be loaded (present in the checkpoint, same kind, shape, dtype).
        missing: keys of the state that the checkpoint lacks.
        unexpected: keys of the checkpoint that the state does not request (left unread).
        mismatches: one line per shape, dtype, kind or coverage problem.
        resharded: tensors this rank assembles from other saved chunks.
        num_tensors, num_values: tensors and Python values among ``loadable``.
    """

    step: int | None
    saved_world_size: int
    world_size: int
    saved_mesh: Any
    mesh: Any
    loadable: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatches: tuple[str, ...]
    resharded: tuple[Reshard, ...] = field(default=())
    num_tensors: int = 0
    num_values: int = 0

    def compatible(self, allow_partial: bool = False) -> bool:
        """True when the restore can go ahead: no mismatch, and no missing key unless
        ``allow_partial``."""
        return not self.mismatches and (allow_partial or not self.missing)

    def summary(self) -> str:
        """One line: step, world sizes, meshes and counts."""
        where = f"step {self.step}" if self.step is not None else "checkpoint"
        return (f"{where}: saved by {self.saved_world_size} rank(s) ({_mesh_text(self.saved_mesh)}"
                f"), restoring on {self.world_size} ({_mesh_text(self.mesh)}); "
                f"{self.num_tensors} tensors and {self.num_values} values to load, "
                f"{len(self.resharded)} resharded on this rank, {len(self.missing)} missing, "
                f"{len(self.unexpected)} not requested, {len(self.mismatches)} mismatched")

    def problem_lines(self, allow_partial: bool = False) -> list[str]:
        """The lines that make the restore fail: missing keys (unless ``allow_partial``), then
        mismatches."""
        lines = [] if allow_partial else [f"missing from checkpoint: {k}" for k in self.missing]
        return lines + list(self.mismatches)

    def error_message(self, allow_partial: bool = False) -> str:
        """The text of the ``StateMismatchError`` for this report."""
        lines = self.problem_lines(allow_partial)
        shown = "\n  ".join(lines[:_SHOWN]) + ("\n  ..." if len(lines) > _SHOWN else "")
        where = f"step {self.step}" if self.step is not None else "the checkpoint"
        text = (f"state_dict does not match {where} ({len(self.missing)} missing keys, "
                f"{len(self.mismatches)} shape/dtype mismatches):\n  {shown}\n")
        if self.missing and not allow_partial:
            text += "Pass allow_partial=True to load only the keys that exist.\n"
        return text + self.summary()

    def __str__(self) -> str:
        out = [self.summary()]

        def section(title: str, items: Sequence[Any]) -> None:
            if items:
                out.append(f"  {title} ({len(items)}):")
                out.extend(f"    {x}" for x in items[:_SHOWN])
                if len(items) > _SHOWN:
                    out.append(f"    ... {len(items) - _SHOWN} more")

        section("mismatched", self.mismatches)
        section("missing from checkpoint", self.missing)
        section("in the checkpoint, not requested", self.unexpected)
        section("resharded on this rank", self.resharded)
        return "\n".join(out)


def _local_chunks(value: torch.Tensor | ShardedTensor) -> list[ChunkStorageMetadata] | None:
    """The regions of the global tensor this rank holds (DTensor, sharded), or the whole tensor."""
    if isinstance(value, ShardedTensor):
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s in distinct_boxes(value.layout())]
    make = getattr(value, "__create_chunk_list__", None)
    if make is None:
        return [ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.shape)]
    try:
        chunks = make()
    except Exception:  # e.g. partial placements: DCP itself refuses them later, with its reason
        return None
    return list(chunks)


def _volume(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _reshard(key: str, value: torch.Tensor | ShardedTensor,
             saved: TensorStorageMetadata) -> Reshard | None:
    local = _local_chunks(value)
    if local is None:
        return None
    saved_chunks = saved.chunks
    if len(local) == 1:
        same = find_chunk(saved_chunks, tuple(local[0].offsets))
        if same is not None and tuple(same.sizes) == tuple(local[0].sizes):
            return None
    sources = {i for lc in local
               for i in overlapping_chunks(saved_chunks, tuple(lc.offsets), tuple(lc.sizes))}
    return Reshard(key, len(saved_chunks), len(local), len(sources))


def compatibility_report(metadata: Metadata, flat: Mapping[str, Any], saved_world_size: int, *,
                         world_size: int = 1, saved_mesh: Any = None, mesh: Any = None,
                         step: int | None = None) -> CompatibilityReport:
    """Compare a checkpoint's metadata with the flat state about to be restored into.

    Pure: reads no storage and runs no collective. A tensor in ``flat`` may be a DTensor (its
    global shape is compared; its local region decides what is resharded), a
    :class:`~ckptmgr.dcp.shards.ShardedTensor` (likewise, with its local shards) or a plain tensor
    (the whole tensor is loaded on this rank).

    Args:
        metadata: the checkpoint's DCP metadata (tensor sizes, dtypes, stored chunks).
        flat: flat key -> tensor or Python value, as :func:`~ckptmgr.dcp.state.flatten_state`
            makes it.
        saved_world_size: ranks that saved the checkpoint (the manifest's ``world_size``).
        world_size: ranks restoring it.
        saved_mesh: the manifest's mesh description, if recorded.
        mesh: the current mesh description (None: taken from the DTensors in ``flat``).
        step: the step, for the text.

    Returns:
        The report; ``report.compatible(allow_partial)`` says whether to go ahead.
    """
    md = metadata.state_dict_metadata
    loadable: list[str] = []
    missing: list[str] = []
    problems: list[str] = []
    resharded: list[Reshard] = []
    num_tensors = num_values = 0
    for key, value in flat.items():
        saved = md.get(key)
        if saved is None:
            missing.append(key)
            continue
        if isinstance(value, (torch.Tensor, ShardedTensor)):
            if not isinstance(saved, TensorStorageMetadata):
                problems.append(f"{key}: checkpoint holds a Python value, state has a tensor")
                continue
            bad = False
            if tuple(value.shape) != tuple(saved.size):
                problems.append(f"{key}: shape {list(saved.size)} in checkpoint, "
                                f"{list(value.shape)} in state")
                bad = True
            if value.dtype != saved.properties.dtype:
                problems.append(f"{key}: dtype {dtype_name(saved.properties.dtype)} in "
                                f"checkpoint, {dtype_name(value.dtype)} in state")
                bad = True
            if bad:
                continue
            stored = stored_volume(saved.chunks)
            if stored < _volume(saved.size):
                problems.append(f"{key}: the checkpoint stores {stored} of its "
                                f"{_volume(saved.size)} elements (incomplete save)")
                continue
            change = _reshard(key, value, saved)
            if change is not None:
                resharded.append(change)
            num_tensors += 1
        else:
            if isinstance(saved, TensorStorageMetadata):
                problems.append(f"{key}: checkpoint holds a tensor, state has "
                                f"{type(value).__name__}")
                continue
            num_values += 1
        loadable.append(key)
    unexpected = sorted(set(md) - set(flat))
    return CompatibilityReport(
        step=step, saved_world_size=saved_world_size, world_size=world_size,
        saved_mesh=saved_mesh, mesh=describe_mesh(flat) if mesh is None else mesh,
        loadable=tuple(loadable), missing=tuple(missing), unexpected=tuple(unexpected),
        mismatches=tuple(problems), resharded=tuple(resharded), num_tensors=num_tensors,
        num_values=num_values)
