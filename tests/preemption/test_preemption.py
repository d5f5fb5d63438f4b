"""Preemption with real signals to real processes: a last checkpoint, a clean exit, exact resume."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import Run, Zygote, open_file_gate, wait_for_file

import ckptmgr
from ckptmgr import CheckpointManager, ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "preemption.py"

# Each run of the example is a real process forked by a zygote (tests/_procs.py: torch and ckptmgr
# imported once). A gate can hold the first data file of the first save of a step above
# ``step_over``: the child creates ``held``, then waits for ``release`` (or forever, to be killed
# there), so "the signal arrives during that save" is a fact the test arranged, not a guess.
_GATES = r"""
import os, re, time
from ckptmgr.storage.local import LocalStorage

real = LocalStorage.open_writer

def open_writer(self, path, *args, **kwargs):
    m = re.search(r"(\d+)", path.split("/")[0])
    step = int(m.group(1)) if m else -1
    for gate in GATES:
        if not gate.get("fired") and step > gate["step_over"]:
            gate["fired"] = True
            open(gate["held"], "x").close()
            while gate.get("release") is None or not os.path.exists(gate["release"]):
                time.sleep(0.01)
            break
    return real(self, path, *args, **kwargs)

LocalStorage.open_writer = open_writer
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "CKPTMGR_PATH")}
    env.update(extra)
    return env


def _start(zygote: Zygote, root: str, *args: str, gates: list[dict[str, Any]] | None = None,
           **env: str) -> Run:
    return zygote.spawn([str(EXAMPLE), "--ckpt", root, *args], env=_env(**env),
                        preamble=f"GATES = {gates!r}\n{_GATES}" if gates else "")


def _read_until(proc: Run, pattern: str, timeout: float = 120) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"process ended before {pattern!r}: {lines[-5:]}\n{err}")
        lines.append(line.strip())
        if re.fullmatch(pattern, line.strip()):
            return lines
    raise AssertionError(f"timed out waiting for {pattern!r}")


def _finish(proc: Run, timeout: float = 120) -> tuple[int, list[str], str]:
    # Reads through the text wrappers: whatever _read_until's readline() already buffered (e.g.
    # the last "step" line) is kept.
    out, err = proc.communicate(timeout)
    assert proc.returncode is not None
    return proc.returncode, [x.strip() for x in out.splitlines()], err


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for line in lines
            if (m := re.fullmatch(r"step (\d+) loss (\S+)", line))}


def _newest(root: str) -> int | None:
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as mgr:
        return mgr.latest_step()


