"""XLA-SPMD planners against the CPU model of the shard interface (no torch_xla needed).

The CPU model lays shards out as XLA does; these tests check the layouts themselves, that every
saved chunk is written exactly once (replicas deduplicated within a process and across ranks, with
balanced writes), that a missing element fails the save, and that any mesh restores into any other.
The same planners run on real torch_xla in tests/xla/real (the XLA lane).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _metadata import metadata_doc
from _procs import run_ranks

from ckptmgr import CheckpointManager, ConfigError, SaveError, StateMismatchError
from ckptmgr.dcp.shards import (
    CpuShardedTensor,
    ShardedTensor,
    ShardInfo,
    StagedShards,
    coverage_problem,
    distinct_shards,
)

# (mesh shape, partition spec, device ids or None) per layout name, for 2-D tensors.
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Any, ...], list[int] | None]] = {
    "tiled_2x2": ((2, 2), (0, 1), None),
    "tiled_2x2_transposed": ((2, 2), (1, 0), None),
    "shuffled_devices": ((2, 2), (0, 1), [3, 1, 0, 2]),
    "rows_4": ((4,), (0, None), None),
    "cols_4": ((4,), (None, 0), None),
    "partial_rows_2x2": ((2, 2), (0, None), None),
    "partial_cols_2x2": ((2, 2), (None, 1), None),
    "partial_2x2x2": ((2, 2, 2), (2, 0), None),
    "two_axes_on_one_dim": ((2, 2), ((0, 1), None), None),
    "replicated_4": ((4,), (None, None), None),
    "replicated_2x2": ((2, 2), (None, None), None),
}

# Shapes: even, uneven (padding), smaller than the mesh (empty tiles), empty.
SHAPES = [(8, 6), (5, 3), (3, 1), (0, 4)]


def _value(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0
           ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _sharded(t: torch.Tensor, layout: str, **kw: Any) -> CpuShardedTensor:
    mesh, spec, ids = LAYOUTS[layout]
    return CpuShardedTensor(t, mesh, spec, device_ids=ids, **kw)


# ----------------------------------------------------------------------------- the CPU model


def test_model_tiled_uneven_layout_matches_xla_rules() -> None:
    st = CpuShardedTensor(torch.arange(15.0).reshape(5, 3), (2, 2), (0, 1))
    got = [(i.device, i.offsets, i.sizes, i.padded_sizes, i.replica_id) for i in st.layout()]
    assert got == [
        ("cpu:0", (0, 0), (3, 2), (3, 2), 0),
        ("cpu:1", (0, 2), (3, 1), (3, 2), 0),
        ("cpu:2", (3, 0), (2, 2), (3, 2), 0),
        ("cpu:3", (3, 2), (2, 1), (3, 2), 0),
    ]
    # padding sits at the end and is zero
    assert st.local_shards()[3].tolist() == [[11.0, 0.0], [14.0, 0.0], [0.0, 0.0]]


def test_model_empty_tiles_and_replica_ids() -> None:
    st = CpuShardedTensor(torch.arange(3.0), (4,), (0,))
    assert [(i.offsets, i.sizes, i.padded_sizes) for i in st.layout()] == [
        ((0,), (1,), (1,)), ((1,), (1,), (1,)), ((2,), (1,), (1,)), ((3,), (0,), (1,))]
    partial = CpuShardedTensor(torch.zeros(4, 4), (2, 2), (0, None))
    assert [(i.offsets, i.replica_id) for i in partial.layout()] == [
        ((0, 0), 0), ((0, 0), 1), ((2, 0), 0), ((2, 0), 1)]
    replicated = CpuShardedTensor(torch.zeros(4, 4), (2, 2), (None, None), device_ids=[2, 0, 3, 1])
    # fully replicated: XLA reports the device ordinal as the replica id
    assert [(i.device, i.replica_id) for i in replicated.layout()] == [
        ("cpu:2", 2), ("cpu:0", 0), ("cpu:3", 3), ("cpu:1", 1)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_model_reassembles_and_dedup_keeps_each_element_once(layout: str,
                                                             shape: tuple[int, int]) -> None:
    t = _value(shape)
    st = _sharded(t, layout)
    assert torch.equal(st.to_full(), t)
    infos = st.layout()
    keep = distinct_shards(infos, st.global_shape)
    boxes = [infos[i].box for i in keep]
    assert len(set(boxes)) == len(boxes)
    assert coverage_problem(shape, boxes) is None
    assert sum(math.prod(s) for _, s in boxes) == t.numel()


def test_model_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="entries for a 2-d tensor"):
        CpuShardedTensor(torch.zeros(2, 2), (4,), (0,))
    with pytest.raises(ValueError, match="uses a mesh axis twice"):
        CpuShardedTensor(torch.zeros(2, 2), (2, 2), (0, 0))
    with pytest.raises(ValueError, match="names no axis"):
        CpuShardedTensor(torch.zeros(2, 2), (2, 2), (0, 2))
    with pytest.raises(ValueError, match="permutation"):
        CpuShardedTensor(torch.zeros(2, 2), (2, 2), (0, 1), device_ids=[0, 0, 1, 2])


# ----------------------------------------------------------------------------- coverage check


def test_coverage_problem_messages() -> None:
    assert coverage_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    missing = coverage_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2))])
    assert missing is not None and "cover 12 of its 16" in missing and "[2, 2]" in missing
    overlap = coverage_problem((4,), [((0,), (3,)), ((2,), (2,))])
    assert overlap is not None and "overlap" in overlap
    outside = coverage_problem((4,), [((0,), (2,)), ((2,), (3,))])
    assert outside is not None and "outside" in outside
    assert coverage_problem((), [((), ())]) is None
    assert coverage_problem((0, 3), []) is None


# ----------------------------------------------------------------------------- one process


def _chunks_in_checkpoint(root: Path, step: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    meta = metadata_doc(next((root / str(step)).glob("metadata-*.json")).read_bytes())
    stored = [(e["fqn"], e["offset"]) for e in meta["storage"]]
    assert len(stored) == len({(f, tuple(o or ())) for f, o in stored})  # each chunk once
    return {fqn: [(c["offsets"], c["sizes"]) for c in t["chunks"]]
            for fqn, t in meta["tensors"].items()}


def _state(seed: int, mesh_for: dict[str, str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    values = {
        "even": _value((8, 6), seed=seed),
        "uneven": _value((5, 3), seed=seed + 1),
        "tiny": _value((3, 1), seed=seed + 2),
        "empty": _value((0, 4), seed=seed + 3),
        "bf16": _value((6, 5), torch.bfloat16, seed=seed + 4),
        "ints": _value((7, 2), torch.int64, seed=seed + 5),
    }
    state: dict[str, Any] = {k: _sharded(v, mesh_for[k]) for k, v in values.items()}
    state["plain"] = _value((4,), seed=seed + 6)
    state["step"] = seed
    return state, values


SAVE_MESH = {"even": "tiled_2x2", "uneven": "partial_rows_2x2", "tiny": "rows_4",
             "empty": "cols_4", "bf16": "replicated_2x2", "ints": "partial_2x2x2"}
LOAD_MESH = {"even": "partial_cols_2x2", "uneven": "shuffled_devices", "tiny": "replicated_4",
             "empty": "tiled_2x2", "bf16": "two_axes_on_one_dim", "ints": "tiled_2x2_transposed"}


def _blank(mesh_for: dict[str, str]) -> dict[str, Any]:
    state, values = _state(99, mesh_for)
    for k, v in values.items():
        state[k] = _sharded(torch.zeros_like(v), mesh_for[k])
    state["plain"] = torch.zeros(4)
    state["step"] = -1
    return state


@pytest.mark.parametrize("background", [False, True], ids=["save", "save_async"])
def test_round_trip_to_another_mesh_writes_each_chunk_once(tmp_path: Path,
                                                           background: bool) -> None:
    state, values = _state(1, SAVE_MESH)
    with CheckpointManager(str(tmp_path), 5) as mgr:
        if background:
            assert mgr.save_async(5, state)
            for k in values:  # mutations after save_async returned never reach the checkpoint
                st = state[k]
                st.load_local_shards_([torch.ones_like(d) for d in st.local_shards()])
            mgr.join()
        else:
            assert mgr.save(5, state)
        stats = mgr.last_save_stats
        assert stats is not None
        tensor_bytes = sum(v.numel() * v.element_size() for v in values.values()) + 16
        # every element of every tensor once: no replica, no padding written (+ one small value)
        assert tensor_bytes <= stats.total_bytes <= tensor_bytes + 8
        chunks = _chunks_in_checkpoint(tmp_path, 5)
        assert len(chunks["uneven"]) == 2 and len(chunks["bf16"]) == 1
        assert len(chunks["tiny"]) == 3  # the empty fourth tile is not stored

        dst = _blank(LOAD_MESH)
        mgr.restore(5, dst)
    for k, v in values.items():
        assert torch.equal(dst[k].to_full(), v), k
        for buf, info in zip([dst[k].shard_data(i) for i in range(len(dst[k].layout()))],
                             dst[k].layout(), strict=True):
            # padding of restored shards is zero, like a freshly sharded tensor
            assert buf.sum().item() == unpadded_sum(buf, info)
    assert torch.equal(dst["plain"], state["plain"]) and dst["step"] == 1


def unpadded_sum(buf: torch.Tensor, info: ShardInfo) -> float:
    return float(buf[tuple(slice(0, s) for s in info.sizes)].sum().item())


def test_restore_into_plain_tensors_and_back(tmp_path: Path) -> None:
    state, values = _state(2, SAVE_MESH)
    with CheckpointManager(str(tmp_path), 1) as mgr:
        mgr.save(1, state)
        plain = {k: torch.zeros_like(v) for k, v in values.items()}
        mgr.restore(1, plain)
        for k, v in values.items():
            assert torch.equal(plain[k], v), k
        # and plain tensors saved restore into sharded ones
        mgr.save(2, {k: v.clone() for k, v in values.items()})
        dst = {k: _sharded(torch.zeros_like(v), LOAD_MESH[k]) for k, v in values.items()}
        mgr.restore(2, dst)
    for k, v in values.items():
        assert torch.equal(dst[k].to_full(), v), k


class _Dropping(CpuShardedTensor):
    """A faulty shard source: forgets the shards of one device (a lost shard must not pass)."""

    def __init__(self, *args: Any, drop: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._drop = drop

    def layout(self) -> list[ShardInfo]:
        return [i for i in super().layout() if i.device != f"cpu:{self._drop}"]

    def local_shards(self) -> list[torch.Tensor]:
        infos = super().layout()
        data = super().local_shards()
        return [d for d, i in zip(data, infos, strict=True) if i.device != f"cpu:{self._drop}"]


def test_missing_element_fails_the_save_and_keeps_the_last_step(tmp_path: Path) -> None:
    t = _value((5, 3))
    with CheckpointManager(str(tmp_path), 1) as mgr:
        mgr.save(1, {"w": CpuShardedTensor(t, (2, 2), (0, 1))})
        bad = _Dropping(t, (2, 2), (0, 1), drop=2)
        with pytest.raises(SaveError, match=r"'w'.*cover 11 of its 15 elements.*\[3, 0\]"):
            mgr.save(2, {"w": bad})
        assert mgr.all_steps() == [1]
        # a partially replicated tensor losing one replica is still complete: saved
        ok = _Dropping(t, (2, 2), (0, None), drop=1)
        assert mgr.save(3, {"w": ok})
        out = {"w": torch.zeros(5, 3)}
        mgr.restore(3, out)
    assert torch.equal(out["w"], t)


def test_shape_and_dtype_mismatch_is_a_state_mismatch(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), 1) as mgr:
        mgr.save(1, {"w": CpuShardedTensor(_value((4, 4)), (2, 2), (0, 1))})
        with pytest.raises(StateMismatchError, match="shape"):
            mgr.restore(1, {"w": CpuShardedTensor(torch.zeros(4, 5), (2, 2), (0, 1))})
        with pytest.raises(StateMismatchError, match="dtype"):
            mgr.restore(1, {"w": CpuShardedTensor(torch.zeros(4, 4, dtype=torch.float64),
                                                  (2, 2), (0, 1))})


def test_planner_dcp_refuses_sharded_values(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), 1, planner="dcp") as mgr, pytest.raises(
            ConfigError, match="planner='dcp'"):
        mgr.save(1, {"w": CpuShardedTensor(torch.zeros(4), (2,), (0,))})


def test_staging_copies_no_replica(tmp_path: Path) -> None:
    t = _value((64, 64))
    st = CpuShardedTensor(t, (2, 2), (None, None))  # four replicas
    staged = StagedShards.stage(st)
    assert len(staged.layout()) == 1 and torch.equal(staged.local_shards()[0], t)
    with CheckpointManager(str(tmp_path), 1) as mgr:
        mgr.save_async(1, {"w": st})
        mgr.join()
        assert mgr._stager.nbytes == t.numel() * t.element_size()


def test_unchanged_layout_reuses_the_plan_and_a_new_one_replans(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), 1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": CpuShardedTensor(_value((8, 8), seed=step), (2, 2), (0, 1))})
        planner = mgr._durable.planners.get(True)
        assert planner is not None and planner.global_plan_reuses == 1
        t = _value((8, 8), seed=3)
        mgr.save(3, {"w": CpuShardedTensor(t, (4,), (None, 0))})  # another layout: re-planned
        assert planner.global_plan_reuses == 1
        out = {"w": torch.zeros(8, 8)}
        mgr.restore(3, out)
    assert torch.equal(out["w"], t)


class _Interface(ShardedTensor):
    """A minimal third-party implementation of the interface (no CPU-model internals)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def global_shape(self) -> torch.Size:
        return self.t.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    def layout(self) -> list[ShardInfo]:
        half = self.t.shape[0] // 2
        rest = self.t.shape[0] - half
        return [ShardInfo("a", (0,), (half,), (half,), 0),
                ShardInfo("b", (half,), (rest,), (rest + 1,), 0)]

    def local_shards(self) -> list[torch.Tensor]:
        half = self.t.shape[0] // 2
        return [self.t[:half].clone(), torch.cat([self.t[half:], torch.zeros(1)])]

    def load_local_shards_(self, data: Any) -> None:
        half = self.t.shape[0] // 2
        self.t[:half] = data[0]
        self.t[half:] = data[1][:-1]


