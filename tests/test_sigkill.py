"""SIGKILL during saves never leaves a half-written step that restore would accept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptmgr import CheckpointManager

_WRITER = r"""
import sys, torch, ckptmgr
root = sys.argv[1]
mgr = ckptmgr.CheckpointManager(root, save_interval=1, max_to_keep=3)
start = (mgr.latest_step() or 0) + 1
for step in range(start, start + 10_000):
    g = torch.Generator().manual_seed(step)
    state = {"w": torch.randn(256, 1024, generator=g), "step": step,
             "b": torch.randn(64, 64, generator=g).bfloat16()}
    mgr.save(step, state)
    print(step, flush=True)
"""


def expected(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "step": step,
            "b": torch.randn(64, 64, generator=g).bfloat16()}


@pytest.mark.slow
def test_repeated_sigkill_during_saves(local_root: str) -> None:
    killed_at = []
    for round_ in range(4):
        with subprocess.Popen([sys.executable, "-c", _WRITER, local_root],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            # let it commit a few steps, then kill at a varying moment inside a save
            for _ in range(2 + round_):
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
            time.sleep(0.013 * round_)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at.append(line.strip())
        with CheckpointManager(local_root, save_interval=1, max_to_keep=3) as mgr:
            steps = mgr.all_steps()
            assert steps, killed_at
            for step in steps:
                target = {"w": torch.zeros(256, 1024), "step": -1,
                          "b": torch.zeros(64, 64, dtype=torch.bfloat16)}
                mgr.restore(step, target)
                exp = expected(step)
                assert target["step"] == step
                assert torch.equal(target["w"], exp["w"])  # type: ignore[arg-type]
                assert torch.equal(target["b"], exp["b"])  # type: ignore[arg-type]
