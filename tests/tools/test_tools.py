"""ckptmgr.tools in-process: list, inspect, verify, prune, export, copy and import, on checkpoints
made by the library (a sharded one, a corrupted one, incomplete leftovers) and plain DCP ones."""

from __future__ import annotations

import json
import os
import shutil
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoints import flip_byte, model_state, plain_dcp_save, save_sharded

from ckptmgr import (
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    tools,
)
from ckptmgr.formats import plain_dcp
from ckptmgr.tools import export as tools_export

safetensors_torch = pytest.importorskip("safetensors.torch")


def _build_root(root: str) -> None:
    with CheckpointManager(root, save_interval=10) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, model_state(step), metrics={"loss": 1.0 / step, "acc": step / 100})
    save_sharded(root, 40, model_state(40))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("tpl") / "run")
    _build_root(root)
    return root


@pytest.fixture
def ckpt(template: str, tmp_path: Path) -> str:
    """A fresh copy of committed steps 10, 20, 30 (world size 1) and 40 (sharded, world size 2)."""
    root = str(tmp_path / "run")
    shutil.copytree(template, root)
    return root


@pytest.fixture
def mem_ckpt() -> Iterator[str]:
    root = f"memory://tools-tests/{uuid.uuid4().hex}"
    _build_root(root)
    yield root
    import fsspec

    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def _data_file(root: str, step: int) -> str:
    d = os.path.join(root, str(step))
    return os.path.join(d, sorted(n for n in os.listdir(d) if n.startswith("data-"))[0])


def _add_leftovers(root: str) -> None:
    os.makedirs(os.path.join(root, "50"))
    Path(root, "50", "data-aaaaaaaaaaaa-r00000-000.bin").write_bytes(b"x" * 10)
    os.makedirs(os.path.join(root, ".tmp-60-0123456789ab"))
    Path(root, ".tmp-60-0123456789ab", "data-0123456789ab-r00000-000.bin").write_bytes(b"y" * 7)
    os.makedirs(os.path.join(root, "notes"))  # not ours: never listed or touched
    os.makedirs(os.path.join(root, "70"))  # a step name, but not our files: listed, never removed
    Path(root, "70", "README.txt").write_text("hands off")


class Recorder:
    def __init__(self) -> None:
        self.phases: list[tuple[str, int, int]] = []

    def start(self, total: int, label: str) -> None:
        self.phases.append((label, total, 0))

    def advance(self, nbytes: int) -> None:
        label, total, done = self.phases[-1]
        self.phases[-1] = (label, total, done + nbytes)

    def finish(self) -> None:
        pass


# ---------------------------------------------------------------------------------------- ls


def test_list_steps_marks_leftovers(ckpt: str) -> None:
    _add_leftovers(ckpt)
    entries = tools.list_steps(ckpt)
    assert [(e.step, e.name, e.committed, e.status) for e in entries] == [
        (10, "10", True, "committed"), (20, "20", True, "committed"),
        (30, "30", True, "committed"), (40, "40", True, "committed"),
        (50, "50", False, "incomplete"), (60, ".tmp-60-0123456789ab", False, "incomplete"),
        (70, "70", False, "incomplete")]
    e10 = entries[0]
    assert e10.metrics == {"loss": 0.1, "acc": 0.1} and e10.world_size == 1
    assert e10.time is not None and e10.time.endswith("Z") and e10.total_bytes > 0
    assert entries[3].world_size == 2
    assert entries[4].total_bytes == 10 and entries[4].time is None
    doc = json.loads(json.dumps([e.to_json() for e in entries]))
    assert {"step", "time", "total_bytes", "committed"} <= set(doc[0])


def test_list_steps_unreadable_manifest_and_empty_root(ckpt: str, tmp_path: Path) -> None:
    Path(ckpt, "20", "commit.json").write_bytes(b"{not json")
    e = {x.step: x for x in tools.list_steps(ckpt)}[20]
    assert e.committed and e.status == "unreadable" and "commit.json" in (e.error or "")
    assert tools.list_steps(str(tmp_path / "nothing-here")) == []


