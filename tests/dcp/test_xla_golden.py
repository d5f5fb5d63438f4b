"""Checkpoints written once by REAL torch_xla (tests/xla/make_golden.py, 4 XLA devices) restore
here, on the main suite's torch and without torch_xla, to the values recorded beside them.

- ``tests/xla/golden/torch_xla_dcp``: plain DCP written by torch_xla's own ``SPMDSavePlanner``;
  it comes in through ``import_dcp`` (its partially replicated tensor is missing: torch_xla's bug).
- ``tests/xla/golden/ckptmgr_root``: a ckptmgr root saved from sharded XLA tensors; restored into
  plain CPU tensors and into CPU models of sharded tensors on other meshes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptmgr
from ckptmgr.dcp.shards import CpuShardedTensor, unpadded
from ckptmgr.errors import StateMismatchError
from ckptmgr.tools import import_dcp, inspect_step

GOLDEN = Path(__file__).resolve().parents[1] / "xla" / "golden"


def _expected(kind: str) -> dict[str, Any]:
    return json.loads((GOLDEN / kind / "values.json").read_text())  # type: ignore[no-any-return]


def _tensor(entry: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    return torch.tensor(entry["values"], dtype=torch.float64).reshape(entry["shape"]).to(dtype)


def _zeros_state(record: dict[str, Any]) -> dict[str, Any]:
    model = {}
    for key, entry in record["tensors"].items():
        dtype = getattr(torch, entry["dtype"])
        model[key.split(".", 1)[1]] = torch.zeros(entry["shape"], dtype=dtype)
    return {"model": model, "extra": {"epoch": 0, "tag": ""}}


def _check(state: dict[str, Any], record: dict[str, Any]) -> None:
    assert set(state["model"]) == {k.split(".", 1)[1] for k in record["tensors"]}
    for key, entry in record["tensors"].items():
        got = state["model"][key.split(".", 1)[1]]
        if isinstance(got, CpuShardedTensor):
            got = got.to_full()
        expected = _tensor(entry)
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        assert torch.equal(got, expected), key
    assert state["extra"] == {"epoch": record["values"]["extra.epoch"],
                              "tag": record["values"]["extra.tag"]}


def test_golden_files_are_small() -> None:
    total = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    assert 0 < total < 100_000


def test_torch_xla_dcp_checkpoint_imports_and_restores(tmp_path: Path) -> None:
    record = _expected("torch_xla_dcp")
    root = str(tmp_path / "root")
    step = record["step"]
    import_dcp(GOLDEN / "torch_xla_dcp" / "checkpoint", root, step, trusted=True)
    state = _zeros_state(record)
    with ckptmgr.CheckpointManager(root, 1) as mgr:
        mgr.restore(step, state, trusted=True)
        _check(state, record)
        # torch_xla 2.9 dropped the partially replicated tensor: a request for it is refused.
        assert record["missing"] == ["model.partial"]
        with pytest.raises(StateMismatchError, match=r"model\.partial"):
            mgr.restore(step, {"model": {"partial": torch.zeros(6, 4)}}, trusted=True)


def _copy_root(tmp_path: Path) -> str:
    # Restore from a copy: the committed golden files are never opened for writing.
    dst = tmp_path / "root"
    shutil.copytree(GOLDEN / "ckptmgr_root" / "root", dst)
    return str(dst)


def test_ckptmgr_xla_root_restores_into_cpu_tensors(tmp_path: Path) -> None:
    record = _expected("ckptmgr_root")
    assert record["missing"] == []
    root = _copy_root(tmp_path)
    state = _zeros_state(record)
    with ckptmgr.CheckpointManager(root, 1) as mgr:
        assert mgr.all_steps() == [record["step"]]
        mgr.restore(record["step"], state)
    _check(state, record)
    # every tensor stored once: the data file holds exactly the tensors' bytes and the values
    details = inspect_step(root, record["step"])
    for t in details.tensors:
        assert sum(torch.Size(s).numel() for _, s in t.chunks) == torch.Size(t.shape).numel()


# The recorded layouts were 2x2 meshes and a 1-D mesh of 4; restore onto other ones.
RESHARD = {
    "1-D of 4, reversed": ((4,), [3, 2, 1, 0], {"tiled": (None, 0), "uneven": (0, None),
                                                "partial": (None, 0), "replicated": (0, None),
                                                "half": (0, None), "ints": (None, 0),
                                                "plain": (0,)}),
    "4x1": ((4, 1), None, {"tiled": (0, 1), "uneven": (1, 0), "partial": (0, None),
                           "replicated": (None, None), "half": (1, None), "ints": (0, 1),
                           "plain": (1,)}),
    "2x2 shuffled": ((2, 2), [3, 1, 0, 2], {"tiled": (None, 0), "uneven": ((0, 1), None),
                                            "partial": (1, 0), "replicated": (0, None),
                                            "half": (0, 1), "ints": (1, None),
                                            "plain": ((1, 0),)}),
}


@pytest.mark.parametrize("target", list(RESHARD))
def test_ckptmgr_xla_root_restores_into_sharded_cpu_model(tmp_path: Path, target: str) -> None:
    record = _expected("ckptmgr_root")
    root = _copy_root(tmp_path)
    mesh_shape, ids, specs = RESHARD[target]
    state = _zeros_state(record)
    state["model"] = {k: CpuShardedTensor(v, mesh_shape, specs[k], device_ids=ids)
                      for k, v in state["model"].items()}
    with ckptmgr.CheckpointManager(root, 1) as mgr:
        mgr.restore(record["step"], state)
    _check(state, record)
    # every shard, replicas included, holds its box of the value
    for key, entry in record["tensors"].items():
        st = state["model"][key.split(".", 1)[1]]
        expected = _tensor(entry)
        for i, info in enumerate(st.layout()):
            box = tuple(slice(o, o + n) for o, n in zip(info.offsets, info.sizes, strict=True))
            assert torch.equal(unpadded(st.shard_data(i), info), expected[box]), (key, info)
