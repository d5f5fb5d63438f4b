"""Preemption sources fire once: a preemption file left in place, a check on its rising edge only,
and SIGINT as the preemption signal saves and exits 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointManager


def test_preemption_file_left_in_place_fires_once(local_root: str, tmp_path: Path) -> None:
    marker = tmp_path / "preempted"
    marker.write_text("")
    with CheckpointManager(local_root, save_interval=100, chkpt_on_preemption=False,
                           exit_on_preemption=False, preemption_file=str(marker)) as mgr:
        assert mgr.save(1, {"w": torch.ones(1)}) is True  # fires: off-interval step saved
        assert mgr.reached_preemption(1)
        for step in range(2, 6):  # the file is still there: no further forced saves
            assert mgr.save(step, {"w": torch.ones(1)}) is False
        assert mgr.all_steps() == [1]
        marker.unlink()
        assert mgr.save(6, {"w": torch.ones(1)}) is False  # read false: armed again
        marker.write_text("")
        assert mgr.save(7, {"w": torch.ones(1)}) is True
        assert mgr.all_steps() == [1, 7]


def test_preemption_check_fires_on_rising_edge_only(local_root: str) -> None:
    answers = iter([True, True, True, False, True, True])
    with CheckpointManager(local_root, save_interval=100, chkpt_on_preemption=False,
                           exit_on_preemption=False, preemption_check=lambda: next(answers)) as mgr:
        saved = [mgr.save(s, {"w": torch.ones(1)}) for s in range(1, 7)]
    assert saved == [True, False, False, False, True, False]


_SIGINT_SCRIPT = textwrap.dedent("""
    import sys, time, torch, ckptmgr
    mgr = ckptmgr.CheckpointManager(sys.argv[1], save_interval=1000,
                                    preemption_signals=("SIGINT", "SIGTERM"))
    w = torch.zeros(4)
    try:
        for step in range(100000):
            w += 1
            mgr.save(step, {"w": w})
            print("step", step, flush=True)
            time.sleep(0.02)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(3)
""")


def test_sigint_as_preemption_signal_saves_and_exits_130(local_root: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "CKPTMGR_PATH")}
    proc = subprocess.Popen([sys.executable, "-c", _SIGINT_SCRIPT, local_root],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    steps: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        steps.append(int(line.split()[1]))
        if steps[-1] >= 3:
            break
    proc.send_signal(signal.SIGINT)
    out = proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    proc.stdout.close()
    proc.stderr.close()
    assert "KeyboardInterrupt" not in out + err, err
    assert proc.returncode == 128 + signal.SIGINT, err
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        newest = mgr.latest_step()
        assert newest is not None and newest >= steps[-1]
        state = {"w": torch.zeros(4)}
        mgr.restore(newest, state)
        assert torch.equal(state["w"], torch.full((4,), float(newest + 1)))


def test_preemption_save_goes_durable_when_the_local_tier_cannot_hold_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A preemption checkpoint with a local tier goes to the durable root when the grace is too
    short, but only if the local tier holds it: when another run's local step holds the number
    (the local save is skipped) or the local save fails, it is saved durably whatever the grace,
    so a restart resumes from it (it was saved nowhere, and the run resumed from step 3)."""
    from ckptmgr import local_tier
    from ckptmgr.errors import SaveError

    node = tmp_path / "node"
    with CheckpointManager(str(tmp_path / "a"), local_path=str(node), local_interval=5,
                           save_interval=1000) as other:  # another run, same local_path
        other.save(10, {"w": torch.full((4,), -1.0)})
    for case in ("foreign step", "local save fails"):
        marker = tmp_path / f"preempt-{case}"
        root = tmp_path / f"b-{case}"
        step = 10 if case == "foreign step" else 15
        with CheckpointManager(str(root), local_path=str(node), local_interval=5,
                               save_interval=3, exit_on_preemption=False,
                               preemption_file=str(marker), preemption_grace_s=0.001) as mgr:
            assert mgr.save(3, {"w": torch.full((4,), 3.0)})
            marker.write_text("")
            if case == "local save fails":  # a fault a real disk gives only when full
                def fail(*args: object, **kwargs: object) -> None:
                    raise SaveError("local tier: No space left on device (injected)")
                monkeypatch.setattr(local_tier.LocalTier, "save", fail)
            assert mgr.save(step, {"w": torch.full((4,), float(step))}) is True
            monkeypatch.undo()
        with CheckpointManager(str(root), local_path=str(node), local_interval=5,
                               save_interval=3) as mgr:
            target = {"w": torch.zeros(4)}
            assert mgr.restore_latest(target) == step, case
            assert target["w"][0].item() == float(step)
