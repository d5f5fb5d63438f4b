"""Send ckptmgr's save and restore events to TensorBoard (or print them without it).

    python examples/tensorboard_events.py --ckpt /tmp/run --logdir /tmp/tb

A listener gets ``on_save_start(step)``, ``on_save_end(stats)`` (a ``ckptmgr.SaveStats``:
blocking and write seconds, bytes, throughput, tier) and ``on_restore_end(step, bytes, seconds)``
on every rank; W&B (``wandb.log``) or a Prometheus gauge fit in the same few lines.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import ckptmgr
from ckptmgr.events import CheckpointListener


class ToTensorBoard(CheckpointListener):
    """Scalars per save under ``ckpt/`` (printed when tensorboard is not installed)."""

    def __init__(self, logdir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the tensorboard package is optional
            self.writer = None
        else:
            self.writer = SummaryWriter(logdir)

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, step)
        else:
            print(f"step {step} {name} {value:.6g}")

    def on_save_end(self, stats: ckptmgr.SaveStats) -> None:
        self.scalar("ckpt/blocking_s", stats.blocking_s, stats.step)
        self.scalar("ckpt/write_s", stats.write_s, stats.step)
        self.scalar("ckpt/bytes", stats.total_bytes, stats.step)
        self.scalar("ckpt/throughput_MBps", stats.throughput_bytes_per_s / 1e6, stats.step)

    def on_restore_end(self, step: int, bytes_read: int, seconds: float) -> None:
        self.scalar("ckpt/restore_s", seconds, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default=None, help="checkpoint root (default: a temp dir)")
    parser.add_argument("--logdir", default=None, help="TensorBoard log dir (default: temp)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    ckpt = args.ckpt or tempfile.mkdtemp(prefix="ckpt-")
    logdir = args.logdir or tempfile.mkdtemp(prefix="tb-")

    model = torch.nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    listener = ToTensorBoard(logdir)
    with ckptmgr.CheckpointManager(ckpt, save_interval=10, max_to_keep=2) as mgr:
        mgr.add_listener(listener)
        for step in range(args.steps):
            loss = model(torch.randn(8, 64)).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            mgr.save_async(step, {"model": model, "optim": optim})
        mgr.join()
        mgr.restore(mgr.latest_step(), {"model": model})
    listener.close()
    print(f"saved steps {mgr.all_steps()} under {ckpt}; events in {logdir}")


if __name__ == "__main__":
    main()
