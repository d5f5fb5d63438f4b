"""SPMD planners: states holding :class:`~ckptmgr.dcp.shards.ShardedTensor` values (XLA SPMD
tensors through :mod:`ckptmgr.dcp.xla`, or the CPU model), next to ordinary tensors and values.

Saving (DCP's call order):
1) (all ranks) ``set_up_planner``: sharded values are set aside; everything else goes to
   :class:`~ckptmgr.dcp.planner.CkptSavePlanner`.
   ``create_local_plan``: one write item per distinct box among this process's shards (replicas
   on local devices collapse to the lowest replica id; empty tiles are dropped).
2) (coordinator) ``create_global_plan``: every tensor's distinct chunks over all ranks must tile it
   exactly once, or the save fails with :class:`~ckptmgr.errors.SaveError` naming the tensor and
   an element no chunk holds (never a silent drop). Then the balanced dedup keeps each chunk held
   by several ranks on exactly one of them, evening out bytes per rank.
3) (all ranks) ``resolve_data``: the chunk's unpadded host data; a tensor's shards move to the
   host once, when its first chunk is written, and are released as they are written.

Loading: every distinct local box is read once into a host buffer (DCP's resharding reads it from
whichever saved chunks overlap it, so any saved mesh loads into any current one); :meth:`write_back`
then pads each local shard and hands them to ``load_local_shards_`` (replicas get copies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner
from ckptmgr.dcp.shards import (
    ShardedTensor,
    coverage_problem,
    distinct_boxes,
    distinct_shards,
    unpadded,
)
from ckptmgr.errors import SaveError, StateMismatchError

__all__ = ["SpmdLoadPlanner", "SpmdSavePlanner", "has_sharded"]


def _is_spmd(value: Any) -> bool:
    # A staged DTensor is a ShardedTensor that plans itself, exactly as the live DTensor did.
    return isinstance(value, ShardedTensor) and not getattr(value, "plans_itself", False)


def has_sharded(flat: Mapping[str, Any]) -> bool:
    """Whether a flat state holds any :class:`ShardedTensor` planned by the SPMD planners."""
    return any(_is_spmd(v) for v in flat.values())


def _split(state_dict: dict[str, Any]) -> tuple[dict[str, ShardedTensor], dict[str, Any]]:
    sharded = {k: v for k, v in state_dict.items() if _is_spmd(v)}
    rest = {k: v for k, v in state_dict.items() if k not in sharded}
    return sharded, rest


class SpmdSavePlanner(CkptSavePlanner):
    """Save planning for states with sharded tensors (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._sharded: dict[str, ShardedTensor] = {}
        self._pending: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """(all ranks) Set the sharded values aside; the rest is planned as usual."""
        self._sharded, rest = _split(state_dict)
        self._pending = {}
        super().set_up_planner(rest, storage_meta, is_coordinator)

    def _structure_key(self, state_dict: Any) -> Any:
        # The sharded values' layouts join the base key (the state given to the base planner
        # holds only the rest); ShardInfo compares by value and holds no tensor.
        base = super()._structure_key(state_dict)
        if base is None:
            return None
        return base, tuple((fqn, tuple(st.global_shape), st.dtype, tuple(st.layout()))
                           for fqn, st in self._sharded.items())

    def release_state(self) -> None:
        """Drop the references to the last saved state (see the base class)."""
        super().release_state()
        self._sharded = {}
        self._pending = {}

    def create_local_plan(self) -> SavePlan:
        """(all ranks) The base plan plus one item per distinct local box of each sharded value."""
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for fqn, st in self._sharded.items():
            layout = st.layout()
            props = TensorProperties(dtype=st.dtype)
            size = torch.Size(st.global_shape)
            for i in distinct_shards(layout, size):
                info = layout[i]
                offsets = torch.Size(info.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets,
                                                   sizes=torch.Size(info.sizes)),
                        properties=props, size=size)))
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Check that every tensor is covered exactly once, then dedup and plan."""
        # coverage_problem drops repeated boxes (replicas held by several ranks) itself.
        boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        shapes: dict[str, torch.Size] = {}
        for plan in all_plans:
            for item in plan.items:
                td = item.tensor_data
                if item.type != WriteItemType.SHARD or td is None:
                    continue
                boxes.setdefault(item.index.fqn, []).append(
                    (tuple(td.chunk.offsets), tuple(td.chunk.sizes)))
                shapes[item.index.fqn] = td.size
        for fqn in [*self._sharded, *(k for k in boxes if k not in self._sharded)]:
            if fqn not in boxes:
                raise SaveError(f"sharded tensor {fqn!r} has no shard on any rank: nothing of "
                                "it would be saved")
            problem = coverage_problem(shapes[fqn], boxes[fqn])
            if problem is not None:
                raise SaveError(f"refusing to save sharded tensor {fqn!r} of shape "
                                f"{list(shapes[fqn])}: {problem}")
        return super().create_global_plan(all_plans)

    def resolve_data(self, write_item: WriteItem) -> Any:
        """(all ranks) The unpadded host data of a chunk, or what the base planner resolves."""
        fqn = write_item.index.fqn
        st = self._sharded.get(fqn)
        if st is None:
            return super().resolve_data(write_item)
        pending = self._pending.get(fqn)
        if pending is None:
            layout = st.layout()
            data = st.local_shards()
            pending = {}
            for i in distinct_shards(layout, st.global_shape):
                pending[layout[i].offsets] = unpadded(data[i], layout[i])
            self._pending[fqn] = pending
        offsets = tuple(write_item.index.offset or ())
        chunk = pending.pop(offsets, None)
        if chunk is None:
            raise SaveError(f"sharded tensor {fqn!r}: no local shard at {list(offsets)} "
                            "(its layout changed during the save?)")
        if not pending:
            del self._pending[fqn]
        return chunk


class SpmdLoadPlanner(CkptLoadPlanner):
    """Load planning (resharding) into states with sharded tensors; call :meth:`write_back`
    after the load to move the data onto the devices."""

    def __init__(self) -> None:
        super().__init__()
        self._sharded: dict[str, ShardedTensor] = {}
        # fqn -> distinct local boxes (ordered as the read items' dest_index.index) and buffers
        self._boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """(all ranks) Set the sharded values aside; the rest is planned as usual."""
        self._sharded, rest = _split(state_dict)
        super().set_up_planner(rest, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        """(all ranks) Base plan plus reads covering each distinct local box once."""
        plan = super().create_local_plan()
        assert self.metadata is not None
        items: list[ReadItem] = []
        for fqn, st in self._sharded.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise StateMismatchError(f"{fqn!r} is not a tensor in the checkpoint",
                                         missing=[fqn] if md is None else [])
            if tuple(md.size) != tuple(st.global_shape) or md.properties.dtype != st.dtype:
                raise StateMismatchError(
                    f"{fqn!r}: checkpoint has {list(md.size)} {md.properties.dtype}, the state "
                    f"has {list(st.global_shape)} {st.dtype}")
            layout = st.layout()
            boxes = distinct_boxes(layout)
            self._boxes[fqn] = boxes
            self._buffers[fqn] = [torch.empty(sizes, dtype=st.dtype) for _, sizes in boxes]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                      for o, s in boxes]
            items.extend(create_read_items_for_chunk_list(fqn, md, chunks))
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """(all ranks) Where a read lands: a view into the box's host buffer."""
        fqn = read_item.dest_index.fqn
        if fqn not in self._sharded:
            return super().resolve_tensor(read_item)  # type: ignore[no-any-return]
        index = read_item.dest_index.index
        assert index is not None
        target = self._buffers[fqn][index]
        for dim, (off, length) in enumerate(
                zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            target = target.narrow(dim, off, length)
        return target

    def write_back(self) -> None:
        """(all ranks) Pad the loaded boxes into each local shard and load them onto the
        devices (replicas get the same data)."""
        for fqn, st in self._sharded.items():
            by_box = dict(zip(self._boxes.get(fqn, []), self._buffers.get(fqn, []),
                              strict=True))
            shards = []
            for info in st.layout():
                buf = torch.zeros(info.padded_sizes, dtype=st.dtype)
                if info.numel:
                    unpadded(buf, info).copy_(by_box[info.box])
                shards.append(buf)
            st.load_local_shards_(shards)
        self._buffers.clear()
