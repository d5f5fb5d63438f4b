"""Real processes for tests, in one module: functions on forked ranks (:func:`run_ranks`,
:func:`start_ranks`), a CheckpointManager served in another process (:class:`Holder`), and Python
programs run as users run them (:class:`Zygote`); file gates order them (:func:`wait_for_file`,
:func:`open_file_gate`), never sleeps.

Every process forks from a server that imported :data:`PRELOAD` (torch, ckptmgr) once per test
session, so it starts in tenths of a second instead of paying the 2-3 s of importing torch each
time (more under load). There are two such servers because there are two kinds of child:

- a *function* (ranks, holders) runs in a child of multiprocessing's fork server: the function and
  its arguments are pickled to it, results and errors come back on a queue, the child ends with
  ``os._exit`` once the function returned;
- a *program* (examples, doc blocks, trainers to kill) runs in a child of the zygote, which exits
  like an interpreter (non-daemon threads joined, atexit run, the status from ``SystemExit``, a
  traceback and status 1 for an uncaught exception), with its own stdout/stderr pipes, which
  multiprocessing's children do not offer.

Both servers start no threads and no process group, so forking them is safe. A child takes the
test's environment as it is when the child starts (not the server's, frozen at its start).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import IO, Any

import torch
import torch.distributed as dist

# What both servers import before they fork anything (ckptmgr.manager: what `import ckptmgr`
# defers, about 1 s per child otherwise; ckptmgr reads no environment variable at import).
PRELOAD = ("torch", "torch.nn", "torch.optim", "torch.distributed",
           "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch._dynamo", "ckptmgr", "ckptmgr.manager")

# How long a test waits for another process before it fails instead of hanging.
TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------ gates


def wait_for_file(path: str, timeout_s: float = 120.0) -> None:
    """Block until ``path`` exists: a gate between processes, opened by whichever process creates
    the file once it has reached the point the others must wait for.

    Raises:
        TimeoutError: no file after ``timeout_s`` (the other side failed; do not hang).
    """
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.005)


def open_file_gate(path: str) -> None:
    """Create ``path``, letting every :func:`wait_for_file` on it through."""
    with open(path, "x"):
        pass


# ------------------------------------------------------------- functions in forked processes


def context() -> Any:
    """The multiprocessing context of every function child: the fork server with PRELOAD."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _adopt_env(env: dict[str, str]) -> None:
    """(child) Take the test's environment: the fork server's is the session's at its start."""
    os.environ.clear()
    os.environ.update(env)


def _start(target: Callable[..., None], *args: Any, env: dict[str, str] | None = None,
           daemon: bool = False) -> Any:
    """A started function child of the fork server running ``target(*args, environment)``: the
    test's environment now, with ``env`` on top."""
    proc = context().Process(target=target, args=(*args, {**os.environ, **(env or {})}),
                             daemon=daemon)
    proc.start()
    return proc


def _reap(procs: Sequence[Any]) -> None:
    """Join each child for up to 10 s, then kill it: a test never leaves one behind."""
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def _answer(q: Any, timeout_s: float, who: str) -> Any:
    """The next answer on ``q``; AssertionError, not a hang, when none comes in time."""
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"{who} did not answer within {timeout_s} s") from None


_STORE: Any = None


