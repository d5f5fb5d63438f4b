"""The CUDA paths on a real GPU (issue 32): marker ``cuda``, collected always, skipped without one.

What runs only here: pinned staging on a side stream (thread mode), ``cudaHostRegister`` of the
writer process's shared arenas (process mode), restore into CUDA tensors in place, FSDP2 on NCCL,
CUDA DTensors saved at one world size and restored at another, and a preemption on a GPU trainer.
CPU-side simulations of the same paths (fake CUDA tensors, no device allocation) live in
``test_fake_cuda.py``; this module proves them on the device. ``benchmarks/gpu_check.sh`` runs it
on a GPU host (docs/performance.md, "The GPU lane").

Overlap is judged with CUDA events on the default stream, never wall-clock time: the fraction of a
save's window in which the default stream was running matmuls.
"""

from __future__ import annotations

import gc
import itertools
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _procs import Zygote, run_ranks, wait_for_file
from torch import nn

from ckptmgr import CheckpointManager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs this on a GPU host)"),
]

DEV = "cuda"


# -- a small mixed-precision training state: bf16 weights, fp32 master copy, AdamW moments --------

class Trainer:
    """bf16 model weights cast from an fp32 master copy that AdamW updates (the usual
    mixed-precision arrangement). Gradients are drawn from a seeded CUDA generator, so every
    step is deterministic on one device."""

    def __init__(self, seed: int = 0, width: int = 256) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                   nn.Linear(2 * width, width)).to(DEV, torch.bfloat16)
        self.master = {n.replace(".", "_"): nn.Parameter(p.detach().float().clone())
                       for n, p in self.model.named_parameters()}
        self.optim = torch.optim.AdamW(list(self.master.values()), lr=1e-3)
        self.gen = torch.Generator(device=DEV)
        self.gen.manual_seed(seed + 1)
        self.step(2)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for p in self.master.values():
                p.grad = torch.randn(p.shape, device=DEV, generator=self.gen)
            self.optim.step()
            with torch.no_grad():
                for mp, p in zip(self.master.values(), self.model.parameters(), strict=True):
                    p.copy_(mp)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "master": self.master, "optim": self.optim}


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by a flat name (the live objects, not copies)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state["model"].state_dict(keep_vars=True).items():
        out[f"model.{k}"] = v
    for k, v in state["master"].items():
        out[f"master.{k}"] = v
    for pid, s in state["optim"].state.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{id(pid)}.{k}"] = v
    return out


def _snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in _tensors(state).items()}


