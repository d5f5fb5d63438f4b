"""The writer process (``async_mode="process"``): each rank's background saves run in a process of
their own, so a save never competes with training for the GIL.

Training process (one :class:`WriterProcess` per manager; every method on the caller's thread
except :meth:`WriterProcess.save`, which the background save thread calls):

1) :meth:`WriterProcess.ensure` (collective over the caller's group, at each due save): when any
   rank's writer is absent or dead, every rank stops its own and starts a new one. The first start
   makes the rendezvous: the coordinator's training process hosts a TCP store the writers of all
   ranks meet on to form their own gloo group (a new prefix per generation).
2) ``save_async`` stages into shared-memory arenas (:mod:`ckptmgr._shm`) and encodes Python values
   (:func:`~ckptmgr.dcp.writer.encode_object`), then :func:`wire_items` describes the staged state
   by reference: no tensor byte is pickled.
3) :meth:`WriterProcess.save` (background save thread) sends new arenas' descriptors and the job,
   and waits for the reply: the :class:`~ckptmgr.durable.DurableOutcome`, or the error to raise.
4) :meth:`WriterProcess.close`: the writer exits; a writer that does not is killed.

Writer process (:func:`main`, a fresh interpreter started with ``python -c``, so the training
script is never imported in it, safe under torchrun): ignores SIGINT/SIGTERM and the preemption
signals (the training process decides, then closes it); exits at once when the training process is
gone (a lifeline pipe's EOF or a new parent pid), so nothing is written after the parent died, and
nothing half-written becomes visible (the commit protocol). It builds the root's
:class:`~ckptmgr.durable.DurableTier` with the recipe the manager uses
(:meth:`~ckptmgr.durable.DurableTier.from_config`, from the same configuration) and saves through
it (the same code thread mode runs): it writes, checksums, commits, fenced by the training
process's writer lease (read from storage, never renewed here) and by the parent being alive, and
applies retention. It never unpickles a user object: values arrive encoded.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from ckptmgr._async import Stager
from ckptmgr._dist import Comm, portable
from ckptmgr._shm import ArenaSet, ShmTensor, attach, view
from ckptmgr.config import ManagerConfig
from ckptmgr.dcp.shards import StagedDTensor
from ckptmgr.dcp.writer import EncodedValue, encode_object
from ckptmgr.durable import DurableOutcome, DurableTier, View
from ckptmgr.errors import CkptmgrError, ConfigError, LeaseError, SaveError
from ckptmgr.lease import Lease, LeaseInfo
from ckptmgr.step_store import CommitPlan
from ckptmgr.storage import ClientConfig, apply_client_config, client_config, split_scheme

__all__ = ["DurableJob", "WriterProcess", "main", "stop_if_stuck", "wire_items"]

log = logging.getLogger("ckptmgr")

_ORPHANED = 70  # exit status of a writer whose training process is gone
_CLOSE_WAIT_S = 60.0  # a writer still busy after close() is asked this long, then killed


@dataclass(frozen=True)
class _WireDTensor:
    """A staged DTensor by reference: its host copy's place in an arena and its layout (the mesh
    stays behind: it names the training process's groups)."""

    ref: ShmTensor
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Any, ...]
    properties: Any
    placements: tuple[Any, ...]
    replica_id: int


@dataclass(frozen=True)
class DurableJob:
    """One durable save for the writer process: the coordinator's plan, the state by reference
    (:func:`wire_items`), and the root's view as the training process knows it."""

    plan: CommitPlan
    trusted: bool
    items: dict[str, Any]
    view: View


@dataclass(frozen=True)
class _Spec:
    cfg: ManagerConfig
    rank: int
    world_size: int
    rendezvous: tuple[str, int] | None
    generation: int
    lease: LeaseInfo | None
    timeout_s: float
    log_level: int
    fsspec_conf: ClientConfig  # how the trainer opens the root (fsspec config, scheme class)


def wire_items(staged: dict[str, Any], stager: Stager, *, trusted: bool) -> dict[str, Any]:
    """(caller's thread) The staged state by reference: tensors as their place in an arena,
    DTensors with their layout, Python values encoded.

    Raises:
        ConfigError: a Python value larger than a stored value may be.
        UnsafeCheckpointError: a value that needs pickle and not ``trusted``.
    """
    arenas = stager.arenas
    assert arenas is not None, "the stager of a writer process stages into shared memory"
    out: dict[str, Any] = {}
    for key, value in staged.items():
        if isinstance(value, StagedDTensor):
            out[key] = _WireDTensor(arenas.locate(value.data), tuple(value.global_shape),
                                    value.dtype, value.chunks, value.properties,
                                    value.placements, value.replica_id)
        elif isinstance(value, torch.Tensor):
            out[key] = arenas.locate(value)
        else:
            data, encoding = encode_object(key, value, trusted=trusted)
            out[key] = EncodedValue(data, encoding)
    return out


