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
whichever saved chunks overlap it, so any saved mesh loads into any current one); as soon as the
last read of a tensor is committed, its local shards are padded and handed to
``load_local_shards_`` (replicas get copies). :meth:`SpmdLoadPlanner.write_back` does the same for
any tensor not done yet (none, after a complete load).

Standalone use, the way torch_xla's ``SPMDSavePlanner``/``SPMDLoadPlanner`` are used (the import
changes, the call does not)::

    dcp.save(state_dict, storage_writer=writer, planner=SpmdSavePlanner())
    dcp.load(state_dict, storage_reader=reader, planner=SpmdLoadPlanner())

with any DCP storage (``FileSystemWriter``/``Reader``, ``ckptmgr.dcp.CkptStorageWriter``/
``Reader``): nested state dicts are flattened as DCP's default planners flatten them
(``flatten_state_dict=True``, the default here; the manager passes flat states and False), and XLA
tensors are wrapped into :class:`~ckptmgr.dcp.xla.XlaShards` by the planners themselves.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
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

from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner, flatten_like_dcp, set_by_path
from ckptmgr.dcp.shards import (
    ShardedTensor,
    coverage_problem,
    distinct_boxes,
    distinct_shards,
    unpadded,
)
from ckptmgr.dcp.xla import wrap_xla_tensors
from ckptmgr.errors import SaveError, StateMismatchError

__all__ = ["SpmdLoadPlanner", "SpmdSavePlanner", "has_sharded"]


def _is_spmd(value: Any) -> bool:
    # A staged DTensor is a ShardedTensor that plans itself, exactly as the live DTensor did.
    return isinstance(value, ShardedTensor) and not getattr(value, "plans_itself", False)


def has_sharded(flat: Mapping[str, Any]) -> bool:
    """Whether a flat state holds any :class:`ShardedTensor` planned by the SPMD planners."""
    return any(_is_spmd(v) for v in flat.values())


class _Picklable:
    """Planners travel to DCP's async-save process pickled: without their lock."""

    _lock: threading.Lock

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _split(state_dict: dict[str, Any]) -> tuple[dict[str, ShardedTensor], dict[str, Any]]:
    sharded = {k: v for k, v in state_dict.items() if _is_spmd(v)}
    rest = {k: v for k, v in state_dict.items() if k not in sharded}
    return sharded, rest


