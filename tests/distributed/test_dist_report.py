"""The compatibility report (pure) and its use by restore; ModelOptimizerState in one process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptmgr
from ckptmgr.dcp import ModelOptimizerState, compatibility_report
from ckptmgr.dcp.report import describe_mesh


def _tensor_md(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]],
               dtype: torch.dtype = torch.float32) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=dtype), torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


# Saved by 2 FSDP ranks: "w" in two row shards, "b" whole (replicated), a value, an extra key.
METADATA = Metadata(state_dict_metadata={
    "w": _tensor_md((4, 3), [((0, 0), (2, 3)), ((2, 0), (2, 3))]),
    "b": _tensor_md((3,), [((0,), (3,))]),
    "epoch": BytesStorageMetadata(),
    "old": _tensor_md((1,), [((0,), (1,))]),
    "holey": _tensor_md((4,), [((0,), (2,))]),
})


def test_same_layout_and_reshard() -> None:
    flat = {"w": torch.zeros(4, 3), "b": torch.zeros(3), "epoch": 0}
    rep = compatibility_report(METADATA, flat, 2, world_size=1, saved_mesh={
        "shape": [2], "dim_names": ["dp"], "device_type": "cpu"}, step=7)
    assert rep.compatible() and rep.loadable == ("w", "b", "epoch")
    assert (rep.num_tensors, rep.num_values) == (2, 1)
    assert rep.unexpected == ("holey", "old") and rep.missing == ()
    assert [(r.key, r.saved_chunks, r.source_chunks) for r in rep.resharded] == [("w", 2, 2)]
    text = str(rep)
    assert "step 7: saved by 2 rank(s) (cpu mesh dp=2), restoring on 1 (no mesh)" in text
    assert "resharded on this rank (1)" in text and "w: saved in 2 chunk(s)" in text
    assert "in the checkpoint, not requested (2)" in text


def test_mismatches_and_missing() -> None:
    flat = {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.float64),
            "epoch": torch.ones(1), "old": 5, "new": torch.zeros(1), "holey": torch.zeros(4)}
    rep = compatibility_report(METADATA, flat, 2, world_size=3, step=1)
    assert rep.missing == ("new",) and rep.loadable == ()
    assert not rep.compatible() and not rep.compatible(allow_partial=True)
    assert rep.mismatches == (
        "w: shape [4, 3] in checkpoint, [3, 4] in state",
        "b: dtype float32 in checkpoint, float64 in state",
        "epoch: checkpoint holds a Python value, state has a tensor",
        "old: checkpoint holds a tensor, state has int",
        "holey: the checkpoint stores 2 of its 4 elements (incomplete save)",
    )
    msg = rep.error_message()
    assert "missing from checkpoint: new" in msg and "Pass allow_partial=True" in msg
    assert "(1 missing keys, 5 shape/dtype mismatches)" in msg
    assert "missing from checkpoint" not in rep.error_message(allow_partial=True)
    only_missing = compatibility_report(METADATA, {"new": torch.zeros(1)}, 2)
    assert not only_missing.compatible() and only_missing.compatible(allow_partial=True)


def test_long_lists_are_cut_in_text() -> None:
    flat = {f"k{i}": torch.zeros(1) for i in range(120)}
    rep = compatibility_report(METADATA, flat, 1)
    assert len(rep.missing) == 120
    assert "... 70 more" in str(rep) and rep.error_message().count("missing from checkpoint") == 50
    assert describe_mesh(flat) is None


def test_restore_logs_report_and_raises_with_it(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with ckptmgr.CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(1, {"w": torch.ones(2, 2), "n": 3})
        with caplog.at_level(logging.INFO, logger="ckptmgr"):
            mgr.restore(1, {"w": torch.zeros(2, 2)})
        assert any("restore plan: step 1: saved by 1 rank(s)" in r.getMessage()
                   for r in caplog.records)
        with pytest.raises(ckptmgr.StateMismatchError) as ei:
            mgr.restore(1, {"w": torch.zeros(4)})
        assert "w: shape [2, 2] in checkpoint, [4] in state" in str(ei.value)
        assert "restoring on 1" in str(ei.value) and ei.value.mismatches


# ------------------------------------------------------------------- ModelOptimizerState


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def test_model_optimizer_state_round_trip(tmp_path: Path) -> None:
    model = _model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(3):
        _step(model, optim, s)
    with ckptmgr.CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(3, {"app": ModelOptimizerState(model, optim)})
        fresh = _model(1)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=5.0, weight_decay=0.1)
        # gradients present and no optimizer state yet: still restored in place
        fresh(torch.randn(2, 8)).sum().backward()
        mgr.restore(3, {"app": ModelOptimizerState(fresh, fresh_optim)})
    assert fresh_optim.param_groups[0]["lr"] == 1e-2
    assert fresh[0].weight.grad is not None  # restore leaves gradients alone
    fresh_optim.zero_grad()
    _step(model, optim, 3)
    _step(fresh, fresh_optim, 3)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = optim.state_dict()["state"], fresh_optim.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_model_optimizer_state_variants(tmp_path: Path) -> None:
    model = _model(0)
    opt_a = torch.optim.SGD(list(model[0].parameters()), lr=0.1, momentum=0.9)
    opt_b = torch.optim.Adam(list(model[2].parameters()), lr=1e-3)
    two = ModelOptimizerState(model, [opt_a, opt_b])
    sd = two.state_dict()
    assert set(sd) == {"model", "optim"} and set(sd["model"]) == set(model.state_dict())
    assert "0.weight" in sd["optim"]["state"] and "2.weight" in sd["optim"]["state"]
    only_model = ModelOptimizerState(model)
    assert set(only_model.state_dict()) == {"model"}
    assert "Sequential" in repr(two) and "SGD, Adam" in repr(two)
    with ckptmgr.CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(1, {"m": only_model})
        other = _model(5)
        mgr.restore(1, {"m": ModelOptimizerState(other)})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values(), strict=True))
    with pytest.raises(ckptmgr.ConfigError, match=r"torch\.nn\.Module"):
        ModelOptimizerState(object())  # type: ignore[arg-type]
    with pytest.raises(ckptmgr.ConfigError, match=r"optimizers\[1\]"):
        ModelOptimizerState(model, [opt_a, object()])  # type: ignore[list-item]
    with pytest.raises(ckptmgr.ConfigError, match="'optim'"):
        two.load_state_dict({"model": {}})