def test_list_steps_memory(mem_ckpt: str) -> None:
    assert [e.step for e in tools.list_steps(mem_ckpt)] == [10, 20, 30, 40]


# ----------------------------------------------------------------------------------- inspect


def test_inspect_step(ckpt: str) -> None:
    d = tools.inspect_step(ckpt, 10)
    assert d.info.step == 10 and d.info.metrics["loss"] == 0.1
    t = {x.name: x for x in d.tensors}
    assert t["model.fc.weight"].shape == (6, 5) and t["model.fc.weight"].dtype == "float32"
    assert t["model.fc.weight"].nbytes == 120 and t["model.fc.weight"].sharding == "whole"
    assert t["model.emb"].dtype == "bfloat16" and t["scalar"].shape == ()
    v = {x.name: x for x in d.values}
    assert v["extra.epoch"].encoding == "json" and "optim.param_groups" in v
    doc = d.to_json()
    assert doc["manifest"]["files"] and json.dumps(doc)

    latest = tools.inspect_step(ckpt)  # default: the newest committed step
    assert latest.info.step == 40 and latest.info.world_size == 2
    sharded = {x.name: x for x in latest.tensors}["model.fc.weight"]
    assert sharded.sharding == "2 chunks of [3, 5]" and len(sharded.chunks) == 2


def test_inspect_errors(ckpt: str) -> None:
    _add_leftovers(ckpt)
    with pytest.raises(CheckpointNotFoundError, match="10, 20, 30, 40") as ei:
        tools.inspect_step(ckpt, 7)
    assert ei.value.available == [10, 20, 30, 40]
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        tools.inspect_step(ckpt, 50)


# ------------------------------------------------------------------------------------ verify


def test_verify_clean_with_progress(ckpt: str) -> None:
    rec = Recorder()
    results = tools.verify_steps(ckpt, all_steps=True, progress=rec)
    assert [r.step for r in results] == [10, 20, 30, 40] and all(r.ok for r in results)
    total = sum(r.bytes_checked for r in results)
    assert rec.phases == [("verify", total, total)]
    assert [r.step for r in tools.verify_steps(ckpt)] == [40]
    assert [r.step for r in tools.verify_steps(ckpt, [20, 10])] == [10, 20]
    with pytest.raises(CheckpointNotFoundError):
        tools.verify_steps(ckpt, [11])


def test_verify_names_damaged_files(ckpt: str) -> None:
    flipped = _data_file(ckpt, 20)
    flip_byte(flipped, 3)  # inside the first tensor written
    truncated = _data_file(ckpt, 30)
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 1)
    os.unlink(_data_file(ckpt, 40))
    Path(ckpt, "10", "commit.json").write_bytes(b"[]")
    results = {r.step: r for r in tools.verify_steps(ckpt, all_steps=True)}
    assert results[10].corrupt_files == ["commit.json"]
    r20 = results[20]
    assert r20.corrupt_files == [os.path.basename(flipped)]
    reasons = " ".join(p.reason for p in r20.problems)
    assert "checksum is xxh3_64:" in reasons and "item checksum mismatch" in reasons
    assert results[30].corrupt_files == [os.path.basename(truncated)]
    assert "size is" in results[30].problems[0].reason
    assert results[40].problems[0].reason == "file is missing"
    assert not any(r.ok for r in results.values())


def test_verify_corrupt_metadata(ckpt: str) -> None:
    d = os.path.join(ckpt, "30")
    (md,) = [n for n in os.listdir(d) if n.startswith("metadata-")]
    flip_byte(os.path.join(d, md), 5)
    (r,) = tools.verify_steps(ckpt, [30])
    assert r.corrupt_files == [md]


def test_verify_memory(mem_ckpt: str) -> None:
    assert all(r.ok for r in tools.verify_steps(mem_ckpt, all_steps=True))


# ------------------------------------------------------------------------------------- prune


