"""The shard interface our SPMD planners are written against, and its CPU model.

A :class:`ShardedTensor` is a tensor of ``global_shape`` whose data lives in pieces on devices,
the way XLA SPMD keeps it: each device holds one *shard*, a box ``[offsets, offsets + sizes)`` of
the global tensor stored in a buffer of ``padded_sizes`` (XLA pads uneven tiles to one size; the
last tiles of a dimension may even be empty). Devices holding the same box are replicas of each
other and carry distinct ``replica_id`` values. A process sees only its *local* shards.

Implementations:
- :class:`ckptmgr.dcp.xla.XlaShards` over a real torch_xla tensor (the only module importing
  torch_xla);
- :class:`CpuShardedTensor`, a CPU model that lays out shards exactly as XLA does for a mesh and a
  partition spec (tiled, transposed device order, partial and full replication, uneven and empty
  tiles); it is what the default test suite checks the planners against, and it can be saved and
  restored by the manager like the real thing;
- :class:`StagedShards`, the host copy of one shard per distinct box that an async save keeps;
- :class:`StagedDTensor`, the host copy of a DTensor's local shard that an async save keeps, with
  the layout it came from (it plans exactly as the live DTensor did, and never touches a device).

Pure torch: no torch_xla, no process group.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ckptmgr.errors import ConfigError

__all__ = [
    "CpuShardedTensor",
    "KnownShapeShards",
    "ShardInfo",
    "ShardedTensor",
    "StagedDTensor",
    "StagedShards",
    "box_slices",
    "coverage_problem",
    "distinct_boxes",
    "distinct_shards",
    "unpadded",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


@dataclass(frozen=True)
class ShardInfo:
    """Where one local shard sits: the box of the global tensor it holds and its buffer shape.

    Attributes:
        device: the device holding it (e.g. ``"xla:2"``, or ``"cpu:2"`` in the CPU model).
        offsets: index of its first element in the global tensor, per dimension.
        sizes: its extent per dimension, without padding (0 for an empty tile).
        padded_sizes: the shape of the device buffer (``>= sizes``; padding sits at the end).
        replica_id: distinct among the devices holding the same box.
    """

    device: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    padded_sizes: tuple[int, ...]
    replica_id: int

    @property
    def numel(self) -> int:
        """Elements of the global tensor it holds (padding excluded)."""
        return math.prod(self.sizes)

    @property
    def box(self) -> Box:
        """``(offsets, sizes)``: equal boxes mean replicas of the same data."""
        return self.offsets, self.sizes


def box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    """The index of box ``[offsets, offsets + sizes)`` in the global tensor."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def unpadded(data: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The view of a padded shard buffer that holds global data."""
    if tuple(data.shape) == info.sizes:
        return data
    return data[tuple(slice(0, s) for s in info.sizes)]


class ShardedTensor(abc.ABC):
    """A tensor split across devices (see the module docstring). Subclasses implement:

    1) ``layout()``: this process's shards, cheap (no data moves);
    2) ``local_shards()``: their padded data on the host, in ``layout()`` order (save);
    3) ``load_local_shards_(data)``: write padded host buffers back to the devices (restore).
    """

    @property
    @abc.abstractmethod
    def global_shape(self) -> torch.Size:
        """Shape of the whole (logical) tensor."""

    @property
    @abc.abstractmethod
    def dtype(self) -> torch.dtype:
        """Element type."""

    @abc.abstractmethod
    def layout(self) -> list[ShardInfo]:
        """This process's shards (one per local device), without moving data."""

    @abc.abstractmethod
    def local_shards(self) -> list[torch.Tensor]:
        """Padded host (CPU) copies of the local shards, in :meth:`layout` order."""

    @abc.abstractmethod
    def load_local_shards_(self, data: Sequence[torch.Tensor]) -> None:
        """Replace the local shards' data with ``data`` (padded CPU tensors, :meth:`layout`
        order, shapes ``padded_sizes``)."""

    def describe(self) -> dict[str, Any] | None:
        """The mesh as a JSON-ready dict for the manifest, or None when unknown."""
        return None

    @property
    def shape(self) -> torch.Size:
        """Same as :attr:`global_shape` (so reports can treat it like a tensor)."""
        return self.global_shape

    def numel(self) -> int:
        """Elements of the global tensor."""
        return math.prod(self.global_shape)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={list(self.global_shape)}, dtype={self.dtype}, "
                f"local_shards={len(self.layout())})")


