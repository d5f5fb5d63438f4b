"""Train a tiny XLA-SPMD sharded model with ckptmgr, and resume it from the newest checkpoint.

Needs torch_xla (2.9.0 with torch 2.9.0, see docs/xla.md). On a CPU-only machine, run it on four
virtual XLA devices:

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python examples/xla_spmd.py --ckpt /tmp/xla-run --steps 12

It prints ``step <n> loss <value>`` per step and saves asynchronously every ``--every`` steps. Run
it again with more ``--steps`` (or after killing it): it restores the newest committed step and
prints the same losses an uninterrupted run prints. The weights are sharded several ways on a 2-D
device mesh: tiled, partially replicated (the layout torch_xla's own checkpointing drops),
replicated and not annotated at all.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

import ckptmgr

BATCH, D_IN, HIDDEN, D_OUT = 16, 8, 32, 4


def make_mesh() -> xs.Mesh:
    """A 2-D ("data", "model") mesh over every device (n x 1 when the count is odd)."""
    n = xr.global_runtime_device_count()
    shape = (n // 2, 2) if n % 2 == 0 else (n, 1)
    return xs.Mesh(np.arange(n), shape, ("data", "model"))


def make_model(mesh: xs.Mesh, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT)).to(device)
    xs.mark_sharding(model[0].weight, mesh, ("model", "data"))  # tiled on both mesh axes
    xs.mark_sharding(model[0].bias, mesh, ("model",))           # partially replicated
    xs.mark_sharding(model[2].weight, mesh, (None, "model"))    # partially replicated
    # model[2].bias carries no annotation: XLA replicates it.
    return model


def batch(step: int, mesh: xs.Mesh, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a function of the step alone, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.sin(x[:, :D_OUT] * 2) + 0.1 * torch.randn(BATCH, D_OUT, generator=g)
    x, y = x.to(device), y.to(device)
    xs.mark_sharding(x, mesh, ("data", None))
    xs.mark_sharding(y, mesh, ("data", None))
    return x, y


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default=os.environ.get("CKPTMGR_PATH", "/tmp/ckptmgr-xla-spmd"),
                        help="checkpoint root: a local path or a gs:// or s3:// URL")
    parser.add_argument("--steps", type=int, default=12, help="train until this step (exclusive)")
    parser.add_argument("--every", type=int, default=4, help="save every this many steps")
    args = parser.parse_args(argv)

    if not xr.is_spmd():  # once per process (tests call main() repeatedly)
        xr.use_spmd()
    device = torch_xla.device()
    mesh = make_mesh()
    model = make_model(mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    # Stateful objects (module, optimizer) are captured with state_dict() at each save and
    # restored in place, then handed back with load_state_dict().
    state = {"model": model, "optim": opt, "progress": {"epoch": 0}}

    start = 0
    with ckptmgr.CheckpointManager(args.ckpt, args.every, max_to_keep=3) as mgr:
        # Primes the optimizer it is given (its state must exist to be loaded in place) and
        # reshards when the mesh differs from the saved one; None on a new run.
        latest = mgr.restore_latest(state)
        if latest is not None:
            start = latest + 1
            print(f"resumed from step {latest}", flush=True)
        for step in range(start, args.steps):
            x, y = batch(step, mesh, device)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            torch_xla.sync()
            state["progress"] = {"epoch": step // 5}
            print(f"step {step} loss {loss.item()!r}", flush=True)
            mgr.save_async(step, state)  # returns at once; writes in the background when due


if __name__ == "__main__":
    main()
