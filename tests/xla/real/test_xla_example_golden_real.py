"""The XLA example runs as users run it and resumes exactly; the golden checkpoints under
tests/xla/golden are what make_golden.py writes today and restore into real sharded tensors.

Shares the lane's pytest process with test_xla_spmd_real.py; one extra process runs the example
as a script (the uninterrupted run), the interrupted and resumed runs call its main() in here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
torch_xla = pytest.importorskip("torch_xla", exc_type=ImportError)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

import ckptmgr  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "xla_spmd.py"
GOLDEN = REPO / "tests" / "xla" / "golden"

if not xr.is_spmd():
    xr.use_spmd()


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+) loss (\S+)", text)}


def _main(module: ModuleType, *args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(list(args))
    return out.getvalue()


def test_example_resume_matches_uninterrupted(tmp_path: Path) -> None:
    # as a user runs it: no CKPTMGR_PATH, and no XLA_USE_SPMD (use_spmd() set it in here)
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTMGR_PATH", "XLA_USE_SPMD")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(EXAMPLE), "--ckpt", str(tmp_path / "full"),
                          "--steps", "12", "--every", "4"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    full = _losses(run.stdout)
    assert sorted(full) == list(range(12))
    # 0, 4 and 8 by the interval, 11 by close() (save_on_close); max_to_keep=3
    assert sorted(os.listdir(tmp_path / "full"), key=int) == ["4", "8", "11"]

    example = _load(EXAMPLE, "xla_spmd_example")
    first = _main(example, "--ckpt", str(tmp_path / "split"), "--steps", "7", "--every", "4")
    second = _main(example, "--ckpt", str(tmp_path / "split"), "--steps", "12", "--every", "4")
    assert "resumed from step 6" in second  # close() saved the first run's last step
    assert _losses(first) == {s: full[s] for s in range(7)}
    assert _losses(second) == {s: full[s] for s in range(7, 12)}


def _values_json(path: Path) -> dict[str, object]:
    record = json.loads(path.read_text())
    record.pop("versions")
    return record  # type: ignore[no-any-return]


def test_golden_checkpoints_are_what_make_golden_writes(tmp_path: Path) -> None:
    make_golden = _load(REPO / "tests" / "xla" / "make_golden.py", "make_golden")
    make_golden.make(tmp_path)
    for kind in ("torch_xla_dcp", "ckptmgr_root"):
        assert _values_json(tmp_path / kind / "values.json") == _values_json(
            GOLDEN / kind / "values.json"), kind


def test_golden_root_restores_into_real_sharded_tensors(tmp_path: Path) -> None:
    record = json.loads((GOLDEN / "ckptmgr_root" / "values.json").read_text())
    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "ckptmgr_root" / "root", root)
    device = torch_xla.device()
    mesh = xs.Mesh(np.array([1, 3, 0, 2]), (2, 2))
    model = {}
    expected = {}
    for key, entry in record["tensors"].items():
        name = key.split(".", 1)[1]
        dtype = getattr(torch, entry["dtype"])
        expected[name] = torch.tensor(entry["values"], dtype=torch.float64).reshape(
            entry["shape"]).to(dtype)
        t = torch.zeros(entry["shape"], dtype=dtype).to(device)
        spec = (1,) + (None,) * (len(entry["shape"]) - 1)
        xs.mark_sharding(t, mesh, spec)  # rows split on one axis: partially replicated
        model[name] = t
    torch_xla.sync()
    state = {"model": model, "extra": {"epoch": 0, "tag": ""}}
    with ckptmgr.CheckpointManager(str(root), 1) as mgr:
        mgr.restore(record["step"], state)
    for name, t in model.items():
        assert torch.equal(t.cpu(), expected[name]), name
    assert state["extra"] == {"epoch": 3, "tag": "golden"}
