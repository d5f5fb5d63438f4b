"""The interleaved A/B harness (benchmarks/ab.py): variants, settings, pairing and the summary."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptmgr.storage import local

AB = Path(__file__).resolve().parents[2] / "benchmarks" / "ab.py"


def _ab() -> Any:
    spec = importlib.util.spec_from_file_location("ckptmgr_bench_ab", AB)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_parse_variant_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    ab = _ab()
    v = ab.parse_variant("ckptmgr.restore AB_TEST_X=1 ckptmgr.storage.local.DIRECT_IO=False",
                         "ckptmgr.save")
    assert (v.op, v.env, v.attrs) == ("ckptmgr.restore", {"AB_TEST_X": "1"},
                                      {"ckptmgr.storage.local.DIRECT_IO": False})
    assert ab.parse_variant("AB_TEST_X=0", "dcp.save").op == "dcp.save"  # the default op
    c = ab.parse_variant("AB_TEST_X=2 cmd:echo hi", "ckptmgr.save")
    assert (c.op, c.command, c.env) == ("cmd", "echo hi", {"AB_TEST_X": "2"})
    with pytest.raises(SystemExit, match="not one of"):
        ab.parse_variant("ckptmgr.save dcp.save", "ckptmgr.save")
    monkeypatch.delenv("AB_TEST_X", raising=False)
    before = local.DIRECT_IO
    with ab.applied(v):
        assert os.environ["AB_TEST_X"] == "1" and local.DIRECT_IO is False
    assert "AB_TEST_X" not in os.environ and local.DIRECT_IO is before
    assert ab.quantile([1.0, 2.0, 3.0, 4.0], 0.25) == 1.75


def test_interleaved_pairs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pairs alternate their order; each side's samples, medians, minimums and the per-pair
    ratios are reported; the settings reach the trial; scratch files are removed."""
    ab = _ab()
    out = tmp_path / "out" / "ab.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    doc = ab.main(["--a", "ckptmgr.save",
                   "--b", "ckptmgr.save ckptmgr.storage.local.DIRECT_IO=False",
                   "--size", "1MiB", "--count", "8", "--pairs", "3", "--warmup", "1",
                   "--dir", str(scratch), "--out", str(out)])
    assert doc["first_of_pair"] == ["b", "a", "b"]  # the warm-up pair ran A first
    r = doc["ratio_b_over_a"]
    assert r["pairs"] == 3 and len(doc["a"]["samples_s"]) == len(doc["b"]["samples_s"]) == 3
    assert r["q1"] <= r["median"] <= r["q3"] and r["min"] <= r["q1"]
    assert doc["a"]["min_s"] <= doc["a"]["median_s"]
    assert doc["b"]["attrs"] == {"ckptmgr.storage.local.DIRECT_IO": "False"}
    assert json.loads(out.read_text())["ratio_b_over_a"]["median"] == r["median"]
    assert list(scratch.iterdir()) == []

    # Reads (cold, files written once) against a shell command that sees its settings.
    doc = ab.main(["--a", "ckptmgr.restore", "--b",
                   'AB_TEST_Y=7 cmd:test "$AB_TEST_Y" = 7 && test -d "$AB_DIR"',
                   "--size", "1MiB", "--count", "8", "--pairs", "2", "--warmup", "0",
                   "--dir", str(scratch)])
    assert doc["b"]["op"] == "cmd" and len(doc["b"]["samples_s"]) == 2
    assert "AB_TEST_Y" not in os.environ

    # A background save's blocked time against its time until committed.
    doc = ab.main(["--a", "ckptmgr.save_async.blocked", "--b", "ckptmgr.save_async",
                   "--size", "1MiB", "--count", "8", "--pairs", "2", "--warmup", "0",
                   "--dir", str(scratch)])
    assert doc["a"]["op"] == "ckptmgr.save_async.blocked" and len(doc["a"]["samples_s"]) == 2
    assert list(scratch.iterdir()) == []

    # Compute lost to a background save (a short loop here).
    monkeypatch.setattr(ab, "COMPUTE_MIN_S", 0.2)
    doc = ab.main(["--a", "ckptmgr.save_async.compute_lost", "--b",
                   "ckptmgr.save_async.compute_lost ckptmgr._save_path.OVERLAP_STAGING=True",
                   "--size", "1MiB", "--count", "8", "--pairs", "1", "--warmup", "0",
                   "--dir", str(scratch)])
    assert all(x >= 0 for x in doc["a"]["samples_s"] + doc["b"]["samples_s"])
    assert list(scratch.iterdir()) == []