class KnownShapeShards(ShardedTensor):
    """A :class:`ShardedTensor` whose global shape and dtype are fixed at construction."""

    def __init__(self, global_shape: Sequence[int], dtype: torch.dtype) -> None:
        self._global_shape = torch.Size(global_shape)
        self._dtype = dtype

    @property
    def global_shape(self) -> torch.Size:
        return self._global_shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype


def distinct_shards(layout: Sequence[ShardInfo], global_shape: Sequence[int]) -> list[int]:
    """Indices into ``layout`` of one shard per distinct box (the lowest replica id; ties: the
    first), empty boxes left out. A tensor with no elements keeps one shard (its metadata must
    still be saved)."""
    best: dict[Box, int] = {}
    for i, info in enumerate(layout):
        if info.numel == 0:
            continue
        j = best.get(info.box)
        if j is None or info.replica_id < layout[j].replica_id:
            best[info.box] = i
    if not best and layout and math.prod(global_shape) == 0:
        return [0]
    return sorted(best.values())


def distinct_boxes(layout: Sequence[ShardInfo]) -> list[Box]:
    """The distinct non-empty boxes of ``layout``, in first-seen order."""
    return list(dict.fromkeys(info.box for info in layout if info.numel))


def _first_missing(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...] | None:
    mask = torch.zeros(tuple(shape), dtype=torch.bool)
    for offsets, sizes in boxes:
        mask[box_slices(offsets, sizes)] = True
    missing = (~mask).nonzero()
    return tuple(int(v) for v in missing[0]) if len(missing) else None