def test_prune_dry_run_then_for_real(ckpt: str) -> None:
    _add_leftovers(ckpt)
    lines: list[str] = []
    r = tools.prune_steps(ckpt, keep_last=1, incomplete=True, dry_run=True, log=lines.append)
    assert r.deleted == (10, 20, 30) and r.kept == (40,) and r.dry_run
    assert r.removed_leftovers == ("50", ".tmp-60-0123456789ab")
    assert r.foreign_leftovers == ("70",)
    assert "would delete step 10" in lines
    assert "leaving 70: it holds files ckptmgr did not write" in lines
    assert sorted(os.listdir(ckpt)) == sorted(
        ["10", "20", "30", "40", "50", ".tmp-60-0123456789ab", "70", "notes"])

    r = tools.prune_steps(ckpt, keep_last=1, keep_every=20, incomplete=True)
    assert r.deleted == (10, 30) and r.kept == (20, 40) and not r.failed
    assert sorted(os.listdir(ckpt)) == ["20", "40", "70", "notes"]
    assert [e.step for e in tools.list_steps(ckpt)] == [20, 40, 70]


def test_prune_never_deletes_newest_and_keeps_best(ckpt: str) -> None:
    r = tools.prune_steps(ckpt, keep_last=1, keep_best=1, best_metric="acc", best_mode="min")
    assert r.deleted == (20, 30) and r.kept == (10, 40)
    assert tools.prune_steps(ckpt, keep_last=0).deleted == ()  # 0 keeps every step, as the manager
    assert tools.prune_steps(ckpt, incomplete=True).deleted == ()  # no --keep-last: no step
    with pytest.raises(ConfigError, match="keep_period"):
        tools.prune_steps(ckpt, keep_last=1, keep_every=0)


# ------------------------------------------------------------------------------------ export


