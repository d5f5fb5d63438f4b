"""Checkpoints the tools and the CLI are tested on: a seeded state, a step sharded as two ranks
would write it, a step written by plain DCP, and a damaged byte."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckptmgr.codec.layout import new_attempt_id, staging_dir_name
from ckptmgr.dcp.compat import dcp_save
from ckptmgr.dcp.planner import CkptSavePlanner
from ckptmgr.dcp.writer import CkptStorageWriter, CommitPlan
from ckptmgr.storage import open_storage


def model_state(seed: int) -> dict[str, Any]:
    """A small state of every kind a step holds (fp32 and bf16 tensors, optimizer state, Python
    values), seeded."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"fc.weight": torch.randn(6, 5, generator=g),
                  "fc.bias": torch.randn(6, generator=g),
                  "emb": torch.randn(4, 3, generator=g).to(torch.bfloat16),
                  "steps": torch.tensor([seed, 2 * seed])},
        "optim": {"state": {0: {"exp_avg": torch.randn(6, 5, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "extra": {"epoch": seed, "name": "run"},
        "scalar": torch.tensor(0.5 * seed),
    }


class ShardingPlanner(CkptSavePlanner):
    """Writes every tensor with >= 2 rows as two row chunks, as two FSDP ranks would."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            t = self.state_dict[item.index.fqn]
            if item.type == WriteItemType.BYTE_IO or t.dim() == 0 or t.shape[0] < 2:
                items.append(item)
                continue
            half = t.shape[0] // 2
            for start, rows in ((0, half), (half, t.shape[0] - half)):
                offsets = torch.Size([start] + [0] * (t.dim() - 1))
                sizes = torch.Size([rows, *t.shape[1:]])
                items.append(WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes),
                                                TensorProperties.create_from_tensor(t), t.size())))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, torch.Tensor) and obj.dim() and obj.shape[0] >= 2:
            half = obj.shape[0] // 2
            start = index.offset[0] if index.offset is not None else 0
            return obj[start:start + (half if start == 0 else obj.shape[0] - half)]
        return super().lookup_object(index)


def save_sharded(root: str, step: int, state: dict[str, Any]) -> None:
    """A committed step whose tensors are stored in two chunks each (world size 2 manifest)."""
    from ckptmgr.dcp.state import flatten_state

    storage = open_storage(root)
    attempt = new_attempt_id()
    staged = storage.supports_rename
    plan = CommitPlan(step=step, attempt=attempt,
                      write_dir=staging_dir_name(step, attempt) if staged else str(step),
                      step_dir=str(step), staged=staged, overwrite=False, world_size=2)
    storage.makedirs(plan.write_dir)
    dcp_save(flatten_state(state).flat, CkptStorageWriter.for_attempt(storage, plan, 0),
             ShardingPlanner(), None)


def flip_byte(path: str, offset: int = 0) -> None:
    """Damage one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def plain_dcp_save(state: dict[str, Any], path: str) -> None:
    """A step written by plain ``dcp.save`` (no ckptmgr), as other tools write them."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save(state, checkpoint_id=path, no_dist=True)
