"""Write the golden XLA checkpoints under tests/xla/golden/ with REAL torch_xla (run it in the
XLA lane's environment; tests/dcp/test_xla_golden.py restores them in the default suite, without
torch_xla):

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=. <xla-env>/bin/python tests/xla/make_golden.py

Two checkpoints of the same small state (tens of KB in all), sharded on 4 XLA devices:
- ``torch_xla_dcp/checkpoint``: a plain DCP directory written by torch_xla's own
  ``torch.distributed.checkpoint.save(..., planner=SPMDSavePlanner())`` (comes in through
  ``ckptmgr.tools.import_dcp``). torch_xla 2.9 leaves the partially replicated tensor out of it: its
  ``values.json`` lists it under ``missing``.
- ``ckptmgr_root/root``: a ckptmgr root with step 10 committed by ``CheckpointManager.save``.

Each ``values.json`` records, per flat key, the dtype, shape, row-major values and the layout it was
saved from, plus the versions that wrote it. The values are small integers, exact in every dtype.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import numpy as np
import torch

GOLDEN = Path(__file__).resolve().parent / "golden"
STEP = 10

# name -> (shape, dtype, mesh shape, device ids, partition spec, what it shows)
LAYOUTS: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...], list[int] | None,
                         tuple[Any, ...] | None, str]] = {
    "tiled": ((8, 6), torch.float32, (2, 2), None, (0, 1), "tiled on a 2x2 mesh"),
    "uneven": ((5, 3), torch.float32, (2, 2), [0, 2, 1, 3], (0, 1),
               "5x3 on a transposed 2x2 mesh: padded, short tiles"),
    "partial": ((6, 4), torch.float32, (2, 2), None, (0, None),
                "rows split on one axis of a 2x2 mesh, replicated on the other"),
    "replicated": ((3, 4), torch.float32, (2, 2), None, (None, None), "fully replicated"),
    "half": ((4, 6), torch.bfloat16, (2, 2), None, (1, 0), "bfloat16, axes swapped"),
    "ints": ((6, 2), torch.int64, (4,), None, (0, None),
             "int64 on a 1-D mesh of 4: tiles of 2, 2, 2 rows and an empty one"),
    "plain": ((7,), torch.float32, None, None, None, "an XLA tensor with no sharding annotation"),
}


def golden_values(name: str) -> torch.Tensor:
    """The value of ``name``: distinct small integers (exact in bfloat16 too)."""
    shape, dtype = LAYOUTS[name][0], LAYOUTS[name][1]
    seed = sorted(LAYOUTS).index(name)
    base = (torch.arange(math.prod(shape), dtype=torch.float64) * 7 + seed * 31) % 251 - 125
    return base.reshape(shape).to(dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _record(names: list[str], missing: list[str], made_by: str) -> dict[str, Any]:
    import torch_xla

    tensors = {}
    for name in names:
        shape, dtype, mshape, ids, spec, note = LAYOUTS[name]
        v = golden_values(name)
        tensors[f"model.{name}"] = {
            "dtype": _dtype_name(dtype), "shape": list(shape),
            "values": v.flatten().tolist(),
            "layout": {"mesh_shape": list(mshape) if mshape else None, "device_ids": ids,
                       "partition_spec": [list(e) if isinstance(e, tuple) else e
                                          for e in spec] if spec is not None else None,
                       "note": note}}
    return {"made_by": made_by, "step": STEP, "tensors": tensors,
            "values": {"extra.epoch": 3, "extra.tag": "golden"},
            "missing": missing,
            "versions": {"torch": torch.__version__, "torch_xla": torch_xla.__version__}}


def _xla_state() -> dict[str, Any]:
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if not xr.is_spmd():  # a second use_spmd() warns
        xr.use_spmd()
    n = xr.global_runtime_device_count()
    if n != 4:
        raise SystemExit(f"make_golden wants 4 XLA devices (CPU_NUM_DEVICES=4), got {n}")
    device = torch_xla.device()
    model = {}
    for name, (_, _, mshape, ids, spec, _) in LAYOUTS.items():
        t = golden_values(name).to(device)
        if mshape is not None:
            mesh = xs.Mesh(np.array(ids if ids is not None else list(range(n))), mshape)
            xs.mark_sharding(t, mesh, spec)
        model[name] = t
    torch_xla.sync()
    return {"model": model, "extra": {"epoch": 3, "tag": "golden"}}


def write_torch_xla_dcp(out: Path) -> dict[str, Any]:
    """(a) torch_xla's own SPMD planner through plain DCP; returns the values.json content."""
    import warnings

    import torch.distributed.checkpoint as dist_cp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    state = _xla_state()
    ckpt = out / "checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process and deprecation notices
        dist_cp.save(state, storage_writer=dist_cp.FileSystemWriter(str(ckpt)),
                     planner=SPMDSavePlanner())
    md = dist_cp.FileSystemReader(str(ckpt)).read_metadata()
    names = [n for n in LAYOUTS if f"model.{n}" in md.state_dict_metadata]
    missing = [f"model.{n}" for n in LAYOUTS if n not in names]
    return _record(names, missing, "torch.distributed.checkpoint.save with torch_xla's "
                                   "SPMDSavePlanner (tests/xla/make_golden.py)")


def write_ckptmgr_root(out: Path) -> dict[str, Any]:
    """(b) ckptmgr's manager from the same sharded XLA tensors; returns values.json content."""
    import ckptmgr

    state = _xla_state()
    with ckptmgr.CheckpointManager(str(out / "root"), 1) as mgr:
        mgr.save(STEP, state, force=True)
    return _record(list(LAYOUTS), [], "ckptmgr.CheckpointManager.save (tests/xla/make_golden.py)")


def make(golden: Path) -> None:
    """Write both checkpoints under ``golden`` (replacing what is there)."""
    for name, writer in [("torch_xla_dcp", write_torch_xla_dcp),
                         ("ckptmgr_root", write_ckptmgr_root)]:
        out = golden / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        record = writer(out)
        (out / "values.json").write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=GOLDEN, help="default: tests/xla/golden")
    make(parser.parse_args().out)


if __name__ == "__main__":
    main()