def test_any_implementation_of_the_interface(tmp_path: Path) -> None:
    t = _value((5,))
    with CheckpointManager(str(tmp_path), 1) as mgr:
        mgr.save(1, {"w": _Interface(t.clone())})
        out = _Interface(torch.zeros(5))
        mgr.restore(1, {"w": out})
    assert torch.equal(out.t, t)


# ----------------------------------------------------------------------------- several ranks


def _two_hosts(rank: int, world: int, root: str) -> dict[str, Any]:
    # 8 devices on a 4x2 mesh, 4 per host (rank); the row axis spans hosts.
    mesh = (4, 2)
    local = list(range(rank * 4, rank * 4 + 4))
    t = _value((90, 40), seed=7)
    r = _value((600,), seed=8)
    state = {"tiled": CpuShardedTensor(t, mesh, (0, 1), local_devices=local),
             "partial": CpuShardedTensor(t, mesh, (None, 1), local_devices=local),
             "replicated": CpuShardedTensor(r, mesh, (None,), local_devices=local)}
    with CheckpointManager(root, 1) as mgr:
        mgr.save_async(1, state)
        mgr.join()
        stats = mgr.last_save_stats
        assert stats is not None
        # restore at world 2 on a transposed layout
        dst = {"tiled": CpuShardedTensor(torch.zeros(90, 40), (2, 4), (1, 0), local_devices=local),
               "partial": CpuShardedTensor(torch.zeros(90, 40), mesh, (0, None),
                                           local_devices=local),
               "replicated": CpuShardedTensor(torch.zeros(600), mesh, (0,), local_devices=local)}
        mgr.restore(1, dst)
    ok = all(
        torch.equal(info_data, t[tuple(slice(o, o + s) for o, s in zip(i.offsets, i.sizes,
                                                                          strict=True))])
        for k in ("tiled", "partial")
        for i, info_data in ((i, d[tuple(slice(0, s) for s in i.sizes)])
                             for i, d in zip(dst[k].layout(), dst[k].local_shards(),
                                             strict=True)))
    ok_r = all(torch.equal(d[tuple(slice(0, s) for s in i.sizes)], r[i.offsets[0]:
                                                                        i.offsets[0] + i.sizes[0]])
               for i, d in zip(dst["replicated"].layout(), dst["replicated"].local_shards(),
                               strict=True))
    return {"bytes": stats.bytes, "total": stats.total_bytes, "ok": ok and ok_r}


