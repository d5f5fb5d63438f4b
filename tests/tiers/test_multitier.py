"""Multi-tier checkpoints (ckptmgr.local_tier): a node-local tier per rank, a durable tier on S3.

Real gloo ranks (tests/_procs.py), FSDP2-sharded model and Adam state (DTensors), each rank given
its own local directory (``node<r>``, simulating nodes), the durable tier on the moto S3 server.
Bit-exactness is checked per rank on the local shards of every parameter and optimizer tensor.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks

import ckptmgr
from ckptmgr.config import ManagerConfig, load_config
from ckptmgr.errors import ConfigError

BUCKET = "ckpt-tests"
WIDTH = 32


@pytest.fixture()
def s3_url(moto_s3: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


# ------------------------------------------------------------------------ in the ranks


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 3))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """This rank's local shards of every parameter and optimizer tensor, hashed."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to_local().contiguous().numpy().tobytes())
        for k, v in sorted(optim.state.get(p, {}).items()):
            t = v.to_local() if hasattr(v, "to_local") else v
            h.update(k.encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _manager(durable: str, node: str, **kw: Any) -> ckptmgr.CheckpointManager:
    kw.setdefault("local_interval", 5)
    return ckptmgr.CheckpointManager(durable, save_interval=10, local_path=node, **kw)


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer, progress: dict[str, int]
           ) -> dict[str, Any]:
    from ckptmgr.dcp import ModelOptimizerState

    return {"app": ModelOptimizerState(model, optim), "progress": progress}


def _train_run(rank: int, world: int, durable: str, nodes: str, steps: int) -> dict[str, Any]:
    model, optim = _build(0)
    digests: dict[int, str] = {}
    with _manager(durable, f"{nodes}/node{rank}") as mgr:
        for step in range(1, steps + 1):
            _train(model, optim, step)
            if mgr.save_async(step, _state(model, optim, {"step": step})):
                digests[step] = _digest(model, optim)
        mgr.join()
        return {"digests": digests, "all": mgr.all_steps(),
                "tiers": {s: mgr.step_info(s).tiers for s in mgr.all_steps()}}


def _resume_run(rank: int, world: int, durable: str, nodes: str, corrupt_local: int | None,
                step: int | None) -> dict[str, Any]:
    model, optim = _build(1)  # other initial values: only a restore makes them equal
    progress = {"step": -1}
    with _manager(durable, f"{nodes}/node{rank}") as mgr:
        latest = mgr.latest_step()
        assert latest is not None
        target = latest if step is None else step
        tiers = mgr.step_info(target).tiers
        if corrupt_local is not None and rank == 1:  # after the agreement at construction
            d = Path(f"{nodes}/node{rank}/rank-{rank}/{corrupt_local}")
            data = next(p for p in d.iterdir() if p.name.startswith("data-"))
            data.write_bytes(data.read_bytes()[:-8])
        mgr.restore(target, _state(model, optim, progress))
        return {"latest": latest, "all": mgr.all_steps(), "tiers": tiers,
                "digest": _digest(model, optim), "progress": progress["step"],
                "local_after": mgr.all_steps()}


# -------------------------------------------------------------------------------- tests


def test_durable_lagging_local_then_replaced_node(s3_url: str, tmp_path: Path) -> None:
    nodes = str(tmp_path)
    a = run_ranks(_train_run, 2, s3_url, nodes, 15, timeout_s=180)
    # due: local every 5, durable every 10; local keeps the 2 newest whole steps
    assert a[0]["all"] == a[1]["all"] == [10, 15]
    assert a[0]["tiers"] == {10: ("durable", "local"), 15: ("local",)}
    for r in range(2):
        assert sorted(os.listdir(f"{nodes}/node{r}/rank-{r}")) == ["10", "15"]  # lease released

    # The durable tier lags: the newest step is only on the local tier, and it restores.
    b = run_ranks(_resume_run, 2, s3_url, nodes, None, None, timeout_s=180)
    for r in range(2):
        assert (b[r]["latest"], b[r]["tiers"], b[r]["progress"]) == (15, ("local",), 15)
        assert b[r]["digest"] == a[r]["digests"][15]

    # A replaced node: rank 1's local directory is empty. Every rank falls back to the durable
    # tier (the local steps are no longer listed anywhere), bit-exact.
    shutil.rmtree(f"{nodes}/node1")
    c = run_ranks(_resume_run, 2, s3_url, nodes, None, None, timeout_s=180)
    for r in range(2):
        assert (c[r]["latest"], c[r]["all"], c[r]["tiers"]) == (10, [10], ("durable",))
        assert c[r]["digest"] == a[r]["digests"][10] and c[r]["progress"] == 10


def test_corrupt_local_falls_back_agreed(s3_url: str, tmp_path: Path) -> None:
    nodes = str(tmp_path)
    a = run_ranks(_train_run, 2, s3_url, nodes, 15, timeout_s=180)
    assert a[0]["all"] == [10, 15]
    # A flipped byte in rank 1's step 15, found by the checksums at construction: step 15 is
    # not whole, on every rank; the newest whole step is 10.
    d = Path(f"{nodes}/node1/rank-1/15")
    f = next(p for p in d.iterdir() if p.name.startswith("data-"))
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    f.write_bytes(bytes(raw))
    b = run_ranks(_resume_run, 2, s3_url, nodes, None, None, timeout_s=180)
    for r in range(2):
        assert (b[r]["latest"], b[r]["all"], b[r]["tiers"]) == (10, [10], ("durable", "local"))
        assert b[r]["digest"] == a[r]["digests"][10]
    # Damaged after the ranks agreed (rank 1 truncates its step 10 after construction): the
    # check before reading fails on rank 1, every rank reads the durable step 10 instead.
    c = run_ranks(_resume_run, 2, s3_url, nodes, 10, 10, timeout_s=180)
    for r in range(2):
        assert c[r]["digest"] == a[r]["digests"][10] and c[r]["progress"] == 10
        assert c[r]["local_after"] == [10]  # still durable; no longer local