def test_write_patterns_measures_each_pattern(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/write_patterns.py: every pattern timed once per round, the scratch file gone,
    the JSON as printed (1 MiB stands in for 1 GiB)."""
    spec = importlib.util.spec_from_file_location(
        "ckptmgr_bench_write_patterns", AB.parent / "write_patterns.py")
    assert spec is not None and spec.loader is not None
    wp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wp)
    monkeypatch.setattr(wp, "TOTAL", 1 << 20)
    monkeypatch.setattr(wp, "PATTERNS", [(256 << 10, 1, False), (64 << 10, 3, True)])
    out = tmp_path / "patterns.json"
    rc = wp.main(["--dir", str(tmp_path), "--rounds", "2", "--out", str(out)])
    if rc == 2:
        pytest.skip("no O_DIRECT here")
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [(r["write_bytes"], r["in_flight"], r["preallocated"]) for r in rows] == [
        (256 << 10, 1, False), (64 << 10, 3, True)]
    assert all(len(r["seconds"]) == 2 and min(r["seconds"]) > 0 for r in rows)
    assert "| write size | in flight |" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patterns.json"]


def test_settle_path_choice_saves_until_the_choice_has_learned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' untimed saves before the first timed one: as many as the local path
    choice needs to learn (a warm-up file, then two on each path), none once it has, none where
    the path is forced or the files are too small to be timed."""
    import torch

    from ckptmgr import CheckpointManager

    bench = _ab().bench
    monkeypatch.setattr(local, "_CHOOSERS", {})
    monkeypatch.setattr(local, "_MEASURE_MIN", 256 << 10)
    monkeypatch.setattr(local, "DIRECT_IO", None)
    state = {f"t{i}": torch.randn(70_000) for i in range(2)}
    nbytes = bench.state_bytes(state)
    steps = iter(range(1, 100))
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        def save() -> None:
            mgr.save(next(steps), state)

        assert bench.settle_path_choice(save, str(tmp_path), 1 << 10) == 0  # too small
        made = bench.settle_path_choice(save, str(tmp_path), nbytes)
        chooser = local._chooser_for(str(tmp_path))
        assert chooser is not None
        if not local._O_DIRECT or len(chooser._speeds[True]) < 2:  # no O_DIRECT here
            pytest.skip("this file system takes no direct writes")
        assert made == 5 and min(map(len, chooser._speeds.values())) == 2
        assert bench.settle_path_choice(save, str(tmp_path), nbytes) == 0
        monkeypatch.setattr(local, "_CHOOSERS", {})
        monkeypatch.setattr(local, "DIRECT_IO", True)
        assert bench.settle_path_choice(save, str(tmp_path), nbytes) == 0


def test_a_side_that_took_zero_has_no_ratio_but_counts_as_a_pair() -> None:
    """A compute loss of 0 s is a result (bench.py clamps at 0): the summary and its Markdown
    neither divide by it nor drop its pair from the count (before: ZeroDivisionError)."""
    ab = _ab()
    a, b = ab.parse_variant("", "ckptmgr.save_async.compute_lost"), ab.parse_variant(
        "", "ckptmgr.save_async.compute_lost")
    doc = ab.summarize(a, b, [0.0, 0.2, 0.1], [0.1, 0.1, 0.0], ["a", "b", "a"], {
        "size_bytes": 1, "count": 1, "warmup": 0, "cache": "-", "loadavg": [0.0, 0.0]})
    r = doc["ratio_b_over_a"]
    assert r["pairs"] == 2 and r["pairs_run"] == 3 and r["b_faster_pairs"] == 2
    assert r["per_pair"] == [0.5, 0.0] and r["of_mins"] != r["of_mins"]  # NaN: A's min is 0
    text = ab.markdown(doc)
    assert "B faster in 2/3 pairs" in text and "of the 2 pairs" in text
