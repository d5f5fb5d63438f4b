"""The GPU benchmark's CPU dry run, end to end: every method measured, table and JSON written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GPU_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"
METHODS = ["floor.d2h", "floor.h2d", "floor.write", "floor.read", "dcp.save", "dcp.load",
           "dcp_async.returned", "dcp_async.staged", "dcp_async.total",
           "ckptmgr_thread.blocking", "ckptmgr_thread.total", "ckptmgr.restore",
           "ckptmgr_process.blocking", "ckptmgr_process.total", "compute_lost.dcp_async",
           "compute_lost.ckptmgr_thread", "compute_lost.ckptmgr_process"]


@pytest.mark.slow
def test_gpu_bench_dry_run(tmp_path: Path) -> None:
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    # As benchmarks/gpu_check.sh runs it: a script (the writer processes re-import __main__).
    proc = subprocess.run(
        [sys.executable, str(GPU_BENCH), "--dry-run", "--dir", str(scratch), "--out", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "gpu_bench.json").read_text())
    assert doc["errors"] == {}, doc["errors"]
    assert doc["environment"]["cuda"] is False
    assert doc["environment"]["device"].startswith("cpu")
    assert doc["config"]["dry_run"] and doc["config"]["reps_done"] == 1
    rows = {r["name"]: r for r in doc["rows"]}
    for name in METHODS:
        assert name in rows and len(rows[name]["samples_s"]) == 1, name
        assert rows[name]["median_s"] >= 0, name
    assert rows["floor.d2h"]["label"].startswith("host copy (no CUDA")
    assert len(doc["targets"]) == 8 and all(t["ratio_median"] == t["ratio_median"]
                                            for t in doc["targets"])  # none NaN: all measured
    md = (out / "gpu_bench.md").read_text()
    for name in METHODS:
        assert f"| `{name}` |" in md, name
    assert "## Targets" in md and ("PASS" in md or "MISS" in md)
    assert md in proc.stdout  # the same table is printed
    assert list(scratch.iterdir()) == []  # every method's output and the scratch dir removed
