"""Simulated nodes on one machine, for node-loss tests and benchmarks (issue 29).

A :class:`Node` is a long-lived *agent* process that forks the node's ranks on request (like
tests/_procs.py's zygote). Agents are themselves forked from a node zygote that imported torch and
ckptmgr once per test session, so a node starts, and a rank starts, in tenths of a second.
Two variants, same interface:

- ``namespaced=True``: the agent runs as the init of its own namespaces (what ``unshare
  --user --map-root-user --pid --fork --mount-proc --uts --kill-child`` makes): its own
  user namespace (root mapped to us), PID namespace, UTS namespace (its own host name) and mount
  namespace with a private tmpfs mounted at :attr:`Node.disk`, its local disk. The network is
  *not* unshared: every rank joins the others over loopback. Every node may be given the same
  ``disk`` path; each sees only its own tmpfs there.
- ``namespaced=False``: the agent is a plain process leading its own process group; the disk is a
  host directory (give each node its own).

"Node loss" (:meth:`Node.lose`) is SIGKILL of every process of the node and its disk gone: the
namespace's init is killed (the kernel kills everything in its PID namespace, and the tmpfs dies
with the mount namespace); a plain node's process group is killed and its directory deleted.

A :class:`Job` runs one program (``tests/fixtures/node_train.py``) on a list of nodes,
``ranks_per_node`` ranks each, with a torchrun-like environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` = the node's index in the job,
``MASTER_ADDR``/``MASTER_PORT`` of a TCPStore the test owns, ``TORCHELASTIC_USE_AGENT_STORE``):
``init_process_group("gloo")`` works as under torchrun. Ranks talk to the test through files in
the job's directory (results, gates); every wait has a timeout, nothing sleeps for a guess.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

# What a node's agent imports before it forks ranks (s3fs: the durable tier of the tests), down to
# what ckptmgr and DTensor import lazily (torch._dynamo alone takes seconds under load): a rank of
# tests/fixtures/node_train.py imports nothing else.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.device_mesh",
           "torch.distributed.tensor", "torch._dynamo", "ckptmgr", "ckptmgr.config",
           "ckptmgr.local_tier", "ckptmgr.manager", "ckptmgr.replicas", "s3fs")

TRAIN = Path(__file__).resolve().parent / "fixtures" / "node_train.py"

# How long a test waits for a node or a rank before it fails instead of hanging.
TIMEOUT_S = 120.0

# The node zygote: imports the preload once, then starts each node's agent by forking. One JSON
# request per datagram on the socket from the test, with the new agent's end of its own socket
# pair attached; the answer is the pid of the forked child (the agent of a plain node; the outer
# process of a namespaced node, which waits for the namespace's init as `unshare --fork` does).
# When the test's end closes, the zygote exits (its agents live on until their own sockets
# close).
#
# The agent: init of the node (namespaced) or a process-group leader (plain). One JSON request
# per datagram on its socket from the test, one JSON answer each. It forks ranks and reaps them;
# when the test's end of the socket closes, it kills its ranks and exits (so a namespaced node,
# whose init it is, ends entirely).
_NAMESPACES = r"""
import ctypes, gc, importlib, json, os, runpy, shutil, signal, socket, sys, traceback, types

# <sched.h>, <sys/mount.h>, <sys/prctl.h>
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x4000000, 0x10000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
PR_SET_PDEATHSIG = 1
libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_namespaces(uid, gid):
    # What `unshare --user --map-root-user --pid --fork --mount-proc --uts` does before its fork
    # (the fork and the /proc mount follow in the caller): a forked child has one thread, as the
    # user namespace requires.
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWPID), "unshare")
    for name, line in (("uid_map", f"0 {uid} 1"), ("setgroups", "deny"),
                       ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(line)
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def become_init(cmd):
    # The namespace's init, as `unshare --kill-child --mount-proc` and the old `sh -c 'hostname
    # && mount -t tmpfs'` made it: killed with its parent, its own /proc, host name and tmpfs.
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
          "mount /proc")
    name = cmd["name"].encode()
    check(libc.sethostname(name, len(name)), "sethostname")
    check(libc.mount(b"none", cmd["disk"].encode(), b"tmpfs", 0,
                     f"size={cmd['tmpfs_size']}".encode()), f"mount tmpfs on {cmd['disk']}")
"""

_AGENT = _NAMESPACES + r"""
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except Exception as e:  # best effort: the rank imports it again and reports the error
        print(f"node zygote: preloading {name} failed: {e!r}", file=sys.stderr, flush=True)
