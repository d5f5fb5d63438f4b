"""Our DCP planners: DCP's default planning over the flat state dicts of :mod:`.state`, with a
balanced dedup of replicated items.

Call order (DCP's, per save):
1) (all ranks) ``set_up_planner``, ``create_local_plan``: every rank lists every item it holds:
   its own shards of sharded tensors (FSDP2/HSDP DTensor chunks) and a copy of every replicated
   item (plain tensors under DDP, DTensors replicated along a mesh dimension, Python values).
2) (coordinator) ``create_global_plan``: :func:`balance_replicated` keeps each replicated item on
   exactly one of the ranks that hold it, then DCP builds the metadata from the deduplicated plans.
3) (all ranks) ``finish_plan``; the writer writes each rank's items.

Plan caching (per planner instance; the manager keeps one save planner, so a training run plans
once): ``create_local_plan`` reuses its last plan when :meth:`CkptSavePlanner._structure_key` of
the state equals the last one, and the coordinator reuses its last global plan and metadata when
every gathered local plan equals the one it planned from (an exact comparison: a change of any
rank's keys, shapes, dtypes, shards or of the world size plans again). Subclasses opt out with
``plan_cache = False``, or per save by returning None from ``_structure_key``; one whose local
plan depends on more than the flat state's tensors' layout must extend ``_structure_key``.

Python values never go through ``torch.save``/``torch.load`` between our writer and our reader: the
writer encodes the object it looks up, and the reader hands decoded values to
:meth:`CkptLoadPlanner.load_value`. Under another storage reader they arrive as DCP's pickle bytes
(:meth:`CkptLoadPlanner.load_bytes`), loaded with ``weights_only=True`` unless trusted.

Flat or nested: the manager flattens states itself (``ckptmgr.dcp.state``) and hands these planners
flat dicts (``flatten_state_dict=False``, the default here); under plain ``dcp.save``/``dcp.load``
pass ``flatten_state_dict=True`` for nested dicts, as DCP's default planners do (the SPMD planners
of :mod:`.spmd` do so by default, like torch_xla's).
"""

from __future__ import annotations

import dataclasses
import io
import math
import secrets
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from ckptmgr.dcp.shards import StagedDTensor, coverage_problem
from ckptmgr.errors import UnsafeCheckpointError

__all__ = [
    "REUSE_CHUNK_BYTES", "CkptLoadPlanner", "CkptSavePlanner", "PlanTokenError",
    "balance_replicated", "default_structure_key", "flatten_like_dcp", "item_bytes",
    "metadata_bytes_estimate", "plan_token", "set_by_path", "split_item", "tagged_plan",
]

REUSE_CHUNK_BYTES = 4 << 20
"""With ``reuse_unchanged=True``, tensor chunks larger than this are cut along dim 0 into row
blocks of about this many bytes, so that a partly changed tensor (a few embedding rows) rewrites
only the blocks that changed. 4 MiB: 256 files per GiB written, and a changed row costs at most
4 MiB of writing (docs/byte-format.md, "Shared chunks")."""

# Bytes our metadata (format 2) spends per key (its header entry: name, dtype, size, chunk grid,
# column descriptions), besides the key itself, and per stored chunk (its packed checksum and
# position, when they do not compress). Measured on real metadata: 90-110 per key.
_METADATA_BYTES_PER_KEY = 100
_METADATA_BYTES_PER_CHUNK = 16
# Python values are tagged JSON of unknown size at planning time; most are a few dozen bytes.
_VALUE_BYTES = 64
# Plans kept per planner: two, so that states alternating between two layouts (say, a synchronous
# save of live tensors and a background one of staged copies) both stay planned.
_CACHED_PLANS = 2


def item_bytes(item: WriteItem) -> int:
    """Bytes a write item stores: its chunk's (DCP's ``tensor_storage_size`` counts the whole
    tensor, so every shard of a sharded tensor would weigh as much as all of them); a Python
    value counts as a small constant."""
    td = item.tensor_data
    if item.type == WriteItemType.BYTE_IO or td is None:
        return _VALUE_BYTES
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


_item_bytes = item_bytes


