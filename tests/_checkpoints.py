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


REUSE_STEPS = (10, 20, 30, 40)
"""The steps of :func:`save_reuse_root`: 10 saved without reuse, the others with it."""


def reuse_state(step: int) -> dict[str, Any]:
    """A state for ``reuse_unchanged=True``: a frozen base (6 MiB, two shared row blocks of the
    same bytes at every step), a trained adapter that changes every step (one shared chunk), a
    bias too small to share (in the step's own data file) and a Python value."""
    base = torch.Generator().manual_seed(0)
    trained = torch.Generator().manual_seed(step)
    return {
        "model": {"base.weight": torch.randn(3072, 512, generator=base),
                  "adapter.weight": torch.randn(64, 64, generator=trained),
                  "adapter.bias": torch.randn(8, generator=trained)},
        "extra": {"step": step},
    }


def save_reuse_root(root: str) -> None:
    """A mixed root: step 10 without reuse, then 20, 30 and 40 with ``reuse_unchanged=True``
    (each references the base's two chunks and its own adapter chunk)."""
    from ckptmgr import CheckpointManager

    with CheckpointManager(root, save_interval=10) as mgr:
        mgr.save(REUSE_STEPS[0], reuse_state(REUSE_STEPS[0]))
    with CheckpointManager(root, save_interval=10, reuse_unchanged=True) as mgr:
        for step in REUSE_STEPS[1:]:
            mgr.save(step, reuse_state(step))


def base_chunks(root: str) -> list[str]:
    """The shared chunks every reuse step of a :func:`save_reuse_root` root references (the
    frozen base's two row blocks), sorted."""
    from ckptmgr.step_store import StepStore

    store = StepStore(open_storage(root, writable=False))
    common = set.intersection(*({f.path for f in store.read_manifest(s).shared}
                                for s in REUSE_STEPS[1:]))
    assert len(common) == 2, common
    return sorted(common)


def assert_reuse_restores(root: str, step: int) -> None:
    """Step ``step`` of ``root`` (a :func:`save_reuse_root` step, or a copy of one) restores
    bit-exact, read by a reader with checksums verified."""
    from ckptmgr import CheckpointManager

    want = reuse_state(step)
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
              "extra": {"step": -1}}
    with CheckpointManager(root, save_interval=1, read_only=True) as mgr:
        mgr.restore(step, target)
    for k, v in want["model"].items():
        assert torch.equal(target["model"][k], v), (step, k)
    assert target["extra"] == want["extra"]
