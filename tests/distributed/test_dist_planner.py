"""The balanced dedup of replicated items (pure, on DCP save plans built from real state dicts)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.planner import SavePlan

import ckptmgr
from ckptmgr.dcp.planner import CkptSavePlanner, balance_replicated, metadata_bytes_estimate
from ckptmgr.dcp.state import flatten_state


def _plans(per_rank: list[dict[str, torch.Tensor]]) -> list[SavePlan]:
    return [create_default_local_save_plan(sd, r == 0) for r, sd in enumerate(per_rank)]


def _bytes(plan: SavePlan) -> int:
    return sum(i.tensor_storage_size() or 0 for i in plan.items)


def _owners(plans: list[SavePlan]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r, p in enumerate(plans):
        for item in p.items:
            out.setdefault(item.index.fqn, []).append(r)
    return out


def test_equal_replicated_items_spread_evenly() -> None:
    sd = {f"layer{i}.weight": torch.zeros(64, 64) for i in range(30)}
    for world in (2, 3, 4):
        plans = balance_replicated(_plans([sd] * world))
        owners = _owners(plans)
        assert sorted(owners) == sorted(sd) and all(len(r) == 1 for r in owners.values())
        sizes = [_bytes(p) for p in plans]
        assert max(sizes) - min(sizes) <= 64 * 64 * 4, sizes


def test_largest_first_and_shards_are_counted() -> None:
    # rank 0 alone holds a big shard; the replicated items should go to rank 1 first
    shard = {"emb.shard0": torch.zeros(1000)}
    replicated = {"big": torch.zeros(400), **{f"small{i}": torch.zeros(50) for i in range(12)}}
    plans = balance_replicated(_plans([{**shard, **replicated}, replicated]))
    sizes = [_bytes(p) for p in plans]
    assert sizes == [4000, 4000]  # 1000 floats vs 400 + 12 * 50 floats
    # item order inside a plan is kept
    kept = [i.index.fqn for i in plans[1].items]
    assert kept == [k for k in replicated if k in kept]


def test_coordinator_metadata_is_counted_and_deterministic() -> None:
    sd = {f"w{i}": torch.zeros(256) for i in range(8)}
    plans = _plans([sd, sd])
    with_md = balance_replicated(plans, coordinator_extra_bytes=2048)
    assert [_bytes(p) for p in with_md] == [3072, 5120]
    assert [[i.index for i in p.items] for p in balance_replicated(plans, 2048)] == [
        [i.index for i in p.items] for p in with_md]
    assert len(plans[0].items) == 8  # inputs untouched


def test_values_are_written_once() -> None:
    flat = flatten_state({"w": torch.zeros(4), "epoch": 3, "cfg": {"lr": 0.1}}).flat
    plans = balance_replicated(_plans([flat, flat, flat]))
    owners = _owners(plans)
    assert all(len(r) == 1 for r in owners.values()) and set(owners) == set(flat)


def test_metadata_estimate_is_close(tmp_path: Path) -> None:
    state = {"model": {f"blocks.{i}.attn.qkv.weight": torch.zeros(48, 16) for i in range(40)},
             "optim": {f"blocks.{i}.exp_avg": torch.zeros(48, 16) for i in range(40)}}
    with ckptmgr.CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(1, state)
        info = mgr.step_info(1)
    actual = next(f.size for f in info.files if f.path.startswith("metadata-"))
    estimate = metadata_bytes_estimate(_plans([flatten_state(state).flat]))
    assert 0.8 * actual <= estimate <= 1.25 * actual, (estimate, actual)


def test_save_planner_global_plan_dedups() -> None:
    sd = {f"w{i}": torch.zeros(128) for i in range(6)}
    planner = CkptSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    plans, metadata = planner.create_global_plan(_plans([sd, sd]))
    assert sorted(metadata.state_dict_metadata) == sorted(sd)
    assert sum(len(p.items) for p in plans) == 6 and all(p.items for p in plans)
