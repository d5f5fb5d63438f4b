"""Exact resume: RNGState (per rank, a grown world derived by the documented rule) and the data
loader's position, through CheckpointManager (issue 31 item 8)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _procs import run_ranks

import ckptmgr
from ckptmgr import rng as rng_mod
from ckptmgr.errors import StateMismatchError
from ckptmgr.rng import RNGState, derived_seeds


def _draws() -> tuple[float, float, list[float]]:
    """One draw from each generator RNGState covers (CPU)."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------ the training loop of the docs


class LoaderPosition:
    """Where the loop is (a Stateful): epoch, batches done in it, steps done. The sampler's
    generator is reseeded from the epoch at each epoch start, so (epoch, batch) is the position."""

    def __init__(self) -> None:
        self.epoch = self.batch = self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.batch, self.step = sd["epoch"], sd["batch"], sd["step"]


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(16, 1))


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g),
                                          torch.randn(40, 1, generator=g))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> float:
    # Every generator is drawn from: numpy and Python noise, dropout (torch).
    x = x + torch.from_numpy(np.random.randn(*x.shape).astype(np.float32)) * 0.01
    x = x * (1.0 + random.random() * 0.01)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _train_with_position(root: Path, total: int, stop_after: int | None = None, *,
                         with_rng: bool = True) -> list[float]:
    """Steps up to ``total`` (resuming from ``root``); leaves after step ``stop_after`` by closing
    the manager (save_on_close takes that step). Returns the losses of the steps it ran."""
    _seed_all(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator()
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=8, shuffle=True, generator=gen)
    pos = LoaderPosition()
    state: dict[str, Any] = {"model": model, "optim": opt, "data": pos}
    if with_rng:
        state["rng"] = RNGState()
    losses: list[float] = []
    with ckptmgr.CheckpointManager(str(root), save_interval=4) as mgr:
        mgr.restore_latest(state)
        while pos.step < total:
            gen.manual_seed(1000 + pos.epoch)
            for i, (x, y) in enumerate(loader):
                if i < pos.batch:
                    continue  # done before the interruption
                losses.append(_step(model, opt, x, y))
                pos.batch, pos.step = i + 1, pos.step + 1
                mgr.save_async(pos.step, state)
                if pos.step in (stop_after, total):
                    return losses
            pos.epoch, pos.batch = pos.epoch + 1, 0
    return losses


def _final(root: Path) -> tuple[dict[str, torch.Tensor], tuple[float, float, list[float]]]:
    model = _model()
    state = {"model": model, "rng": RNGState()}
    with ckptmgr.CheckpointManager(str(root), save_interval=1, save_on_close=False) as mgr:
        mgr.restore_latest(state)
    return {k: v.clone() for k, v in model.state_dict().items()}, _draws()


def test_interrupted_run_with_dropout_and_shuffling_matches_an_uninterrupted_one(
        tmp_path: Path) -> None:
    total, k = 13, 6  # 5 batches an epoch: the interruption is mid-epoch, between saves (4, 8)
    whole = _train_with_position(tmp_path / "whole", total)
    first = _train_with_position(tmp_path / "cut", total, stop_after=k)
    with ckptmgr.CheckpointManager(str(tmp_path / "cut"), save_interval=1) as mgr:
        assert mgr.latest_step() == k  # save_on_close took the step the loop left at
    rest = _train_with_position(tmp_path / "cut", total)
    assert first + rest == whole  # bit for bit: Python floats of the losses
    w_params, w_draws = _final(tmp_path / "whole")
    c_params, c_draws = _final(tmp_path / "cut")
    assert w_draws == c_draws
    for name, t in w_params.items():
        assert torch.equal(t, c_params[name]), name
    # The control: resumed without the RNG state, the same loop does not match.
    first = _train_with_position(tmp_path / "cut2", total, stop_after=k, with_rng=False)
    rest = _train_with_position(tmp_path / "cut2", total, with_rng=False)
    assert first == whole[:k] and rest != whole[k:]


