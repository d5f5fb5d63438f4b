"""The accelerator save path, checked on CPU by simulation (issue 18, items 1 and 2).

A fake process group (world 64, this process is rank 3), device meshes of type ``"cuda"`` and fake
CUDA tensors (``FakeTensorMode``) stand in for a GPU job: FSDP2-style ``Shard(0)`` and 2-D HSDP
``(Replicate, Shard(0))`` DTensor states go through staging, local planning, the global plan over
all 64 simulated ranks and a real write and commit, under a ``TorchDispatchMode`` audit that fails
on any op producing a fresh (non-view) tensor on a non-CPU device. The old staging,
``DTensor.from_local(host_copy, cuda_mesh)``, fails here: it moves the copy back to the device.

This module alone uses ``torch.testing._internal`` (the fake process group): a simulation, not a
real process group; the real gloo tests live elsewhere. The process group is created for this
module and destroyed after it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from ckptmgr._async import Stager
from ckptmgr.dcp.checkpoint import read_restore_source, write_step
from ckptmgr.dcp.planner import CkptSavePlanner, item_bytes
from ckptmgr.dcp.shards import StagedDTensor, coverage_problem
from ckptmgr.errors import CorruptCheckpointError
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage

WORLD, RANK = 64, 3
HSDP = (8, 8)  # (replicate, shard): rank 3 is at (0, 3)

# A tiny Llama-like model: uneven first dimensions leave trailing ranks short or empty.
SHAPES = {"embed.weight": (1000, 64), "layers.0.attn.wq": (256, 64), "layers.0.mlp.w1": (96, 64),
          "layers.0.norm.weight": (64,), "out.bias": (10,)}


class DeviceAllocationAudit(TorchDispatchMode):
    """Records every op whose output is a fresh tensor (not a view) on a device other than the
    CPU (``meta`` tensors, the simulation's stand-ins for other ranks' data, hold no memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.device_allocations: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (list, tuple)) else [out]
        for o in outs:
            if isinstance(o, torch.Tensor) and o.device.type not in ("cpu", "meta") \
                    and not func.is_view:
                self.device_allocations.append(f"{func} -> {o.device}")
        return out