def coverage_problem(shape: Sequence[int], boxes: Sequence[Box], *,
                     complete: bool = True) -> str | None:
    """Why the distinct ``boxes`` do not tile a tensor of ``shape`` exactly once, else None.

    Checks bounds, overlaps (a sweep along the most split dimension, so tiled layouts cost about
    ``n log n``) and, when ``complete``, that the volumes add up to the tensor's size.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    ndim = len(shape)
    boxes = [b for b in dict.fromkeys((tuple(o), tuple(s)) for o, s in boxes) if math.prod(b[1])]
    for offsets, sizes in boxes:
        if len(offsets) != ndim or len(sizes) != ndim or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            return (f"chunk at {list(offsets)} of size {list(sizes)} lies outside shape "
                    f"{list(shape)}")
    if ndim:
        # Sweep along the dimension the boxes are split on most (a split dimension's boxes
        # rarely overlap in extent there; sweeping a dimension every box spans is quadratic).
        d = max(range(ndim), key=lambda i: len({b[0][i] for b in boxes}))
        order = sorted(boxes, key=lambda b: b[0][d])
        active: list[Box] = []
        for box in order:
            start = box[0][d]
            active = [a for a in active if a[0][d] + a[1][d] > start]
            for other in active:
                if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in
                       zip(box[0], box[1], other[0], other[1], strict=True)):
                    return (f"chunks at {list(other[0])} (size {list(other[1])}) and "
                            f"{list(box[0])} (size {list(box[1])}) overlap but differ")
            active.append(box)
    elif len(boxes) > 1:
        return "a 0-d tensor has several chunks"
    covered = sum(math.prod(s) for _, s in boxes)
    if covered == total or not complete:
        return None
    msg = f"the chunks cover {covered} of its {total} elements"
    if total <= 1 << 24:
        first = _first_missing(shape, boxes)
        if first is not None:
            msg += f"; element {list(first)} is in no chunk"
    return msg


class CpuShardedTensor(KnownShapeShards):
    """A CPU model of an XLA SPMD sharded tensor: shards laid out exactly as XLA does.

    ``partition_spec`` gives, per tensor dimension, the mesh axis (an int), several mesh axes (a
    tuple, major first) or None (not split). A dimension of size ``n`` split ``k`` ways is cut into
    tiles of ``ceil(n / k)``; tile ``t`` holds ``[min(t*c, n), min((t+1)*c, n))`` and is padded to
    ``c`` (so trailing tiles may be short or empty). Mesh axes no dimension uses replicate: a
    device's ``replica_id`` is its rank, by device id, among the devices holding the same box
    (partial replication); with no split dimension at all the tensor is fully replicated and
    ``replica_id`` is the device id. All as torch_xla 2.9 reports it (checked layout by layout in
    the XLA lane).

    Args:
        tensor: the global value (copied).
        mesh_shape: devices per mesh axis.
        partition_spec: see above; one entry per tensor dimension.
        device_ids: the device at each mesh position in row-major order (default ``0..n-1``; a
            permutation gives a transposed or shuffled mesh).
        local_devices: the device ids this process holds (default all): models one host of many.
    """

    def __init__(self, tensor: torch.Tensor, mesh_shape: Sequence[int],
                 partition_spec: Sequence[int | tuple[int, ...] | None], *,
                 device_ids: Sequence[int] | None = None,
                 local_devices: Sequence[int] | None = None) -> None:
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        if not self.mesh_shape or any(s < 1 for s in self.mesh_shape):
            raise ValueError(f"mesh_shape must be positive sizes, got {list(mesh_shape)}")
        if len(partition_spec) != tensor.dim():
            raise ValueError(f"partition_spec has {len(partition_spec)} entries for a "
                             f"{tensor.dim()}-d tensor")
        spec: list[tuple[int, ...]] = []
        for entry in partition_spec:
            axes = () if entry is None else (entry,) if isinstance(entry, int) else tuple(entry)
            if any(a < 0 or a >= len(self.mesh_shape) for a in axes):
                raise ValueError(f"partition_spec entry {entry!r} names no axis of a "
                                 f"{len(self.mesh_shape)}-d mesh")
            spec.append(axes)
        used = [a for axes in spec for a in axes]
        if len(used) != len(set(used)):
            raise ValueError(f"partition_spec {list(partition_spec)} uses a mesh axis twice")
        n = math.prod(self.mesh_shape)
        ids = list(range(n)) if device_ids is None else [int(d) for d in device_ids]
        if sorted(ids) != list(range(n)):
            raise ValueError(f"device_ids must be a permutation of 0..{n - 1}")
        self.partition_spec = tuple(spec)
        self.device_ids = tuple(ids)
        self.local_devices = tuple(ids if local_devices is None else local_devices)
        super().__init__(tensor.shape, tensor.dtype)
        self._infos: list[ShardInfo] = []
        self._data: list[torch.Tensor] = []
        # XLA lists each replication group's devices in ascending id order (whatever the mesh
        # order) and a device's replica id is its rank there.
        groups: dict[tuple[int, ...], list[int]] = {}
        for position, device in enumerate(ids):
            coord = _unravel(position, self.mesh_shape)
            groups.setdefault(tuple(coord[a] for a in used), []).append(device)
        for position, device in enumerate(ids):
            if device not in self.local_devices:
                continue
            coord = _unravel(position, self.mesh_shape)
            offsets, sizes, padded = [], [], []
            for dim, axes in enumerate(spec):
                length = tensor.shape[dim]
                parts = math.prod(self.mesh_shape[a] for a in axes)
                tile = _ravel([coord[a] for a in axes], [self.mesh_shape[a] for a in axes])
                chunk = -(-length // parts) if parts else length
                start = min(tile * chunk, length)
                offsets.append(start)
                sizes.append(min(start + chunk, length) - start)
                padded.append(chunk)
            if used:
                replica = sorted(groups[tuple(coord[a] for a in used)]).index(device)
            else:
                replica = device
            info = ShardInfo(f"cpu:{device}", tuple(offsets), tuple(sizes), tuple(padded),
                             replica)
            buf = torch.zeros(info.padded_sizes, dtype=tensor.dtype)
            unpadded(buf, info).copy_(tensor[box_slices(offsets, sizes)])
            self._infos.append(info)
            self._data.append(buf)

    def layout(self) -> list[ShardInfo]:
        return list(self._infos)

    def local_shards(self) -> list[torch.Tensor]:
        return [d.clone() for d in self._data]

    def load_local_shards_(self, data: Sequence[torch.Tensor]) -> None:
        if len(data) != len(self._infos):
            raise ValueError(f"expected {len(self._infos)} shards, got {len(data)}")
        for buf, new, info in zip(self._data, data, self._infos, strict=True):
            if tuple(new.shape) != info.padded_sizes:
                raise ValueError(f"shard of {info.device}: expected shape "
                                 f"{list(info.padded_sizes)}, got {list(new.shape)}")
            buf.copy_(new)

    def describe(self) -> dict[str, Any]:
        return {"device_type": "cpu-model", "shape": list(self.mesh_shape)}

    def shard_data(self, index: int) -> torch.Tensor:
        """The live padded buffer of local shard ``index`` (for tests)."""
        return self._data[index]

    def to_full(self) -> torch.Tensor:
        """Assemble the global tensor from the local shards (every element must be local)."""
        out = torch.zeros(self._global_shape, dtype=self._dtype)
        for info, buf in zip(self._infos, self._data, strict=True):
            out[box_slices(info.offsets, info.sizes)] = unpadded(buf, info)
        return out


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    coord = []
    for size in reversed(shape):
        coord.append(index % size)
        index //= size
    return coord[::-1]


def _ravel(coord: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for c, size in zip(coord, shape, strict=True):
        index = index * size + c
    return index


class StagedShards(KnownShapeShards):
    """Host copies of one shard per distinct box of a :class:`ShardedTensor` (save only).

    Made by :meth:`stage` into buffers the caller may reuse across saves; replicas are not copied.
    """

    def __init__(self, global_shape: torch.Size, dtype: torch.dtype,
                 infos: Sequence[ShardInfo], data: Sequence[torch.Tensor],
                 mesh: dict[str, Any] | None = None) -> None:
        super().__init__(global_shape, dtype)
        self._infos = list(infos)
        self._data = list(data)
        self._mesh = mesh

    @classmethod
    def stage(cls, source: ShardedTensor,
              buffers: dict[Box, torch.Tensor] | None = None) -> StagedShards:
        """Copy ``source``'s distinct shards (unpadded) into ``buffers`` (filled in; reused when a
        box's shape and dtype match)."""
        buffers = {} if buffers is None else buffers
        layout = source.layout()
        keep = distinct_shards(layout, source.global_shape)
        padded = source.local_shards()
        infos, data = [], []
        for i in keep:
            info = layout[i]
            src = unpadded(padded[i], info)
            buf = buffers.get(info.box)
            if buf is None or buf.dtype != src.dtype or tuple(buf.shape) != info.sizes:
                buf = torch.empty(info.sizes, dtype=src.dtype)
                buffers[info.box] = buf
            buf.copy_(src)
            infos.append(ShardInfo(info.device, info.offsets, info.sizes, info.sizes,
                                   info.replica_id))
            data.append(buf)
        for box in set(buffers) - {info.box for info in infos}:
            del buffers[box]
        return cls(source.global_shape, source.dtype, infos, data, source.describe())

    def layout(self) -> list[ShardInfo]:
        return list(self._infos)

    def local_shards(self) -> list[torch.Tensor]:
        return list(self._data)

    def load_local_shards_(self, data: Sequence[torch.Tensor]) -> None:
        raise TypeError("staged shards are a save-time copy; restore into the live tensor")

    def describe(self) -> dict[str, Any] | None:
        return self._mesh