# The preloaded objects out of the collector's reach: a collection in a fork would otherwise
# write to (and so copy) every page of them.
gc.freeze()


def serve(sock):
    children = set()
    while True:
        msg = sock.recv(1 << 20)
        if not msg:
            break
        cmd = json.loads(msg)
        op = cmd["op"]
        try:
            if op == "spawn":
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # never returns to the loop: the program's exit ends this process
                    sock.close()
                    fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    os.environ.clear()
                    os.environ.update(cmd["env"])
                    sys.argv = cmd["argv"]
                    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
                    sys.modules["__main__"] = types.ModuleType("__main__")
                    try:
                        runpy.run_path(sys.argv[0], run_name="__main__")
                    except SystemExit:
                        raise
                    except BaseException:  # as an interpreter would: a traceback and status 1
                        traceback.print_exc()
                        raise SystemExit(1) from None
                    # Up through agent() and the zygote's loop to the top of the script: the
                    # process ends as an interpreter ends (threads joined, atexit, teardown).
                    raise SystemExit(0)
                children.add(pid)
                answer = pid
            elif op == "poll":
                pid, status = os.waitpid(cmd["pid"], os.WNOHANG)
                answer = os.waitstatus_to_exitcode(status) if pid else None
                if pid:
                    children.discard(pid)
            elif op == "kill":
                os.kill(cmd["pid"], cmd["sig"])
                answer = True
            elif op == "info":
                answer = {"hostname": socket.gethostname(), "pid": os.getpid()}
            elif op == "copy":  # a directory as this node sees it (its disk) to or from the host
                shutil.copytree(cmd["src"], cmd["dst"], symlinks=True, dirs_exist_ok=True)
                answer = True
            elif op == "wipe":  # the node's disk emptied, the mount point kept
                for entry in os.listdir(cmd["path"]):
                    p = os.path.join(cmd["path"], entry)
                    if os.path.isdir(p) and not os.path.islink(p):
                        shutil.rmtree(p)
                    else:
                        os.unlink(p)
                answer = True
            else:
                raise ValueError(f"unknown op {op!r}")
            sock.send(json.dumps({"ok": answer}).encode())
        except Exception as e:
            sock.send(json.dumps({"err": f"{type(e).__name__}: {e}"}).encode())
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def setup_failed():
    # A node that cannot start: its log says why, the test sees its socket close.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def agent(cmd, sock):
    # (forked child of the zygote) Serves the node and never returns; a rank it forks leaves
    # with the SystemExit that ends its program.
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the agent reaps its ranks itself
        os.environ.clear()  # the test's environment when it started the node
        os.environ.update(cmd["env"])
        fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        if cmd["namespaced"]:
            enter_namespaces(cmd["uid"], cmd["gid"])
            init = os.fork()
        else:
            os.setsid()  # a process-group leader: node loss is a kill of its group
            init = 0
        if init == 0 and cmd["namespaced"]:
            become_init(cmd)
    except BaseException:
        setup_failed()
    if init == 0:
        serve(sock)
        os._exit(0)  # the agent runs no program of its own: nothing to finalize
    # The namespaced node's outer process, as `unshare --fork`: it waits for the init and
    # exits with its status. Only the init holds the socket: its death is the test's EOF.
    sock.close()
    status = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
    os._exit(status if status >= 0 else 128 - status)


def reap(*_):
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


signal.signal(signal.SIGCHLD, reap)
zsock = socket.socket(fileno=int(sys.argv[1]))
while True:
    msg, fds, _, _ = socket.recv_fds(zsock, 1 << 16, 1)
    if not msg:
        break
    cmd = json.loads(msg)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                zsock.close()
                agent(cmd, socket.socket(fileno=fds[0]))
            except SystemExit:  # a rank's program ended: the interpreter ends the process
                raise
            except BaseException:
                traceback.print_exc()
            os._exit(1)  # never back in the zygote's loop
        os.close(fds[0])
        zsock.send(json.dumps({"ok": pid}).encode())
    except Exception as e:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        zsock.send(json.dumps({"err": f"{type(e).__name__}: {e}"}).encode())
"""


# The check of :func:`namespace_problem`: the agent's own code enters the namespaces, in a small
# interpreter without the preload.
_NAMESPACES_CHECK = _NAMESPACES + r"""
disk = sys.argv[1]
enter_namespaces(os.getuid(), os.getgid())
init = os.fork()
if init == 0:
    try:
        become_init({"name": "ckptmgr-check", "disk": disk, "tmpfs_size": "1m"})
        open(os.path.join(disk, "x"), "w").close()
        print(socket.gethostname(), os.getpid(), flush=True)
        os._exit(0)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