def box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...],
        coord: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The chunk a DTensor's rank at mesh ``coord`` holds (torch.chunk rule: tiles of
    ceil(n/k), trailing ones short or empty at offset n)."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard):
            n, k = sizes[p.dim], mesh_shape[mdim]
            c = -(-n // k)
            start = min(coord[mdim] * c, n)
            offsets[p.dim] += start
            sizes[p.dim] = min(start + c, n) - start
    return offsets, sizes


def coord_of(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(mesh_shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


@pytest.fixture(scope="module")
def meshes() -> Iterator[dict[str, DeviceMesh]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield {"fsdp": init_device_mesh("cuda", (WORLD,)),
               "hsdp": init_device_mesh("cuda", HSDP, mesh_dim_names=("replicate", "shard"))}
    finally:
        dist.destroy_process_group()


def fake_cuda_state(mesh: DeviceMesh) -> dict[str, Any]:
    """Rank 3's flat state: bf16 parameters and fp32 AdamW moments as fake CUDA DTensors, a
    CPU step counter and a Python value."""
    placements: tuple[Any, ...] = ((Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0)))
    coord = mesh.get_coordinate()
    assert coord is not None
    flat: dict[str, Any] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for name, shape in SHAPES.items():
            _, sizes = box(shape, tuple(mesh.shape), placements, tuple(coord))
            for key, dtype in ((f"model.{name}", torch.bfloat16),
                               (f"optim.state.{name}.exp_avg", torch.float32),
                               (f"optim.state.{name}.exp_avg_sq", torch.float32)):
                local = torch.empty(sizes, dtype=dtype, device="cuda")
                flat[key] = DTensor.from_local(local, mesh, placements, run_check=False,
                                               shape=torch.Size(shape),
                                               stride=torch.empty(shape, device="meta").stride())
    flat["optim.state.step"] = torch.tensor(7.0)
    flat["extra"] = {"epoch": 2, "hist": [1, 2]}
    return flat


def simulated_plans(mesh: DeviceMesh, staged: dict[str, Any]) -> list[SavePlan]:
    """Every rank's local plan, from our planner's local-plan code on stand-ins built from each
    rank's chunk; rank 3's plan is the one of the real staged state."""
    plans = []
    for rank in range(WORLD):
        if rank == RANK:
            flat = staged
        else:
            coord = coord_of(rank, tuple(mesh.shape))
            flat = {}
            for key, value in staged.items():
                if not isinstance(value, StagedDTensor):
                    flat[key] = value
                    continue
                offsets, sizes = box(tuple(value.global_shape), tuple(mesh.shape),
                                     value.placements, coord)
                chunk = type(value.chunks[0])(torch.Size(offsets), torch.Size(sizes))
                flat[key] = StagedDTensor(
                    torch.empty(sizes, dtype=value.dtype, device="meta"),
                    global_shape=value.global_shape, dtype=value.dtype, chunks=[chunk],
                    properties=value.properties, placements=value.placements, mesh=None)
        planner = CkptSavePlanner()
        planner.set_up_planner(flat, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    return plans


@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_staging_and_planning_allocate_nothing_on_the_device(
        meshes: dict[str, DeviceMesh], kind: str, tmp_path: Any) -> None:
    mesh = meshes[kind]
    live = fake_cuda_state(mesh)
    stager = Stager()
    audit = DeviceAllocationAudit()
    with audit:
        staged = stager.stage(live)
        local = CkptSavePlanner()
        local.set_up_planner(staged, is_coordinator=False)
        staged_plan = local.create_local_plan()
        plans = simulated_plans(mesh, staged)
        coordinator = CkptSavePlanner()
        global_plans, metadata = coordinator.create_global_plan(plans)
        again = CkptSavePlanner()
        again.set_up_planner(staged, is_coordinator=False)
        cached_check = again.create_local_plan()
    assert audit.ops, "the audit saw no op: it is not hooked in"
    assert audit.device_allocations == []

    # Staged values are host tensors plus the layout they came from.
    for key, value in live.items():
        if isinstance(value, DTensor):
            s = staged[key]
            assert isinstance(s, StagedDTensor)
            (data,) = s.local_shards()
            assert data.device.type == "cpu" and not isinstance(data, DTensor)
            assert tuple(data.shape) == tuple(value.to_local().shape)
            assert s.placements == tuple(value.placements) and s.mesh is mesh
            assert s.chunks == tuple(value.__create_chunk_list__())
        else:
            assert not isinstance(staged[key], torch.Tensor) or staged[key].device.type == "cpu"
    n_tensors = sum(isinstance(v, DTensor) for v in live.values())
    assert stager.nbytes == stager.last_staged_bytes == sum(
        v.to_local().numel() * v.dtype.itemsize for v in live.values()
        if isinstance(v, DTensor)) + 4  # the step counter
    assert stager.pinned_nbytes == 0  # no CUDA runtime here: pinned only where CUDA is available

    # The staged state plans exactly as the live DTensors do (same items, same properties).
    live_planner = CkptSavePlanner()
    live_planner.set_up_planner(live, is_coordinator=False)
    assert staged_plan.items == live_planner.create_local_plan().items
    assert cached_check.items == staged_plan.items
    # ... and our chunk rule, used for the other 63 ranks, agrees with DTensor's at rank 3.
    assert plans[RANK].items == staged_plan.items

    # The global plan over 64 simulated ranks: every tensor tiled exactly once, each replicated
    # item kept once, the same metadata as DCP's own planner.
    shard_items = [i for i in staged_plan.items if i.type == WriteItemType.SHARD]
    assert len(shard_items) == n_tensors
    sdm = metadata.state_dict_metadata
    for key, value in live.items():
        if isinstance(value, DTensor):
            chunks = sdm[key].chunks  # type: ignore[union-attr]
            boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
            assert coverage_problem(tuple(value.shape), boxes) is None
    owners: dict[Any, int] = {}
    for rank, plan in enumerate(global_plans):
        for item in plan.items:
            assert item.index not in owners, f"{item.index} written twice"
            owners[item.index] = rank
    dcp_plans, dcp_md = DefaultSavePlanner(flatten_state_dict=False).create_global_plan(plans)
    assert set(dcp_md.state_dict_metadata) == set(sdm)
    for key, md in dcp_md.state_dict_metadata.items():
        ours = sdm[key]
        assert type(ours) is type(md)
        if hasattr(md, "chunks"):
            assert sorted(map(str, md.chunks)) == sorted(map(str, ours.chunks))  # type: ignore
    assert sum(len(p.items) for p in dcp_plans) == len(owners)
    per_rank = [sum(map(item_bytes, p.items)) for p in global_plans]
    largest = max(item_bytes(i) for p in plans for i in p.items)
    if kind == "fsdp":
        # Each shard is written by the rank holding it.
        assert all(owners[i.index] == RANK for i in shard_items)
    else:
        # 8 replicas of every chunk: each kept once, spread over its holders by bytes (the
        # coordinator also writes the metadata, so its share is left out).
        assert max(per_rank[1:]) - min(per_rank[1:]) <= largest
    assert sum(per_rank) == sum(
        math.prod(v.shape) * v.dtype.itemsize for v in live.values()
        if isinstance(v, DTensor)) + 4 + 64  # the step counter; a Python value counts 64


def test_writing_and_commit_allocate_nothing_on_the_device(
        meshes: dict[str, DeviceMesh], tmp_path: Any) -> None:
    """Stage, plan, write the data files, the metadata and the manifest, commit: no device
    allocation on the way (rank 3's shards, written as a one-rank save)."""
    live = fake_cuda_state(meshes["fsdp"])
    store = StepStore(open_storage(str(tmp_path)))
    plan = store.begin_save(5, forced=True, overwrite=False, world_size=1)
    assert plan is not None
    audit = DeviceAllocationAudit()
    with audit:
        staged = Stager().stage(live)
        outcome = write_step(staged, store, plan, rank=0, group=None,
                             planner=CkptSavePlanner(), trusted=False)
    assert audit.device_allocations == []
    assert outcome.manifest is not None and store.committed_steps() == [5]
    # Rank 3's shard alone (rows 48-63): a reader refuses the step, whose chunks leave a gap.
    with pytest.raises(CorruptCheckpointError, match=r"no chunk holds \[0, 48\) of dimension 0"):
        read_restore_source(store, 5, verify=True)


def test_the_audit_catches_a_device_copy(meshes: dict[str, DeviceMesh]) -> None:
    """What the old staging did, ``DTensor.from_local(host_copy, cuda_mesh)``: moving the host
    copy back to the mesh's device fails the audit (or, without CUDA, raises outright)."""
    live = fake_cuda_state(meshes["fsdp"])["model.out.bias"]
    host = torch.empty(live.to_local().shape, dtype=live.dtype)
    audit = DeviceAllocationAudit()
    try:
        with audit, FakeTensorMode(allow_non_fake_inputs=True):
            DTensor.from_local(host, live.device_mesh, live.placements, run_check=False,
                               shape=live.shape, stride=live.stride())
    except (RuntimeError, AssertionError):
        return  # "PyTorch is not linked with support for cuda devices": the hidden device copy
    assert audit.device_allocations
