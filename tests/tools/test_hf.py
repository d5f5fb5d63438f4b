"""Hugging Face safetensors out (``export_hf``, ``ckptmgr export --format hf``) and weights in
(``CheckpointManager.load_initial``), including a checkpoint saved sharded at world size 2."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks
from safetensors.torch import load_file, save_file

import ckptmgr
from ckptmgr import tools
from ckptmgr.cli import main as cli_main
from ckptmgr.errors import ConfigError, StateMismatchError


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(3))
        self.head = torch.nn.Linear(width, 6)  # 6 rows: uneven shards at world 4


def _model(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _save(root: Path, step: int, model: torch.nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckptmgr.CheckpointManager(str(root), 1) as mgr:
        mgr.save(step, {"model": model, "optim": opt, "extra": {"epoch": 3}})


def _hf_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(str(out / shard))
        assert all(index["weight_map"][k] == shard for k in part)
        got.update(part)
    assert set(got) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in got.values())
    return got


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_export_hf_shards_index_prefix_cast_and_key_map(tmp_path: Path) -> None:
    model = _model(0)
    _save(tmp_path / "root", 7, model)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = tmp_path / "hf"
    r = tools.export_hf(str(tmp_path / "root"), None, out, max_shard_size=1500, prefix="model.")
    assert r.step == 7 and r.num_tensors == len(want) and len(r.shards) > 2
    assert r.shards[0] == f"model-00001-of-{len(r.shards):05d}.safetensors"
    assert sorted(os.listdir(out)) == sorted([*r.shards, "model.safetensors.index.json"])
    for shard in r.shards:  # none over the limit unless it holds a single larger tensor
        sizes = [t.numel() * t.element_size() for t in load_file(str(out / shard)).values()]
        assert sum(sizes) <= 1500 or len(sizes) == 1
    _equal(_hf_tensors(out), want)
    assert r.skipped == ()  # only keys under the prefix are considered

    # dtype cast and a mapping function that renames and drops
    r2 = tools.export_hf(str(tmp_path / "root"), 7, tmp_path / "hf2", prefix="model",
                         dtype="bf16", max_shard_size="1MB",
                         key_map=lambda k: None if k.startswith("head.") else f"model.{k}")
    assert len(r2.shards) == 1
    got = _hf_tensors(tmp_path / "hf2")
    _equal(got, {f"model.{k}": v.to(torch.bfloat16) for k, v in want.items()
                 if not k.startswith("head.")})
    assert "model.head.weight" in r2.skipped

    with pytest.raises(ConfigError, match="max_shard_size"):
        tools.export_hf(str(tmp_path / "root"), 7, tmp_path / "x", max_shard_size="lots")
    with pytest.raises(ConfigError, match="both written as"):
        tools.export_hf(str(tmp_path / "root"), 7, tmp_path / "x", prefix="model",
                        key_map=lambda k: "same")


def test_export_hf_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model(1)
    _save(tmp_path / "root", 3, model)
    out = tmp_path / "hf"
    code = cli_main(["export", str(tmp_path / "root"), "--step", "3", "--format", "hf",
                     str(out), "--prefix", "model.", "--max-shard-size", "2KB", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "hf" and doc["step"] == 3 and len(doc["shards"]) > 1
    _equal(_hf_tensors(out), {k: v.detach() for k, v in model.state_dict().items()})
    # the older positional form still works
    assert cli_main(["export", str(tmp_path / "root"), "3", str(tmp_path / "m.safetensors"),
                     "--only", "model"]) == 0


# ------------------------------------------------------------- world 2: sharded, then resharded


def _fsdp_rank(rank: int, world: int, root: str, weights: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model(0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with ckptmgr.CheckpointManager(root, 1) as mgr:
        mgr.save(1, {"model": model})
    # load_initial into DTensor targets: each rank copies its slices of the file's tensors
    fresh = _model(99)
    for layer in fresh.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    with ckptmgr.CheckpointManager(root + "-run", 1) as mgr:
        assert mgr.load_initial(weights, {"model": fresh}) is True
    full = {k: v.full_tensor().numpy() for k, v in fresh.state_dict().items()}
    # and from the world-2 root itself into a second sharded model, collectively
    other = _model(98)
    fully_shard(other, mesh=mesh)
    with ckptmgr.CheckpointManager(root + "-run2", 1) as mgr:
        assert mgr.load_initial(root, {"model": other}) is True
    # numpy arrays: tensors would travel through shared memory that dies with the rank
    return {"file": full,
            "root": {k: v.full_tensor().numpy() for k, v in other.state_dict().items()}}


def test_world2_sharded_export_and_load_initial(tmp_path: Path) -> None:
    want = {k: v.detach().clone() for k, v in _model(0).state_dict().items()}
    weights = tmp_path / "ref.safetensors"
    save_file(want, str(weights))
    root = str(tmp_path / "fsdp")
    results = run_ranks(_fsdp_rank, 2, root, str(weights), timeout_s=180)
    for r in results:
        for kind in ("file", "root"):
            _equal({k: torch.from_numpy(v) for k, v in r[kind].items()}, want)
    # the world-2 checkpoint's chunks are assembled into whole tensors by the export
    info = ckptmgr.CheckpointManager(root, 1, read_only=True)
    assert info.step_info(1).world_size == 2
    info.close()
    out = tmp_path / "hf"
    tools.export_hf(root, 1, out, prefix="model.", max_shard_size=2000)
    _equal(_hf_tensors(out), want)
    # resharded: restored at world 1, saved again, exported again: the same tensors
    plain = _model(5)
    with ckptmgr.CheckpointManager(root, 1, read_only=True) as mgr:
        mgr.restore(1, {"model": plain})
    _save(tmp_path / "again", 2, plain)
    tools.export_hf(str(tmp_path / "again"), 2, tmp_path / "hf-again", prefix="model.",
                    max_shard_size=2000)
    _equal(_hf_tensors(tmp_path / "hf-again"), want)


# ------------------------------------------------------------------------ load_initial (world 1)


def test_load_initial_sources(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _model(0)
    want = {k: v.detach().clone() for k, v in src.state_dict().items()}
    save_file(want, str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": want}, tmp_path / "w.pt")
    _save(tmp_path / "root", 4, src)
    tools.export_hf(str(tmp_path / "root"), 4, tmp_path / "hf", prefix="model.",
                    max_shard_size=1000)

    cases: list[tuple[str, Any]] = [
        (str(tmp_path / "w.safetensors"), None),            # names under the "model" wrapper
        (str(tmp_path / "hf"), None),                       # a Hugging Face directory
        (str(tmp_path / "w.pt"), lambda k: k.replace("state_dict.", "model.", 1)),
        (str(tmp_path / "root"), None),                     # another ckptmgr root
        (tmp_path / "w.safetensors", {k: f"model.{k}" for k in want}),
    ]
    for i, (source, key_map) in enumerate(cases):
        model = _model(10 + i)
        opt = torch.optim.Adam(model.parameters())
        with ckptmgr.CheckpointManager(str(tmp_path / f"run{i}"), 1) as mgr:
            assert mgr.load_initial(source, {"model": model, "optim": opt}, key_map=key_map)
            _equal({k: v.detach() for k, v in model.state_dict().items()}, want)
            mgr.save(1, {"model": model})
            # once the run has its own step, load_initial does nothing
            other = _model(50)
            with caplog.at_level(logging.INFO, logger="ckptmgr"):
                assert mgr.load_initial(source, {"model": other}, key_map=key_map) is False
            assert "load_initial ignored" in caplog.text
            assert not torch.equal(other.head.weight, want["head.weight"])

    # a file cast to the state's dtype; a partial file leaves the rest
    half = {k: v.to(torch.bfloat16) for k, v in want.items() if k.startswith("layers.")}
    save_file(half, str(tmp_path / "half.safetensors"))
    model = _model(60)
    head = model.head.weight.detach().clone()
    with ckptmgr.CheckpointManager(str(tmp_path / "run-half"), 1) as mgr:
        mgr.load_initial(str(tmp_path / "half.safetensors"), {"model": model})
    assert torch.equal(model.layers[0].weight, want["layers.0.weight"].to(torch.bfloat16).float())
    assert torch.equal(model.head.weight, head)


def test_load_initial_errors(tmp_path: Path) -> None:
    save_file({"nope.weight": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    save_file({"head.weight": torch.zeros(3, 3)}, str(tmp_path / "bad.safetensors"))
    with ckptmgr.CheckpointManager(str(tmp_path / "run"), 1) as mgr:
        state = {"model": _model(0)}
        with pytest.raises(StateMismatchError, match="nothing in"):
            mgr.load_initial(str(tmp_path / "x.safetensors"), state)
        with pytest.raises(StateMismatchError, match="shapes differ"):
            mgr.load_initial(str(tmp_path / "bad.safetensors"), state)
        with pytest.raises(ConfigError):
            mgr.load_initial(str(tmp_path / "run"), state)  # its own root: no committed step
        with pytest.raises(ConfigError, match="key_map"):
            mgr.load_initial(str(tmp_path / "x.safetensors"), state, key_map=3)  # type: ignore[arg-type]


# -------------------------------------------------------------------- streaming: peak memory

# VmHWM (this process's peak RSS), not ru_maxrss: Linux carries ru_maxrss across exec, so a child
# of the test process would inherit the parent's peak as its own.
_PEAK = textwrap.dedent("""
    import gc, sys
    import ckptmgr, torch
    import ckptmgr.tools.export, torch.distributed.checkpoint  # imports in the baseline
    from ckptmgr import tools

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    gc.collect()
    base = hwm()
    r = tools.export_hf(sys.argv[1], None, sys.argv[2], max_shard_size=int(sys.argv[3]))
    print(base, hwm(), len(r.shards), r.nbytes)