_UNREADABLE = ("storage.options (and fsspec's configuration) must hold values a fresh interpreter "
               "can import, nothing defined in the training script; use async_mode='thread' "
               "otherwise")


class _SpecPickler(pickle.Pickler):
    """Refuses what the writer process could not load: objects of the training script."""

    def reducer_override(self, obj: Any) -> Any:
        cls = obj if isinstance(obj, type) else type(obj)
        if getattr(cls, "__module__", None) == "__main__" or (
                callable(obj) and getattr(obj, "__module__", None) == "__main__"):
            raise ConfigError(f"the writer process cannot load {cls.__qualname__}, defined in "
                              f"__main__: {_UNREADABLE}")
        return NotImplemented


def _dump_spec(spec: _Spec) -> bytes:
    """(training process) The writer's configuration, pickled, or ConfigError saying why not."""
    buf = io.BytesIO()
    try:
        _SpecPickler(buf, pickle.HIGHEST_PROTOCOL).dump(("init", spec))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"the configuration cannot be sent to the writer process "
                          f"({type(e).__name__}: {e}): {_UNREADABLE}") from e
    return buf.getvalue()


def _died_message(rank: int, code: int | None, why: str | None) -> str:
    if why is not None:
        return why
    if code is None:
        return f"the writer process of rank {rank} closed its connection"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"the writer process of rank {rank} was killed by {name}{hint}"
    return f"the writer process of rank {rank} exited with status {code}"


