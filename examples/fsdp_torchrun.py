"""The used-by loop with FSDP2 under torchrun: gloo on CPU, nccl on GPUs, the same script.

Run it, stop it, and resume it at another world size; the checkpoint is resharded on restore::

    torchrun --nproc-per-node 2 examples/fsdp_torchrun.py --steps 30   # saves every 10 steps
    torchrun --nproc-per-node 4 examples/fsdp_torchrun.py --steps 60   # resumes from step 20
    python examples/fsdp_torchrun.py --steps 90                        # one process, no group

The checkpoint settings come from ``configs/fsdp.yaml`` (``--ckpt`` or ``CKPTMGR_PATH`` replace the
path). Each rank trains on its slice of the same global batch of every step. With ``--digest``, rank
0 prints ``step <n> digest <sha256>`` of the full (unsharded) model and optimizer state after each
save and after a restore, so runs at different world sizes can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ckptmgr
from ckptmgr.config import load_config
from ckptmgr.dcp import ModelOptimizerState

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "fsdp.yaml"
GLOBAL_BATCH = 48  # divisible by 1, 2, 3, 4, 6 and 8 ranks


def make_model() -> torch.nn.Module:
    """A small residual MLP; the same initial weights on every rank (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(),
        torch.nn.Linear(128, 128), torch.nn.GELU(),
        torch.nn.Linear(128, 1))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a pure function of the step, so any world size sees it."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g)
    y = x[:, :8].sum(dim=1, keepdim=True).sin()
    return x, y


def state_digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """sha256 of the full model + optimizer state (collective when sharded; rank 0's is real)."""
    sharded = dist.is_initialized()
    opts = StateDictOptions(full_state_dict=sharded, cpu_offload=sharded)
    msd, osd = get_state_dict(model, optim, options=opts)
    h = hashlib.sha256()
    flat = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():
        flat.update({f"optim.{fqn}.{k}": v for k, v in st.items()})
    for key in sorted(flat):
        t = flat[key].detach().cpu().contiguous().reshape(-1)
        h.update(key.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="ckptmgr YAML config")
    p.add_argument("--ckpt", default=None, help="checkpoint root (replaces the config's path)")
    p.add_argument("--steps", type=int, default=100, help="train until this step (exclusive)")
    p.add_argument("--save-interval", type=int, default=None, help="replaces the config's")
    p.add_argument("--digest", action="store_true", help="print state digests (rank 0)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    # torchrun sets RANK/WORLD_SIZE/MASTER_ADDR; without it this is one process, no group.
    distributed = "RANK" in os.environ
    use_cuda = torch.cuda.is_available()
    if distributed:
        if use_cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    torch.set_num_threads(1)

    model = make_model().to(device)
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    progress = {"step": -1, "samples_seen": 0}
    state = {"app": ModelOptimizerState(model, optim), "progress": progress}

    cfg = load_config(args.config)
    updates = {k: v for k, v in (("path", args.ckpt), ("save_interval", args.save_interval))
               if v is not None}
    if updates:
        cfg = load_config({**cfg.model_dump(by_alias=True, mode="json"), **updates})
    mgr = ckptmgr.CheckpointManager.from_config(cfg)
    start = 0
    last = mgr.latest_step()
    if last is not None:
        saved_by = mgr.step_info(last).world_size
        mgr.restore(last, state)  # in place; resharded from saved_by ranks to this world size
        start = last + 1
        digest = state_digest(model, optim) if args.digest else ""
        if rank == 0:
            print(f"resumed from step {last} (saved by {saved_by} ranks, now {world})", flush=True)
            if digest:
                print(f"step {last} digest {digest}", flush=True)

    rows = GLOBAL_BATCH // world
    for step in range(start, args.steps):
        x, y = (t[rank * rows:(rank + 1) * rows].to(device) for t in global_batch(step))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        progress["step"] = step
        progress["samples_seen"] += GLOBAL_BATCH
        if mgr.save_async(step, state, metrics={"loss": loss.item()}) and args.digest:
            digest = state_digest(model, optim)
            if rank == 0:
                print(f"step {step} digest {digest}", flush=True)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if args.digest and start < args.steps and not mgr.should_save(args.steps - 1):
        digest = state_digest(model, optim)  # of the last step, which close() saves
        if rank == 0:
            print(f"step {args.steps - 1} digest {digest}", flush=True)
    mgr.close()  # saves the last step too, when the interval did not (save_on_close)
    if rank == 0:
        print(f"done: committed steps {mgr.all_steps()} in {mgr.path}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
