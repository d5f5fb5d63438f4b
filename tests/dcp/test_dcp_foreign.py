"""Steps written by plain DCP (torch_xla's CheckpointManager, torchtitan, ``dcp.save``) restore in
place with ``restore(step, state, trusted=True)`` (issue 17), read by DCP's own readers; without
``trusted=True`` they are refused before anything is unpickled, and listing never unpickles.

Roots are made the way torch_xla's manager makes them: ``dcp.save`` into ``<root>/<step>/`` (plus
its pickled ``.manager_metadata``), and the golden checkpoint written by real torch_xla.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_xla_golden import GOLDEN, _check, _expected, _zeros_state

import ckptmgr
from ckptmgr import CheckpointManager
from ckptmgr.dcp.shards import CpuShardedTensor
from ckptmgr.errors import CorruptCheckpointError, StateMismatchError, UnsafeCheckpointError


def _model_optim(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = _model_optim(seed)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _dcp_save(state: dict[str, Any], path: str) -> None:
    """What torch_xla's manager writes for one step: DCP files plus its pickled marker."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, ".manager_metadata"), "wb") as f:
        pickle.dump({"step": os.path.basename(path)}, f)


@pytest.fixture
def xla_root(tmp_path: Path) -> tuple[str, torch.nn.Module, torch.optim.Optimizer]:
    root = str(tmp_path / "run")
    model, optim = _trained(0)
    _dcp_save({"model": model.state_dict(), "optim": optim.state_dict(),
               "extra": {"epoch": 3, "tags": ["a", "b"]}}, os.path.join(root, "20"))
    return root, model, optim


def _same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    return all(torch.equal(sa["state"][i][k], sb["state"][i][k])
               for i in sa["state"] for k in sa["state"][i])