def split_item(item: WriteItem, chunk_bytes: int) -> list[WriteItem] | None:
    """``item`` cut along dim 0 into row blocks of at most ``chunk_bytes`` (at least one row
    each), or None when it is not a tensor chunk larger than that with more than one row.

    Deterministic (a pure function of the chunk's box, dtype and ``chunk_bytes``): every rank
    holding a replicated tensor cuts it the same way, so the dedup still sees equal items.
    """
    td = item.tensor_data
    if item.type == WriteItemType.BYTE_IO or td is None or not len(td.chunk.sizes):
        return None
    sizes = list(td.chunk.sizes)
    row_bytes = math.prod(sizes[1:]) * td.properties.dtype.itemsize
    if row_bytes == 0 or sizes[0] * row_bytes <= chunk_bytes:
        return None
    rows = max(1, chunk_bytes // row_bytes)
    if rows >= sizes[0]:
        return None
    out: list[WriteItem] = []
    base = list(td.chunk.offsets)
    for start in range(0, sizes[0], rows):
        offsets = torch.Size([base[0] + start, *base[1:]])
        box = torch.Size([min(rows, sizes[0] - start), *sizes[1:]])
        # SHARD: DCP's global plan allows several items of one key only of this type.
        out.append(WriteItem(
            index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=box),
                                        properties=td.properties, size=td.size)))
    return out


def metadata_bytes_estimate(plans: list[SavePlan]) -> int:
    """About how many bytes the coordinator's metadata file takes for these (deduplicated or not)
    plans: it is counted in the coordinator's share of the writes."""
    seen: set[MetadataIndex] = set()
    keys: set[str] = set()
    total = 0
    for plan in plans:
        for item in plan.items:
            if item.index not in seen:
                seen.add(item.index)
                total += _METADATA_BYTES_PER_CHUNK
                if item.index.fqn not in keys:
                    keys.add(item.index.fqn)
                    total += _METADATA_BYTES_PER_KEY + len(item.index.fqn)
    return total


def balance_replicated(plans: list[SavePlan], coordinator_extra_bytes: int = 0) -> list[SavePlan]:
    """Keep every item that several plans hold in exactly one of them, balancing bytes per rank.

    A greedy "largest item first onto the least loaded rank" (LPT): each rank starts with the bytes
    only it holds (its shards), the coordinator (plan 0) also with ``coordinator_extra_bytes``
    (the metadata it writes); then replicated items, largest first (ties in first-seen order),
    go to the least loaded of the ranks that hold them (ties: the lowest rank). With N ranks and
    equal replicated items the spread is at most one item. DCP's own dedup assigns items in
    first-seen order without counting the shards that come later, nor the metadata.

    Deterministic for given plans; item order inside each plan is kept. Plans are not modified.
    """
    holders: dict[MetadataIndex, list[int]] = {}
    first: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            first.setdefault(item.index, item)
    load = [0] * len(plans)
    if plans:
        load[0] += coordinator_extra_bytes
    replicated: list[MetadataIndex] = []
    for index, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += _item_bytes(first[index])
        else:
            replicated.append(index)
    order = {index: i for i, index in enumerate(replicated)}
    replicated.sort(key=lambda idx: (-_item_bytes(first[idx]), order[idx]))
    owner: dict[MetadataIndex, int] = {}
    for index in replicated:
        rank = min(holders[index], key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += _item_bytes(first[index])
    return [
        dataclasses.replace(plan, items=[
            item for item in plan.items if owner.get(item.index, rank) == rank])
        for rank, plan in enumerate(plans)
    ]


_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is made of Python scalars, lists, tuples and dicts only (at any depth):
    nothing in it is a tensor of any kind."""
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if depth > 100:
        return False  # deeper than any value we store: let DCP's walk decide (it never recurses)
    if isinstance(value, Mapping):
        return all(_plain(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    return False


def _keep_plain_values(given: Mapping[str, Any], flattened: Mapping[str, Any]) -> dict[str, Any]:
    """``flattened`` (DCP's ``flatten_sharded_tensors`` of the flat dict ``given``) with every
    plain Python value put back as it was given, in ``given``'s key order.

    DCP's flattening of sharded tensors rebuilds every container that holds a mapping, by
    walking its leaves: an empty dict has none, so ``[{"state": {}, "param_groups": [...]}]``
    came back without ``"state"``, and int keys came back as str. A plain value holds no
    ShardedTensor, so there is nothing in it to flatten.
    """
    out: dict[str, Any] = {}
    for key, value in given.items():
        if _plain(value):
            out[key] = value
        elif key in flattened:  # DCP leaves out a ShardedTensor with no local shard
            out[key] = flattened[key]
    return out


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    # Everything DCP's write item of a whole tensor holds (TensorProperties: dtype, layout,
    # requires_grad, pinned), plus the strides: a cheap extra that only ever forces a re-plan.
    return (tuple(t.shape), t.dtype, t.layout, t.requires_grad, t.is_pinned(), t.stride())


def default_structure_key(state_dict: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a default local save plan of ``state_dict`` depends on, in key order, or None when
    some value is of a kind whose plan this function cannot vouch for.

    Plain tensors: shape, dtype, layout, requires_grad, pinned, strides. DTensors: global shape,
    mesh, placements, and the local tensor's key. Staged DTensors (host copies): their
    :meth:`~ckptmgr.dcp.shards.StagedDTensor.structure_key`. Python values: only that they are
    values.
    Holds no tensor, so a cached key keeps no state alive.
    """
    parts: list[tuple[Any, ...]] = []
    for fqn, value in state_dict.items():
        if isinstance(value, DTensor):
            parts.append((fqn, "dtensor", tuple(value.shape), value.device_mesh,
                          tuple(value.placements), _tensor_key(value.to_local())))
        elif isinstance(value, StagedDTensor):
            parts.append((fqn, "staged-dtensor", value.structure_key()))
        elif hasattr(value, "__create_write_items__"):
            return None  # another checkpointable tensor type: its items are its own business
        elif isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                return None  # ShardedTensor and other subclasses plan their own items
            parts.append((fqn, "tensor", _tensor_key(value)))
        else:
            parts.append((fqn, "value"))
    return tuple(parts)


def global_plan_problems(metadata: Metadata, limit: int = 10, *,
                         complete: bool = True) -> list[str]:
    """Why the chunks of a global plan's tensors do not tile each tensor exactly once (bounds,
    overlaps and, when ``complete``, coverage), up to ``limit`` reasons; empty when they do.
    0-d tensors are not checked (as DCP does not).

    What DCP's own validation of a global plan checks, in about ``n log n`` per tensor of ``n``
    chunks (a sweep) instead of its pairwise overlap test: at 16k ranks that test alone is
    2 * 10^8 box comparisons per tensor.
    """
    problems = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size):
            boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
            problem = coverage_problem(tuple(md.size), boxes, complete=complete)
            if problem is not None:
                problems.append(f"{fqn}: {problem}")
                if len(problems) >= limit:
                    break
    return problems


def _same_plans(a: list[SavePlan], b: list[SavePlan]) -> bool:
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b, strict=True))


