"""Read once, then share: replicated state is read from storage by one rank and broadcast.

DDP-style state (the same full tensor on every rank) would otherwise be read from storage by every
rank: N times the bytes for N ranks. Before the load, the ranks agree on the tensors every one of
them restores whole (a plain CPU tensor with the checkpoint's shape and dtype on every rank),
assign each to one reader (largest first onto the least-loaded rank, so bytes read per rank stay
balanced), load only their own share through DCP, then broadcast each shared tensor from its
reader in one agreed order.

What is not shared (each rank reads what it needs, as before): sharded values (DTensor, shard
views), tensors on an accelerator or not contiguous, tensors whose shape or dtype differ between
ranks, and everything at world size 1. Checksums are verified by the reading rank before it
broadcasts.

Call order (every rank of ``group``): :func:`plan_shared_reads` (one all_gather) before the load,
:func:`share_reads` (one broadcast per shared tensor) after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["plan_shared_reads", "share_reads"]


def _shareable(key: str, value: Any, metadata: Metadata) -> tuple[tuple[int, ...], str, int] | None:
    # Exactly torch.Tensor: DTensor and other subclasses hold a part of the tensor.
    if type(value) is not torch.Tensor or value.device.type != "cpu" or not value.is_contiguous():
        return None
    saved = metadata.state_dict_metadata.get(key)
    if not isinstance(saved, TensorStorageMetadata) or tuple(saved.size) != tuple(value.shape):
        return None
    if saved.properties.dtype != value.dtype:
        return None
    return tuple(value.shape), str(value.dtype), value.numel() * value.element_size()


def plan_shared_reads(flat: Mapping[str, Any], metadata: Metadata, *, world_size: int,
                      group: Any) -> dict[str, int]:
    """(collective over ``group``) The tensors every rank restores whole, each with the rank
    (in ``group``) that reads it; {} alone or without a group."""
    if group is None or world_size < 2:
        return {}
    mine = {k: d for k, v in flat.items() if (d := _shareable(k, v, metadata)) is not None}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    common = [k for k, d in gathered[0].items() if all(g.get(k) == d for g in gathered[1:])]
    load = [0] * world_size
    owners: dict[str, int] = {}
    for key in sorted(common, key=lambda k: (-gathered[0][k][2], k)):
        reader = min(range(world_size), key=lambda r: (load[r], r))
        owners[key] = reader
        load[reader] += gathered[0][key][2]
    return owners


def share_reads(flat: Mapping[str, Any], owners: Mapping[str, int], *, group: Any) -> None:
    """(collective over ``group``, after the load) Broadcast every shared tensor from its
    reader into the same tensor on the other ranks, in one agreed order."""
    with torch.no_grad():  # a target may be a parameter that requires grad
        for key in sorted(owners):
            # As bytes: gloo cannot broadcast some dtypes (int16, uint16-64, float8 kinds).
            data = flat[key].reshape(-1).view(torch.uint8)
            dist.broadcast(data, src=dist.get_global_rank(group, owners[key]), group=group)
