"""GPU checkpoint benchmark: a training state on the GPU, ckptmgr against the floors and DCP.

One run on one state that lives on the GPU (default 8 GiB: bf16 weights, an fp32 master copy and
two fp32 AdamW moments, 2 + 4 + 4 + 4 bytes per parameter, in a Llama-like set of tensors) measures:

- floors: device-to-host copy into preallocated pinned buffers and host-to-device copy back (CUDA
  events), write + fsync of the state's bytes and a cold read (``bench.py``'s helpers);
- ``dcp.save`` / ``dcp.load`` (in place, into the CUDA tensors);
- ``dcp.async_save`` with DCP's best staging (a reused ``DefaultStager`` with pinned + shared
  memory, async staging and non-blocking copies; ``AsyncCheckpointerType.PROCESS``; a 1-rank gloo
  group): time until the call returns, until staging completes, until saved;
- ckptmgr ``save_async`` in thread and process mode: time blocked, time until committed;
- GPU compute lost by a bf16 matmul loop on the default stream during one background save (DCP's
  best, ckptmgr thread, ckptmgr process), timed with CUDA events;
- ckptmgr ``restore`` into the CUDA tensors (in place) against ``dcp.load``.

Each method's output is deleted before the next (peak disk about 2x the state); reads are cold.
Every method is wrapped: one that fails prints its error in the table and the others still run.
``--budget-s`` stops starting new repetitions (and, past it, new methods); the table is always
printed. ``--dry-run`` runs everything on a tiny CPU state (no CUDA: the copy floors are plain
host copies, labelled so). Run it as a script (DCP's and ckptmgr's writer processes re-import the
main module)::

    python benchmarks/gpu_bench.py --dir /scratch --out OUTDIR [--size 8GiB] [--budget-s 150]
    python benchmarks/gpu_bench.py --dry-run --dir /tmp --out OUTDIR
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import math
import mmap
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as B  # benchmarks/bench.py: the CPU benchmark's helpers

Start = Callable[[], tuple[Callable[[], bool], Callable[[], None]]]


# --------------------------------------------------------------------------------- the state


def make_gpu_state(total_bytes: int, layers: int, device: torch.device,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A flat training state of about ``total_bytes``: per parameter a ``dtype`` weight (bf16 on
    the GPU) and fp32 master, ``exp_avg`` and ``exp_avg_sq``, shaped like a Llama model of
    ``layers`` layers (vocab = 8 x hidden, MLP = 8/3 x hidden; embeddings are the largest)."""
    per_param = torch.finfo(dtype).bits // 8 + 12
    params = total_bytes // per_param
    # params ~= layers * 12 h^2 (4 attention + 3 MLP matrices) + 2 * 8h * h (embed, lm_head)
    hidden = max(16, int(math.sqrt(params / (12 * layers + 16))) // 16 * 16)
    ffn, vocab = hidden * 8 // 3 // 16 * 16, hidden * 8
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, hidden)}
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            shapes[f"layers.{i}.attn.{n}"] = (hidden, hidden)
        shapes[f"layers.{i}.mlp.gate"] = (ffn, hidden)
        shapes[f"layers.{i}.mlp.up"] = (ffn, hidden)
        shapes[f"layers.{i}.mlp.down"] = (hidden, ffn)
        shapes[f"layers.{i}.norm1"] = (hidden,)
        shapes[f"layers.{i}.norm2"] = (hidden,)
    shapes["norm"] = (hidden,)
    shapes["lm_head"] = (vocab, hidden)
    gen = torch.Generator(device=device).manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        master = torch.randn(shape, device=device, generator=gen)
        state[f"model.{name}"] = master.to(dtype)
        state[f"optim.{name}.master"] = master
        state[f"optim.{name}.exp_avg"] = torch.randn(shape, device=device, generator=gen) * 1e-3
        state[f"optim.{name}.exp_avg_sq"] = torch.rand(shape, device=device, generator=gen) * 1e-6
    return state


# ------------------------------------------------------------------------- clocks and compute


