"""Read once, then share: replicated state is read from storage by one rank and sent to the others.

Replicated state would otherwise be read from storage by every rank holding it: N times the bytes
for N replicas. Two kinds are shared:

- DDP-style: the same full tensor on every rank (a plain CPU tensor with the checkpoint's shape and
  dtype): one reader, then a broadcast over the group;
- replicas of a shard: ranks whose DTensor holds the same box of a tensor (HSDP's replicate
  dimension, or a DTensor replicated on a mesh dimension): one reader among them, then
  point-to-point sends to the other holders only.

Before the load the ranks agree (one all_gather) on who holds what; each shareable unit gets one
reader (largest first onto the least-loaded holder, so bytes read per rank stay balanced); every
rank loads only the keys it reads itself; after the load the readers send. Checksums are verified
by the reading rank before it sends.

Not shared (each rank reads what it needs, as before): tensors on an accelerator or not
contiguous, DTensors whose local tensor covers several boxes, XLA sharded tensors (the SPMD
planners), shapes or dtypes that differ from the checkpoint's, and everything at world size 1.

Call order (every rank of ``group``): :func:`plan_shared_reads` before the load,
:func:`share_reads` after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

__all__ = ["Share", "plan_shared_reads", "share_reads"]


@dataclass(frozen=True)
class Share:
    """One shared unit this rank takes part in: who reads it, who holds it (ranks in the group,
    ascending), and the tag of its point-to-point messages."""

    reader: int
    holders: tuple[int, ...]
    tag: int


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _shareable(key: str, value: Any, metadata: Metadata) -> tuple[Any, int] | None:
    """(what this rank holds of ``key``, its bytes), or None when it cannot be shared."""
    if type(value) is torch.Tensor:  # exactly: other subclasses hold a part of the tensor
        what: Any = ("whole",)
    elif isinstance(value, DTensor):
        chunks = value.__create_chunk_list__()  # type: ignore[no-untyped-call]
        if len(chunks) != 1:
            return None
        what = ("box", tuple(chunks[0].offsets), tuple(chunks[0].sizes))
    else:
        return None
    local = _local(value)
    if local.device.type != "cpu" or not local.is_contiguous() or local.numel() == 0:
        return None
    saved = metadata.state_dict_metadata.get(key)
    if not isinstance(saved, TensorStorageMetadata) or tuple(saved.size) != tuple(value.shape):
        return None
    if saved.properties.dtype != value.dtype:
        return None
    return (*what, tuple(value.shape), str(value.dtype)), local.numel() * local.element_size()


def plan_shared_reads(flat: Mapping[str, Any], metadata: Metadata, *, rank: int,
                      world_size: int, group: Any) -> dict[str, Share]:
    """(collective over ``group``) The shared units this rank takes part in, by key; {} alone or
    without a group. This rank loads a key of the result only if it is its reader."""
    if group is None or world_size < 2:
        return {}
    mine = {k: d for k, v in flat.items() if (d := _shareable(k, v, metadata)) is not None}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    units: dict[tuple[str, Any], list[int]] = {}  # (key, what is held) -> holders
    for r, held in enumerate(gathered):
        for key, (what, _) in held.items():
            units.setdefault((key, what), []).append(r)
    sizes = {(k, w): gathered[hs[0]][k][1] for (k, w), hs in units.items()}
    load = [0] * world_size
    out: dict[str, Share] = {}
    order = sorted((u for u, hs in units.items() if len(hs) > 1),
                   key=lambda u: (-sizes[u], u[0], repr(u[1])))
    for tag, unit in enumerate(order):
        holders = tuple(units[unit])
        reader = min(holders, key=lambda r: (load[r], r))
        load[reader] += sizes[unit]
        if rank in holders:
            out[unit[0]] = Share(reader, holders, tag)
    return out


def share_reads(flat: Mapping[str, Any], plan: Mapping[str, Share], *, rank: int,
                world_size: int, group: Any) -> None:
    """(collective over ``group``, after the load) Send every shared unit from its reader to its
    other holders: a broadcast when every rank holds it, else point-to-point."""
    pending = []
    with torch.no_grad():  # a target may be a parameter that requires grad
        # Broadcasts first, in the same order everywhere; then the point-to-point messages.
        for key in sorted(plan, key=lambda k: plan[k].tag):
            share = plan[key]
            # As bytes: gloo cannot send some dtypes (int16, uint16-64, float8 kinds).
            data = _local(flat[key]).reshape(-1).view(torch.uint8)
            if len(share.holders) == world_size:
                dist.broadcast(data, src=dist.get_global_rank(group, share.reader), group=group)
            elif rank == share.reader:
                pending += [dist.isend(data, dst=dist.get_global_rank(group, r), group=group,
                                       tag=share.tag) for r in share.holders if r != rank]
            else:
                pending.append(dist.irecv(data, src=dist.get_global_rank(group, share.reader),
                                          group=group, tag=share.tag))
        for work in pending:
            if work is not None:
                work.wait()