@dataclasses.dataclass(frozen=True)
class _Tagged:
    """``planner_data`` of a local plan sent whole: its id, and the planner data it carries."""

    plan_id: str
    data: Any = None


@dataclasses.dataclass(frozen=True)
class _Token:
    """``planner_data`` of a local plan sent as a token: "the plan I sent as ``plan_id``"."""

    plan_id: str


def tagged_plan(plan: SavePlan, plan_id: str) -> SavePlan:
    """(all ranks) ``plan`` as sent whole, under ``plan_id`` (the coordinator remembers it)."""
    return dataclasses.replace(plan, planner_data=_Tagged(plan_id, plan.planner_data))


def plan_token(plan_id: str) -> SavePlan:
    """(all ranks) The stand-in for the plan sent earlier as ``plan_id``: no items."""
    return SavePlan([], planner_data=_Token(plan_id))


class PlanTokenError(ValueError):
    """The coordinator does not hold the plan a rank sent a token for (its cache was cleared):
    this save fails, and every rank sends its whole plan in the next one."""


class CkptSavePlanner(DefaultSavePlanner):
    """DCP's default save planning on a flat state dict, with :func:`balance_replicated` dedup and
    plan caching across saves (module docstring).

    DCP's own plan caching is off: its cache is process-wide and keyed by class name, so two
    managers (or two process groups) in one process would share it. Ours lives on the instance.

    Attributes:
        plan_cache: class-level switch; a subclass sets it False to plan every save afresh.
        local_plan_reuses: saves whose local plan came from the cache (this rank).
        global_plan_reuses: saves whose global plan and metadata came from the cache (coordinator).
    """

    plan_cache: bool = True

    def __init__(self, *, flatten_state_dict: bool = False,
                 chunk_bytes: int | None = None) -> None:
        """
        Args:
            flatten_state_dict: flatten nested dicts and lists the way DCP's default planner
                does (and record the paths as ``planner_data``): for nested state dicts under
                plain ``dcp.save``. The manager hands over states it flattened itself.
            chunk_bytes: cut tensor chunks larger than this into row blocks (:func:`split_item`;
                the manager's ``reuse_unchanged=True``); None: DCP's chunks as they are.
        """
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=True)
        self.chunk_bytes = chunk_bytes
        # Row block's index -> the index and offsets of the item it was cut from (the plan's).
        self._parents: dict[MetadataIndex, tuple[MetadataIndex, tuple[int, ...]]] = {}
        self.local_plan_reuses = 0
        self.global_plan_reuses = 0
        self.plan_tokens_sent = 0
        self._key: Any = None
        # Newest first: (structure key, local plan as sent whole) and (gathered plans, their
        # ids, global plans, metadata).
        self._local_cache: list[tuple[Any, SavePlan, dict[MetadataIndex, Any]]] = []
        self._global_cache: list[tuple[list[SavePlan], list[str | None], list[SavePlan],
                                       Metadata]] = []
        # Rank side: the id of the plan sent in the last save whose planning reached this rank
        # (finish_plan), and of the plan sent in the save in progress.
        self._delivered: str | None = None
        self._sent: str | None = None
        # Coordinator side: per rank, the whole plans behind the ids of its last two plannings.
        self._known: list[dict[str, SavePlan]] = []

    def _structure_key(self, state_dict: Mapping[str, Any]) -> Any:
        """(all ranks) A comparable summary of everything this rank's local plan depends on, or
        None to plan this save afresh (and skip the global cache on the coordinator).

        The hook for subclasses: one whose ``create_local_plan`` adds items derived from state it
        keeps elsewhere must return None or fold that state's layout into the key. The key is
        compared with ``==`` (never hashed) and must not hold tensors. Default:
        :func:`default_structure_key` of the state given to ``set_up_planner``.
        """
        return default_structure_key(state_dict)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """(all ranks) DCP's set-up (flattening when asked, then flattening sharded tensors),
        with every plain Python value of a flat state kept exactly as given
        (:func:`_keep_plain_values`: DCP's walk drops empty dicts)."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if not self.flatten_state_dict:
            self.state_dict = _keep_plain_values(state_dict, self.state_dict)

    def clear_plan_cache(self) -> None:
        """Forget every cached plan (the next save plans afresh).

        On the coordinator this also forgets the plans behind the ranks' tokens: clear every
        rank's cache together (a rank that sends a token the coordinator no longer holds fails
        that save with :class:`PlanTokenError`, then sends its whole plan)."""
        self._local_cache.clear()
        self._global_cache.clear()
        self._known.clear()
        self._delivered = self._sent = None

    def release_state(self) -> None:
        """Drop the references to the last saved state (the plans stay cached): a planner kept
        across saves must not keep the caller's tensors alive between them."""
        self.state_dict = {}

    def lookup_object(self, index: MetadataIndex) -> Any:
        """(all ranks) The object a write item stands for; a staged DTensor's host shard."""
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, StagedDTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)

    def create_local_plan(self) -> SavePlan:
        """(all ranks) DCP's default local plan, or the cached one for an equal structure key.

        A reused plan that reached the coordinator in the last save goes as a token (a few
        bytes: :func:`plan_token`) instead of all its items; a subclass that overrides this
        method gets whole plans (it may add items to what this returns)."""
        if self._sent is not None:  # the last save never reached finish_plan: resend whole
            self._delivered = None
        plan = self._local_plan()
        tagged = plan.planner_data
        if not isinstance(tagged, _Tagged):
            self._sent = None
            return plan
        self._sent = tagged.plan_id
        if (tagged.plan_id == self._delivered
                and type(self).create_local_plan is CkptSavePlanner.create_local_plan):
            self.plan_tokens_sent += 1
            return plan_token(tagged.plan_id)
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """(all ranks) The coordinator's plan for this rank; what this rank sent is now known
        to it (the next unchanged plan goes as a token)."""
        self._delivered, self._sent = self._sent, None
        out: SavePlan = super().finish_plan(new_plan)
        return out

    def _local_plan(self) -> SavePlan:
        self._key = None
        if self.plan_cache:
            key = self._structure_key(self.state_dict)
            # Flattened: the nesting paths go into the plan (planner_data), so they key it too.
            paths = tuple(self.mappings.items()) if self.flatten_state_dict else None
            self._key = None if key is None else (self.is_coordinator, key, paths)
        if self._key is not None:
            for i, (cached_key, cached_plan, parents) in enumerate(self._local_cache):
                if cached_key == self._key:
                    self._local_cache.insert(0, self._local_cache.pop(i))
                    self.local_plan_reuses += 1
                    self.plan = cached_plan
                    self._parents = parents
                    return cached_plan
        plan: SavePlan = super().create_local_plan()
        self._parents = {}
        if self.chunk_bytes is not None:
            plan = self._split(plan, self.chunk_bytes)
            self.plan = plan
        if self._key is not None:
            plan = tagged_plan(plan, secrets.token_hex(8))
            self.plan = plan
            self._local_cache.insert(0, (self._key, plan, self._parents))
            del self._local_cache[_CACHED_PLANS:]
        return plan

    def _split(self, plan: SavePlan, chunk_bytes: int) -> SavePlan:
        """``plan`` with its large tensor items cut into row blocks (:func:`split_item`)."""
        items: list[WriteItem] = []
        for item in plan.items:
            blocks = split_item(item, chunk_bytes)
            if blocks is None:
                items.append(item)
                continue
            assert item.tensor_data is not None, "split_item cuts tensor items only"
            offsets = tuple(item.tensor_data.chunk.offsets)
            for block in blocks:
                self._parents[block.index] = (item.index, offsets)
            items.extend(blocks)
        return dataclasses.replace(plan, items=items)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """(all ranks) The data of a write item; a row block is a view of the tensor (or local
        shard) it was cut from."""
        parent = self._parents.get(write_item.index)
        if parent is None:
            data: torch.Tensor | io.BytesIO = super().resolve_data(write_item)
            return data
        index, offsets = parent
        t = self.lookup_object(index)
        assert isinstance(t, torch.Tensor) and write_item.tensor_data is not None, "row block"
        chunk = write_item.tensor_data.chunk
        start = chunk.offsets[0] - offsets[0]
        if start or chunk.sizes[0] != t.shape[0]:
            t = t.narrow(0, start, chunk.sizes[0])
        return t

    def _global_plan(self, plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan and metadata of deduplicated ``plans`` (its public helper, as its
        default planner does), checked by :func:`global_plan_problems`."""
        global_plan, metadata = create_default_global_save_plan(plans)
        if self.flatten_state_dict:
            merged: dict[Any, Any] = {}
            for p in reversed(global_plan):
                merged.update(p.planner_data or {})
            metadata = dataclasses.replace(metadata, planner_data=merged)
        # As DCP: a one-rank plan may hold part of a tensor (nothing else would write the rest).
        problems = global_plan_problems(metadata, complete=len(global_plan) > 1)
        if problems:
            raise ValueError(f"Failed to validate global plan: {'; '.join(problems)[:500]}")
        self.global_plan = global_plan
        self.metadata = metadata
        return global_plan, metadata

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Balanced dedup, then DCP's global plan (its own dedup finds nothing);
        or the cached result when every gathered plan equals the ones it was made from.

        Returns a fresh list and a fresh (shallow) copy of the metadata every time: the storage
        writer sets ``storage_data`` on it.
        """
        all_plans, ids = self._resolve_tokens(all_plans)
        use_cache = self.plan_cache and self._key is not None
        if use_cache:
            for i, (inputs, input_ids, plans, metadata) in enumerate(self._global_cache):
                # Plans that came with the same ids are the same (O(1) a rank); others are
                # compared item by item (a rank that planned again may have made an equal plan).
                if (None not in ids and input_ids == ids) or _same_plans(inputs, all_plans):
                    self._global_cache.insert(0, self._global_cache.pop(i))
                    self.global_plan_reuses += 1
                    self.global_plan = list(plans)
                    self.metadata = dataclasses.replace(metadata)
                    return list(plans), self.metadata
        balanced = balance_replicated(all_plans, metadata_bytes_estimate(all_plans))
        plans, metadata = self._global_plan(balanced)
        if use_cache:
            self._global_cache.insert(0, (list(all_plans), ids, list(plans),
                                          dataclasses.replace(metadata)))
            del self._global_cache[_CACHED_PLANS:]
        return plans, metadata

    def _resolve_tokens(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan],
                                                                  list[str | None]]:
        """(coordinator) Each rank's whole plan (tokens looked up, tags taken off) and the id
        it came under (None: an untagged plan); remembers the ids of the last two plannings."""
        if len(self._known) != len(all_plans):
            self._known = [{} for _ in all_plans]
        plans: list[SavePlan] = []
        ids: list[str | None] = []
        for rank, (plan, known) in enumerate(zip(all_plans, self._known, strict=True)):
            data = plan.planner_data
            if isinstance(data, _Token):
                whole = known.get(data.plan_id)
                if whole is None:
                    raise PlanTokenError(
                        f"rank {rank} sent a token for plan {data.plan_id}, which the "
                        "coordinator does not hold (its plan cache was cleared or it restarted):"
                        " this save fails; the next one sends whole plans")
                plans.append(whole)
                ids.append(data.plan_id)
            elif isinstance(data, _Tagged):
                whole = dataclasses.replace(plan, planner_data=data.data)
                known.pop(data.plan_id, None)
                known[data.plan_id] = whole
                plans.append(whole)
                ids.append(data.plan_id)
            else:
                plans.append(plan)
                ids.append(None)
            if ids[-1] is not None:
                known[ids[-1]] = known.pop(ids[-1])  # newest last
                while len(known) > _CACHED_PLANS:
                    del known[next(iter(known))]
        return plans, ids


class CkptLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planning (resharding) on a flat state dict; collects Python values.

    Python values reach it two ways: from our reader, decoded (:meth:`load_value`, no pickle);
    from another storage reader (DCP's ``FileSystemReader``), as DCP's pickle bytes
    (:meth:`load_bytes`), which are unpickled with ``torch.load(weights_only=True)`` (plain
    values, containers and tensors only) unless the planner is ``trusted``.

    Each loaded value is recorded in :attr:`values` (the manager applies them itself) and set in
    the state dict being loaded, as DCP's default planner does.
    """

    def __init__(self, *, flatten_state_dict: bool = False, allow_partial_load: bool = False,
                 trusted: bool = False) -> None:
        """
        Args:
            flatten_state_dict: flatten nested dicts and lists as DCP's default planner does
                (nested state dicts under plain ``dcp.load``).
            allow_partial_load: leave keys the checkpoint lacks as they are instead of failing.
            trusted: unpickle values from another storage reader fully (``weights_only=False``),
                which runs code from the checkpoint: only for checkpoints you trust.
        """
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=True,
                         allow_partial_load=allow_partial_load)
        self.trusted = trusted
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """(all ranks) DCP's set-up, with every plain Python value of a flat state kept as given
        (:func:`_keep_plain_values`): DCP's walk would leave a value such as ``[{}]`` out of the
        state to load, so it would never be read."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if not self.flatten_state_dict:
            self.state_dict = _keep_plain_values(state_dict, self.state_dict)

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """(all ranks) Take the decoded Python value of ``read_item``."""
        fqn = read_item.dest_index.fqn
        self.values[fqn] = value
        if self.flatten_state_dict and fqn in self.mappings:
            set_by_path(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """(all ranks) A value as DCP's pickle bytes, from a storage reader other than ours."""
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # UnpicklingError and whatever a hostile stream raises
            if not self.trusted:
                raise UnsafeCheckpointError(
                    f"{fqn!r} holds an object that only full unpickling can load "
                    f"({type(e).__name__}); pass trusted=True to the load planner only if you "
                    "trust who wrote this checkpoint") from e
            value.seek(0)
            obj = torch.load(value, weights_only=False)
        self.load_value(read_item, obj)


def flatten_like_dcp(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's own flattening of a nested state dict: flat key -> value, and flat key -> its path.

    Done by DCP's public default save planner, whose set-up flattens and nothing else (the load
    planner's also replaces, in place, every value of a type it does not know by None: our
    sharded tensors among them).
    """
    planner = DefaultSavePlanner(flatten_state_dict=True, flatten_sharded_tensors=True)
    planner.set_up_planner(state_dict=dict(state_dict), is_coordinator=False)
    return dict(planner.state_dict), dict(planner.mappings)


def set_by_path(root: Any, path: tuple[str | int, ...] | list[str | int], value: Any) -> None:
    """Set ``value`` at ``path`` of a nested state dict the way DCP's flattening recorded it:
    str parts are dict keys (missing dicts are created), int parts list indices (lists grow)."""
    container = root
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(container, list) and isinstance(part, int):
            while len(container) <= part:
                container.append(None)
            if last:
                container[part] = value
            else:
                if container[part] is None:
                    container[part] = {} if isinstance(path[i + 1], str) else []
                container = container[part]
        else:
            if (isinstance(part, str) and part not in container and part.isdigit()
                    and int(part) in container):
                part = int(part)  # an int-keyed dict (an optimizer's state): DCP wrote str(k)
            if last:
                container[part] = value
            else:
                container = container.setdefault(
                    part, {} if isinstance(path[i + 1], str) else [])
