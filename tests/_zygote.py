"""Run Python programs as users run them, without paying interpreter and torch start-up each time.

A zygote process imports torch and ckptmgr once (seconds on a small machine), then forks one child
per run. Each child is a real process: its own pid (real signals reach it), its own stdout/stderr
pipes (passed to the zygote over a Unix socket), environment, working directory and argv; it runs a
script as ``__main__`` (``python script.py``) or a code string (``python -c``) and exits like any
interpreter (non-daemon threads joined, atexit run, the status from ``SystemExit``, a traceback
and status 1 for an uncaught exception). The zygote itself starts no threads, so forking is safe.

``preamble``: Python run in the child before the program, for test hooks (e.g. gates).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

# Program source defining ``arm(kill_at)`` (prepend it to a program): from the call on, the
# ``kill_at``-th file-system call that changes or syncs files (fsync, rename, replace, link, unlink,
# rmdir, mkdir, makedirs, ftruncate, rmtree) prints "gate <name>" and blocks for good, so the test
# can SIGKILL the process exactly there; ``arm`` returns a one-item list counting those calls.
FS_GATE = r"""
import os as _os, shutil as _shutil, threading as _threading, time as _time

def arm(kill_at):
    lock = _threading.Lock()
    count = [0]
    def gated(real, name):
        def call(*args, **kwargs):
            with lock:
                count[0] += 1
                hit = count[0] == kill_at
            if hit:
                print("gate", name, flush=True)
                while True:
                    _time.sleep(60)
            return real(*args, **kwargs)
        return call
    names = ("fsync", "rename", "replace", "link", "unlink", "rmdir", "mkdir", "makedirs",
             "ftruncate")
    for mod, name in [(_os, n) for n in names] + [(_shutil, "rmtree")]:
        setattr(mod, name, gated(getattr(mod, name), name))
    return count
"""

PRELOAD = ("torch", "torch.nn", "torch.optim", "torch.distributed",
           "torch.distributed.checkpoint", "torch._dynamo", "ckptmgr")

_SERVER = r"""
import importlib, json, os, runpy, socket, sys, types

for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except Exception as e:  # best effort: the child imports it again and reports the error
        print(f"zygote: preloading {name} failed: {e!r}", file=sys.stderr)

sock = socket.socket(fileno=int(sys.argv[1]))
while True:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    if not msg:
        break
    cmd = json.loads(msg)
    if cmd["op"] == "poll":
        pid, status = os.waitpid(cmd["pid"], os.WNOHANG)
        sock.send(json.dumps(os.waitstatus_to_exitcode(status) if pid else None).encode())
        continue
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # never returns to the loop: the program's exit ends this process
        sock.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(cmd["env"])
        if cmd["cwd"]:
            os.chdir(cmd["cwd"])
        if cmd["preamble"]:
            exec(compile(cmd["preamble"], "<preamble>", "exec"), {"__name__": "_preamble"})
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        if cmd["code"] is not None:
            sys.argv = ["-c", *cmd["argv"]]
            sys.path[0] = ""
            exec(compile(cmd["code"], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = cmd["argv"]
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            runpy.run_path(sys.argv[0], run_name="__main__")
        sys.exit(0)
    for fd in fds:
        os.close(fd)
    sock.send(str(pid).encode())
"""


class Zygote:
    """The test's end of a zygote (see the module docstring)."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(theirs.fileno()), json.dumps(list(preload))],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()

    def _ask(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> Any:
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(msg).encode()], list(fds))
            reply = self._sock.recv(1 << 16)
        assert reply, f"the zygote died (exit status {self.proc.poll()})"
        return json.loads(reply)

    def spawn(self, argv: Sequence[str] = (), *, code: str | None = None,
              env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
              preamble: str = "") -> Run:
        """Start ``python argv...`` (or ``python -c code argv...``); returns at once."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = self._ask({"op": "spawn", "argv": [str(a) for a in argv], "code": code,
                             "env": dict(os.environ if env is None else env),
                             "cwd": str(cwd) if cwd is not None else None,
                             "preamble": preamble}, [out_w, err_w])
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return Run(self, int(pid), open(out_r), open(err_r))

    def run(self, argv: Sequence[str] = (), *, timeout: float, **kwargs: Any
            ) -> subprocess.CompletedProcess[str]:
        """Like ``subprocess.run(..., capture_output=True, text=True)``."""
        proc = self.spawn(argv, **kwargs)
        out, err = proc.communicate(timeout)
        return subprocess.CompletedProcess(list(argv), proc.returncode or 0, out, err)

    def poll(self, pid: int) -> int | None:
        """The exit status of child ``pid`` (negative: killed by that signal), or None."""
        code = self._ask({"op": "poll", "pid": pid})
        return None if code is None else int(code)

    def close(self) -> None:
        """End the zygote (its children are not waited for)."""
        self._sock.close()  # EOF: the zygote's loop ends
        self.proc.wait(timeout=60)


class Run:
    """One child of a :class:`Zygote`, used like a ``Popen`` with text stdout/stderr pipes."""

    def __init__(self, zygote: Zygote, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = stderr
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status. Raises ``subprocess.TimeoutExpired`` (after killing the
        child) when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read stdout and stderr to the end (both at once: neither pipe can fill), then wait.
        Raises ``subprocess.TimeoutExpired`` (after killing the child) when ``timeout`` passes
        first."""
        assert self.stdout is not None and self.stderr is not None
        got: dict[int, str] = {}
        readers = [threading.Thread(target=lambda i=i, f=f: got.__setitem__(i, f.read()),
                                    daemon=True)
                   for i, f in enumerate((self.stdout, self.stderr))]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in readers):
            self.kill()
            for t in readers:
                t.join()
            self.wait()
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0)
        self.stdout.close()
        self.stderr.close()
        self.wait(timeout)
        return got[0], got[1]