@pytest.mark.filterwarnings(
    "ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11 calls it on every loader
def test_stateful_dataloader_recipe_resumes_exactly(tmp_path: Path) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    sampler_mod = pytest.importorskip("torchdata.stateful_dataloader.sampler")

    def run(root: Path, total: int, stop_after: int | None = None) -> list[float]:
        _seed_all(0)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dataset = _dataset()
        # The sampler's own generator: the loader saves and restores it (mid-epoch too). The
        # loader's generator only draws each iterator's worker seed: reseeded per epoch.
        sampler = sampler_mod.RandomSampler(dataset, generator=torch.Generator().manual_seed(1))
        loader_gen = torch.Generator()
        loader = sdl.StatefulDataLoader(dataset, batch_size=8, sampler=sampler,
                                        generator=loader_gen)
        rank = 0  # torch.distributed.get_rank() under a process group
        state = {"model": model, "optim": opt, "rng": RNGState(),
                 "loader": {f"rank{rank}": loader}, "extra": {"step": 0, "epoch": 0}}
        extra = state["extra"]
        losses: list[float] = []
        with ckptmgr.CheckpointManager(str(root), save_interval=4) as mgr:
            mgr.restore_latest(state)
            while extra["step"] < total:
                loader_gen.manual_seed(1000 + extra["epoch"])
                for x, y in loader:
                    losses.append(_step(model, opt, x, y))
                    extra["step"] += 1
                    mgr.save_async(extra["step"], state)
                    if extra["step"] in (stop_after, total):
                        return losses
                extra["epoch"] += 1
        return losses

    whole = run(tmp_path / "whole", 13)
    first = run(tmp_path / "cut", 13, stop_after=6)
    rest = run(tmp_path / "cut", 13)
    assert first + rest == whole
    assert _final(tmp_path / "whole")[1] == _final(tmp_path / "cut")[1]


# ------------------------------------------------------------------------------ per rank, 2 -> 3


def _ranks_save(rank: int, world: int, root: str) -> dict[str, Any]:
    _seed_all(100 + rank)
    _draws()
    state = {"rng": RNGState()}
    with ckptmgr.CheckpointManager(root, save_interval=1, save_on_close=False) as mgr:
        mgr.save(1, state)
        saved_torch = bytes(torch.get_rng_state().tolist())
        after_save = _draws()
        _seed_all(999)  # every rank the same: the restore must undo it per rank
        mgr.restore(1, state)
        after_restore = _draws()
    return {"after": after_save, "restored": after_restore, "torch": saved_torch}


def _ranks_restore(rank: int, world: int, root: str) -> tuple[float, float, list[float]]:
    _seed_all(999)
    with ckptmgr.CheckpointManager(root, save_interval=1, save_on_close=False) as mgr:
        mgr.restore_latest({"rng": RNGState()})
    return _draws()


def test_per_rank_streams_restored_per_rank_and_a_grown_world_derived(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    two = run_ranks(_ranks_save, 2, root, timeout_s=120)
    assert two[0]["after"] != two[1]["after"]  # each rank its own stream
    for r in (0, 1):
        assert two[r]["restored"] == two[r]["after"], r
    three = run_ranks(_ranks_restore, 3, root, timeout_s=120)
    assert three[0] == two[0]["after"] and three[1] == two[1]["after"]
    # The new rank: the documented rule, from rank 0's saved torch state and its rank number.
    seeds = derived_seeds(two[0]["torch"], 2)
    random.seed(seeds["python"])
    np.random.seed([seeds["numpy"] & 0xFFFFFFFF, seeds["numpy"] >> 32])
    torch.manual_seed(seeds["torch"])
    assert three[2] == _draws()
    assert len({repr(d) for d in three}) == 3
    for i in range(3):  # no generator of the new rank repeats another rank's
        assert len({repr(d[i]) for d in three}) == 3, i


# ------------------------------------------------------------------------------ single process


def test_a_step_without_rng_state_is_a_state_mismatch(tmp_path: Path) -> None:
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=1) as mgr:
        mgr.save(1, {"extra": {"a": 1}})
        with pytest.raises(StateMismatchError, match=r"rng\.rank0"):
            mgr.restore(1, {"extra": {"a": 0}, "rng": RNGState()})
        _seed_all(5)
        before = _draws()
        _seed_all(5)
        mgr.restore(1, {"rng": RNGState()}, allow_partial=True)  # leaves the generators
        assert _draws() == before


def test_a_generator_saved_without_state_is_derived(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _seed_all(3)
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=1) as mgr:
        with monkeypatch.context() as m:
            m.setattr(rng_mod, "_numpy", lambda: None)  # numpy not installed at save time
            mgr.save(1, {"rng": RNGState()})
        torch0 = bytes(torch.get_rng_state().tolist())
        expected = _draws()
        _seed_all(9)
        mgr.restore(1, {"rng": RNGState()})
    got = _draws()
    assert got[0] == expected[0] and got[2] == expected[2]
    np.random.seed([(s := derived_seeds(torch0, 0)["numpy"]) & 0xFFFFFFFF, s >> 32])
    assert got[1] == float(np.random.rand())


def test_load_state_dict_without_this_rank_or_rank0_is_refused() -> None:
    with pytest.raises(StateMismatchError, match="no state for rank 0"):
        RNGState().load_state_dict({"rank5": {}})


class _FakeCuda:
    """torch.cuda's generator functions for two devices, without a GPU."""

    def __init__(self) -> None:
        self.states = [bytes([1] * 16), bytes([2] * 16)]

    def patch(self, m: pytest.MonkeyPatch, devices: int) -> None:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: devices)
        m.setattr(torch.cuda, "get_rng_state_all",
                  lambda: [torch.tensor(list(s), dtype=torch.uint8)
                           for s in self.states[:devices]])

        def set_state(t: torch.Tensor, device: int) -> None:
            self.states[device] = bytes(t.tolist())

        m.setattr(torch.cuda, "set_rng_state", set_state)