class SpmdSavePlanner(_Picklable, CkptSavePlanner):
    """Save planning for states with sharded tensors (see the module docstring).

    Args:
        flatten_state_dict: flatten nested state dicts as DCP's default planner does (plain
            ``dcp.save``); False for states flattened already (the manager's).
    """

    def __init__(self, *, flatten_state_dict: bool = True) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict)
        self._sharded: dict[str, ShardedTensor] = {}
        self._pending: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
        self._lock = threading.Lock()  # storage writers resolve items on several threads

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """(all ranks) Flatten (when asked), wrap XLA tensors, set the sharded values aside;
        the rest is planned as usual."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._sharded, self.state_dict = _split(wrap_xla_tensors(self.state_dict))
        self._pending = {}

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
        with self._lock:
            return self._take_chunk(fqn, st, tuple(write_item.index.offset or ()))

    def _take_chunk(self, fqn: str, st: ShardedTensor, offsets: tuple[int, ...]) -> torch.Tensor:
        pending = self._pending.get(fqn)
        if pending is None:
            layout = st.layout()
            data = st.local_shards()
            pending = {}
            for i in distinct_shards(layout, st.global_shape):
                pending[layout[i].offsets] = unpadded(data[i], layout[i])
            self._pending[fqn] = pending
        chunk = pending.pop(offsets, None)
        if chunk is None:
            raise SaveError(f"sharded tensor {fqn!r}: no local shard at {list(offsets)} "
                            "(its layout changed during the save?)")
        if not pending:
            del self._pending[fqn]
        return chunk


class SpmdLoadPlanner(_Picklable, CkptLoadPlanner):
    """Load planning (resharding) into states with sharded tensors; each tensor's shards go
    back to its devices as soon as its last read is committed (module docstring).

    Args:
        flatten_state_dict: flatten nested state dicts as DCP's default planner does (plain
            ``dcp.load``); False for states flattened already (the manager's).
        allow_partial_load: leave keys the checkpoint lacks as they are instead of failing.
        trusted: as :class:`~ckptmgr.dcp.planner.CkptLoadPlanner` (values from another storage
            reader).
    """

    def __init__(self, *, flatten_state_dict: bool = True, allow_partial_load: bool = False,
                 trusted: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         allow_partial_load=allow_partial_load, trusted=trusted)
        self._sharded: dict[str, ShardedTensor] = {}
        # fqn -> distinct local boxes (ordered as the read items' dest_index.index) and buffers
        self._boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self._buffers: dict[str, list[torch.Tensor]] = {}
        self._unread: dict[str, int] = {}  # fqn -> reads not committed yet
        self._lock = threading.Lock()

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """(all ranks) Flatten (when asked), wrap XLA tensors, set the sharded values aside;
        the rest is planned as usual.

        The sharded values are set aside before DCP's own set-up sees the state: it replaces
        every value of a type it does not know by None, in place.
        """
        flat, paths = (flatten_like_dcp(state_dict) if self.flatten_state_dict
                       else (dict(state_dict), {}))
        self._sharded, rest = _split(wrap_xla_tensors(flat))
        given = dict(rest)
        flatten, self.flatten_state_dict = self.flatten_state_dict, False
        try:
            super().set_up_planner(rest, metadata, is_coordinator)  # DCP's, on a flat dict
        finally:
            self.flatten_state_dict = flatten
        if flatten:
            self.original_state_dict, self.mappings = state_dict, paths
            for k, v in rest.items():
                if v is not given[k]:  # a meta tensor DCP materialized: the state gets it too
                    set_by_path(state_dict, paths[k], v)
        self._boxes, self._buffers, self._unread = {}, {}, {}

    def create_local_plan(self) -> LoadPlan:
        """(all ranks) Base plan plus reads covering each distinct local box once."""
        assert self.metadata is not None
        # DCP's own plan for the rest. Not DefaultLoadPlanner.create_local_plan: when the state's
        # keys miss some of the checkpoint's (ours, set aside), it falls back to flattening the
        # whole original state the torch 2.3 way, sharded values included.
        plan = create_default_local_load_plan(self.state_dict, self.metadata,
                                              not self.allow_partial_load)
        items: list[ReadItem] = []
        for fqn, st in list(self._sharded.items()):
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None and self.allow_partial_load:
                del self._sharded[fqn]  # left as it is
                continue
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

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """(all ranks) Count each sharded tensor's reads in the final plan; one with none (all
        of its boxes empty) goes back to its devices now."""
        plan = super().finish_plan(new_plan)
        unread: dict[str, int] = {}
        for item in plan.items:
            fqn = item.dest_index.fqn
            if fqn in self._buffers:
                unread[fqn] = unread.get(fqn, 0) + 1
        self._unread = unread
        for fqn in [f for f in self._buffers if f not in unread]:
            self._write_back_one(fqn)
        return plan

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """(all ranks) After a read landed: a sharded tensor whose last read this was goes
        back to its devices."""
        super().commit_tensor(read_item, tensor)
        fqn = read_item.dest_index.fqn
        with self._lock:
            left = self._unread.get(fqn)
            if left is None:
                return
            if left > 1:
                self._unread[fqn] = left - 1
                return
            del self._unread[fqn]
            self._write_back_one(fqn)

    def write_back(self) -> None:
        """(all ranks) Pad the loaded boxes into each local shard and load them onto the
        devices (replicas get the same data), for every sharded tensor not done yet."""
        with self._lock:
            for fqn in list(self._buffers):
                self._write_back_one(fqn)
            self._unread.clear()

    def _write_back_one(self, fqn: str) -> None:
        st = self._sharded[fqn]
        by_box = dict(zip(self._boxes.pop(fqn, []), self._buffers.pop(fqn, []), strict=True))
        shards = []
        for info in st.layout():
            buf = torch.zeros(info.padded_sizes, dtype=st.dtype)
            if info.numel:
                unpadded(buf, info).copy_(by_box[info.box])
            shards.append(buf)
        st.load_local_shards_(shards)
