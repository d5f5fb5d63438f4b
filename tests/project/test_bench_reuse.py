"""The reuse benchmark's smoke mode (``benchmarks/bench_reuse.py --quick``), end to end: every
scenario measured on a 16 MiB state, the table and JSON written, the scratch removed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

BENCH_REUSE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_reuse.py"


def _bench_reuse() -> Any:
    spec = importlib.util.spec_from_file_location("ckptmgr_bench_reuse", BENCH_REUSE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_quick_run(tmp_path: Path) -> None:
    br = _bench_reuse()
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    doc = br.main(["--quick", "--dir", str(scratch), "--out", str(out)])
    series = {s["name"]: s for s in doc["series"]}
    for scenario in ("frozen", "embedding", "embedding_hot"):
        for what in ("first_s", "later_s", "first_bytes", "later_bytes", "time_ratio",
                     "bytes_ratio"):
            s = series[f"{scenario}.{what}"]
            assert len(s["samples"]) == 1 and s["median"] > 0, s
        (run,) = doc["saves"][scenario]
        assert len(run["seconds"]) == len(run["bytes"]) == 3
        # The first save writes at least the state's bytes; no later save writes more than it.
        assert run["bytes"][0] >= run["state_bytes"]
        assert max(run["bytes"][1:]) <= run["bytes"][0] * 1.01
    assert len(series["trained.time_ratio"]["samples"]) == 2
    for what in ("blocked_off_s", "blocked_on_s", "blocked_ratio", "committed_ratio"):
        s = series[f"async.{what}"]
        assert len(s["samples"]) == 2 and s["median"] > 0, s
    assert series["floor.write"]["median"] > 0 and series["floor.hash"]["median"] > 0
    assert {t["measure"] for t in doc["targets"]} == {
        "frozen.bytes_ratio", "frozen.time_ratio", "trained.time_ratio"}
    assert json.loads((out / "bench_reuse.json").read_text())["config"]["saves"] == 3
    md = (out / "bench_reuse.md").read_text()
    assert "| `frozen.bytes_ratio` |" in md and ("PASS" in md or "MISS" in md)
    assert list(scratch.iterdir()) == []  # every root and the scratch directory removed