def _preempted_run(rank: int, world: int, durable: str, nodes: str, at: int,
                   grace: float) -> dict[str, Any]:
    model, optim = _build(0)
    with _manager(durable, f"{nodes}/node{rank}", exit_on_preemption=False,
                  preemption_grace_s=grace, local_interval=100) as mgr:
        for step in range(1, 40):
            _train(model, optim, step)
            if step == at and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this rank only
            mgr.save_async(step, _state(model, optim, {"step": step}))
            if mgr.reached_preemption(step):
                return {"step": step, "digest": _digest(model, optim),
                        "tiers": mgr.step_info(step).tiers}
    raise AssertionError("no preemption")


def test_preemption_saves_local_first_then_durable(s3_url: str, tmp_path: Path) -> None:
    nodes = str(tmp_path)
    # No durable save yet in this process: the durable save is tried, and fits.
    a = run_ranks(_preempted_run, 2, s3_url, nodes, 4, 30.0, timeout_s=180)
    assert a[0]["step"] == a[1]["step"] == 4
    assert a[0]["tiers"] == ("durable", "local")
    b = run_ranks(_resume_run, 2, s3_url, nodes, None, None, timeout_s=180)
    for r in range(2):
        assert (b[r]["latest"], b[r]["progress"]) == (4, 4)
        assert b[r]["digest"] == a[r]["digest"]


def test_preemption_past_the_grace_keeps_the_local_tier(s3_url: str, tmp_path: Path) -> None:
    nodes = str(tmp_path)
    # The durable save of step 10 took longer than the (tiny) grace period: the preemption at
    # step 12 is saved to the local tier only; the job resumes from it there.
    a = run_ranks(_preempted_run, 2, s3_url, nodes, 12, 1e-6, timeout_s=180)
    assert a[0]["step"] == 12 and a[0]["tiers"] == ("local",)
    b = run_ranks(_resume_run, 2, s3_url, nodes, None, None, timeout_s=180)
    for r in range(2):
        assert (b[r]["latest"], b[r]["tiers"], b[r]["progress"]) == (12, ("local",), 12)
        assert b[r]["digest"] == a[r]["digest"]


# --------------------------------------------------------------------- config, one process


def test_config_rules() -> None:
    base = {"path": "/tmp/run", "save_interval": 10}
    cases = {
        (("local_interval", 5),): "local_interval requires local_path to be set, got 5",
        (("local_path", "/nvme/x"),): "local_path requires local_interval to be set, got "
        "'/nvme/x'",
        (("local_path", "s3://b/x"), ("local_interval", 5)):
            "local_path must be a local directory path (each rank writes its own node-local "
            "disk; the durable tier is path), got 's3://b/x'",
        (("local_path", "/nvme/x"), ("local_interval", 0)): "local_interval must be >= 1, got 0",
        (("local_path", "/nvme/x"), ("local_interval", 5), ("local_max_to_keep", 0)):
            "local_max_to_keep must be >= 1, got 0",
        (("local_path", "/tmp/run"), ("local_interval", 5)):
            "local_path must differ from path (the durable tier), got '/tmp/run'",
    }
    for kw, message in cases.items():
        with pytest.raises(ConfigError) as ei:
            ManagerConfig.from_kwargs(**base, **dict(kw))
        assert str(ei.value) == message
    cfg = ManagerConfig.from_kwargs(**base, local_path="file:///nvme/x", local_interval=5)
    assert (cfg.local.path, cfg.local.interval, cfg.local.max_to_keep) == ("/nvme/x", 5, 2)
    yaml_cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "multitier.yaml")
    assert yaml_cfg.local.path and yaml_cfg.local.interval


def test_single_process_tiers_and_retention(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(4, 3)
    saved: dict[int, torch.Tensor] = {}
    durable, node = str(tmp_path / "durable"), str(tmp_path / "node")
    with _manager(durable, node, local_max_to_keep=3) as mgr:
        for step in range(1, 27):
            with torch.no_grad():
                model.weight.add_(1.0)
            if mgr.save(step, {"model": model}):
                saved[step] = model.weight.detach().clone()
        assert mgr.all_steps() == [10, 15, 20, 25]  # durable 10, 20; local 15, 20, 25
        assert [mgr.step_info(s).tiers for s in (10, 15, 20)] == [
            ("durable",), ("local",), ("durable", "local")]
        assert mgr.should_save(5) and mgr.should_save(10) and not mgr.should_save(7)
    with _manager(durable, node) as mgr, caplog.at_level(logging.INFO, "ckptmgr"):
        for step in (25, 20, 10):
            mgr.restore(step, {"model": model})
            assert torch.equal(model.weight, saved[step])
        assert any("from the local tier" in r.getMessage() for r in caplog.records)
