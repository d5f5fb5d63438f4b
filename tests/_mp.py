"""Run a function on N real processes joined by a gloo process group (CPU).

Ranks are forked from a fork server that has torch and ckptmgr imported (see ``PRELOAD``).

The parent owns a ``TCPStore`` on an OS-chosen port (race-free, RECIPES.md); children connect to it,
so no port is guessed and no init file can go stale. Every group gets a short timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# Ranks are forked by multiprocessing's fork server, which imports these once per test session:
# a rank then starts in tenths of a second instead of seconds (RECIPES.md: 2-2.7 s idle each, far
# more under load). The server starts no threads and no process group, so a fork is clean.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor", "ckptmgr"]


def context() -> Any:
    """The multiprocessing context for test ranks: a fork server with torch and ckptmgr loaded."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           q: Any, timeout_s: float, env: dict[str, str]) -> None:
    # The fork server's environment is the session's at its start; the test's is now this one.
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("CKPTMGR_COLLECTIVE_TIMEOUT_S", str(timeout_s))
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        q.put((rank, "ok", result))
    except BaseException as e:  # report everything, including SystemExit
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; their results by rank.

    Raises:
        AssertionError: a rank failed (with its traceback) or the run exceeded ``timeout_s``.
    """
    ctx = context()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    q = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_child,
                         args=(fn, r, world, store.port, args, q, timeout_s / 2, env))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, payload = q.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}: {payload}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]


class Ranks:
    """``world`` rank processes started by :func:`start_ranks`, for tests that kill one of them:
    the parent gathers the results of the others with :meth:`results` and :meth:`close` ends the
    rest."""

    def __init__(self, fn: Callable[..., Any], world: int, args: tuple[Any, ...],
                 timeout_s: float) -> None:
        ctx = context()
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                                   timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.queue = ctx.Queue()
        env = dict(os.environ)
        self.procs = [ctx.Process(target=_child, args=(fn, r, world, self.store.port, args,
                                                       self.queue, timeout_s / 2, env))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def results(self, ranks: list[int]) -> dict[int, Any]:
        """The results of ``ranks`` (each must finish within the timeout and succeed)."""
        out: dict[int, Any] = {}
        errors: list[str] = []
        for _ in ranks:
            rank, status, payload = self.queue.get(timeout=self.timeout_s)
            (out.__setitem__(rank, payload) if status == "ok"
             else errors.append(f"rank {rank}: {payload}"))
        assert not errors, "\n".join(errors)
        assert sorted(out) == sorted(ranks), out
        return out

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def start_ranks(fn: Callable[..., Any], world: int, *args: Any,
                timeout_s: float = 60.0) -> Ranks:
    """Start ``fn(rank, world, *args)`` on ``world`` processes and return at once."""
    return Ranks(fn, world, args, timeout_s)


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
        time.sleep(0.01)


def open_file_gate(path: str) -> None:
    """Create ``path``, letting every :func:`wait_for_file` on it through."""
    with open(path, "x"):
        pass