def _assert_bitexact(expected: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    got = _snapshot(state)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype, k
        # Bits, not values: compare the bytes (bf16 included).
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (
            f"{k} differs")


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("call", ["save", "save_async"])
def test_cuda_state_round_trips_bitexact_in_place(tmp_path: Path, mode: str, call: str) -> None:
    t = Trainer()
    state = t.state()
    with CheckpointManager(str(tmp_path / "root"), save_interval=1, async_mode=mode) as mgr:
        expected = _snapshot(state)
        assert getattr(mgr, call)(3, state)
        t.step(3)  # the live state moves on; the checkpoint keeps step 3
        mgr.wait_until_finished()
        live = {k: (v.device, v.data_ptr()) for k, v in _tensors(state).items()}
        mgr.restore(3, state)
    after = {k: (v.device, v.data_ptr()) for k, v in _tensors(state).items()}
    assert after == live  # in place: the same CUDA storage, no tensor replaced
    assert all(d.type == "cuda" for k, (d, _) in after.items() if not k.endswith(".step"))
    _assert_bitexact(expected, state)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_save_async_allocates_no_device_memory(tmp_path: Path, mode: str) -> None:
    t = Trainer(width=512)
    state = t.state()
    nbytes = sum(v.numel() * v.element_size() for v in _tensors(state).values()
                 if v.device.type == "cuda")
    with CheckpointManager(str(tmp_path / "root"), save_interval=1, max_to_keep=2,
                           async_mode=mode) as mgr:
        gc.collect()  # an earlier test's CUDA tensors freed now, not during the saves
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        pinned = set()
        for step in range(1, 21):
            assert mgr.save_async(step, state)
            mgr.wait_until_finished()
            stats = mgr.last_save_stats
            assert stats is not None and stats.step == step
            pinned.add(stats.pinned_bytes)
        torch.cuda.synchronize()
        # The peak is the proof: any device buffer a save made, even freed again, raised it.
        # (Allocated memory may only fall: a collection of unrelated garbage frees some.)
        assert torch.cuda.max_memory_allocated() == peak  # not one transient device buffer
        assert torch.cuda.memory_allocated() <= base
    # Pinned host buffers: allocated at the first save, every CUDA byte staged through them,
    # the same buffers reused by the 19 saves after it.
    assert len(pinned) == 1, pinned
    assert pinned.pop() >= nbytes


def test_staging_overlaps_compute_on_the_default_stream(tmp_path: Path) -> None:
    """A matmul loop on the default stream (another thread, as a training step's kernels would be
    queued) keeps the GPU busy while ``save_async`` copies the state to the host: the copies run
    on a side stream. Judged by CUDA events on the default stream around the save call."""
    gen = torch.Generator(device=DEV)
    gen.manual_seed(0)
    # 2 GiB of fp32 tensors: tens of milliseconds of device-to-host copying.
    state = {f"w{i}": torch.randn(4096, 4096, device=DEV, generator=gen) for i in range(32)}
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16, generator=gen)
    c = torch.empty_like(a)
    expected = {k: v.cpu() for k, v in state.items()}
    stop, running = threading.Event(), threading.Event()
    done: list[torch.cuda.Event] = []

    def compute() -> None:
        torch.cuda.set_device(0)
        while not stop.is_set():
            torch.mm(a, a, out=c)
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            done.append(e)
            if len(done) > 8:
                done[-8].synchronize()  # keep ~8 matmuls queued: a live loop, not a backlog
            if len(done) == 30:
                running.set()

    with CheckpointManager(str(tmp_path / "root"), save_interval=1) as mgr:
        mgr.save_async(1, state)  # the first save allocates the pinned buffers
        mgr.wait_until_finished()
        worker = threading.Thread(target=compute)
        worker.start()
        try:
            assert running.wait(60)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            assert mgr.save_async(2, state)
            end.record()
        finally:
            stop.set()
            worker.join()
        torch.cuda.synchronize()
        mgr.wait_until_finished()
        window_ms = begin.elapsed_time(end)
        # Matmuls that ran inside the window, and one matmul's time measured in the same loop.
        inside = [e for e in done if begin.elapsed_time(e) > 0 and e.elapsed_time(end) > 0]
        gaps = sorted(g for g in (x.elapsed_time(y) for x, y in itertools.pairwise(done)) if g > 0)
        matmul_ms = gaps[len(gaps) // 4]  # a low quantile: the loop's own pace, not its stalls
        busy = len(inside) * matmul_ms / window_ms
        assert len(inside) >= 5, (len(inside), window_ms, matmul_ms)
        assert busy >= 0.7, f"default stream busy {busy:.2f} of a {window_ms:.1f} ms save window"
        restored = {k: torch.empty_like(v) for k, v in state.items()}
        mgr.restore(2, restored)
    for k, v in expected.items():
        assert torch.equal(restored[k].cpu(), v), k


# -- several processes ----------------------------------------------------------------------------

def _fsdp2_rank(rank: int, world: int, root: str) -> bool:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    mesh = DeviceMesh.from_group(nccl, "cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10)).to(DEV)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 64, device=DEV)

    def train() -> None:
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    train()
    state = {"model": model, "optim": optim}

    def snap() -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v.full_tensor().cpu() for k, v in model.state_dict().items()}
        for i, s in enumerate(optim.state.values()):
            for k, v in s.items():
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"optim.{i}.{k}"] = v.cpu()
        return out

    with CheckpointManager(root, save_interval=1) as mgr:
        expected = snap()
        mgr.save(1, state)
        train()
        mgr.restore(1, state)
    got = snap()
    dist.destroy_process_group(nccl)
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_fsdp2_on_a_one_gpu_nccl_mesh(tmp_path: Path) -> None:
    assert run_ranks(_fsdp2_rank, 1, str(tmp_path / "root"), timeout_s=180) == [True]


