"""The used-by loop: a small model trained with AdamW, checkpointed by ckptmgr, resumable.

Run it twice and the second run resumes where the first stopped::

    python examples/train_toy.py --steps 60              # trains steps 0..59, saves every 10
    python examples/train_toy.py --steps 120             # resumes from step 50, trains to 119

Every step calls ``save_async``; the manager saves only the steps that are due. The loss of each
step is printed as ``step <n> loss <value>`` so runs can be compared.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

import ckptmgr


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a pure function of the step, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return x, y


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=os.environ.get("CKPTMGR_PATH", "./ckpt-demo"),
                   help="checkpoint root: a directory or URL (default ./ckpt-demo)")
    p.add_argument("--steps", type=int, default=100, help="train until this step (exclusive)")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--max-to-keep", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=1000)
    progress = {"step": 0, "tokens_seen": 0}
    state = {"model": model, "optim": optim, "sched": sched, "progress": progress}

    mgr = ckptmgr.CheckpointManager(args.ckpt, save_interval=args.save_interval,
                                    max_to_keep=args.max_to_keep)
    last = mgr.restore_latest(state)  # in place; None on a new run
    start = 0 if last is None else last + 1
    if last is not None:
        print(f"resumed from step {last}")
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(start, args.steps):
        x, y = make_batch(step)
        loss = loss_fn(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        progress["step"] = step
        progress["tokens_seen"] += x.shape[0]
        print(f"step {step} loss {loss.item():.8f}", flush=True)
        mgr.save_async(step, state, metrics={"loss": loss.item()})
    mgr.close()  # also saves the last step (save_on_close), if the interval did not
    print(f"done: committed steps {mgr.all_steps()} in {mgr.path}")


if __name__ == "__main__":
    main()
