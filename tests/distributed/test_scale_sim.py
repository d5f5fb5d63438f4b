"""benchmarks/scale_sim.py at tiny N: it runs end to end, and its simulated local plans are item
for item what our planner makes for the same rank's staged state (issue 18, item 6)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

from ckptmgr.dcp.planner import CkptSavePlanner, global_plan_problems
from ckptmgr.dcp.shards import StagedDTensor

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale_sim.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_sim", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_simulated_plans_match_the_planner_on_staged_stand_ins() -> None:
    sim = _load()
    n = 6
    builder = sim.PlanBuilder(n, layers=1)
    for rank in (0, 3, 5):
        flat = {}
        for key, shape, dtype, is_dt in builder.keys:
            if not is_dt:
                flat[key] = torch.zeros((), dtype=dtype)
                continue
            offsets, sizes = sim.shard0_box(shape, n, rank)
            flat[key] = StagedDTensor(
                torch.empty(sizes, dtype=dtype, device="meta"), global_shape=shape, dtype=dtype,
                chunks=[ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))],
                properties=TensorProperties(dtype=dtype,
                                            requires_grad=key.startswith("model.")))
        planner = CkptSavePlanner()
        planner.set_up_planner(flat, is_coordinator=rank == 0)
        assert planner.create_local_plan().items == builder.local_plan(rank).items
    # The coordinator's plan over the simulated ranks tiles every tensor once.
    coordinator = CkptSavePlanner()
    _, md = coordinator.create_global_plan(builder.plans())
    assert global_plan_problems(md) == []


def test_script_runs_at_tiny_n(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "4,16", "--layers", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "scale-sim-1l.json").read_text())
    assert [r["ranks"] for r in results] == [4, 16]
    for r in results:
        assert r["items"] == r["ranks"] * r["keys"]
        assert r["metadata_bytes"] > 0 and r["manifest_bytes"] > 0
        assert r["objects_written"] == r["ranks"] + 2
        assert r["plan_first_s"] > 0 and r["dcp_plan_s"] is not None
    assert "| 16 | 1 |" in (tmp_path / "scale-sim-1l.md").read_text()