SHAPES = {"emb": ((7, 16), torch.bfloat16), "w": ((64, 32), torch.float32),
          "b": ((5,), torch.float32)}


def _full(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def _dtensor_state(world: int, rank: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    torch.cuda.set_device(0)  # every rank shares the one GPU (gloo carries the collectives)
    mesh = DeviceMesh("cuda", list(range(world)))
    out: dict[str, Any] = {}
    for name in SHAPES:
        full = _full(name)
        local = torch.chunk(full, world, dim=0)[rank].contiguous()  # Shard(0)'s split, uneven too
        local = local.to(DEV) if fill else torch.zeros_like(local, device=DEV)
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                       shape=full.shape, stride=full.stride())
    return {"model": out}


def _dtensor_save(rank: int, world: int, root: str) -> bool:
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save_async(5, _dtensor_state(world, rank, fill=True))
    return True


def _dtensor_restore(rank: int, world: int, root: str) -> bool:
    state = _dtensor_state(world, rank, fill=False)
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.restore(5, state)
    for name, dt in state["model"].items():
        local = dt.to_local()
        want = torch.chunk(_full(name), world, dim=0)[rank]
        if local.device.type != "cuda" or not torch.equal(local.cpu(), want):
            return False
    return True


@pytest.mark.parametrize(("save_world", "restore_world"), [(2, 1), (1, 2)])
def test_cuda_dtensors_change_world_size(tmp_path: Path, save_world: int,
                                         restore_world: int) -> None:
    root = str(tmp_path / "root")
    assert run_ranks(_dtensor_save, save_world, root, timeout_s=180) == [True] * save_world
    assert run_ranks(_dtensor_restore, restore_world, root, timeout_s=180) == [True] * restore_world


# -- preemption on a GPU trainer ------------------------------------------------------------------

_TRAINER = r"""
import sys, torch, ckptmgr
p, opt, x = None, None, None

def setup():
    global p, opt, x
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(512, 512, device="cuda"))
    opt = torch.optim.AdamW([p], lr=1e-2)
    x = torch.randn(512, 512, device="cuda")

def train(step):
    p.grad = x * (step * 1e-3)
    opt.step()

if __name__ == "__main__":
    root, ready = sys.argv[1], sys.argv[2]
    setup()
    mgr = ckptmgr.CheckpointManager(root, save_interval=1000, chkpt_on_preemption=True)
    for step in range(1, 10**9):
        train(step)
        mgr.save_async(step, {"model": {"w": p}, "optim": opt})
        if step == 20:
            open(ready, "x").close()
"""


def test_sigterm_on_a_gpu_trainer_takes_the_last_checkpoint(zygote: Zygote,
                                                            tmp_path: Path) -> None:
    root, ready = str(tmp_path / "root"), str(tmp_path / "ready")
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    proc = zygote.spawn([str(script), root, ready])
    wait_for_file(ready, timeout_s=120)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    with CheckpointManager(root, save_interval=1000) as mgr:
        steps = mgr.all_steps()
        assert len(steps) == 1 and steps[0] >= 20, steps
        last = steps[0]
        # The same training replayed here, to the step the signal was seen at.
        ns: dict[str, Any] = {"__name__": "replay"}
        exec(compile(_TRAINER, "trainer", "exec"), ns)  # defines setup/train only
        ns["setup"]()
        for step in range(1, last + 1):
            ns["train"](step)
        p, opt = ns["p"], ns["opt"]
        want = (p.detach().cpu().clone(), {k: v.cpu().clone() for k, v in opt.state[p].items()})
        with torch.no_grad():
            p.zero_()
        mgr.restore(last, {"model": {"w": p}, "optim": opt})
    assert torch.equal(p.detach().cpu(), want[0])
    for k, v in want[1].items():
        assert torch.equal(opt.state[p][k].cpu(), v), k
    assert os.path.exists(ready)
