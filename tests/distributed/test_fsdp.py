"""FSDP2, HSDP and DDP state through ckptmgr on real gloo process groups (CPU).

One spawned group of 4 processes runs every case, to pay process start-up and the torch/FSDP imports
once (RECIPES.md). The processes run in phases, each a fresh default process group of the phase's
real world size over the parent's TCPStore (a prefix per phase), so "restore at 3 ranks" is a world
of 3, not a subgroup:

- w2 (ranks 0-1): FSDP2 trains 3 steps, saves step 2, trains step 3 -> the references; a fresh
  model restores step 2 at the same world size.
- w3 (ranks 0-2), w4 (ranks 0-3): fresh FSDP2 models restore step 2 (uneven shards at 3), compare
  the gathered full state with the reference bit for bit, train step 3 and compare again.
- w4 also: HSDP on a 2x2 mesh restores the FSDP checkpoint, trains step 3, saves it (replicas
  deduplicated, balanced); DDP with 16 equal layers saves (each replicated tensor once, bytes per
  rank within 10%).
- w1 (rank 0 alone, no process group): a plain model restores both checkpoints.

Training is made independent of the world size so "the next step equals the uninterrupted run's"
can be checked bit for bit at every world size: every rank computes the loss on the same full
batch, ranks other than 0 multiply it by zero, and gradients are summed (divide factor 1), so the
reduced gradient is exactly rank 0's, whatever the number of ranks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _procs import rank_store, run_ranks

WIDTH = 64
PHASE_TIMEOUT_S = 150.0


# -------------------------------------------------------------------------------- phases


def _phase(store: Any, name: str, rank: int, world: int) -> bool:
    """Join the default process group of phase ``name`` (ranks < world); False for other ranks."""
    if rank >= world:
        return False
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{name}/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=PHASE_TIMEOUT_S))
    return True


# -------------------------------------------------------------------- model and training


class Net(torch.nn.Module):
    """Three square layers, an uneven head (8 rows: 3/3/2 shards at 3 ranks) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(100 + step))


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int,
                rank: int) -> None:
    loss = model(_batch(step)).square().mean()
    if rank != 0:
        loss = loss * 0.0  # see the module docstring: the summed gradient is rank 0's, exactly
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _build(seed: int, mesh: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Net from ``seed``; sharded with fully_shard over ``mesh`` (1-D: FSDP, 2-D: HSDP)."""
    torch.manual_seed(seed)
    model = Net()
    if mesh is not None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded model + optimizer state as one flat dict (on rank 0; empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    sharded = dist.is_initialized()
    opts = StateDictOptions(full_state_dict=sharded, cpu_offload=sharded)
    msd, osd = get_state_dict(model, optim, options=opts)
    flat: dict[str, Any] = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():
        for k, v in st.items():
            flat[f"optim.{fqn}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    if "param_groups" in osd:
        flat["optim.param_groups"] = repr(osd["param_groups"])
    return flat


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ (bits and dtype for tensors), or that only one side has."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# -------------------------------------------------------------------------- the cases


def _restore_and_step(mgr: Any, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer,
                      rank: int, refs: dict[str, Any]) -> dict[str, Any]:
    """Restore ``step`` into a fresh model, then train step 3; diffs against the references."""
    from ckptmgr.dcp import ModelOptimizerState

    state = {"app": ModelOptimizerState(model, optim), "progress": {"step": -1}}
    mgr.restore(step, state)
    out: dict[str, Any] = {"progress": state["progress"]["step"]}
    restored = _full_state(model, optim)
    _train_step(model, optim, 3, rank)
    after = _full_state(model, optim)
    if rank == 0:
        out["restored_diff"] = _diff(restored, refs["saved"])
        out["next_diff"] = _diff(after, refs["next"])
        out["num_keys"] = len(restored)
    return out


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    store = rank_store()
    from torch.distributed.device_mesh import init_device_mesh

    import ckptmgr
    from ckptmgr.dcp import ModelOptimizerState

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    fsdp_root, hsdp_root, ddp_root = (str(Path(root) / n) for n in ("fsdp", "hsdp", "ddp"))
    out: dict[str, Any] = {}
    capture = _Capture()
    logging.getLogger("ckptmgr").addHandler(capture)
    logging.getLogger("ckptmgr").setLevel(logging.INFO)
    refs: dict[str, Any] = {}

    # -- w2: the uninterrupted run, its checkpoint at step 2, and a same-size restore
    if _phase(store, "w2", rank, 2):
        model, optim = _build(0, init_device_mesh("cpu", (2,)))
        with ckptmgr.CheckpointManager(fsdp_root, save_interval=1) as mgr:
            for s in range(3):
                _train_step(model, optim, s, rank)
            mgr.save(2, {"app": ModelOptimizerState(model, optim), "progress": {"step": 2}})
            refs["saved"] = _full_state(model, optim)
            _train_step(model, optim, 3, rank)
            refs["next"] = _full_state(model, optim)
            info = mgr.step_info(2)
            md_size = next(f.size for f in info.files if f.path.startswith("metadata-"))
            out["w2_bytes_per_rank"] = dict(info.bytes_per_rank)
            out["w2_data_bytes_per_rank"] = {r: b - (md_size if r == 0 else 0)
                                             for r, b in info.bytes_per_rank.items()}
            model, optim = _build(1, init_device_mesh("cpu", (2,)))
            out["w2"] = _restore_and_step(mgr, 2, model, optim, rank, refs)
        dist.destroy_process_group()
    out["t_w2"] = time.perf_counter() - t0

    # -- w3: uneven shards
    if _phase(store, "w3", rank, 3):
        model, optim = _build(1, init_device_mesh("cpu", (3,)))
        with ckptmgr.CheckpointManager(fsdp_root, save_interval=1) as mgr:
            capture.lines.clear()
            out["w3"] = _restore_and_step(mgr, 2, model, optim, rank, refs)
            out["w3_report"] = [m for m in capture.lines if m.startswith("restore plan")]
        dist.destroy_process_group()
    out["t_w3"] = time.perf_counter() - t0

    # -- w4: FSDP, then HSDP 2x2 (restore, step, save), then DDP balance. The managers stay open
    # until the phase ends: see _dist.make_group's group names (a closed manager's name is reused).
    if _phase(store, "w4", rank, 4):
        with contextlib.ExitStack() as managers:
            fsdp_mgr = managers.enter_context(ckptmgr.CheckpointManager(fsdp_root, 1))
            model, optim = _build(1, init_device_mesh("cpu", (4,)))
            out["w4"] = _restore_and_step(fsdp_mgr, 2, model, optim, rank, refs)
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            model, optim = _build(1, mesh)
            out["hsdp"] = _restore_and_step(fsdp_mgr, 2, model, optim, rank, refs)
            hsdp_mgr = managers.enter_context(ckptmgr.CheckpointManager(hsdp_root, 1))
            hsdp_mgr.save(3, {"app": ModelOptimizerState(model, optim), "progress": {"step": 3}})
            out["hsdp_bytes_per_rank"] = dict(hsdp_mgr.step_info(3).bytes_per_rank)
            ddp_mgr = managers.enter_context(ckptmgr.CheckpointManager(ddp_root, 1))
            out["ddp"] = _ddp_balance(ddp_mgr, ddp_root)
        dist.destroy_process_group()
    out["t_w4"] = time.perf_counter() - t0

    # -- w1: a plain model, no process group
    if rank == 0:
        assert not dist.is_initialized()
        with ckptmgr.CheckpointManager(fsdp_root, save_interval=1) as mgr:
            model, optim = _build(1)
            out["w1"] = _restore_and_step(mgr, 2, model, optim, rank, refs)
        with ckptmgr.CheckpointManager(hsdp_root, save_interval=1) as mgr:
            model, optim = _build(1)
            state = {"app": ModelOptimizerState(model, optim), "progress": {"step": -1}}
            mgr.restore(3, state)
            out["w1_from_hsdp_diff"] = _diff(_full_state(model, optim), refs["next"])
            out["w1_from_hsdp_progress"] = state["progress"]["step"]
    out["t_w1"] = time.perf_counter() - t0
    return out


def _ddp_balance(mgr: Any, root: str) -> dict[str, Any]:
    """DDP (replicated) model of 16 equal layers + Adam: bytes per rank, copies per item."""
    from torch.nn.parallel import DistributedDataParallel

    from ckptmgr.dcp import ModelOptimizerState
    from ckptmgr.dcp.metadata import decode_metadata

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(16))))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(_batch(0)).sum().backward()
    optim.step()
    mgr.save(1, {"app": ModelOptimizerState(model, optim)})
    info = mgr.step_info(1)
    md_file = next(f.path for f in info.files if f.path.startswith("metadata-"))
    md = decode_metadata((Path(root) / "1" / md_file).read_bytes())
    copies: dict[str, int] = {}
    for idx in md.storage_data:
        copies[idx.fqn] = copies.get(idx.fqn, 0) + 1
    tensor_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"bytes_per_rank": dict(info.bytes_per_rank), "copies": copies,
            "model_tensor_bytes": tensor_bytes}


@pytest.mark.slow
def test_fsdp_hsdp_ddp_reshard_across_world_sizes(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTMGR_COLLECTIVE_TIMEOUT_S", "60")  # the ranks' collectives
    results = run_ranks(_worker, 4, str(tmp_path), timeout_s=400.0, group=False)
    r0 = results[0]
    for case in ("w2", "w3", "w4", "hsdp", "w1"):
        assert r0[case]["restored_diff"] == [], (case, r0[case]["restored_diff"][:10])
        assert r0[case]["next_diff"] == [], (case, r0[case]["next_diff"][:10])
        assert r0[case]["num_keys"] > 20
        for r in results:
            if case in r:
                assert r[case]["progress"] == 2
    assert r0["w1_from_hsdp_diff"] == [] and r0["w1_from_hsdp_progress"] == 3

    # the compatibility report names the world sizes and what is resharded
    (report,) = r0["w3_report"]
    assert "saved by 2 rank(s)" in report and "restoring on 3" in report
    assert "resharded on this rank" in report and "head.weight" in report

    print("seconds after start:", {k: round(v, 1) for k, v in r0.items() if k.startswith("t_")})
    print("bytes per rank: fsdp", r0["w2_bytes_per_rank"], "hsdp", r0["hsdp_bytes_per_rank"],
          "ddp", r0["ddp"]["bytes_per_rank"])
    # FSDP: shards are written by their owners, so data is even (equal-size shards at 2 ranks);
    # the coordinator also writes the metadata (15% of this tiny model's bytes)
    bpr = r0["w2_data_bytes_per_rank"]
    assert set(bpr) == {0, 1} and max(bpr.values()) <= 1.10 * min(bpr.values()), bpr
    # HSDP: each shard has two replicas (ranks 0/2 and 1/3), each written once by one of them;
    # this model's 8 KiB items are 20% of a rank's share, so balance is to within one item
    bpr = r0["hsdp_bytes_per_rank"]
    assert set(bpr) == {0, 1, 2, 3} and max(bpr.values()) - min(bpr.values()) <= 16 * 1024, bpr
    # DDP: every replicated item written once, bytes per rank within 10%
    ddp = r0["ddp"]
    assert set(ddp["copies"].values()) == {1}, ddp["copies"]
    bpr = ddp["bytes_per_rank"]
    assert set(bpr) == {0, 1, 2, 3} and max(bpr.values()) <= 1.10 * min(bpr.values()), bpr
    assert sum(bpr.values()) < 3.5 * ddp["model_tensor_bytes"]  # params + 2 Adam moments + md
