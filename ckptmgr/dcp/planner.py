"""Our DCP planners: DCP's default planning over the flat state dicts of :mod:`.state`, with a
balanced dedup of replicated items.

Call order (DCP's, per save):
1) (all ranks) ``set_up_planner``, ``create_local_plan``: every rank lists every item it holds:
   its own shards of sharded tensors (FSDP2/HSDP DTensor chunks) and a copy of every replicated
   item (plain tensors under DDP, DTensors replicated along a mesh dimension, Python values).
2) (coordinator) ``create_global_plan``: :func:`balance_replicated` keeps each replicated item on
   exactly one of the ranks that hold it, then DCP builds the metadata from the deduplicated plans.
3) (all ranks) ``finish_plan``; the writer writes each rank's items.

Python values never go through ``torch.save``/``torch.load``: the writer encodes the object it looks
up, and the reader hands decoded values to :meth:`CkptLoadPlanner.load_value`.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem, WriteItemType

from ckptmgr.errors import UnsafeCheckpointError

__all__ = ["CkptLoadPlanner", "CkptSavePlanner", "balance_replicated", "metadata_bytes_estimate"]

# Bytes our JSON metadata spends per stored item (its storage entry with file name, position,
# length, checksum and encoding, plus its share of the tensor entry), besides twice the key.
# Measured on real metadata: 200-230 bytes for 1-D and 2-D tensors; a little over is harmless.
_METADATA_BYTES_PER_ITEM = 215
# Python values are tagged JSON of unknown size at planning time; most are a few dozen bytes.
_VALUE_BYTES = 64


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return _VALUE_BYTES
    return item.tensor_storage_size() or 0


def metadata_bytes_estimate(plans: list[SavePlan]) -> int:
    """About how many bytes the coordinator's metadata file takes for these (deduplicated or not)
    plans: it is counted in the coordinator's share of the writes."""
    seen: set[MetadataIndex] = set()
    total = 0
    for plan in plans:
        for item in plan.items:
            if item.index not in seen:
                seen.add(item.index)
                total += _METADATA_BYTES_PER_ITEM + 2 * len(item.index.fqn)
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


class CkptSavePlanner(DefaultSavePlanner):
    """DCP's default save planning on a flat state dict, with :func:`balance_replicated` dedup.

    DCP's plan caching is off: its cache is process-wide and keyed by class name, so two managers
    (or two process groups) in one process would share it.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Balanced dedup, then DCP's global plan (its own dedup finds nothing)."""
        balanced = balance_replicated(all_plans, metadata_bytes_estimate(all_plans))
        plans: list[SavePlan]
        plans, metadata = super().create_global_plan(balanced)
        return plans, metadata


class CkptLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planning (resharding) on a flat state dict; collects Python values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True,
                         allow_partial_load=False)
        self.values: dict[str, Any] = {}

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Record the decoded Python value of ``read_item``."""
        self.values[read_item.dest_index.fqn] = value

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Only a foreign reader would call this, with pickle bytes: refuse rather than unpickle.
        raise UnsafeCheckpointError(
            f"refusing to unpickle {read_item.dest_index.fqn!r} from a foreign storage reader")