class Clock:
    """Marks on the default stream (CUDA events) or, without CUDA, on the host clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def wait(self, mark: Any) -> None:
        if self.cuda:
            mark.synchronize()

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds between two marks (waits for ``b``)."""
        if self.cuda:
            b.synchronize()
            return float(a.elapsed_time(b)) / 1000
        return float(b - a)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class MatmulLoop:
    """A matmul loop on the default stream whose missing iterations measure lost compute."""

    def __init__(self, clock: Clock, device: torch.device, dim: int, dtype: torch.dtype) -> None:
        self.clock = clock
        self.a = torch.randn(dim, dim, device=device).to(dtype)
        self.b = torch.randn(dim, dim, device=device).to(dtype)
        self.c = torch.empty(dim, dim, device=device, dtype=dtype)

    def step(self) -> None:
        torch.mm(self.a, self.b, out=self.c)

    def iteration_s(self, update: Callable[[], None], n: int = 10) -> float:
        """Seconds of one training-like iteration (4 matmuls and ``update``) alone."""
        for _ in range(4):
            self.step()
        update()
        self.clock.sync()
        a = self.clock.mark()
        for _ in range(n):
            for _ in range(4):
                self.step()
            update()
        return self.clock.seconds(a, self.clock.mark()) / n

    def run_during(self, start: Start, min_s: float, update: Callable[[], None],
                   before_update: Callable[[], None] | None = None) -> dict[str, float]:
        """Run training-like iterations (4 matmuls, then ``update``, an in-place write to the
        saved state, as an optimizer step is) while one background save runs; lost = the window
        on the GPU minus the iterations done times the iteration time measured alone before and
        after. ``before_update`` runs once before the first update after the save starts: DCP's
        async staging requires the caller to wait for staging before the state changes
        (``AsyncSaveResponse.staging_completion``); ckptmgr's ``save_async`` has captured the
        state when it returns, so it passes none."""
        base = self.iteration_s(update)
        self.clock.sync()
        first = self.clock.mark()
        for _ in range(4):  # the GPU is busy when the save starts, as in training
            self.step()
        iters = 1
        t0 = time.perf_counter()
        done, finish = start()
        blocked = time.perf_counter() - t0
        save_s = math.nan
        inflight: collections.deque[Any] = collections.deque()
        gated = before_update is None
        while True:
            for _ in range(4):
                self.step()
            if not gated:
                before_update()  # type: ignore[misc]
                gated = True
            update()
            iters += 1
            inflight.append(self.clock.mark())
            if len(inflight) > 2:  # keep the host at most ~8 matmuls ahead of the GPU
                self.clock.wait(inflight.popleft())
            if math.isnan(save_s) and done():
                save_s = time.perf_counter() - t0
            if not math.isnan(save_s) and time.perf_counter() - t0 >= min_s:
                break
        window = self.clock.seconds(first, self.clock.mark())
        finish()
        per_iter = (base + self.iteration_s(update)) / 2
        return {"lost_s": max(0.0, window - iters * per_iter), "window_s": window,
                "save_s": save_s, "iter_s": per_iter, "iters": float(iters),
                "blocked_s": blocked}


# ------------------------------------------------------------------------------- the runner