@pytest.fixture(scope="module")
def reference(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Losses of an uninterrupted 120-step run."""
    root = str(tmp_path_factory.mktemp("ref") / "ckpt")
    rc, lines, err = _finish(_start(zygote, root, "--steps", "120", "--step-time", "0"))
    assert rc == 0, err
    return _losses(lines)


def _resume_matches(zygote: Zygote, root: str, reference: dict[int, str], preempted: int,
                    *extra: str) -> None:
    rc, lines, err = _finish(_start(zygote, root, "--steps", "120", "--step-time", "0", *extra))
    assert rc == 0, err
    assert f"resumed from step {preempted}" in lines
    resumed = _losses(lines)
    assert resumed == {s: reference[s] for s in range(preempted + 1, 120)}


@pytest.mark.slow
def test_sigterm_between_steps(zygote: Zygote, local_root: str,
                               reference: dict[int, str]) -> None:
    proc = _start(zygote, local_root, "--steps", "120", "--save-interval", "1000",
                  "--step-time", "0.05")
    before = _read_until(proc, r"step 12 loss \S+")
    proc.send_signal(signal.SIGTERM)
    rc, lines, err = _finish(proc)
    assert rc == 128 + signal.SIGTERM, err
    last = max(_losses(before + lines))
    assert _newest(local_root) == last  # the step at which the signal was seen is the newest
    _resume_matches(zygote, local_root, reference, last)


@pytest.mark.slow
def test_sigterm_during_async_save_and_twice(zygote: Zygote, local_root: str, tmp_path: Path,
                                             reference: dict[int, str]) -> None:
    g = {name: str(tmp_path / name) for name in ("held20", "go20", "held", "go")}
    proc = _start(zygote, local_root, "--steps", "120", "--save-interval", "10",
                  "--step-time", "0", gates=[
                      # the async save of step 20 waits, in flight, for the first signal ...
                      {"step_over": 19, "held": g["held20"], "release": g["go20"]},
                      # ... and the preemption save (a later step) for the second
                      {"step_over": 20, "held": g["held"], "release": g["go"]}])
    before = _read_until(proc, r"step 21 loss \S+")
    wait_for_file(g["held20"])
    proc.send_signal(signal.SIGTERM)  # while the save of step 20 is in flight
    open_file_gate(g["go20"])
    wait_for_file(g["held"])
    proc.send_signal(signal.SIGTERM)  # a second signal during the preemption save
    open_file_gate(g["go"])
    rc, lines, err = _finish(proc)
    assert rc == 143, err
    last = max(_losses(before + lines))
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.latest_step() == last
        assert 20 in mgr.all_steps() or last == 20
    _resume_matches(zygote, local_root, reference, last)


@pytest.mark.slow
def test_sigkill_after_grace_keeps_last_commit(zygote: Zygote, local_root: str,
                                               tmp_path: Path) -> None:
    held = str(tmp_path / "held")
    # The first save after step 15 (the preemption save) stops at its first data file, for good.
    proc = _start(zygote, local_root, "--steps", "1000", "--save-interval", "5",
                  "--step-time", "0", gates=[{"step_over": 15, "held": held}])
    _read_until(proc, r"step 16 loss \S+")
    proc.send_signal(signal.SIGTERM)
    wait_for_file(held)  # the grace period ends while the preemption save still runs
    proc.kill()
    _finish(proc)
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        newest = mgr.latest_step()
        assert newest is not None and newest >= 10
        target: dict[str, Any] = {"extra": {"step": -1}}
        mgr.restore(newest, target, allow_partial=True)
        assert target["extra"]["step"] == newest


@pytest.mark.slow
def test_exit_false_returns_and_reports(zygote: Zygote, local_root: str) -> None:
    proc = _start(zygote, local_root, "--steps", "1000", "--save-interval", "1000",
                  "--step-time", "0.05", "--no-exit")
    _read_until(proc, r"step 5 loss \S+")
    proc.send_signal(signal.SIGTERM)
    rc, lines, err = _finish(proc)
    assert rc == 0, err
    (line,) = [x for x in lines if x.startswith("preempted at step")]
    step = int(line.split()[-1])
    assert _newest(local_root) == step


@pytest.mark.slow
def test_two_ranks_only_rank1_signalled(zygote: Zygote, local_root: str,
                                        tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'init'}"
    procs = [_start(zygote, local_root, "--steps", "1000", "--save-interval", "1000",
                    "--step-time", "0.05", "--dist-init", init, RANK=str(r), WORLD_SIZE="2")
             for r in range(2)]
    pid1 = int(_read_until(procs[1], r"pid 1 \d+")[-1].split()[-1])
    assert pid1 == procs[1].pid
    before = _read_until(procs[0], r"step 8 loss \S+")
    os.kill(pid1, signal.SIGTERM)  # only rank 1 is told
    results = [_finish(p) for p in procs]
    for rc, _, err in results:
        assert rc == 143, err
    last = max(_losses(before + results[0][1]))
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.latest_step() == last
        assert mgr.step_info(last).world_size == 2


def test_file_and_callable_sources(local_root: str, tmp_path: Path) -> None:
    flag = {"now": False}
    marker = tmp_path / "preempted"
    with CheckpointManager(local_root, save_interval=100, exit_on_preemption=False,
                           chkpt_on_preemption=False, preemption_check=lambda: flag["now"],
                           preemption_file=str(marker)) as mgr:
        assert mgr.save_async(3, {"w": torch.ones(1)}) is False
        flag["now"] = True
        assert mgr.save_async(4, {"w": torch.full((1,), 4.0)}) is True  # off-interval
        assert mgr.reached_preemption(4) and not mgr.reached_preemption(3)
        assert mgr.should_save(4)
        assert mgr.all_steps() == [4]
        flag["now"] = False
        marker.write_text("")
        assert mgr.save(7, {"w": torch.ones(1)}) is True
        assert mgr.all_steps() == [4, 7]


def test_handlers_chain_and_are_restored(local_root: str) -> None:
    seen: list[int] = []

    def previous(signum: int, frame: Any) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        mgr = CheckpointManager(local_root, save_interval=100, exit_on_preemption=False,
                                preemption_signals=("SIGUSR1",))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the handler installed before still runs
        assert mgr.save(1, {"w": torch.ones(1)}) is True  # step 1 is off-interval
        assert mgr.reached_preemption(1) and mgr.all_steps() == [1]
        assert mgr.save(2, {"w": torch.ones(1)}) is False  # handled once
        mgr.close()
        assert signal.getsignal(signal.SIGUSR1) is previous
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_off_main_thread_is_a_clear_error(local_root: str) -> None:
    errors: list[BaseException] = []

    def build() -> None:
        try:
            CheckpointManager(local_root, save_interval=1)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert "main thread" in str(errors[0])

    ok: list[object] = []
    t = threading.Thread(target=lambda: ok.append(
        CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False).close()))
    t.start()
    t.join()
    assert ok == [None]
    assert ckptmgr.CheckpointManager  # the public name stays


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return out


@pytest.mark.slow
def test_sigterm_to_trainer_and_writer_process(zygote: Zygote, local_root: str,
                                               reference: dict[int, str]) -> None:
    """async_mode="process": the signal reaches both processes (as SLURM's does); the writer
    ignores it, the trainer takes the last checkpoint, closes the writer and exits 143."""
    proc = _start(zygote, local_root, "--steps", "120", "--save-interval", "10",
                  "--step-time", "0.02", "--async-mode", "process")
    before = _read_until(proc, r"step 25 loss \S+")
    writers = _children(proc.pid)
    assert writers, "no writer process"
    for pid in [proc.pid, *writers]:
        os.kill(pid, signal.SIGTERM)
    rc, lines, err = _finish(proc)
    assert rc == 128 + signal.SIGTERM, err
    last = max(_losses(before + lines))
    assert _newest(local_root) == last
    assert not [p for p in writers if os.path.exists(f"/proc/{p}")]  # closed and reaped
    _resume_matches(zygote, local_root, reference, last)
