"""SIGKILL during saves never leaves a half-written step that restore would accept.

Where the kill lands is not left to timing: the writer stops itself at a chosen file-system call of
a save (fsync, rename, link, unlink, ...: the k-th one), says so, and waits there to be killed. The
test sweeps k over every such call of one save, so every phase boundary of the commit protocol,
retention's deletes included, gets a kill.
"""

from __future__ import annotations

import signal

import pytest
import torch
from _procs import FS_GATE, Zygote

from ckptmgr import CheckpointManager

# A writer (forked from the session zygote) commits a step (four at first, so that retention
# deletes), arms the gate (see FS_GATE) and saves on; with kill_at=0 it counts the calls of one
# save instead and exits.
_WRITER = FS_GATE + r"""
import sys, torch, ckptmgr

def expected(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "step": step,
            "b": torch.randn(64, 64, generator=g).bfloat16()}

root, kill_at = sys.argv[1], int(sys.argv[2])
mgr = ckptmgr.CheckpointManager(root, save_interval=1, max_to_keep=3, chkpt_on_preemption=False)
step = (mgr.latest_step() or 0) + 1
for _ in range(max(1, 5 - step)):
    mgr.save(step, expected(step))
    print("step", step, flush=True)
    step += 1
count = arm(kill_at)
if kill_at == 0:
    mgr.save(step, expected(step))
    print("calls", count[0], flush=True)
    sys.exit(0)
for step in range(step, step + 100):
    mgr.save(step, expected(step))
    print("step", step, flush=True)
"""


def expected(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "step": step,
            "b": torch.randn(64, 64, generator=g).bfloat16()}


def _writer(zygote: Zygote, root: str, kill_at: int) -> tuple[list[list[str]], int]:
    """Run one writer; SIGKILL it at its gate (unless counting). Its lines and exit status."""
    run = zygote.spawn([root, str(kill_at)], code=_WRITER)
    assert run.stdout is not None
    lines: list[list[str]] = []
    while line := run.stdout.readline():
        lines.append(line.split())
        if lines[-1][0] == "gate":
            run.kill()
            break
    out, err = run.communicate(120)
    lines += [x.split() for x in out.splitlines()]
    assert run.returncode is not None
    assert run.returncode in (0, -signal.SIGKILL), (run.returncode, lines, err)
    return lines, run.returncode


def _check_every_step(root: str, context: object) -> list[int]:
    with CheckpointManager(root, save_interval=1, max_to_keep=3,
                           chkpt_on_preemption=False) as mgr:
        steps = mgr.all_steps()
        assert steps, context
        for step in steps:
            target = {"w": torch.zeros(256, 256), "step": -1,
                      "b": torch.zeros(64, 64, dtype=torch.bfloat16)}
            mgr.restore(step, target)
            exp = expected(step)
            assert target["step"] == step, context
            assert torch.equal(target["w"], exp["w"]), context  # type: ignore[arg-type]
            assert torch.equal(target["b"], exp["b"]), context  # type: ignore[arg-type]
    return steps


@pytest.mark.slow
def test_repeated_sigkill_during_saves(local_root: str, zygote: Zygote) -> None:
    counted, code = _writer(zygote, local_root, 0)
    assert code == 0, counted
    (calls,) = [int(x[1]) for x in counted if x[0] == "calls"]
    assert calls >= 3, counted  # data, manifest, retention: at least one call each
    _check_every_step(local_root, counted)
    killed_at: list[str] = []
    for kill_at in range(1, calls + 1):
        lines, code = _writer(zygote, local_root, kill_at)
        gates = [x[1] for x in lines if x[0] == "gate"]
        assert len(gates) == 1 and code == -signal.SIGKILL, lines  # killed at the gate
        killed_at.append(gates[0])
        _check_every_step(local_root, (kill_at, lines))
    assert len(killed_at) == calls
