"""SIGKILL during saves never leaves a half-written step that restore would accept.

Where the kill lands is not left to timing: the writer stops itself at a chosen file-system call of
a save (fsync, rename, link, unlink, ...: the k-th one), says so, and waits there to be killed. The
test sweeps k over every such call of one save, so every phase boundary of the commit protocol,
retention's deletes included, gets a kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from ckptmgr import CheckpointManager

# A zygote imports torch and ckptmgr once, then forks one writer per kill. A writer commits one
# step, arms the gate (its ``kill_at``-th watched call prints "gate ..." and blocks), then saves
# on; with kill_at=0 it counts the watched calls of one save instead and exits.
_ZYGOTE = r"""
import os, shutil, sys, threading, time, torch, ckptmgr

WATCHED = [(os, n) for n in ("fsync", "rename", "replace", "link", "unlink", "rmdir", "mkdir",
                             "makedirs", "ftruncate")] + [(shutil, "rmtree")]

def expected(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "step": step,
            "b": torch.randn(64, 64, generator=g).bfloat16()}

def writer(root, kill_at):
    mgr = ckptmgr.CheckpointManager(root, save_interval=1, max_to_keep=3,
                                    chkpt_on_preemption=False)
    step = (mgr.latest_step() or 0) + 1
    for _ in range(max(1, 5 - step)):  # 4 steps at first: the armed save's retention deletes
        mgr.save(step, expected(step))
        print("step", step, flush=True)
        step += 1
    lock = threading.Lock()
    count = [0]
    def gated(real, name):
        def call(*args, **kwargs):
            with lock:
                count[0] += 1
                hit = count[0] == kill_at
            if hit:
                print("gate", name, flush=True)
                while True:
                    time.sleep(60)
            return real(*args, **kwargs)
        return call
    for mod, name in WATCHED:
        setattr(mod, name, gated(getattr(mod, name), name))
    if kill_at == 0:
        mgr.save(step, expected(step))
        print("calls", count[0], flush=True)
        return
    for step in range(step, step + 100):
        mgr.save(step, expected(step))
        print("step", step, flush=True)

for line in sys.stdin:
    root, kill_at = line.split()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            print("pid", os.getpid(), flush=True)
            writer(root, int(kill_at))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
"""


def expected(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "step": step,
            "b": torch.randn(64, 64, generator=g).bfloat16()}


def _writer(zygote: subprocess.Popen[str], root: str, kill_at: int) -> list[list[str]]:
    """Run one writer; SIGKILL it at its gate (unless counting). Its lines, the exit report last."""
    assert zygote.stdin is not None and zygote.stdout is not None
    zygote.stdin.write(f"{root} {kill_at}\n")
    zygote.stdin.flush()
    lines: list[list[str]] = []
    pid = 0
    while not lines or lines[-1][0] != "exit":
        line = zygote.stdout.readline().split()
        assert line, zygote.communicate()[1]
        lines.append(line)
        if line[0] == "pid":
            pid = int(line[1])
        elif line[0] == "gate":
            os.kill(pid, signal.SIGKILL)
    return lines


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
def test_repeated_sigkill_during_saves(local_root: str) -> None:
    with subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as zygote:
        try:
            counted = _writer(zygote, local_root, 0)
            assert counted[-1][2] == "0", counted
            (calls,) = [int(x[1]) for x in counted if x[0] == "calls"]
            assert calls >= 3, counted  # data, manifest, retention: at least one call each
            _check_every_step(local_root, counted)
            killed_at: list[str] = []
            for kill_at in range(1, calls + 1):
                lines = _writer(zygote, local_root, kill_at)
                gates = [x[1] for x in lines if x[0] == "gate"]
                assert len(gates) == 1, lines  # killed at the gate, not before or after
                assert lines[-1][2] == str(-signal.SIGKILL), lines
                killed_at.append(gates[0])
                _check_every_step(local_root, (kill_at, lines))
        finally:
            zygote.communicate(timeout=60)  # EOF on stdin ends the zygote
    assert len(killed_at) == calls