class GpuBench:
    """Every method once per repetition on one state; a failing method records its error."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.dry_run
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.clock = Clock(self.cuda)
        self.t_start = time.perf_counter()
        self.cache = B.PageCache()
        self.measures: dict[str, B.Measure] = {}
        self.errors: dict[str, str] = {}
        self.rep_s: list[float] = []
        self.residency: list[float] = []
        self.pairs: dict[str, list[float]] = {}  # interleaved A/B: per-pair ratios B/A
        self.scratch = tempfile.mkdtemp(prefix="ckptmgr-gpubench-", dir=args.dir)
        self.state = make_gpu_state(args.size, args.layers, self.device, self.dtype)
        self.nbytes = B.state_bytes(self.state)
        self.clock.sync()
        # Preallocated host buffers of the copy floors (pinned with CUDA), touched now so the
        # first floor does not pay their page faults.
        self.host = {k: torch.zeros(t.shape, dtype=t.dtype, pin_memory=self.cuda)
                     for k, t in self.state.items()}
        self._buf = memoryview(bytearray(B._IO_CHUNK))
        self._aligned = mmap.mmap(-1, B._IO_CHUNK)  # page-aligned, for O_DIRECT
        self.loop = MatmulLoop(self.clock, self.device, args.matmul_dim, self.dtype)
        self._update_key = min(self.state, key=lambda k: self.state[k].numel())
        self._group: Any = None
        self._own_group = False
        self._stager: Any = None
        self.dcp_stager_reused = True  # False once torch closed a reused DefaultStager
        self._dcp_warm = False
        self._mgrs: dict[str, Any] = {}
        self._steps: dict[str, int] = {}

    # -- bookkeeping

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def record(self, name: str, kind: str, label: str, seconds: float,
               **extra: float) -> None:
        m = self.measures.setdefault(name, B.Measure(name, kind, label))
        m.samples.append(seconds)
        for k, v in extra.items():
            m.extra.setdefault(k, []).append(v)

    def path(self, name: str) -> str:
        return os.path.join(self.scratch, name)

    def settle(self, *names: str) -> None:
        """Delete ``names`` (untimed; bench.py's :func:`settle`)."""
        B.settle(self.path(n) for n in names)

    def cold(self, *names: str) -> None:
        self.residency.append(self.cache.drop([self.path(n) for n in names]))

    def timed(self, fn: Callable[[], Any]) -> float:
        gc.collect()
        self.clock.sync()
        t = time.perf_counter()
        fn()
        self.clock.sync()  # in-place loads into CUDA tensors end when the device is done
        return time.perf_counter() - t

    # -- the repetitions

    def run(self) -> None:
        methods = self.args.methods
        # No warm-up repetition: what needs one (DCP's checkpoint process and stager, each
        # manager's buffers and writer process) is warmed by an untimed save on first use.
        for rep in range(1, self.args.reps + 1):
            if self.rep_s and self.elapsed() + max(self.rep_s) > self.args.budget_s:
                print(f"[gpu_bench] budget: {self.elapsed():.0f} s used, a repetition takes "
                      f"{max(self.rep_s):.0f} s; stopping", file=sys.stderr, flush=True)
                break
            t = time.perf_counter()
            for method in methods:
                if self.elapsed() > self.args.budget_s * 1.5:
                    self.errors.setdefault(method, "skipped: over the time budget")
                    continue
                try:
                    getattr(self, f"run_{method}")()
                except Exception as e:  # one failing method must not cost the others
                    self.errors[method] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    print(f"[gpu_bench] {method} failed:\n{traceback.format_exc()}",
                          file=sys.stderr, flush=True)
            self.rep_s.append(time.perf_counter() - t)
            print(f"[gpu_bench] rep {rep}/{self.args.reps}: {self.rep_s[-1]:.1f} s "
                  f"(total {self.elapsed():.0f} s)", file=sys.stderr, flush=True)

    def run_floors(self) -> None:
        dev = "device-to-host copy into pinned buffers" if self.cuda else \
            "host copy (no CUDA: stands in for device-to-host)"
        back = "host-to-device copy from pinned buffers" if self.cuda else \
            "host copy (no CUDA: stands in for host-to-device)"
        nb = self.cuda
        for name, label, pairs in (
                ("floor.d2h", dev, [(self.host[k], t) for k, t in self.state.items()]),
                ("floor.h2d", back, [(t, self.host[k]) for k, t in self.state.items()])):
            self.clock.sync()
            a = self.clock.mark()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=nb)
            self.record(name, f"floor-{name[6:]}", label,
                        self.clock.seconds(a, self.clock.mark()))
        path = self.path("floor.bin")
        # Issue 28: writes are judged against the fastest of the three write floors.
        self.record("floor.write_stream", "floor-write",
                    "write + fsync, 64 MiB writes, streaming writeback",
                    self.timed(lambda: B.floor_write(path, self.nbytes, self._buf, stream=True)))
        self.settle("floor.bin")
        ok: list[bool] = []
        direct = self.timed(lambda: ok.append(B.floor_write_direct(path, self.nbytes,
                                                                   self._aligned)))
        if ok[0]:
            self.record("floor.write_direct", "floor-write", "O_DIRECT write + fsync, 64 MiB "
                        "writes (dd oflag=direct)", direct)
        self.settle("floor.bin")
        self.record("floor.write", "floor-write", "write + fsync, 64 MiB writes (dd)",
                    self.timed(lambda: B.floor_write(path, self.nbytes, self._buf)))
        self.cold("floor.bin")
        self.record("floor.read", "floor-read", f"read, 64 MiB reads, {self.cache.label}",
                    self.timed(lambda: B.floor_read(path, self._buf)))
        self.settle("floor.bin")

    def run_dcp(self) -> None:
        import torch.distributed.checkpoint as dcp

        d = self.path("dcp")
        self.record("dcp.save", "write", "dcp.save (FileSystemWriter)", self.timed(
            lambda: dcp.save(self.state, storage_writer=dcp.FileSystemWriter(d), no_dist=True)))
        self.cold("dcp")
        self.record("dcp.load", "read", "dcp.load (in place into the state's tensors)",
                    self.timed(lambda: dcp.load(self.state, storage_reader=dcp.FileSystemReader(
                        d), no_dist=True)))
        self.settle("dcp")

    def gloo(self) -> Any:
        """A 1-rank gloo group (bench.py's :func:`one_rank_gloo`)."""
        if self._group is None:
            self._group, self._own_group = B.one_rank_gloo()
        return self._group

    def dcp_start(self, name: str, times: dict[str, float],
                  staged: dict[str, Any] | None = None,
                  state: dict[str, torch.Tensor] | None = None) -> Start:
        """Starts one ``dcp.async_save`` with DCP's best staging in PROCESS mode; ``times`` gets
        ``returned``, ``staged`` and ``saved`` (seconds from the call); ``staged["future"]`` the
        staging future (None when staging was synchronous)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        inner = getattr(self._stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            # Some torch releases (2.11 seen) close a stager passed to async_save once its save
            # ends, so it cannot be reused: each save then gets a fresh one, as DCP's default.
            self._stager, self.dcp_stager_reused = None, False
        if self._stager is None:
            # Pinned memory and non-blocking copies need an accelerator: without CUDA the
            # stager keeps shared memory and async staging only.
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=self.cuda, use_shared_memory=True, use_async_staging=True,
                use_non_blocking_copy=self.cuda))
        group = self.gloo()

        def start() -> tuple[Callable[[], bool], Callable[[], None]]:
            t0 = time.perf_counter()
            res = dcp.async_save(self.state if state is None else state,
                                 storage_writer=dcp.FileSystemWriter(self.path(name)),
                                 process_group=group, async_stager=self._stager,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            times["returned"] = time.perf_counter() - t0
            staging = getattr(res, "staging_completion", None)
            upload = getattr(res, "upload_completion", res)
            if staged is not None:
                staged["future"] = staging

            # A future's callbacks may run after result() has returned to a waiter: the time
            # is taken by whichever of the callback and finish() sees the future done first.
            def on_staged(_: Any) -> None:
                times.setdefault("staged", time.perf_counter() - t0)

            def on_saved(_: Any) -> None:
                times.setdefault("saved", time.perf_counter() - t0)

            if staging is not None:
                staging.add_done_callback(on_staged)
            else:  # synchronous staging: captured when the call returned
                times["staged"] = times["returned"]
            upload.add_done_callback(on_saved)

            def finish() -> None:
                if staging is not None:
                    staging.result()
                    on_staged(None)
                upload.result()
                on_saved(None)

            return upload.done, finish
        return start

    def run_dcp_async(self) -> None:
        if not self._dcp_warm:
            # Untimed: a tiny save starts DCP's checkpoint process; then, where torch lets a
            # stager be reused, a full one allocates its staging buffers (torch 2.11 closes the
            # stager after each save: a full warm-up there would only cost the check's time).
            key = self._update_key
            self.dcp_start("dcp_async", {}, state={key: self.state[key]})()[1]()
            inner = getattr(self._stager, "_state_dict_stager", None)
            if inner is None or getattr(inner, "_deepcopy_dispatch", True):
                self.dcp_start("dcp_async", {})()[1]()
            self.settle("dcp_async")
            self._dcp_warm = True
        times: dict[str, float] = {}
        self.dcp_start("dcp_async", times)()[1]()
        label = "dcp.async_save, best staging, PROCESS"
        self.record("dcp_async.returned", "blocking", f"{label}: until the call returns",
                    times["returned"])
        self.record("dcp_async.staged", "blocking", f"{label}: until staged (blocked)",
                    times["staged"])
        self.record("dcp_async.total", "write", f"{label}: until saved", times["saved"])
        self.settle("dcp_async")

    def manager(self, mode: str) -> Any:
        """The manager of ``async_mode=mode``, warmed by one untimed save (pinned buffers, the
        writer process)."""
        if mode not in self._mgrs:
            import ckptmgr

            self.gloo()  # the same 1-rank job DCP sees
            mgr = ckptmgr.CheckpointManager(self.path(f"ckptmgr_{mode}"), save_interval=1,
                                            chkpt_on_preemption=False, async_mode=mode,
                                            save_on_close=False)
            self._mgrs[mode], self._steps[mode] = mgr, 1
            mgr.save_async(1, self.state)
            mgr.wait_until_finished()
        return self._mgrs[mode]

    def next_step(self, mode: str) -> int:
        """A fresh step of ``mode``'s manager; older steps deleted first (untimed)."""
        self.manager(mode)
        root = self.path(f"ckptmgr_{mode}")
        for s in range(1, self._steps[mode] + 1):
            shutil.rmtree(os.path.join(root, str(s)), ignore_errors=True)
        os.sync()
        self._steps[mode] += 1
        return self._steps[mode]

    def run_ckptmgr(self, mode: str) -> None:
        mgr = self.manager(mode)
        step = self.next_step(mode)
        self.clock.sync()
        t = time.perf_counter()
        mgr.save_async(step, self.state)
        blocked = time.perf_counter() - t
        mgr.wait_until_finished()
        total = time.perf_counter() - t
        stats = mgr.last_save_stats
        label = f"ckptmgr save_async (async_mode={mode!r})"
        self.record(f"ckptmgr_{mode}.blocking", "blocking", f"{label}: blocked", blocked,
                    pinned_bytes=float(getattr(stats, "pinned_bytes", math.nan)),
                    stats_blocking_s=float(getattr(stats, "blocking_s", math.nan)))
        self.record(f"ckptmgr_{mode}.total", "write", f"{label}: until committed", total)
        if mode == "thread":
            self.cold(f"ckptmgr_{mode}")
            self.record("ckptmgr.restore", "read", "ckptmgr restore (in place into the "
                        "state's tensors, checksums verified)",
                        self.timed(lambda: mgr.restore(step, self.state)))
            self.restore_variants(mgr, step)
            self.restore_pairs(mgr, step)
        self.next_step(mode)

    def restore_variants(self, mgr: Any, step: int) -> None:
        """(``--restore-threads``) The same restore with other numbers of read streams: the
        reader's default is set for the call (an experiment's knob, not a user setting)."""
        from ckptmgr.dcp import reader

        default = reader.DEFAULT_NUM_THREADS
        try:
            for n in self.args.restore_threads:
                reader.DEFAULT_NUM_THREADS = n
                self.cold("ckptmgr_thread")
                self.record(f"ckptmgr.restore.streams{n}", "read",
                            f"ckptmgr restore, {n} read streams",
                            self.timed(lambda: mgr.restore(step, self.state)))
        finally:
            reader.DEFAULT_NUM_THREADS = default

    def restore_pairs(self, mgr: Any, step: int) -> None:
        """(``--restore-pairs N``) N interleaved pairs of the same cold restore with the
        reader's pipelined windows (``reader.PIPELINE``) and without, the order flipping every
        pair (an experiment's knob, not a user setting); per-pair ratios in ``self.pairs``."""
        from ckptmgr.dcp import reader

        default = reader.PIPELINE
        ratios: list[float] = []
        try:
            for i in range(self.args.restore_pairs):
                times: dict[bool, float] = {}
                for pipelined in ((True, False) if i % 2 == 0 else (False, True)):
                    reader.PIPELINE = pipelined
                    self.cold("ckptmgr_thread")
                    times[pipelined] = self.timed(lambda: mgr.restore(step, self.state))
                self.record("ckptmgr.restore.pipelined", "read",
                            "ckptmgr restore, staged windows pipelined (pairs)", times[True])
                self.record("ckptmgr.restore.serial", "read",
                            "ckptmgr restore, staged windows one at a time (pairs)",
                            times[False])
                ratios.append(times[True] / times[False])
        finally:
            reader.PIPELINE = default
            self.pairs.setdefault("restore pipelined/serial", []).extend(ratios)

    def run_ckptmgr_thread(self) -> None:
        self.run_ckptmgr("thread")

    def run_ckptmgr_process(self) -> None:
        self.run_ckptmgr("process")

    def update(self) -> None:
        """An in-place write to the saved state (what an optimizer step does)."""
        self.state[self._update_key].add_(0.0)

    def run_compute(self) -> None:
        min_s = self.args.compute_min_s
        for name in ("dcp_async", "ckptmgr_thread", "ckptmgr_process"):
            try:
                if name == "dcp_async":
                    times: dict[str, float] = {}
                    staged: dict[str, Any] = {}

                    def wait_staged(staged: dict[str, Any] = staged) -> None:
                        if staged.get("future") is not None:
                            staged["future"].result()

                    res = self.loop.run_during(self.dcp_start("dcp_compute", times, staged),
                                               min_s, self.update, wait_staged)
                    res["staged_s"] = times.get("staged", math.nan)
                    self.settle("dcp_compute")
                    label = "dcp.async_save (best staging, PROCESS; the state is updated only " \
                        "after staging completes, as DCP requires)"
                else:
                    mode = name.split("_", 1)[1]
                    mgr, step = self.manager(mode), self.next_step(mode)
                    res = self.loop.run_during(
                        lambda m=mgr, s=step: B._start_manager_save(m, s, self.state), min_s,
                        self.update)
                    self.next_step(mode)
                    label = f"ckptmgr save_async (async_mode={mode!r})"
            except Exception as e:  # the other saves are still measured
                self.errors[f"compute_lost.{name}"] = f"{type(e).__name__}: {e}"[:300]
                print(f"[gpu_bench] compute {name} failed:\n{traceback.format_exc()}",
                      file=sys.stderr, flush=True)
                continue
            self.record(f"compute_lost.{name}", "compute",
                        f"compute lost during one {label}", res.pop("lost_s"), **res)

    def close(self) -> None:
        for mode, mgr in self._mgrs.items():
            try:
                mgr.close()
            except Exception as e:
                self.errors.setdefault(f"close.{mode}", f"{type(e).__name__}: {e}"[:300])
        if self._stager is not None:
            self._stager.close()
        if self._dcp_warm:
            # DCP keeps its checkpoint process in a module global; dropping it ends the process.
            from torch.distributed.checkpoint import _async_process_executor as dcp_process

            dcp_process._CHECKPOINT_PROCESS = None
            gc.collect()
        if self._own_group:
            import torch.distributed as dist

            dist.destroy_process_group()
        shutil.rmtree(self.scratch, ignore_errors=True)