class StagedDTensor(KnownShapeShards):
    """A host copy of this rank's local shard of a DTensor, with the layout it came from (save
    only).

    It plans exactly as the live DTensor does: its chunk (offsets and sizes in the global tensor)
    comes from DCP's own ``__create_chunk_list__`` of the live value and its tensor properties from
    the live local tensor, and it implements the same checkpoint hooks DCP's default planner calls
    on a DTensor (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``),
    so local plans, the global plan and the metadata are those of the live state. Unlike
    ``DTensor.from_local(host_copy, mesh, ...)`` it never moves its data to the mesh's device: the
    mesh and placements are kept only to compare and describe the layout.

    Planners treat it like a DTensor, not like an SPMD sharded tensor (:attr:`plans_itself`). A
    rank outside the DTensor's mesh holds no chunk and plans no item, as DCP does for a DTensor.

    Args:
        data: the host copy of the local shard (shape ``sizes`` of the chunk; any device for
            simulation stand-ins, e.g. ``meta``).
        global_shape, dtype: of the whole tensor.
        chunks: this rank's chunk (none outside the mesh).
        properties: the live local tensor's ``TensorProperties``.
        placements: the DTensor's placements (compared, never interpreted).
        mesh: the device mesh (compared and described; None for stand-ins).
        replica_id: this rank's index among the ranks holding the same chunk.
    """

    plans_itself = True

    def __init__(self, data: torch.Tensor, *, global_shape: Sequence[int], dtype: torch.dtype,
                 chunks: Sequence[ChunkStorageMetadata], properties: TensorProperties,
                 placements: Sequence[Any] = (), mesh: Any = None, replica_id: int = 0) -> None:
        super().__init__(global_shape, dtype)
        self._data = data
        self.chunks = tuple(chunks)
        self.properties = properties
        self.placements = tuple(placements)
        self.mesh = mesh
        self.replica_id = replica_id

    @classmethod
    def from_dtensor(cls, key: str, value: Any, data: torch.Tensor) -> StagedDTensor:
        """The staged form of DTensor ``value`` whose local shard was copied into ``data``.

        Reads only the DTensor's metadata (no op runs on its device).

        Raises:
            ConfigError: a DTensor with a ``Partial`` placement (reduce it before saving).
        """
        mesh, placements = value.device_mesh, tuple(value.placements)
        if any(p.is_partial() for p in placements):
            raise ConfigError(f"state key {key!r} is a DTensor with placements {placements}: a "
                              "Partial placement cannot be saved; redistribute it first")
        coord = mesh.get_coordinate()
        with torch.no_grad():
            local = value.to_local()  # the local tensor itself: no op without autograd
            chunks = [] if coord is None else list(value.__create_chunk_list__())
            props = TensorProperties.create_from_tensor(local)
        replica = 0
        if coord is not None:
            for dim, p in enumerate(placements):
                if p.is_replicate():
                    replica = replica * mesh.shape[dim] + coord[dim]
        return cls(data, global_shape=value.shape, dtype=value.dtype, chunks=chunks,
                   properties=props, placements=placements, mesh=mesh, replica_id=replica)

    @property
    def data(self) -> torch.Tensor:
        """The host copy of the local shard (also outside the mesh, where it plans nothing)."""
        return self._data

    def layout(self) -> list[ShardInfo]:
        return [ShardInfo("host", tuple(c.offsets), tuple(c.sizes), tuple(c.sizes),
                          self.replica_id) for c in self.chunks]

    def local_shards(self) -> list[torch.Tensor]:
        return [self._data] if self.chunks else []

    def load_local_shards_(self, data: Sequence[torch.Tensor]) -> None:
        raise TypeError("a staged DTensor is a save-time copy; restore into the live tensor")

    def describe(self) -> dict[str, Any] | None:
        m = self.mesh
        if m is None:
            return None
        return {"shape": list(m.shape),
                "dim_names": list(m.mesh_dim_names) if m.mesh_dim_names else None,
                "device_type": m.device_type}

    def structure_key(self) -> tuple[Any, ...]:
        """Everything its write items depend on, comparable with ``==`` (holds no tensor)."""
        return (tuple(self.global_shape), self.dtype, self.placements, self.mesh, self.chunks,
                self.properties)

    def write_items(self, fqn: str) -> list[WriteItem]:
        """The write items DCP's default planner makes for the live DTensor under ``fqn``."""
        size = torch.Size(self.global_shape)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(c.offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                                         sizes=torch.Size(c.sizes)),
                              properties=self.properties, size=size))
                for c in self.chunks]

    # DCP's checkpoint hooks (the ones DTensor implements), called by its default planner.
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return self.write_items(fqn)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self.chunks)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._data