""")


def test_export_hf_peak_memory_is_one_shard_not_the_model(tmp_path: Path) -> None:
    # A 384 MiB state of 48 tensors of 8 MiB, exported into 32 MiB shards (12 shards).
    mib = 1 << 20
    state = {f"w{i}": torch.full((2 * mib,), float(i)) for i in range(48)}
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), 1) as mgr:
        mgr.save(1, state)
    del state
    shard = 32 * mib
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / "root"),
                          str(tmp_path / "hf"), str(shard)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    base, peak, nshards, nbytes = (int(x) for x in out.stdout.split())
    assert nbytes == 384 * mib and nshards == 12
    print(f"export of {nbytes / mib:.0f} MiB into {shard / mib:.0f} MiB shards: peak RSS "
          f"{(peak - base) / mib:.1f} MiB above a {base / mib:.0f} MiB baseline")
    assert peak - base < 1.3 * shard
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got = load_file(str(tmp_path / "hf" / index["weight_map"]["w47"]))
    assert torch.equal(got["w47"], torch.full((2 * mib,), 47.0))


# ------------------------------------------------------------- transformers (optional)


def test_transformers_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50,
                                     n_positions=32)
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(config)
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), 1) as mgr:
        mgr.save(10, {"model": hf_model})
    out = tmp_path / "hf"
    tools.export_hf(str(tmp_path / "root"), 10, out, prefix="model.", max_shard_size=20_000)
    config.save_pretrained(out)  # the test writes the tiny config next to the weights
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    want = hf_model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k
