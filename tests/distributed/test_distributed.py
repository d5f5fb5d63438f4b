"""Multi-process saves and restores over real gloo process groups (2 ranks, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _procs import run_ranks


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"layers": {str(i): torch.randn(64, 64, generator=g) for i in range(8)},
            "extra": {"epoch": seed}}


def _zero() -> dict[str, Any]:
    return {"layers": {str(i): torch.zeros(64, 64) for i in range(8)}, "extra": {"epoch": -1}}


def _save_restore(rank: int, world: int, root: str) -> dict[str, Any]:
    import ckptmgr

    out: dict[str, Any] = {}
    with ckptmgr.CheckpointManager(root, save_interval=10, max_to_keep=2) as mgr:
        for step in (10, 20):  # in the background, on the worker's own group
            assert mgr.save_async(step, _state(step), metrics={"loss": 1.0 / step})
        assert mgr.save(30, _state(30), metrics={"loss": 1.0 / 30})
        mgr.join()
        out["steps"] = mgr.all_steps()
        target = _zero()
        mgr.restore(30, target)
        exp = _state(30)
        out["ok"] = all(torch.equal(target["layers"][k], exp["layers"][k]) for k in exp["layers"])
        out["epoch"] = target["extra"]["epoch"]
        info = mgr.step_info(30)
        out["bytes_per_rank"] = dict(info.bytes_per_rank)
        out["world_size"] = info.world_size
        # one rank's bad input is raised on every rank, naming the rank, without hanging
        bad: dict[str, Any] = _state(40)
        if rank == 1:
            bad["obj"] = object()
        try:
            mgr.save(40, bad)
        except ckptmgr.UnsafeCheckpointError as e:
            out["save_err"] = str(e)
        mismatch = _zero()
        if rank == 0:
            mismatch["layers"]["0"] = torch.zeros(3)
        try:
            mgr.restore(30, mismatch)
        except ckptmgr.StateMismatchError as e:
            out["restore_err"] = str(e)
        out["steps_after"] = mgr.all_steps()
    return out


@pytest.mark.slow
def test_two_ranks_save_restore_and_agreement(local_root: str) -> None:
    r0, r1 = run_ranks(_save_restore, 2, local_root)
    for r in (r0, r1):
        assert r["steps"] == [20, 30]
        assert r["ok"] and r["epoch"] == 30
        assert r["world_size"] == 2
        assert r["steps_after"] == [20, 30]
    assert "[rank 1]" in r0["save_err"] and "obj" in r1["save_err"]
    assert "layers.0" in r0["restore_err"] and "[rank 0]" in r1["restore_err"]
    bpr = r0["bytes_per_rank"]
    assert bpr == r1["bytes_per_rank"]
    # replicated tensors are written once, spread over both ranks
    assert set(bpr) == {0, 1} and min(bpr.values()) > 0.3 * sum(bpr.values())

    # a world-size-1 process (no process group) restores what two ranks saved
    import ckptmgr

    with ckptmgr.CheckpointManager(local_root, save_interval=10) as mgr:
        target = _zero()
        mgr.restore(20, target)
        exp = _state(20)
        assert all(torch.equal(target["layers"][k], exp["layers"][k]) for k in exp["layers"])
