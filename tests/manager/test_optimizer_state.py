"""Optimizer state through the manager: ``prime_optimizer`` returns the optimizer, an unprimed
optimizer dict is refused while an optimizer object is primed, and a save leaves the optimizer's
state exactly as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptmgr
from ckptmgr import CheckpointManager, StateMismatchError


def test_prime_optimizer_returns_it() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    assert ckptmgr.prime_optimizer(opt) is opt


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_unprimed_optimizer_dict_is_refused_object_is_primed(tmp_path: Path) -> None:
    model, opt = _trained()
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        fresh = torch.nn.Linear(3, 2)
        fresh_opt = torch.optim.AdamW(fresh.parameters())
        with pytest.raises(StateMismatchError, match="prime_optimizer"):
            mgr.restore(1, {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()})
        # allow_partial keeps loading only what the target asks for
        mgr.restore(1, {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()},
                    allow_partial=True)
        assert not fresh_opt.state
        # an optimizer handed as an object is primed, then filled
        mgr.restore(1, {"model": fresh, "optim": fresh_opt})
        for p_ref, p in zip(model.parameters(), fresh.parameters(), strict=True):
            for k, v in opt.state[p_ref].items():
                assert torch.equal(v, fresh_opt.state[p][k])
        # and a primed dict target works as before
        other = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
        mgr.restore(1, {"optim": ckptmgr.prime_optimizer(other).state_dict()})


def _branchy() -> tuple[torch.nn.ModuleDict, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: torch.nn.ModuleDict, optim: torch.optim.Optimizer, steps: range,
           unused_from: int | None = None) -> None:
    for step in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        out = model["used"](x)
        if unused_from is not None and step >= unused_from:
            out = out + model["unused"](x)
        optim.zero_grad()
        out.square().mean().backward()
        optim.step()


@pytest.mark.parametrize("fresh", [False, True])
def test_save_leaves_optimizer_state_exactly_as_it_was(local_root: str, fresh: bool) -> None:
    from ckptmgr.dcp import ModelOptimizerState

    ref_model, ref_optim = _branchy()
    model, optim = _branchy()
    first = range(0) if fresh else range(3)
    _train(ref_model, ref_optim, first)
    _train(model, optim, first)
    unused = list(model["unused"].parameters())
    assert all(p not in optim.state for p in unused)
    before = {id(p): {k: v.clone() for k, v in optim.state[p].items()} for p in optim.state}
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        mgr.save(3, {"app": ModelOptimizerState(model, optim)})
        assert all(p not in optim.state for p in unused)  # still absent
        assert {id(p) for p in optim.state} == set(before)
        for p in optim.state:
            assert all(torch.equal(v, before[id(p)][k]) for k, v in optim.state[p].items())
        # The unused branch starts training later: its first step must be a first step.
        _train(ref_model, ref_optim, range(3, 7), unused_from=5)
        _train(model, optim, range(3, 7), unused_from=5)
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        for p_ref, p in zip(ref_model.parameters(), model.parameters(), strict=True):
            for k, v in ref_optim.state[p_ref].items():
                assert torch.equal(v, optim.state[p][k])
        # A fresh optimizer still restores in place.
        model2, optim2 = _branchy()
        mgr.restore(3, {"app": ModelOptimizerState(model2, optim2)})