def test_two_hosts_write_each_chunk_once_balanced_and_reshard(tmp_path: Path) -> None:
    root = str(tmp_path)
    r0, r1 = run_ranks(_two_hosts, 2, root)
    assert r0["ok"] and r1["ok"]
    tensor_bytes = 2 * 90 * 40 * 4 + 600 * 4
    assert r0["total"] == r1["total"] == tensor_bytes
    # Tiled rows: rank 0 holds 46 rows (7360 bytes), rank 1 44 (7040). The two 7200-byte column
    # halves of the partially replicated tensor live on both hosts: one goes to each.
    assert r0["bytes"] == 7360 + 7200 and r1["bytes"] == 7040 + 7200 + 2400
    # and world size 1 restores it whole
    out = {"tiled": torch.zeros(90, 40), "partial": torch.zeros(90, 40),
           "replicated": torch.zeros(600)}
    with CheckpointManager(root, 1) as mgr:
        mgr.restore(1, out)
    assert torch.equal(out["tiled"], _value((90, 40), seed=7))
    assert torch.equal(out["partial"], _value((90, 40), seed=7))
    assert torch.equal(out["replicated"], _value((600,), seed=8))
    assert os.listdir(root) == ["1"]


class _Refusing(CpuShardedTensor):
    def load_local_shards_(self, data: Any) -> None:
        raise RuntimeError("device refused the shard")


def test_write_back_failure_is_a_restore_error(tmp_path: Path) -> None:
    from ckptmgr import RestoreError

    with CheckpointManager(str(tmp_path), 1) as mgr:
        mgr.save(1, {"w": CpuShardedTensor(_value((4, 4)), (2, 2), (0, 1))})
        with pytest.raises(RestoreError, match="device refused the shard"):
            mgr.restore(1, {"w": _Refusing(torch.zeros(4, 4), (2, 2), (0, 1))})
