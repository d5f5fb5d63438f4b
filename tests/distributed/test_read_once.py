"""Read once, then share (issue 18 item 3): replicated state is read from storage by one rank
and broadcast, real gloo ranks; bytes read per rank come from the manager's restore event."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _procs import run_ranks

_N, _SIZE = 16, 256 * 256  # 16 replicated float32 tensors of 256 KiB each


def _state(seed: float) -> dict[str, Any]:
    return {"model": {str(i): torch.full((_SIZE,), seed + i) for i in range(_N)},
            "step": int(seed)}


def _restore(rank: int, world: int, root: str) -> dict[str, Any]:
    import ckptmgr

    class Bytes:
        nbytes = -1

        def on_restore_end(self, step: int, nbytes: int, seconds: float) -> None:
            self.nbytes = nbytes

    with ckptmgr.CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, _state(1.0))  # DDP-style: every rank holds the same full tensors
        listener = Bytes()
        mgr.add_listener(listener)
        target = {"model": {str(i): torch.zeros(_SIZE) for i in range(_N)}, "step": -1}
        mgr.restore(1, target)
        ok = all(torch.equal(target["model"][str(i)], torch.full((_SIZE,), 1.0 + i))
                 for i in range(_N)) and target["step"] == 1
        size = sum(f.size for f in mgr.step_info(1).files if f.path.startswith("data-"))
        return {"ok": ok, "read": listener.nbytes, "size": size}


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_state_is_read_once_and_balanced(tmp_path: Any, world: int) -> None:
    results = run_ranks(_restore, world, str(tmp_path / "run"), timeout_s=120)
    assert all(r["ok"] for r in results), results
    reads = [r["read"] for r in results]
    tensor_bytes = _N * _SIZE * 4
    # Every tensor byte read from storage once across the ranks (not world times); each rank
    # still reads the few bytes of the Python values it restores ...
    assert tensor_bytes <= sum(reads) <= tensor_bytes + 64 * world, (reads, tensor_bytes)
    assert results[0]["size"] < 2 * tensor_bytes
    # ... and spread evenly: within 10% of each other.
    assert max(reads) <= 1.1 * min(reads), reads


def _sharded_and_mismatched(rank: int, world: int, root: str) -> bool:
    import ckptmgr

    with ckptmgr.CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, {"a": torch.arange(10.0), "b": torch.ones(4)})
        # rank 1 restores "a" as a view that is not contiguous: it reads its own copy
        a = torch.zeros(10) if rank == 0 else torch.zeros(20)[::2]
        target = {"a": a, "b": torch.zeros(4)}
        mgr.restore(1, target)
        return bool(torch.equal(target["a"], torch.arange(10.0))
                    and torch.equal(target["b"], torch.ones(4)))


def test_tensors_not_shareable_everywhere_are_read_by_each_rank(tmp_path: Any) -> None:
    assert run_ranks(_sharded_and_mismatched, 2, str(tmp_path / "run"), timeout_s=120) == [
        True, True]


def _odd_dtypes(rank: int, world: int, root: str) -> bool:
    import ckptmgr

    # dtypes gloo cannot broadcast as such: shared reads send them as bytes
    state = {"i16": torch.arange(5, dtype=torch.int16), "u16": torch.arange(3).to(torch.uint16),
             "f8": torch.ones(4).to(torch.float8_e4m3fn), "b": torch.tensor([True, False])}
    with ckptmgr.CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, state)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(1, target)
        return all(torch.equal(target[k].view(torch.uint8), state[k].view(torch.uint8))
                   for k in state)


def test_dtypes_gloo_cannot_broadcast_are_shared_as_bytes(tmp_path: Any) -> None:
    assert run_ranks(_odd_dtypes, 2, str(tmp_path / "run"), timeout_s=120) == [True, True]


def _hsdp(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckptmgr

    # HSDP on a 2x2 mesh: dim 0 replicates, dim 1 shards; ranks 0 and 2 hold the same shard,
    # ranks 1 and 3 the other. A third kind: a DTensor replicated on the whole mesh.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    full = {str(i): torch.arange(_SIZE, dtype=torch.float32) + i for i in range(_N)}

    def state(src: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"model": {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)])
                          for k, v in src.items()},
                "everywhere": distribute_tensor(src["0"][:1024].clone(), mesh,
                                                [Replicate(), Replicate()])}

    class Bytes:
        nbytes = -1

        def on_restore_end(self, step: int, nbytes: int, seconds: float) -> None:
            self.nbytes = nbytes

    with ckptmgr.CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, state(full))
        listener = Bytes()
        mgr.add_listener(listener)
        target = state({k: torch.zeros(_SIZE) for k in full})
        mgr.restore(1, target)
        ok = all(torch.equal(target["model"][k].full_tensor(), v) for k, v in full.items())
        ok = ok and torch.equal(target["everywhere"].to_local(), full["0"][:1024])
        return {"ok": ok, "read": listener.nbytes}


def test_hsdp_replicas_read_each_shard_once(tmp_path: Any) -> None:
    results = run_ranks(_hsdp, 4, str(tmp_path / "run"), timeout_s=180)
    assert all(r["ok"] for r in results), results
    reads = [r["read"] for r in results]
    tensor_bytes = _N * _SIZE * 4 + 1024 * 4
    assert sum(reads) == tensor_bytes, (reads, tensor_bytes)  # each shard once, not twice
    assert max(reads) <= 1.1 * min(reads), reads