def test_cuda_generators_are_saved_per_device_and_restored_where_present(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda()
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=1) as mgr:
        with monkeypatch.context() as m:
            fake.patch(m, 2)
            mgr.save(1, {"rng": RNGState()})
        fake.states = [bytes([7] * 16), bytes([8] * 16)]
        with monkeypatch.context() as m:
            fake.patch(m, 1)  # one device now: the second saved state is not used
            mgr.restore(1, {"rng": RNGState()})
        assert fake.states == [bytes([1] * 16), bytes([8] * 16)]
        mgr.restore(1, {"rng": RNGState()})  # no CUDA now: the CUDA entry is not asked for


def _iter_flat(sd: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(sd, dict):
        for k, v in sd.items():
            yield from _iter_flat(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix


def test_state_dict_is_keyed_by_rank_and_holds_no_tensor() -> None:
    sd = RNGState().state_dict()
    cuda = ["rank0.cuda"] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    assert sorted(_iter_flat(sd)) == [*cuda, "rank0.numpy", "rank0.python", "rank0.torch"]
    assert not any(isinstance(v, torch.Tensor) for v in sd["rank0"].values())


def test_restored_from_the_local_tier(tmp_path: Path) -> None:
    _seed_all(11)
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), save_interval=10,
                                   local_path=str(tmp_path / "local"), local_interval=1,
                                   save_on_close=False) as mgr:
        assert mgr.save(1, {"rng": RNGState()})
        assert not (tmp_path / "root" / "1").exists()  # on the local tier only
        expected = _draws()
        _seed_all(12)
        mgr.restore(1, {"rng": RNGState()})
        assert _draws() == expected
