"""``benchmarks/bench_nodes.py --quick`` end to end: two simulated nodes, a 1 MiB state per rank,
one repetition of every measurement (saves without and with a replica, a node lost, restores from
the peers and from the S3 server), the table printed and the figures written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_nodes.py"


@pytest.mark.slow
def test_bench_nodes_quick(tmp_path: Path) -> None:
    out = tmp_path / "nodes.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "| measure | median | min |" in proc.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert all(len(v) == 1 for v in rows.values()), rows
    # Each local save of the 1 MiB part went to one peer (its data, not the whole state).
    assert 1.0 <= rows["replica MiB sent per rank per local save"][0] < 1.1, rows
    for name in ("restart to restored, from peers (step 3, local)",
                 "restart to restored, from the durable tier (step 2, S3 server)",
                 "blocked: save after a due durable save, after (1 replica)"):
        assert rows[name][0] > 0, (name, rows)