os._exit(os.waitstatus_to_exitcode(os.waitpid(init, 0)[1]) & 0xFF)
"""


@cache
def namespace_problem() -> str | None:
    """Why nodes cannot run in their own namespaces here (None: they can). Checked once, with
    the agent's own code: user, PID, UTS and mount namespaces, a host name, /proc and a tmpfs."""
    with tempfile.TemporaryDirectory(prefix="ckptmgr-ns-check-") as d:
        try:
            out = subprocess.run([sys.executable, "-c", _NAMESPACES_CHECK, d],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"entering namespaces failed: {e}"
        if out.returncode != 0 or out.stdout.strip() != "ckptmgr-check 1":
            return (f"unshare(user, pid, uts, mount) with a host name, /proc and a tmpfs mount "
                    f"failed (status {out.returncode}): {out.stderr.strip()[-300:]}")
        if os.listdir(d):
            return "the tmpfs mounted in the namespace was visible outside it"
    return None


class _Zygote:
    """The test's end of a node zygote (see ``_AGENT``): an interpreter that imported the
    preload once and forks each node's agent, so a node starts in tenths of a second instead of
    the seconds of importing torch (more under load). One per environment and preload, for the
    whole test session (:func:`_zygote`).

    Args:
        env: variables on top of this process's environment while the zygote imports.
        preload: the modules it imports.
    """

    def __init__(self, env: dict[str, str], preload: Sequence[str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="ckptmgr-node-zygote-")
        self.log = os.path.join(self.dir, "zygote.log")
        script = os.path.join(self.dir, "node_agent.py")  # a file, not -c: readable in ps
        Path(script).write_text(_AGENT)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(self.log, "ab") as logf:
            # cwd: not the repository (the agents' sys.path starts with the script's folder,
            # never the repository's, whose ckptmgr would shadow a PYTHONPATH given to compare
            # other code).
            self.proc = subprocess.Popen(
                [sys.executable, script, str(theirs.fileno()), json.dumps(list(preload))],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                env={**os.environ, **env}, cwd=self.dir)
        theirs.close()
        self._sock = ours
        self._sock.settimeout(TIMEOUT_S)  # the first answer waits for the preload
        self._lock = threading.Lock()

    def start_agent(self, agent_end: socket.socket, request: dict[str, Any]) -> int:
        """Fork an agent serving ``agent_end`` (see ``_AGENT``'s ``agent``); the forked pid."""
        with self._lock:
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()],
                                [agent_end.fileno()])
                reply = self._sock.recv(1 << 16)
            except OSError as e:
                raise NodeError(f"the node zygote did not answer: {e}") from e
        if not reply:
            raise NodeError(f"the node zygote died (status {self.proc.poll()}): "
                            f"{_tail(self.log)}")
        out = json.loads(reply)
        if "err" in out:
            raise NodeError(f"the node zygote could not start node {request['name']}: "
                            f"{out['err']}")
        return int(out["ok"])

    def close(self) -> None:
        self._sock.close()  # end of file: the zygote exits (agents live until their sockets close)
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTES: dict[tuple[tuple[tuple[str, str], ...], str | None, tuple[str, ...]], _Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def _zygote(env: dict[str, str], preload: Sequence[str]) -> _Zygote:
    """The session's zygote for agents whose extra variables are ``env``, importing ``preload``.

    What it imports depends on ``env`` and ``PYTHONPATH``, not on the rest of this process's
    environment (which pytest changes at every test: ``PYTEST_CURRENT_TEST``); each agent takes
    the environment of its start from the request instead."""
    key = (tuple(sorted(env.items())), os.environ.get("PYTHONPATH"), tuple(preload))
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is None or zygote.proc.poll() is not None:
            if not _ZYGOTES:
                atexit.register(_close_zygotes)
            zygote = _ZYGOTES[key] = _Zygote(env, preload)
    return zygote


def _close_zygotes() -> None:
    with _ZYGOTES_LOCK:
        for zygote in _ZYGOTES.values():
            with contextlib.suppress(Exception):
                zygote.close()
        _ZYGOTES.clear()


class NodeError(AssertionError):
    """A node or a rank did not do what the test needed (with what it printed)."""


class Node:
    """One simulated node: an agent process (see the module docstring) and its local disk.

    Args:
        name: the node's host name (namespaced; a plain node shares the machine's).
        disk: the node's local disk as its ranks see it: the tmpfs mount point (namespaced; the
            directory must exist and may be shared by every node) or a host directory (plain;
            created).
        namespaced: run in its own namespaces (see :func:`namespace_problem`).
        env: variables of the agent (and so of what it imports, e.g. ``PYTHONPATH``) on top of
            this process's environment.
        tmpfs_size: size limit of a namespaced node's tmpfs.
        preload: modules imported (once, by the node zygote) before the agent forks ranks.
        wait: wait until the agent is ready (else call :meth:`ready`).
    """

    def __init__(self, name: str, disk: str, *, namespaced: bool,
                 env: dict[str, str] | None = None, tmpfs_size: str = "4g",
                 preload: Sequence[str] = PRELOAD, wait: bool = True) -> None:
        self.name = name
        self.disk = disk
        self.namespaced = namespaced
        self.lost = False
        # The agent's own output goes to a file beside the disk: read on failure.
        self.log = os.path.join(os.path.dirname(disk.rstrip("/")), f"node-{name}.log")
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        if namespaced:
            if not os.path.isdir(disk):
                raise NodeError(f"the mount point {disk} of node {name} does not exist")
        else:
            os.makedirs(disk, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # The forked child: the plain agent, or the namespaced node's outer process (as
            # `unshare --fork` was: it waits for the namespace's init, which it forked).
            self.pid = _zygote(env or {}, preload).start_agent(theirs, {
                "name": name, "disk": disk, "namespaced": namespaced, "tmpfs_size": tmpfs_size,
                "log": self.log, "uid": os.getuid(), "gid": os.getgid(),
                "env": {**os.environ, **(env or {})}})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._sock.settimeout(TIMEOUT_S)
        self.pids: list[int] = []  # ranks spawned (pids as the node sees them)
        self.host_pid = self.pid  # the plain agent / the namespaced node's init, below
        self.hostname = ""
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until the agent answers (its namespaces, host name and disk are set up)."""
        if self.hostname:
            return
        try:
            info = self._ask({"op": "info"})
            if self.namespaced:
                self.host_pid = _init_of(self.pid)
                if info["pid"] != 1:
                    raise NodeError(f"node {self.name}: the agent is not the namespace's init: "
                                    f"{info}")
        except BaseException:
            self._kill()
            raise
        self.hostname = info["hostname"]

    def _ask(self, msg: dict[str, Any]) -> Any:
        if self.lost:
            raise NodeError(f"node {self.name} was lost")
        try:
            self._sock.send(json.dumps(msg).encode())
            reply = self._sock.recv(1 << 16)
        except OSError as e:  # socket.timeout included
            raise NodeError(f"node {self.name} did not answer {msg['op']}: {e}") from e
        if not reply:
            raise NodeError(f"node {self.name}'s agent died: {_tail(self.log)}")
        out = json.loads(reply)
        if "err" in out:
            raise NodeError(f"node {self.name}: {msg['op']} failed: {out['err']}")
        return out["ok"]

    def spawn(self, argv: Sequence[str], env: dict[str, str], log: str) -> int:
        """Start ``python argv...`` on this node (environment ``env`` exactly, stdout and stderr
        appended to ``log``); its pid as the node sees it."""
        pid = int(self._ask({"op": "spawn", "argv": [str(a) for a in argv], "env": env,
                             "log": log}))
        self.pids.append(pid)
        return pid

    def poll(self, pid: int) -> int | None:
        """Exit status of ``pid`` (negative: killed by that signal), or None while it runs."""
        code = self._ask({"op": "poll", "pid": pid})
        return None if code is None else int(code)

    def signal(self, pid: int, sig: int) -> None:
        """Send ``sig`` to the node's process ``pid`` (gone already: nothing)."""
        with contextlib.suppress(NodeError):
            self._ask({"op": "kill", "pid": pid, "sig": int(sig)})

    def copy_from_disk(self, sub: str, dst: str) -> None:
        """Copy ``<disk>/<sub>`` as this node sees it to the host directory ``dst``."""
        self._ask({"op": "copy", "src": os.path.join(self.disk, sub), "dst": dst})

    def copy_to_disk(self, src: str, sub: str = "") -> None:
        """Copy the host directory ``src`` into ``<disk>/<sub>`` as this node sees it."""
        self._ask({"op": "copy", "src": src, "dst": os.path.join(self.disk, sub)})

    def wipe_disk(self) -> None:
        """Empty this node's disk (its processes keep running)."""
        self._ask({"op": "wipe", "path": self.disk})

    def lose(self) -> None:
        """Node loss: SIGKILL of every process of this node, then its disk is gone."""
        if self.lost:
            return
        self._kill()
        if not self.namespaced:
            shutil.rmtree(self.disk, ignore_errors=True)
        self.lost = True

    def _kill(self) -> None:
        if self.namespaced:
            # Killing the PID namespace's init makes the kernel kill every process in it; the
            # outer process (waiting for it) exits once the namespace is empty, and the tmpfs
            # goes with the last process of the mount namespace, the outer one.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.host_pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        try:
            _wait_gone([self.pid])
        finally:
            self._sock.close()
        if not self.namespaced:  # its ranks were children of the agent: wait until they are gone
            _wait_gone(self.pids)

    def close(self) -> None:
        """End the node as a whole (its processes killed; a namespaced node's tmpfs goes)."""
        if self.lost:
            return
        self._kill()
        self.lost = True


def _tail(path: str, n: int = 3000) -> str:
    try:
        return Path(path).read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def _init_of(unshare_pid: int) -> int:
    """The host pid of the namespace's init: the child ``unshare --fork`` started."""
    path = f"/proc/{unshare_pid}/task/{unshare_pid}/children"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            kids = Path(path).read_text().split()
            if kids:
                return int(kids[0])
        time.sleep(0.01)
    raise NodeError(f"no init process under unshare (pid {unshare_pid})")


def _wait_gone(pids: Sequence[int]) -> None:
    """Wait until each of ``pids`` has exited (a zombie counts as exited)."""
    deadline = time.monotonic() + TIMEOUT_S
    for pid in pids:
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                break
            if state in ("Z", "X"):
                break
            if time.monotonic() > deadline:
                raise NodeError(f"process {pid} still runs after SIGKILL")
            time.sleep(0.01)


class Nodes:
    """The simulated nodes of one test: ``Nodes(base, namespaced)``; :meth:`add` starts one,
    :meth:`close` ends every node still up (call it in a ``finally`` or a fixture)."""

    def __init__(self, base: str, namespaced: bool, env: dict[str, str] | None = None) -> None:
        self.base = base
        self.namespaced = namespaced
        self.env = env
        self.all: list[Node] = []
        if namespaced:  # one mount point for every node: each sees only its own tmpfs there
            os.makedirs(os.path.join(base, "disk"), exist_ok=True)

    def disk_of(self, name: str) -> str:
        """The local disk a node named ``name`` gets (the same path for every namespaced node)."""
        return os.path.join(self.base, "disk" if self.namespaced else f"disk-{name}")

    def add(self, name: str, wait: bool = True) -> Node:
        """Start the node ``name`` (a replacement of a lost node keeps its name, not its disk:
        a plain node's directory was deleted by :meth:`Node.lose`)."""
        node = Node(name, self.disk_of(name), namespaced=self.namespaced, env=self.env,
                    wait=wait)
        self.all.append(node)
        return node

    def start(self, names: Sequence[str]) -> list[Node]:
        """Start several nodes at once (their agents import in parallel)."""
        nodes = [self.add(n, wait=False) for n in names]
        for node in nodes:
            node.ready()
        return nodes

    def close(self) -> None:
        errors = []
        for node in self.all:
            try:
                node.close()
            except Exception as e:  # end the others anyway
                errors.append(f"{node.name}: {e}")
        if errors:
            raise NodeError("; ".join(errors))


class Job:
    """One run of a program on ``nodes`` (``ranks_per_node`` ranks each), as torchrun would start
    it: rank ``r`` on node ``r // ranks_per_node``. The program gets ``argv`` and the torchrun
    variables; ``dir`` (a fresh directory) is where its ranks write results and the test its
    gates: :meth:`gate_path` names a file in it.

    ``group_rank=False`` leaves ``GROUP_RANK`` unset, so a rank's node is known by host name only
    (namespaced nodes).
    """

    def __init__(self, nodes: Sequence[Node], argv: Sequence[str], dir: str, *,
                 ranks_per_node: int = 1, env: dict[str, str] | None = None,
                 group_rank: bool = True, timeout_s: float = TIMEOUT_S) -> None:
        import torch.distributed as dist

        self.nodes = list(nodes)
        self.dir = dir
        os.makedirs(dir, exist_ok=True)
        self.world = len(self.nodes) * ranks_per_node
        self.timeout_s = timeout_s
        # The test owns the store on an OS-chosen port (race-free); every rank is its client, as
        # under torchrun (TORCHELASTIC_USE_AGENT_STORE).
        self.store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True,
                                   timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.ranks: list[tuple[Node, int]] = []
        for r in range(self.world):
            node_index = r // ranks_per_node
            node = self.nodes[node_index]
            renv = {**os.environ, **(env or {}),
                    "RANK": str(r), "WORLD_SIZE": str(self.world),
                    "LOCAL_RANK": str(r % ranks_per_node),
                    "LOCAL_WORLD_SIZE": str(ranks_per_node),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "GLOO_SOCKET_IFNAME": "lo",  # a node's host name resolves to nothing
                    "NODE_JOB_DIR": dir, "NODE_DISK": node.disk}
            if group_rank:
                renv["GROUP_RANK"] = str(node_index)
            else:
                renv.pop("GROUP_RANK", None)
            pid = node.spawn([str(a) for a in argv], renv, os.path.join(dir, f"rank-{r}.log"))
            self.ranks.append((node, pid))

    def gate_path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def log(self, rank: int) -> str:
        return _tail(os.path.join(self.dir, f"rank-{rank}.log"), 6000)

    def wait(self, ranks: Sequence[int] | None = None) -> None:
        """Wait until ``ranks`` (default all) exited with status 0.

        Raises:
            NodeError: one failed or is still running after the timeout (with the logs).
        """
        todo = list(range(self.world) if ranks is None else ranks)
        deadline = time.monotonic() + self.timeout_s
        failed: dict[int, int] = {}
        while todo:
            for r in list(todo):
                node, pid = self.ranks[r]
                code = node.poll(pid)
                if code is not None:
                    todo.remove(r)
                    if code != 0:
                        failed[r] = code
            if failed:
                break
            if todo and time.monotonic() > deadline:
                self.kill()
                raise NodeError(f"ranks {todo} still ran after {self.timeout_s} s:\n"
                                + self._logs(todo))
            time.sleep(0.02)
        if failed:
            self.kill()
            raise NodeError(f"ranks failed (status {failed}):\n" + self._logs(sorted(failed)))

    def _logs(self, ranks: Sequence[int]) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.log(r)}" for r in ranks)

    def wait_for(self, name: str, ranks: Sequence[int] | None = None) -> None:
        """Wait until every rank of ``ranks`` (default all) created the gate file
        ``<name>-<rank>`` (a rank that exits early fails this at once, with its log)."""
        todo = list(range(self.world) if ranks is None else ranks)
        deadline = time.monotonic() + self.timeout_s
        while todo:
            for r in list(todo):
                if os.path.exists(self.gate_path(f"{name}-{r}")):
                    todo.remove(r)
                    continue
                node, pid = self.ranks[r]
                if not node.lost:
                    code = node.poll(pid)
                    if code is not None:
                        self.kill()
                        raise NodeError(f"rank {r} exited ({code}) before {name}:\n"
                                        + self._logs([r]))
            if todo and time.monotonic() > deadline:
                self.kill()
                raise NodeError(f"ranks {todo} did not reach {name} within {self.timeout_s} s:\n"
                                + self._logs(todo))
            if todo:
                time.sleep(0.02)

    def open_gate(self, name: str) -> None:
        """Create the gate file ``name`` that the ranks wait for."""
        with open(self.gate_path(name), "x"):
            pass

    def results(self, ranks: Sequence[int] | None = None) -> dict[int, Any]:
        """What each rank wrote to ``result-<rank>.json``."""
        out = {}
        for r in range(self.world) if ranks is None else ranks:
            with open(self.gate_path(f"result-{r}.json")) as f:
                out[r] = json.load(f)
        return out

    def kill(self) -> None:
        """SIGKILL every rank still running on a node that is up (a launcher tearing the job
        down after a failure), and reap them."""
        for node, pid in self.ranks:
            if not node.lost:
                node.signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + self.timeout_s
        for node, pid in self.ranks:
            while not node.lost:
                try:
                    if node.poll(pid) is not None:
                        break
                except NodeError:
                    break
                if time.monotonic() > deadline:
                    raise NodeError(f"rank pid {pid} on {node.name} outlived SIGKILL")
                time.sleep(0.01)

    def close(self) -> None:
        """End the job (ranks still running are killed) and its store."""
        try:
            self.kill()
        finally:
            del self.store
