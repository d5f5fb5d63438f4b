"""A training loop that survives preemption: SIGTERM takes a last checkpoint, then it exits.

Single process::

    python examples/preemption.py --ckpt ./ckpt-preempt &
    kill -TERM %1          # the loop saves the current step, then exits with status 143
    python examples/preemption.py --ckpt ./ckpt-preempt    # resumes from that step

Several ranks (CPU, gloo) with torchrun; a signal to any one rank makes every rank save the same
step and exit::

    torchrun --nproc-per-node 2 examples/preemption.py --ckpt ./ckpt-preempt

Each step prints ``step <n> loss <value>`` (rank 0 only) so a resumed run can be compared with an
uninterrupted one.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist

import ckptmgr


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, a pure function of the step (a resumed run sees the same data)."""
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default="./ckpt-preempt", help="checkpoint root (directory or URL)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--save-interval", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.01, help="seconds of 'work' per step")
    p.add_argument("--extra-mb", type=int, default=0, help="extra state, to make saves slower")
    p.add_argument("--no-exit", action="store_true",
                   help="exit_on_preemption=False: leave the loop via reached_preemption()")
    p.add_argument("--async-mode", default="thread", choices=["thread", "process"],
                   help="where background saves run (a thread, or a writer process per rank)")
    p.add_argument("--dist-init", default=None,
                   help="init_method for torch.distributed (default: torchrun's env://)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", init_method=args.dist_init or "env://",
                                rank=int(os.environ["RANK"]), world_size=world)
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"pid {rank} {os.getpid()}", flush=True)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "extra": {"step": -1},
             "ballast": torch.zeros(args.extra_mb * (1 << 18))}
    mgr = ckptmgr.CheckpointManager(args.ckpt, save_interval=args.save_interval, max_to_keep=2,
                                    exit_on_preemption=not args.no_exit,
                                    async_mode=args.async_mode)
    start = 0
    last = mgr.restore_latest(state)  # None on a new run; primes the optimizer it is given
    if last is not None:
        start = last + 1
        if rank == 0:
            print(f"resumed from step {last}", flush=True)
    for step in range(start, args.steps):
        x, y = make_batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        state["extra"]["step"] = step
        if rank == 0:
            print(f"step {step} loss {loss.item():.8f}", flush=True)
        time.sleep(args.step_time)
        # Saves when due; after a preemption signal, saves this step on every rank and exits
        # with 128 + signal (143 for SIGTERM), unless exit_on_preemption=False.
        mgr.save_async(step, state)
        if mgr.reached_preemption(step):
            print(f"preempted at step {step}", flush=True)
            break
    mgr.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