def test_export_safetensors_only_model_bf16(ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    rec = Recorder()
    r = tools.export_step(ckpt, 30, out, only="model", dtype="bf16", progress=rec)
    assert r.num_tensors == 4 and r.format == "safetensors" and r.skipped == ()
    assert rec.phases == [("export", r.nbytes, r.nbytes)]
    loaded = safetensors_torch.load_file(str(out))
    exp = model_state(30)["model"]
    assert sorted(loaded) == sorted(exp)  # named without the "model." prefix
    assert torch.equal(loaded["fc.weight"], exp["fc.weight"].to(torch.bfloat16))
    assert loaded["steps"].dtype == torch.int64 and torch.equal(loaded["steps"], exp["steps"])
    module = torch.nn.Linear(5, 6)
    module.load_state_dict({k.removeprefix("fc."): v.float() for k, v in loaded.items()
                            if k.startswith("fc.")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "run"]  # no temp


def test_export_pt_everything(ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "all.pt"
    r = tools.export_step(ckpt, 10, str(out))
    assert set(r.skipped) == {"extra.epoch", "extra.name", "optim.param_groups"}
    exp = model_state(10)
    for mmap in (False, True):
        loaded = torch.load(out, weights_only=True, mmap=mmap)
        assert torch.equal(loaded["model.emb"], exp["model"]["emb"])
        assert torch.equal(loaded["optim.state.0.exp_avg"], exp["optim"]["state"][0]["exp_avg"])
        assert torch.equal(loaded["scalar"], exp["scalar"]) and loaded["scalar"].dim() == 0
        assert all(v.data_ptr() % 64 == 0 for v in loaded.values() if v.numel())
    import zipfile

    assert zipfile.ZipFile(out).testzip() is None  # every CRC is right


def test_export_consolidates_shards(ckpt: str, tmp_path: Path) -> None:
    exp = model_state(40)
    for name in ("s.safetensors", "s.pt"):
        tools.export_step(ckpt, 40, tmp_path / name, only="optim")
    st = safetensors_torch.load_file(str(tmp_path / "s.safetensors"))
    pt = torch.load(tmp_path / "s.pt", weights_only=True)
    for loaded in (st, pt):
        assert list(loaded) == ["state.0.exp_avg"]
        assert torch.equal(loaded["state.0.exp_avg"], exp["optim"]["state"][0]["exp_avg"])


def test_export_streams_tensor_by_tensor(ckpt: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    original = tools_export._TensorSource.tensor
    alive: list[weakref.ref[torch.Tensor]] = []

    def tracked(self: Any, key: str, meta: Any) -> torch.Tensor:
        assert all(ref() is None for ref in alive), "a previous tensor is still held"
        t = original(self, key, meta)
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(tools_export._TensorSource, "tensor", tracked)
    for name in ("a.safetensors", "a.pt"):
        tools.export_step(ckpt, 40, tmp_path / name)
    assert len(alive) == 2 * 6


def test_export_errors(ckpt: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="safetensors"):
        tools.export_step(ckpt, 10, tmp_path / "x.txt")
    with pytest.raises(ConfigError, match="'model', 'optim', 'scalar'"):
        tools.export_step(ckpt, 10, tmp_path / "x.pt", only="nope")
    with pytest.raises(ConfigError, match="dtype"):
        tools.export_step(ckpt, 10, tmp_path / "x.pt", dtype="int4")
    with pytest.raises(CheckpointNotFoundError):
        tools.export_step(ckpt, 11, tmp_path / "x.pt")
    flip_byte(_data_file(ckpt, 40), 2)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as ei:
        tools.export_step(ckpt, 40, tmp_path / "x.safetensors")
    assert ei.value.path is not None and ei.value.path.startswith("data-")
    assert list(tmp_path.iterdir()) == [tmp_path / "run"]  # nothing left behind


def test_export_from_memory(mem_ckpt: str, tmp_path: Path) -> None:
    tools.export_step(mem_ckpt, None, tmp_path / "m.safetensors", only="model")
    loaded = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(loaded["fc.bias"], model_state(40)["model"]["fc.bias"])


# ---------------------------------------------------------------------------------------- cp


def _restore(root: str, step: int) -> dict[str, Any]:
    target = model_state(0)
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.restore(step, target)
    return target


def test_copy_local_to_local_and_memory(ckpt: str, tmp_path: Path) -> None:
    dst = str(tmp_path / "copy")
    lines: list[str] = []
    rec = Recorder()
    res = tools.copy_steps(ckpt, dst, [20, 40], progress=rec, log=lines.append)
    assert [(r.step, r.status) for r in res] == [(20, "copied"), (40, "copied")]
    assert rec.phases[0][1] == rec.phases[0][2] == sum(r.nbytes for r in res)
    assert sorted(os.listdir(dst)) == ["20", "40"]  # no staging directory left
    manifest = Path(ckpt, "40", "commit.json").read_bytes()
    assert Path(dst, "40", "commit.json").read_bytes() == manifest  # copied byte for byte
    assert all(r.ok for r in tools.verify_steps(dst, all_steps=True))
    got = _restore(dst, 40)
    assert torch.equal(got["model"]["fc.weight"], model_state(40)["model"]["fc.weight"])
    # again: identical steps are skipped; the rest are copied
    res = tools.copy_steps(ckpt, dst)
    assert [(r.step, r.status) for r in res] == [
        (10, "copied"), (20, "skipped"), (30, "copied"), (40, "skipped")]

    mem = f"memory://tools-tests/{uuid.uuid4().hex}"
    tools.copy_steps(dst, mem, [30])
    assert [e.step for e in tools.list_steps(mem)] == [30]
    assert all(r.ok for r in tools.verify_steps(mem, all_steps=True))
    back = str(tmp_path / "back")
    tools.copy_steps(mem, back)
    assert _restore(back, 30)["extra"] == {"epoch": 30, "name": "run"}


def test_copy_refuses_corrupt_source_and_conflicts(ckpt: str, tmp_path: Path) -> None:
    dst = str(tmp_path / "copy")
    flip_byte(_data_file(ckpt, 30), 1)
    with pytest.raises(CorruptCheckpointError, match="nothing was committed"):
        tools.copy_steps(ckpt, dst, [30])
    assert os.listdir(dst) == []  # the staging directory was removed

    other = str(tmp_path / "other")
    with CheckpointManager(other, save_interval=10) as mgr:
        mgr.save(10, model_state(99))
    with pytest.raises(CheckpointExistsError, match="step 10"):
        tools.copy_steps(ckpt, other, [10])
    with pytest.raises(ConfigError, match="same root"):
        tools.copy_steps(ckpt, ckpt)
    with pytest.raises(CheckpointNotFoundError):
        tools.copy_steps(ckpt, dst, [11])


# ------------------------------------------------------------------------------------ import


def test_import_dcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = model_state(7)
    state["extra"]["when"] = (1, 2.5)
    src = str(tmp_path / "dcp")
    plain_dcp_save(state, src)
    root = str(tmp_path / "run")
    with pytest.raises(UnsafeCheckpointError, match="trusted"):
        tools.import_dcp(src, root, 7)
    assert not os.path.exists(root)  # refused before any I/O

    monkeypatch.setattr(plain_dcp, "_IMPORT_BATCH", 100)  # several DCP reads, one tensor each
    rec = Recorder()
    info = tools.import_dcp(src, root, 7, trusted=True, metrics={"loss": 0.5}, progress=rec)
    assert info.step == 7 and info.world_size == 1 and info.metrics == {"loss": 0.5}
    assert info.metadata["imported_from"] == src
    assert rec.phases[0][1] == rec.phases[0][2] > 0
    assert sorted(os.listdir(root)) == ["7"]
    got = model_state(0)
    got["extra"]["when"] = None
    with CheckpointManager(root, save_interval=1) as mgr:
        assert mgr.all_steps() == [7]
        mgr.restore(7, got)
    for k in ("fc.weight", "emb", "steps"):
        assert torch.equal(got["model"][k], state["model"][k])
    assert got["extra"] == {"epoch": 7, "name": "run", "when": (1, 2.5)}
    assert got["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert all(r.ok for r in tools.verify_steps(root))

    with pytest.raises(CheckpointExistsError):
        tools.import_dcp(src, root, 7, trusted=True)
    with pytest.raises(CheckpointNotFoundError, match=r"\.metadata"):
        tools.import_dcp(str(tmp_path), root, 8, trusted=True)


def test_import_dcp_into_memory(tmp_path: Path) -> None:
    src = str(tmp_path / "dcp")
    plain_dcp_save({"w": torch.arange(10.0), "n": 3}, src)
    mem = f"memory://tools-tests/{uuid.uuid4().hex}"
    tools.import_dcp(src, mem, 1, trusted=True)
    target: dict[str, Any] = {"w": torch.zeros(10), "n": 0}
    with CheckpointManager(mem, save_interval=1) as mgr:
        mgr.restore(1, target)
    assert torch.equal(target["w"], torch.arange(10.0)) and target["n"] == 3


# ------------------------------------------------------------------------------ object store


@pytest.fixture
def s3_root(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """An empty s3:// root on the session's moto server, and the storage options to reach it."""
    try:
        server = request.getfixturevalue("moto_s3")
    except pytest.FixtureLookupError:
        pytest.skip("no moto_s3 fixture in this checkout")
    url = f"s3://ckpt-tests/{uuid.uuid4().hex}"
    yield url, server.storage_options()
    fs = server.fs()
    path = url.removeprefix("s3://")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_tools_on_s3(ckpt: str, s3_root: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, opts = s3_root
    res = tools.copy_steps(ckpt, url, [20, 30, 40], dst_options=opts)
    assert [r.status for r in res] == ["copied"] * 3
    assert [e.step for e in tools.list_steps(url, storage_options=opts)] == [20, 30, 40]
    assert all(r.ok for r in tools.verify_steps(url, all_steps=True, storage_options=opts))
    assert tools.inspect_step(url, 40, storage_options=opts).info.world_size == 2
    tools.export_step(url, 40, tmp_path / "m.safetensors", only="model", storage_options=opts)
    loaded = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(loaded["fc.weight"], model_state(40)["model"]["fc.weight"])
    assert tools.prune_steps(url, keep_last=2, storage_options=opts).deleted == (20,)
    back = str(tmp_path / "back")
    tools.copy_steps(url, back, src_options=opts)
    assert [e.step for e in tools.list_steps(back)] == [30, 40]
    assert torch.equal(_restore(back, 30)["scalar"], model_state(30)["scalar"])
