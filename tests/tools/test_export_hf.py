"""``export --format hf`` without ``--only`` (issue 31): a step with a top-level ``model`` entry
exports that entry, named without ``model.`` (no optimizer state in a Hugging Face directory);
a step without one exports every tensor, as before; the CLI says which it chose, the API logs
it and returns it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptmgr
from ckptmgr import tools
from ckptmgr.cli import main as cli_main


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(out / shard)))
    assert set(got) == set(index["weight_map"])
    return got


def _training_root(root: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # optimizer state with tensors: the keys transformers would call UNEXPECTED
    with ckptmgr.CheckpointManager(str(root), 1) as mgr:
        mgr.save(5, {"model": model, "optim": opt, "extra": {"epoch": 1}})
    return model


def test_api_exports_the_model_entry_and_logs_it(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    model = _training_root(tmp_path / "root")
    with caplog.at_level(logging.INFO, logger="ckptmgr"):
        r = tools.export_hf(str(tmp_path / "root"), None, tmp_path / "hf")
    got = _tensors(tmp_path / "hf")
    want = model.state_dict()
    assert sorted(got) == sorted(want)  # "0.weight", not "model.0.weight"; no "optim.*"
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert r.prefix == "model" and r.left_out == ("optim",) and r.num_tensors == len(want)
    assert r.to_json()["prefix"] == "model"
    assert "exporting step 5's 'model' entry" in caplog.text and "optim" in caplog.text

    # an explicit prefix still wins, and says so in the result (nothing logged about a choice)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckptmgr"):
        r2 = tools.export_hf(str(tmp_path / "root"), 5, tmp_path / "hf-optim", prefix="optim")
    assert r2.prefix == "optim" and r2.left_out == ()
    assert all(not k.startswith(("model", "0.", "1.")) for k in _tensors(tmp_path / "hf-optim"))
    assert "entry" not in caplog.text


def test_api_without_a_model_entry_exports_every_tensor(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), 1) as mgr:
        # "modelx" and "models" start with "model" but are not the model entry
        mgr.save(1, {"modelx": torch.ones(2), "models": {"a": torch.zeros(3)}, "w": torch.ones(1)})
    with caplog.at_level(logging.INFO, logger="ckptmgr"):
        r = tools.export_hf(str(tmp_path / "root"), 1, tmp_path / "hf")
    assert sorted(_tensors(tmp_path / "hf")) == ["models.a", "modelx", "w"]
    assert r.prefix is None and r.left_out == ()
    assert "exporting every tensor" in caplog.text


def test_cli_prints_which_it_chose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _training_root(tmp_path / "root")
    assert cli_main(["export", str(tmp_path / "root"), "5", str(tmp_path / "hf"),
                     "--format", "hf"]) == 0
    out, err = capsys.readouterr()
    assert "exported the 'model' entry, named without 'model.' (left out: optim;" in err
    assert "--only PREFIX" in err and "wrote" in out
    assert sorted(_tensors(tmp_path / "hf")) == sorted(model.state_dict())

    # --json: the document carries the choice; stdout stays one JSON document
    assert cli_main(["export", str(tmp_path / "root"), "5", str(tmp_path / "hf2"),
                     "--format", "hf", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["prefix"] == "model" and doc["left_out"] == ["optim"] and "'model' entry" in err

    # with --only: no note about a default
    assert cli_main(["export", str(tmp_path / "root"), "5", str(tmp_path / "hf3"),
                     "--format", "hf", "--only", "model."]) == 0
    assert "entry" not in capsys.readouterr().err

    with ckptmgr.CheckpointManager(str(tmp_path / "flat"), 1) as mgr:
        mgr.save(2, {"w": torch.ones(2), "b": torch.zeros(1)})
    assert cli_main(["export", str(tmp_path / "flat"), "2", str(tmp_path / "hf4"),
                     "--format", "hf"]) == 0
    assert "no top-level 'model' entry beside training state only in step 2: exported every " \
        "tensor" in capsys.readouterr().err
    assert sorted(_tensors(tmp_path / "hf4")) == ["b", "w"]

    # a plain transformers state_dict saved as it is: lm_head beside model.* is a weight
    with ckptmgr.CheckpointManager(str(tmp_path / "causal"), 1) as mgr:
        mgr.save(3, {"model": {"embed": torch.ones(2)}, "lm_head": {"weight": torch.zeros(2)},
                     "optim": {"lr": torch.ones(1)}})
    assert cli_main(["export", str(tmp_path / "causal"), "3", str(tmp_path / "hf5"),
                     "--format", "hf"]) == 0
    assert sorted(_tensors(tmp_path / "hf5")) == ["lm_head.weight", "model.embed",
                                                   "optim.lr"]