def rank_store() -> Any:
    """(rank child of ``run_ranks(..., group=False)``) The TCPStore the parent owns, for a
    function that makes process groups of its own."""
    assert _STORE is not None, "rank_store() is for ranks started with group=False"
    return _STORE


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
               q: Any, timeout_s: float, group: bool, env: dict[str, str]) -> None:
    global _STORE
    _adopt_env(env)
    os.environ.setdefault("CKPTMGR_COLLECTIVE_TIMEOUT_S", str(timeout_s))
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        if group:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        else:
            _STORE = store
        try:
            result = fn(rank, world, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        q.put((rank, "ok", result))
    except BaseException as e:  # report everything, including SystemExit
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Ranks:
    """``world`` rank processes started by :func:`start_ranks`, for tests that kill one of them:
    the parent gathers the results of the others with :meth:`results` and :meth:`close` ends the
    rest."""

    def __init__(self, fn: Callable[..., Any], world: int, args: tuple[Any, ...],
                 timeout_s: float, group: bool = True) -> None:
        # The parent owns the store on an OS-chosen port (race-free): no port is guessed and no
        # init file can go stale.
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                                   timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.queue = context().Queue()
        self.procs = [_start(_rank_main, fn, r, world, self.store.port, args, self.queue,
                             timeout_s / 2, group)
                      for r in range(world)]

    def results(self, ranks: list[int]) -> dict[int, Any]:
        """The results of ``ranks`` (each must finish within the timeout and succeed).

        Raises:
            AssertionError: a rank failed (with its traceback) or did not answer in time.
        """
        out: dict[int, Any] = {}
        errors: list[str] = []
        for _ in ranks:
            rank, status, payload = _answer(self.queue, self.timeout_s, "a rank")
            if status == "ok":
                out[rank] = payload
            else:
                errors.append(f"rank {rank}: {payload}")
        assert not errors, "\n".join(errors)
        assert sorted(out) == sorted(ranks), out
        return out

    def close(self) -> None:
        _reap(self.procs)


def start_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0,
                group: bool = True) -> Ranks:
    """Start ``fn(rank, world, *args)`` on ``world`` processes and return at once (see
    :func:`run_ranks`)."""
    return Ranks(fn, world, args, timeout_s, group)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0,
              group: bool = True) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` forked processes; their results by rank.

    With ``group`` the ranks are joined by a gloo process group (the default one, timeout
    ``timeout_s / 2``); without, ``fn`` makes its own groups on :func:`rank_store`.

    Raises:
        AssertionError: a rank failed (with its traceback) or the run exceeded ``timeout_s``.
    """
    ranks = Ranks(fn, world, args, timeout_s, group)
    try:
        out = ranks.results(list(range(world)))
    finally:
        ranks.close()
        del ranks.store
    return [out[r] for r in range(world)]


# ------------------------------------------------------------ a manager in another process


def state(v: int) -> dict[str, Any]:
    """A small state whose every part says which version ``v`` it is."""
    return {"w": torch.full((64, 16), float(v)), "ramp": torch.arange(50) + v, "v": v}


def target() -> dict[str, Any]:
    return {"w": torch.zeros(64, 16), "ramp": torch.zeros(50, dtype=torch.int64), "v": -1}


def restored_version(mgr: Any, step: int) -> int:
    """Restore ``step`` with ``mgr``; the version it holds, checking every part agrees."""
    out = target()
    mgr.restore(step, out)
    v = out["v"]
    assert isinstance(v, int), out
    assert torch.equal(out["w"], torch.full((64, 16), float(v))), f"w mixed with version {v}"
    assert torch.equal(out["ramp"], torch.arange(50) + v), f"ramp mixed with version {v}"
    return v


def _gate_data_writes(gate_dir: str) -> None:
    """(holder child) Hold data-file writes at the file gate in ``gate_dir`` once it is armed.

    Patched where the durable tier opens its root (``ckptmgr.durable``), before the manager is
    built."""
    from ckptmgr import durable

    def gated(real_open: Callable[..., Any]) -> Callable[..., Any]:
        def open_storage(*args: Any, **kwargs: Any) -> Any:
            storage = real_open(*args, **kwargs)
            real_writer = storage.open_writer

            def open_writer(path: str, size_hint: int | None = None) -> Any:
                if (os.path.basename(path).startswith("data-")
                        and os.path.exists(os.path.join(gate_dir, "armed"))):
                    open(os.path.join(gate_dir, "arrived"), "w").close()
                    wait_for_file(os.path.join(gate_dir, "open"), TIMEOUT_S)
                return real_writer(path, size_hint)

            storage.open_writer = open_writer
            return storage

        return open_storage

    durable.open_storage = gated(durable.open_storage)


def _serve(root: str, kwargs: dict[str, Any], gate_dir: str | None, calls: Any, answers: Any,
           env: dict[str, str]) -> None:
    _adopt_env(env)
    from ckptmgr import CheckpointManager

    if gate_dir is not None:
        _gate_data_writes(gate_dir)

    try:
        mgr = CheckpointManager(root, **kwargs)
    except BaseException as e:  # reported to the test, which decides
        answers.put(("err", (type(e).__name__, str(e))))
        return
    answers.put(("ok", os.getpid()))
    while True:
        op, args, kw = calls.get(timeout=TIMEOUT_S)
        try:
            if op == "save":
                result: Any = mgr.save(args[0], state(args[1]), **kw)
            elif op == "save_async":
                result = mgr.save_async(args[0], state(args[1]), **kw)
            elif op == "restore_version":
                result = restored_version(mgr, args[0])
            elif op == "save_loop":  # save args[0] again and again until args[1] exists
                result = 0
                while not os.path.exists(args[1]):
                    result += 1
                    mgr.save(args[0], state(1 + result), force=True)
                    if result == 1:
                        open(args[1] + ".started", "w").close()
            elif op == "all_steps":
                result = mgr.all_steps()
            else:
                result = getattr(mgr, op)(*args, **kw)
            answers.put(("ok", result))
        except BaseException as e:
            answers.put(("err", (type(e).__name__, str(e))))
        if op == "close":
            return


class Holder:
    """A CheckpointManager living in another real process, driven by the test one call at a time.

    ``Holder(root, **kwargs)`` starts a process that builds ``CheckpointManager(root, **kwargs)``
    and then serves calls (``save``, ``save_async``, ``join``, ``restore_version``, ``close``)
    from a queue; each call blocks the test until the child answered, so the order of events
    between the two processes is the order of the test's lines, never a guess about timing.
    Errors come back as ``(type name, message)`` instead of being raised in the child.
    ``save_loop`` overwrites one step (versions 2, 3, ...) until a stop file appears, creating
    ``<stop file>.started`` after the first.

    ``env``: variables set in the child on top of the test's environment. ``gate_dir``: once the
    test creates ``<gate_dir>/armed``, every data-file write of the child waits at its open: the
    child creates ``<gate_dir>/arrived`` and waits for ``<gate_dir>/open``. So "the child's save
    is in flight, its commit still to come" is a fact the test arranged.

    Raises:
        AssertionError: the child did not answer within ``TIMEOUT_S``.
    """

    def __init__(self, root: str, *, env: dict[str, str] | None = None,
                 gate_dir: str | None = None, **kwargs: Any) -> None:
        ctx = context()
        self._calls = ctx.Queue()
        self._answers = ctx.Queue()
        kwargs.setdefault("save_interval", 1)
        self.proc = _start(_serve, root, kwargs, gate_dir, self._calls, self._answers, env=env,
                           daemon=True)
        self.status, self.value = self.answer()
        self._served = self.status == "ok"
        self.pid: int = self.proc.pid

    def send(self, op: str, *args: Any, **kw: Any) -> None:
        """Start ``mgr.<op>`` in the child without waiting; :meth:`answer` collects it."""
        self._calls.put((op, args, kw))
        self._served = self._served and op != "close"  # the child returns after close

    def answer(self) -> tuple[str, Any]:
        """The answer to the call sent last."""
        status, value = _answer(self._answers, TIMEOUT_S, "the holder process")
        return status, value

    def call(self, op: str, *args: Any, **kw: Any) -> tuple[str, Any]:
        """Run ``mgr.<op>`` in the child; ("ok", result) or ("err", (type name, message))."""
        self.send(op, *args, **kw)
        return self.answer()

    def ok(self, op: str, *args: Any, **kw: Any) -> Any:
        """:meth:`call`, asserting it succeeded; its result."""
        status, value = self.call(op, *args, **kw)
        assert status == "ok", f"{op}{args} failed in the child: {value}"
        return value

    def stop(self) -> None:
        """Close the child's manager if it is alive, and reap the process."""
        if self.proc.is_alive() and self._served:
            self.send("close")
            with contextlib.suppress(queue.Empty):  # then killed below
                self._answers.get(timeout=TIMEOUT_S)
        _reap([self.proc])



# ------------------------------------------------------------------- programs, from the zygote

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
