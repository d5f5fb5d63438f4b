"""Preemption with real signals to real processes: a last checkpoint, a clean exit, exact resume."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from _mp import open_file_gate, wait_for_file

import ckptmgr
from ckptmgr import CheckpointManager, ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "preemption.py"

# Each run of the example is a real process, forked by a zygote that imported torch and ckptmgr
# once (seconds per run saved). It gets its own stdout/stderr pipes (passed over a Unix socket), its
# own environment and argv, then runs the example as __main__ and exits like any interpreter
# (non-daemon threads joined, exit status from SystemExit). A gate can hold the first data file of
# the first save of a step above ``step_over``: the child creates ``held``, then waits for
# ``release`` (or forever, to be killed there), so "the signal arrives during that save" is a fact.
_ZYGOTE = r"""
import json, os, re, runpy, socket, sys, time
import argparse, logging
import torch, torch.distributed, torch.nn, torch.optim, ckptmgr
import torch._dynamo  # imported lazily by the first optimizer step: once here, not per run
from ckptmgr.storage.local import LocalStorage

def install_gates(gates):
    real = LocalStorage.open_writer
    def open_writer(self, path, *args, **kwargs):
        m = re.search(r"(\d+)", path.split("/")[0])
        step = int(m.group(1)) if m else -1
        for gate in gates:
            if not gate.get("fired") and step > gate["step_over"]:
                gate["fired"] = True
                open(gate["held"], "x").close()
                while gate.get("release") is None or not os.path.exists(gate["release"]):
                    time.sleep(0.01)
                break
        return real(self, path, *args, **kwargs)
    LocalStorage.open_writer = open_writer

sock = socket.socket(fileno=int(sys.argv[1]))
while True:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
    if not msg:
        break
    cmd = json.loads(msg)
    if cmd["op"] == "wait":
        _, status = os.waitpid(cmd["pid"], 0)
        sock.send(json.dumps(os.waitstatus_to_exitcode(status)).encode())
        continue
    pid = os.fork()
    if pid == 0:  # never returns to the loop: the example's exit ends this process
        sock.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(cmd["env"])
        sys.argv = cmd["argv"]
        install_gates(cmd["gates"])
        runpy.run_path(sys.argv[0], run_name="__main__")
        sys.exit(0)
    for fd in fds:
        os.close(fd)
    sock.send(str(pid).encode())
"""


class _Zygote:
    """The parent's end of the zygote: starts example runs, waits for them."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    def _ask(self, msg: dict[str, Any], fds: list[int] | None = None) -> Any:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], fds or [])
            reply = self.sock.recv(1 << 16)
        assert reply, f"the zygote died (exit {self.proc.poll()})"
        return json.loads(reply)

    def spawn(self, argv: list[str], env: dict[str, str],
              gates: list[dict[str, Any]]) -> _Run:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = self._ask({"op": "spawn", "argv": argv, "env": env, "gates": gates},
                            [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        return _Run(self, pid, open(out_r), open(err_r))

    def wait(self, pid: int) -> int:
        return int(self._ask({"op": "wait", "pid": pid}))

    def close(self) -> None:
        self.sock.close()  # EOF: the zygote's loop ends
        self.proc.wait(timeout=60)


class _Run:
    """One run of the example, like a ``Popen`` with text stdout/stderr pipes."""

    def __init__(self, zygote: _Zygote, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = stderr
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid)
        return self.returncode


@pytest.fixture(scope="module")
def zygote() -> Iterator[_Zygote]:
    z = _Zygote()
    yield z
    z.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "CKPTMGR_PATH")}
    env.update(extra)
    return env


def _start(zygote: _Zygote, root: str, *args: str, gates: list[dict[str, Any]] | None = None,
           **env: str) -> _Run:
    return zygote.spawn([str(EXAMPLE), "--ckpt", root, *args], _env(**env), gates or [])


def _read_until(proc: _Run, pattern: str, timeout: float = 120) -> list[str]:
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


def _finish(proc: _Run, timeout: float = 120) -> tuple[int, list[str], str]:
    # Read through the text wrappers: communicate() would read the raw pipes and lose whatever
    # _read_until's readline() already buffered (e.g. the last "step" line). stderr stays small.
    assert proc.stdout is not None and proc.stderr is not None
    out = proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=timeout)
    proc.stdout.close()
    proc.stderr.close()
    return proc.returncode, [x.strip() for x in out.splitlines()], err


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for line in lines
            if (m := re.fullmatch(r"step (\d+) loss (\S+)", line))}


def _newest(root: str) -> int | None:
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as mgr:
        return mgr.latest_step()


@pytest.fixture(scope="module")
def reference(zygote: _Zygote, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Losses of an uninterrupted 120-step run."""
    root = str(tmp_path_factory.mktemp("ref") / "ckpt")
    rc, lines, err = _finish(_start(zygote, root, "--steps", "120", "--step-time", "0"))
    assert rc == 0, err
    return _losses(lines)


def _resume_matches(zygote: _Zygote, root: str, reference: dict[int, str], preempted: int,
                    *extra: str) -> None:
    rc, lines, err = _finish(_start(zygote, root, "--steps", "120", "--step-time", "0", *extra))
    assert rc == 0, err
    assert f"resumed from step {preempted}" in lines
    resumed = _losses(lines)
    assert resumed == {s: reference[s] for s in range(preempted + 1, 120)}


@pytest.mark.slow
def test_sigterm_between_steps(zygote: _Zygote, local_root: str,
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
def test_sigterm_during_async_save_and_twice(zygote: _Zygote, local_root: str, tmp_path: Path,
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
def test_sigkill_after_grace_keeps_last_commit(zygote: _Zygote, local_root: str,
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
def test_exit_false_returns_and_reports(zygote: _Zygote, local_root: str) -> None:
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
def test_two_ranks_only_rank1_signalled(zygote: _Zygote, local_root: str,
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