# ---------------------------------------------------------------------------------- reporting

METHODS = ["floors", "dcp", "dcp_async", "ckptmgr_thread", "ckptmgr_process", "compute"]
# Which floor each kind is compared with in the table; writes: the fastest of WRITE_FLOORS.
FLOOR_OF = {"write": "floor.write", "read": "floor.read", "blocking": "floor.d2h",
            "compute": "compute_lost.dcp_async"}
WRITE_FLOORS = ["floor.write", "floor.write_stream", "floor.write_direct"]
# Every row the dry-run test expects (a failed method shows as an error instead).
ROWS = ["floor.d2h", "floor.h2d", "floor.write", "floor.write_stream", "floor.read", "dcp.save",
        "dcp.load", "dcp_async.returned", "dcp_async.staged", "dcp_async.total",
        "ckptmgr_thread.blocking", "ckptmgr_thread.total", "ckptmgr.restore",
        "ckptmgr_process.blocking",
        "ckptmgr_process.total", "compute_lost.dcp_async", "compute_lost.ckptmgr_thread",
        "compute_lost.ckptmgr_process"]


def _ratio(a: float, b: float) -> float:
    """``a / b``; NaN when either is unmeasured; a zero reference gives 0 (a is 0 too) or inf."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if b <= 0:
        return 0.0 if a <= 0 else math.inf
    return a / b


def summarize(gb: GpuBench) -> dict[str, Any]:
    """The JSON document: device, config, every measure with ratios, errors and targets."""
    ms = gb.measures
    rows = []
    floors = dict(FLOOR_OF)
    write_floors = [ms[n] for n in WRITE_FLOORS if n in ms and ms[n].samples]
    if write_floors:
        floors["write"] = min(write_floors, key=lambda m: m.median).name
    for m in ms.values():
        floor = ms.get(floors.get(m.kind, ""))
        row: dict[str, Any] = {"name": m.name, "kind": m.kind, "label": m.label,
                               "samples_s": m.samples, "median_s": m.median, "min_s": m.min,
                               "extra": {k: sorted(v)[len(v) // 2] for k, v in m.extra.items()}}
        if m.kind != "compute" and m.samples and m.median > 0:
            row["median_gb_s"] = gb.nbytes / m.median / 1e9
        if floor is not None and floor.samples and m.samples:
            row["floor"] = floor.name
            row["ratio_median"] = _ratio(m.median, floor.median)
            row["ratio_min"] = _ratio(m.min, floor.min)
        rows.append(row)
    med = {m.name: m.median for m in ms.values() if m.samples}
    targets = []

    def target(what: str, measure: str, ref: str | float, limit: float,
               strict: bool = False) -> None:
        ref_s = med.get(ref, math.nan) if isinstance(ref, str) else ref
        r = _ratio(med.get(measure, math.nan), ref_s)
        met = (r < limit if strict else r <= limit) if not math.isnan(r) else False
        targets.append({"target": what, "measure": measure, "reference": ref, "limit": limit,
                        "ratio_median": r, "met": met})

    slow_floor = max(med.get("floor.read", math.nan), med.get("floor.h2d", math.nan))
    write_floor = floors["write"]
    for mode in ("thread", "process"):
        blocked = f"ckptmgr_{mode}.blocking"
        target(f"{mode}: save until committed <= 1.2x the fastest write floor",
               f"ckptmgr_{mode}.total", write_floor, 1.2)
        target(f"{mode}: blocked <= 1.2x pinned D2H floor", blocked, "floor.d2h", 1.2)
        target(f"{mode}: blocked <= 0.5x DCP best blocked (until staged)", blocked,
               "dcp_async.staged", 0.5)
        target(f"{mode}: compute lost <= 0.5x DCP best", f"compute_lost.ckptmgr_{mode}",
               "compute_lost.dcp_async", 0.5)
    target("restore <= 1.3x slower of cold-read and H2D floors", "ckptmgr.restore", slow_floor,
           1.3)
    target("restore faster than dcp.load", "ckptmgr.restore", "dcp.load", 1.0, strict=True)
    env = {"device": torch.cuda.get_device_name() if gb.cuda else "cpu (dry run, no CUDA)",
           "cuda": gb.cuda, "torch": torch.__version__, "python": platform.python_version(),
           "cpus": os.cpu_count(), "platform": platform.platform(), "cache_drop": gb.cache.label,
           "max_resident_fraction_after_drop": max(gb.residency, default=0.0),
           "cuda_version": torch.version.cuda, "dcp_stager_reused": gb.dcp_stager_reused,
           "gpu_max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if gb.cuda else 0}
    cfg = {"size_bytes": gb.nbytes, "tensors": len(gb.state), "layers": gb.args.layers,
           "reps_asked": gb.args.reps, "reps_done": len(gb.rep_s),
           "budget_s": gb.args.budget_s, "elapsed_s": gb.elapsed(),
           "matmul_dim": gb.args.matmul_dim, "matmul_dtype": str(gb.dtype),
           "dry_run": gb.args.dry_run, "dir": gb.args.dir}
    pairs = {k: {"ratios": v, "median": sorted(v)[len(v) // 2] if v else math.nan,
                 "min": min(v, default=math.nan), "max": max(v, default=math.nan)}
             for k, v in gb.pairs.items()}
    return {"environment": env, "config": cfg, "rows": rows, "errors": gb.errors,
            "targets": targets, "write_floor": write_floor, "pairs": pairs}


def _f(x: Any, fmt: str = ".3f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(doc: dict[str, Any]) -> str:
    """The run as Markdown: header, the measures, errors, compute details and targets."""
    e, c = doc["environment"], doc["config"]
    out = [f"Device: {e['device']}; torch {e['torch']}, Python {e['python']}, {e['cpus']} CPUs.",
           f"State: {c['size_bytes'] / B.GiB:.2f} GiB in {c['tensors']} tensors on "
           f"{'the GPU' if e['cuda'] else 'the CPU'}; {c['reps_done']} of {c['reps_asked']} "
           f"repetitions, {c['elapsed_s']:.0f} s; reads {e['cache_drop']}.", "",
           "| measure | what | median s | min s | GB/s (median) | x floor (median) | "
           "x floor (min) |", "|---|---|---:|---:|---:|---:|---:|"]
    by = {r["name"]: r for r in doc["rows"]}
    for r in doc["rows"]:
        out.append(f"| `{r['name']}` | {r['label']} | {_f(r['median_s'])} | {_f(r['min_s'])} | "
                   f"{_f(r.get('median_gb_s'), '.2f')} | {_f(r.get('ratio_median'), '.2f')} | "
                   f"{_f(r.get('ratio_min'), '.2f')} |")
    for name in ROWS:
        if name not in by:
            out.append(f"| `{name}` | not measured (not selected, failed or over budget) "
                       "| | | | | |")
    for name, err in doc["errors"].items():
        out.append(f"| `{name}` | ERROR: {err.replace('|', '/')} | | | | | |")
    out += ["", f"Ratios: writes to the fastest write floor (`{doc['write_floor']}`), reads to "
            "`floor.read`, blocking times to `floor.d2h`, compute lost to "
            "`compute_lost.dcp_async`.", ""]
    for k, p in doc["pairs"].items():
        out += [f"Interleaved pairs, {k}: median {_f(p['median'])} (min {_f(p['min'])}, "
                f"max {_f(p['max'])}) over {len(p['ratios'])} pairs.", ""]
    compute = [r for r in doc["rows"] if r["kind"] == "compute" and r["extra"]]
    if compute:
        out += ["| background save under the matmul loop | lost s | window s | save s | "
                "blocked s | iteration ms |", "|---|---:|---:|---:|---:|---:|"]
        for r in compute:
            x = r["extra"]
            out.append(f"| `{r['name']}` | {_f(r['median_s'])} | {_f(x.get('window_s'))} | "
                       f"{_f(x.get('save_s'))} | {_f(x.get('blocked_s'))} | "
                       f"{_f(x.get('iter_s', math.nan) * 1000, '.2f')} |")
        out.append("")
    out += ["## Targets", "", "| target | measure | ratio (median) | limit | result |",
            "|---|---|---:|---:|---|"]
    for t in doc["targets"]:
        res = "PASS" if t["met"] else ("MISS" if not math.isnan(t["ratio_median"]) else
                                       "MISS (not measured)")
        out.append(f"| {t['target']} | `{t['measure']}` | {_f(t['ratio_median'], '.2f')} | "
                   f"{t['limit']} | {res} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--dir", default=os.getcwd(), help="scratch directory on the disk to measure")
    p.add_argument("--out", default=None, help="directory for gpu_bench.md and gpu_bench.json")
    p.add_argument("--size", type=B.parse_size, default=None,
                   help="state size (default 8GiB; 16MiB with --dry-run)")
    p.add_argument("--layers", type=int, default=16, help="transformer layers (default 16)")
    p.add_argument("--reps", type=int, default=None,
                   help="measured repetitions after one warm-up (default 2; 1 with --dry-run)")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="start no repetition that would end past this many seconds, and no "
                        "method past 1.5x it (default 150)")
    p.add_argument("--compute-min-s", type=float, default=None,
                   help="the matmul loop runs at least this long (default 1.0; 0.2 dry run)")
    p.add_argument("--matmul-dim", type=int, default=None,
                   help="matmul size (default 8192 bf16 on the GPU; 256 fp32 dry run)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    p.add_argument("--restore-pairs", type=int, default=0,
                   help="interleaved pairs of restores with and without the reader's pipelined "
                        "windows (default 0: none)")
    p.add_argument("--restore-threads", default="",
                   help="also time restore with these numbers of read streams, e.g. 2,4")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny state on the CPU (no CUDA needed): proves the script runs")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.restore_threads = [int(n) for n in args.restore_threads.split(",") if n.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {METHODS}")
    dry = args.dry_run
    args.size = args.size or (16 * B.MiB if dry else 8 * B.GiB)
    args.reps = args.reps if args.reps is not None else (1 if dry else 2)
    args.compute_min_s = args.compute_min_s or (0.2 if dry else 1.0)
    args.matmul_dim = args.matmul_dim or (256 if dry else 8192)
    if dry:
        args.layers = min(args.layers, 4)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the Markdown; write gpu_bench.md and gpu_bench.json to --out."""
    args = parse_args(argv)
    args.dir = os.path.abspath(args.dir)
    if not args.dry_run and not torch.cuda.is_available():
        print("[gpu_bench] no CUDA device: running on the CPU (use --dry-run for a small state)",
              file=sys.stderr, flush=True)
    logging.getLogger("ckptmgr").setLevel(logging.WARNING)

    def on_term(signum: int, frame: Any) -> None:
        # A timeout's SIGTERM: stop measuring and report; a second one ends the process.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    gb = GpuBench(args)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's single-process and overwrite warnings
            gb.run()
    except BaseException as e:  # even interrupted, the table of what was measured is printed
        gb.errors["run"] = f"{type(e).__name__}: {e}"[:300]
        traceback.print_exc()
    # Report before close(): it waits for a save in flight, and a timeout may end it there.
    doc = write_report(gb, args.out, echo=True)
    try:
        gb.close()
    except BaseException as e:
        gb.errors["close"] = f"{type(e).__name__}: {e}"[:300]
        doc = write_report(gb, args.out, echo=False)
    return doc


def write_report(gb: GpuBench, out: str | None, *, echo: bool) -> dict[str, Any]:
    """Summarize; print the Markdown (``echo``); write gpu_bench.md and .json under ``out``."""
    doc = summarize(gb)
    md = markdown(doc)
    if echo:
        print(md, flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_bench.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
        with open(os.path.join(out, "gpu_bench.md"), "w") as f:
            f.write(md)
    return doc


if __name__ == "__main__":
    main()
