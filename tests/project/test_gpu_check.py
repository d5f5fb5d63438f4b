"""The GPU lane's CPU dry run (``benchmarks/gpu_check.sh --dry-run``), end to end: the ``cuda``
tests collected and skipped into a JUnit file, the GPU benchmark on a tiny CPU state with every
method measured, its table and JSON written, and the log. CI runs the lane this way; a GPU host
runs the same script without ``--dry-run`` (docs/performance.md, "The GPU lane")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "benchmarks" / "gpu_check.sh"
METHODS = ["floor.d2h", "floor.h2d", "floor.write", "floor.write_stream", "floor.read",
           "dcp.save", "dcp.load",
           "dcp_async.returned", "dcp_async.staged", "dcp_async.total",
           "ckptmgr_thread.blocking", "ckptmgr_thread.total", "ckptmgr.restore",
           "ckptmgr_process.blocking", "ckptmgr_process.total", "compute_lost.dcp_async",
           "compute_lost.ckptmgr_thread", "compute_lost.ckptmgr_process"]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CKPTMGR_GPU_SCRATCH": str(scratch),
           "PYTHONWARNINGS": ""}
    proc = subprocess.run([str(GPU_CHECK), "--dry-run", str(out)], capture_output=True,
                          text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    log = (out / "log.txt").read_text()
    assert "GPU: none" in log and "== done: status 0" in log
    # Every cuda test collected, none run: skipped without a GPU, with the reason.
    suite = ET.parse(out / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    cases = suite.findall("testcase")
    assert len(cases) >= 11 and int(suite.get("failures", 0)) == int(suite.get("errors", 0)) == 0
    assert all(c.find("skipped") is not None for c in cases)
    assert all("needs a CUDA GPU" in (c.find("skipped").get("message") or "") for c in cases)
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
    assert len(doc["targets"]) == 10 and all(t["ratio_median"] == t["ratio_median"]
                                             for t in doc["targets"])  # none NaN: all measured
    # Writes are judged against the fastest write floor measured.
    write_floors = [r for r in rows.values() if r["kind"] == "floor-write"]
    assert doc["write_floor"] == min(write_floors, key=lambda r: r["median_s"])["name"]
    assert rows["ckptmgr_thread.total"]["floor"] == doc["write_floor"]
    md = (out / "gpu_bench.md").read_text()
    for name in METHODS:
        assert f"| `{name}` |" in md, name
    assert "## Targets" in md and ("PASS" in md or "MISS" in md)
    assert md in log  # the same table is printed and logged
    assert not scratch.exists()  # every method's output and the scratch dir removed