class WriterProcess:
    """This rank's writer process, seen from the training process.

    Args:
        cfg: the manager's configuration (sent to the writer).
        arenas: the staging arenas the writer maps.
    """

    def __init__(self, cfg: ManagerConfig, arenas: ArenaSet) -> None:
        if split_scheme(cfg.path)[0] == "memory":
            raise ConfigError("async_mode='process' cannot write a memory:// root: that file "
                              "system lives in one process, and the writer process would write "
                              "into its own; use async_mode='thread' (the default) with memory://")
        self._cfg = cfg
        self._arenas = arenas
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lifeline: int | None = None
        self._ready = False
        self._generation = 0
        self._store: Any = None  # the coordinator's rendezvous TCP store (kept while open)
        self._rendezvous: tuple[str, int] | None = None
        # Why each stopped generation was stopped. The save thread may learn of its writer's death
        # after the caller's thread has started the next generation: it records into its own.
        self._why: dict[int, str] = {}
        self._busy: Connection | None = None  # the connection a save thread is using now
        # The caller's thread (ensure -> kill, _start) against the save thread (save).
        self._lock = threading.Lock()
        self._rank = 0

    @property
    def pid(self) -> int | None:
        """The writer process's pid while it runs."""
        return self._proc.pid if self.alive and self._proc is not None else None

    @property
    def alive(self) -> bool:
        return (self._proc is not None and self._proc.poll() is None
                and self._generation not in self._why)

    def ensure(self, comm: Comm, lease: Lease | None) -> bool:
        """(collective over ``comm``) Start every rank's writer when any rank's is absent or
        dead (stopping the others first: their group lost a member). True when started."""
        ok = self.alive
        if comm.world_size > 1:
            ok = all(comm.all_gather(ok))
        if ok:
            return False
        if self._proc is not None:
            mine = self.alive
            log.warning("rank %d: %s; starting new writer processes", comm.rank,
                        "another rank's writer process died" if mine
                        else "this rank's writer process died")
            self.kill("the writer process of another rank died, so this rank's was stopped"
                      if mine else _died_message(comm.rank, self._proc.poll(), None))
        self._start(comm, lease)
        return True

    def _start(self, comm: Comm, lease: Lease | None) -> None:
        generation = self._generation + 1
        self._rank = comm.rank
        if comm.world_size > 1 and self._rendezvous is None:
            hosts = comm.all_gather(socket.gethostname())
            addr = None
            if comm.is_coordinator:
                host = os.environ.get("MASTER_ADDR") or (
                    "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostname())
                self._store = TCPStore(host, 0, None, True,
                                            timedelta(seconds=comm.arrivals.timeout_s),
                                            wait_for_workers=False)
                addr = (host, int(self._store.port))
            self._rendezvous = comm.broadcast(addr)
        info = lease.info if lease is not None else None
        spec = _dump_spec(_Spec(self._cfg, comm.rank, comm.world_size, self._rendezvous,
                                generation, info, comm.arrivals.timeout_s,
                                log.getEffectiveLevel(), client_config(self._cfg.path)))
        parent, child = socket.socketpair()
        life_r, life_w = os.pipe()
        env = dict(os.environ)
        # The writer imports what this process would, from where it would (this ckptmgr first;
        # the working directory only if it is on this process's path: -P).
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, *(p or os.getcwd() for p in sys.path)])
        env["CUDA_VISIBLE_DEVICES"] = ""  # the writer never touches a device
        try:
            proc = subprocess.Popen(
                [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c",
                 "from ckptmgr.writer_process import main; main()",
                 str(child.fileno()), str(life_r)],
                pass_fds=(child.fileno(), life_r), env=env, stdin=subprocess.DEVNULL)
        finally:
            child.close()
            os.close(life_r)
        with self._lock:  # from here on, a save thread still on the old generation sees it ended
            self._generation = generation
            self._proc = proc
            self._conn = Connection(parent.detach())
            self._lifeline = life_w
            self._ready = False
            self._arenas.forget_sent()
        self._conn.send_bytes(spec)  # ("init", _Spec), pickled above

    def save(self, job: DurableJob, retired: list[int]) -> DurableOutcome:
        """(background save thread) Run ``job`` in the writer process and return its outcome.

        Raises:
            SaveError: the writer process died or was stopped (the step was not reported
                committed); or the error the save raised there.
        """
        with self._lock:
            generation, proc, conn = self._generation, self._proc, self._conn
            self._busy = conn
        if proc is None or conn is None:
            raise SaveError(f"no writer process on rank {self._rank}", step=job.plan.step)
        try:
            if not self._ready:
                kind, payload = conn.recv()
                if kind != "ready":
                    raise payload
                with self._lock:
                    self._ready = self._ready or generation == self._generation
            if retired:
                conn.send(("retire", retired))
            with self._lock:  # arenas are marked sent for this generation only
                if generation != self._generation:
                    raise OSError("the writer process was replaced")
                new = self._arenas.unsent()
            if new:
                conn.send(("arenas", [(a.id, a.nbytes) for a in new]))
                for a in new:
                    assert a.fd is not None
                    reduction.send_handle(conn, a.fd, proc.pid)
            conn.send(("save", job))
            kind, payload = conn.recv()
        except (EOFError, OSError) as e:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            why = _died_message(self._rank, code, self._why.get(generation))
            with self._lock:
                why = self._why.setdefault(generation, why)
            raise SaveError(f"{why} during the save of step {job.plan.step}: that save was not "
                            "reported committed (all_steps() shows whether it was); the next "
                            "save starts a new writer process", step=job.plan.step,
                            failures={self._rank: CkptmgrError(why)}) from e
        finally:
            with self._lock:
                self._busy = None
                if conn is not self._conn:  # kill() left this one to us (we were using it)
                    conn.close()
        if kind == "err":
            raise payload
        assert isinstance(payload, DurableOutcome)
        return payload

    def kill(self, why: str) -> None:
        """Stop the writer now (SIGKILL); a save waiting on it fails with ``why``."""
        with self._lock:
            self._why.setdefault(self._generation, why)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._drop_pipes()

    def close(self) -> None:
        """Ask the writer to exit (after its save in flight); kill it if it does not."""
        proc, conn = self._proc, self._conn
        if proc is not None and proc.poll() is None and conn is not None:
            try:
                conn.send(("close", None))
                proc.wait(timeout=_CLOSE_WAIT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                log.warning("the writer process %d did not exit (%s): killing it", proc.pid, e)
                proc.kill()
                proc.wait()
        self._proc = None
        self._drop_pipes()
        self._store = None

    def _drop_pipes(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            # A save thread still reading it closes it itself: closed here, its descriptor
            # number could be reused by the next writer's socket while that thread reads.
            if conn is not None and conn is not self._busy:
                conn.close()
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None


@contextmanager
def stop_if_stuck(writer: WriterProcess | None, seconds: float) -> Iterator[None]:
    """Kill ``writer`` if the ``with`` block (waiting for its save) lasts more than ``seconds``:
    at a preemption, a writer stuck on I/O, or waiting for a frozen writer of another rank, must
    not eat the grace period the last checkpoint needs (that save then fails, reported once)."""
    if writer is None:
        yield
        return
    timer = threading.Timer(seconds, writer.kill, args=(
        f"the writer process was stopped: its save was still running {seconds:.0f} s after a "
        "preemption, which needs the time for the last checkpoint",))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# --------------------------------------------------------------------------- the writer process


def _watch_parent(lifeline: int, parent: int) -> None:
    """Exit at once when the training process is gone: its end of the lifeline closes (EOF), or
    this process was re-parented. Nothing is written after the parent died."""
    while True:
        ready, _, _ = select.select([lifeline], [], [], 0.25)
        if ready or os.getppid() != parent:
            os._exit(_ORPHANED)


class _Writer:
    """The writer process's state: the durable tier (fenced by the lease and the parent), the
    mapped arenas, its group."""

    def __init__(self, spec: _Spec) -> None:
        cfg = spec.cfg
        for sig in cfg.preemption.signals:  # the training process decides about preemption
            signal.signal(sig, signal.SIG_IGN)
        self.parent = os.getppid()
        apply_client_config(spec.fsspec_conf)  # the storage is configured as the trainer's
        self.durable = DurableTier.from_config(cfg)  # the manager's recipe, the same config
        self.durable.follow_lease(spec.lease, alive=self.alive)
        self.arenas: dict[int, torch.Tensor] = {}
        self.comm = Comm(None)
        if spec.world_size > 1:
            assert spec.rendezvous is not None
            timeout = timedelta(seconds=spec.timeout_s)
            host, port = spec.rendezvous
            store = TCPStore(host, port, None, False, timeout)
            dist.init_process_group(
                "gloo", store=PrefixStore(f"ckptmgr-writers/{spec.generation}/", store),
                rank=spec.rank, world_size=spec.world_size, timeout=timeout)
            self.comm = Comm(dist.group.WORLD, timeout)

    def alive(self) -> None:
        """(before a commit or a deletion, with the lease) The training process is alive."""
        if os.getppid() != self.parent:
            raise LeaseError("the training process is gone: the writer process commits nothing")

    def flat(self, items: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, item in items.items():
            if isinstance(item, ShmTensor):
                out[key] = view(self.arenas[item.arena], item)
            elif isinstance(item, _WireDTensor):
                out[key] = StagedDTensor(
                    view(self.arenas[item.ref.arena], item.ref), global_shape=item.global_shape,
                    dtype=item.dtype, chunks=item.chunks, properties=item.properties,
                    placements=item.placements, replica_id=item.replica_id)
            else:
                out[key] = item
        return out

    def save(self, job: DurableJob) -> DurableOutcome:
        self.durable.view = job.view  # the training process's view: it saw every commit
        # A sharded (SPMD) save runs in the training process: the writer's are plain DCP.
        return self.durable.save(self.flat(job.items), job.plan, self.comm, spmd=False,
                                 trusted=job.trusted)

    def close(self) -> None:
        if self.comm.group is not None and dist.is_initialized():
            dist.destroy_process_group()


def _serve(conn: Connection) -> None:
    try:
        _, spec = conn.recv()
    except (EOFError, OSError):
        return
    except Exception as e:  # say why, instead of exiting with a traceback on stderr only
        conn.send(("err", ConfigError(f"the writer process could not read its configuration "
                                      f"({type(e).__name__}: {e}): {_UNREADABLE}")))
        return
    logging.basicConfig(format=f"[ckptmgr writer rank {spec.rank}] %(levelname)s %(message)s")
    logging.getLogger("ckptmgr").setLevel(spec.log_level)
    try:
        writer = _Writer(spec)
    except BaseException as e:
        conn.send(("err", portable(e)))
        return
    try:
        conn.send(("ready", os.getpid()))
        while True:
            kind, payload = conn.recv()
            if kind == "arenas":
                for arena, nbytes in payload:
                    writer.arenas[arena] = attach(reduction.recv_handle(conn), nbytes)
            elif kind == "retire":
                for arena in payload:
                    writer.arenas.pop(arena, None)
            elif kind == "save":
                try:
                    reply: tuple[str, Any] = ("ok", writer.save(payload))
                except BaseException as e:
                    log.debug("save failed in the writer process", exc_info=True)
                    reply = ("err", portable(e))
                conn.send(reply)
            elif kind == "close":
                return
    except (EOFError, OSError):  # the training process is gone: nothing more to do
        return
    finally:
        writer.close()


def main() -> None:
    """The writer process's entry point (argv: the socket's fd, the lifeline's fd)."""
    sock, lifeline = int(sys.argv[1]), int(sys.argv[2])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(lifeline, os.getppid()), daemon=True,
                     name="ckptmgr-lifeline").start()
    _serve(Connection(sock))