def test_without_trusted_it_is_refused_saying_why(xla_root: Any) -> None:
    root, _, _ = xla_root
    model, optim = _model_optim(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(root, 10) as mgr:
        assert mgr.all_steps() == [20] and mgr.latest_step() == 20
        assert mgr.step_info(20).format == "dcp"
        with pytest.raises(UnsafeCheckpointError) as ei:
            mgr.restore(20, {"model": model, "optim": optim})
    msg = str(ei.value)
    assert "plain DCP" in msg and "pickle" in msg and "trusted=True" in msg, msg
    assert ei.value.step == 20
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_trusted_restores_torch_xla_style_dicts(xla_root: Any) -> None:
    """torch_xla's documented restore: state dicts of a primed optimizer, then load_state_dict."""
    root, saved_model, saved_optim = xla_root
    model, optim = _model_optim(1)
    with CheckpointManager(root, 10) as mgr:
        ckptmgr.prime_optimizer(optim)
        state_dict = {"model": model.state_dict(), "optim": optim.state_dict(),
                      "extra": {"epoch": 0, "tags": []}}
        mgr.restore(max(mgr.all_steps()), state_dict, trusted=True)
    model.load_state_dict(state_dict["model"])
    optim.load_state_dict(state_dict["optim"])
    assert _same_model(model, saved_model)
    assert _same_optim(optim, saved_optim)  # tensors, and param_groups rebuilt from DCP's keys
    assert state_dict["extra"] == {"epoch": 3, "tags": ["a", "b"]}


def test_trusted_restores_objects_and_primes_the_optimizer(xla_root: Any) -> None:
    root, saved_model, saved_optim = xla_root
    model, optim = _model_optim(1)  # optimizer never stepped: ckptmgr primes it
    with CheckpointManager(root, 10, read_only=True) as mgr:
        mgr.restore(20, {"model": model, "optim": optim}, trusted=True)
    assert _same_model(model, saved_model) and _same_optim(optim, saved_optim)
    # a subset of the checkpoint is fine
    other, _ = _model_optim(2)
    with CheckpointManager(root, 10, read_only=True) as mgr:
        mgr.restore(20, {"model": other}, trusted=True)
    assert _same_model(other, saved_model)


def test_mismatches_are_listed(xla_root: Any) -> None:
    root, saved_model, _ = xla_root
    model, optim = _model_optim(1)
    with CheckpointManager(root, 10, read_only=True) as mgr:
        with pytest.raises(StateMismatchError) as ei:
            mgr.restore(20, {"model": model.state_dict(), "sched": {"last": 1}}, trusted=True)
        assert ei.value.missing == ["sched.last"] and "allow_partial=True" in str(ei.value)
        state = {"model": model.state_dict(), "sched": {"last": 1}}
        mgr.restore(20, state, trusted=True, allow_partial=True)
        assert state["sched"] == {"last": 1}
        model.load_state_dict(state["model"])
        assert _same_model(model, saved_model)
        with pytest.raises(StateMismatchError, match=r"model\.0\.weight: checkpoint \[3, 4\]"):
            mgr.restore(20, {"model": {"0": {"weight": torch.zeros(4, 4)}}}, trusted=True)
        with pytest.raises(StateMismatchError, match="float64"):
            mgr.restore(20, {"model": {"0": {"weight": torch.zeros(3, 4, dtype=torch.float64)}}},
                        trusted=True)
        # an unprimed optimizer's state dict: its entries would stay silently empty
        with pytest.raises(StateMismatchError, match="prime_optimizer"):
            mgr.restore(20, {"optim": optim.state_dict()}, trusted=True)


def test_listing_never_unpickles_and_refusal_reads_nothing(tmp_path: Path) -> None:
    """A hostile .metadata (and .manager_metadata) runs code when unpickled: listing, step_info,
    the CLI's ls and a refused restore leave it untouched."""
    root = tmp_path / "run"
    marker = tmp_path / "pwned"
    step = root / "7"
    step.mkdir(parents=True)

    class Evil:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    for name in (".metadata", ".manager_metadata"):
        (step / name).write_bytes(pickle.dumps(Evil()))
    (step / "__0_0.distcp").write_bytes(b"\0" * 16)
    with CheckpointManager(str(root), 1) as mgr:
        assert mgr.all_steps() == [7]
        assert mgr.step_info(7).format == "dcp"
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore(7, {"a": torch.zeros(2)})
        assert mgr.save(8, {"a": torch.zeros(2)}) is True
    from ckptmgr.tools import list_steps

    list_steps(str(root))
    assert not marker.exists()


def test_unreadable_metadata_is_corrupt_not_a_raw_error(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "3").mkdir(parents=True)
    (root / "3" / ".metadata").write_bytes(b"not a pickle")
    with CheckpointManager(str(root), 1) as mgr, pytest.raises(
            CorruptCheckpointError, match=r"\.metadata cannot be read"):
        mgr.restore(3, {"a": torch.zeros(2)}, trusted=True)


def test_metadata_naming_a_file_outside_the_step_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp_save({"a": torch.arange(4.0)}, str(root / "4"))
    md = dcp.FileSystemReader(str(root / "4")).read_metadata()
    for info in md.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (root / "4" / ".metadata").write_bytes(pickle.dumps(md))
    with CheckpointManager(str(root), 1) as mgr, pytest.raises(
            UnsafeCheckpointError, match="outside the step directory"):
        mgr.restore(4, {"a": torch.zeros(4)}, trusted=True)


def test_fsspec_root_is_read_with_dcps_fsspec_reader(tmp_path: Path) -> None:
    local = tmp_path / "run"
    model, optim = _trained(3)
    _dcp_save({"model": model.state_dict(), "optim": optim.state_dict()}, str(local / "30"))
    fs = fsspec.filesystem("memory")
    url = f"memory://foreign-{uuid.uuid4().hex}"
    fs.put(str(local), url.removeprefix("memory://"), recursive=True)
    try:
        other, other_optim = _model_optim(4)
        with CheckpointManager(url, 10) as mgr:
            assert mgr.all_steps() == [30]
            mgr.restore(30, {"model": other, "optim": other_optim}, trusted=True)
        assert _same_model(other, model) and _same_optim(other_optim, optim)
    finally:
        fs.rm(url.removeprefix("memory://"), recursive=True)


def _golden_root(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """torch_xla's golden DCP checkpoint placed as step 10 of a root (a copy: the golden files
    are never opened for writing)."""
    record = _expected("torch_xla_dcp")
    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "torch_xla_dcp" / "checkpoint", root / str(record["step"]))
    return str(root), record


def _without_partial(state: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    # torch_xla 2.9 dropped its partially replicated tensor from this checkpoint (its bug).
    assert record["missing"] == ["model.partial"]
    record["tensors"] = {k: v for k, v in record["tensors"].items() if k != "model.partial"}
    state["model"] = {k: v for k, v in state["model"].items() if k != "partial"}
    return state


def test_golden_torch_xla_checkpoint_restores_in_place(tmp_path: Path) -> None:
    root, record = _golden_root(tmp_path)
    state = _without_partial(_zeros_state(record), record)
    with CheckpointManager(root, 1) as mgr:
        assert mgr.all_steps() == [record["step"]]
        mgr.restore(record["step"], state, trusted=True)
        _check(state, record)
        with pytest.raises(StateMismatchError, match=r"model\.partial"):
            mgr.restore(record["step"], {"model": {"partial": torch.zeros(6, 4)}}, trusted=True)


def test_golden_torch_xla_checkpoint_restores_into_sharded_tensors(tmp_path: Path) -> None:
    """Through the SPMD load planner, onto another mesh than the one it was saved from."""
    root, record = _golden_root(tmp_path)
    state = _without_partial(_zeros_state(record), record)
    specs = {"tiled": (None, 0), "uneven": (0, None), "replicated": (0, None),
             "half": (0, None), "ints": (None, 0), "plain": (0,)}
    state["model"] = {k: CpuShardedTensor(v, (4,), specs[k], device_ids=[3, 2, 1, 0])
                      for k, v in state["model"].items()}
    with CheckpointManager(root, 1) as mgr:
        mgr.restore(record["step"], state, trusted=True)
    _check(state, record)
