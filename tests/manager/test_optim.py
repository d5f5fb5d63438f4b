"""Optimizer state: prime_optimizer creates the state an in-place restore loads into and changes
nothing else (and returns the optimizer); an unprimed optimizer dict is refused while an optimizer
object is primed; a save leaves the optimizer's state exactly as it was."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptmgr
from ckptmgr import CheckpointManager, StateMismatchError
from ckptmgr.errors import ConfigError
from ckptmgr.optim import prime_optimizer

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# Optimizers that keep state for every param that gets a gradient, with their code paths
# (single-tensor, foreach, fused) where torch offers them on CPU.
STATEFUL: dict[str, Factory] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adam-amsgrad-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
    "adam-l2-maximize": lambda ps: torch.optim.Adam(
        ps, lr=1e-2, weight_decay=0.1, maximize=True, foreach=False
    ),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True, foreach=False
    ),
    "sgd-nesterov-foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True, foreach=True
    ),
    "sgd-momentum-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    # maximize=True turns a -0.0 param into +0.0 even at lr=0.
    "sgd-momentum-maximize": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, maximize=True, foreach=False
    ),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, foreach=False),
    "rmsprop-momentum-centered": lambda ps: torch.optim.RMSprop(
        ps, lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-3, foreach=False
    ),
    "rmsprop-momentum-centered-foreach": lambda ps: torch.optim.RMSprop(
        ps, lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-3, foreach=True
    ),
    "rmsprop-maximize": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, maximize=True, foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=False),
    "adagrad-foreach": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
    # The rest of torch.optim that creates state lazily and steps without a closure.
    "adamax-foreach": lambda ps: torch.optim.Adamax(ps, foreach=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, foreach=False),
    "radam-foreach": lambda ps: torch.optim.RAdam(ps, foreach=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, foreach=False),
    # ASGD's foreach path and Adafactor turn inf params into NaN even at lr=0.
    "asgd-foreach": lambda ps: torch.optim.ASGD(ps, foreach=True),
    "rprop": lambda ps: torch.optim.Rprop(ps, foreach=False),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, foreach=False),
}
# The ones the save/restore round trip covers: those ckptmgr users train with.
CORE = [name for name in STATEFUL if name.split("-")[0] in {"adam", "adamw", "sgd", "rmsprop",
                                                              "adagrad"}]
# Adagrad creates its state in __init__, so it never has params without state.
LAZY_CORE = [name for name in CORE if not name.startswith("adagrad")]

SIGNALLING_NAN = 0x7F800001  # arithmetic quiets it to 0x7FC00001
NAN_WITH_PAYLOAD = 0x7FC01234
NEGATIVE_NAN = -0x003FFFFF  # 0xFFC00001 as int32


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``: equality on them is bit-exact (signed zeros, NaN payloads)."""
    return t.detach().reshape(-1).view(torch.uint8).clone()


class _Params:
    """Params covering the hard cases: odd float values, a frozen param, an existing grad."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        odd = torch.randn(4, 5, generator=gen)
        flat, ints = odd.view(-1), odd.view(-1).view(torch.int32)
        flat[0], flat[1], flat[2], flat[3] = -0.0, float("inf"), float("-inf"), 1e-45
        ints[4], ints[5], ints[6] = SIGNALLING_NAN, NAN_WITH_PAYLOAD, NEGATIVE_NAN
        self.odd = nn.Parameter(odd)
        self.zeros = nn.Parameter(torch.tensor([-0.0, 0.0, -0.0]))
        self.frozen = nn.Parameter(torch.randn(3, generator=gen), requires_grad=False)
        self.with_grad = nn.Parameter(torch.randn(2, 3, generator=gen))
        self.with_grad.grad = torch.randn(2, 3, generator=gen)
        self.plain = nn.Parameter(torch.randn(5, generator=gen))

    def all(self) -> list[nn.Parameter]:
        return [self.odd, self.zeros, self.frozen, self.with_grad, self.plain]

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.all() if p.requires_grad]


class _Snapshot:
    """Everything prime_optimizer must leave alone, recorded bit for bit and by identity."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.values = [_bits(p) for p in self.params]
        self.grads = [p.grad for p in self.params]
        self.grad_values = [None if g is None else _bits(g) for g in self.grads]
        self.groups = [dict(g) for g in optimizer.param_groups]
        self.group_values = [
            {k: _bits(v) for k, v in g.items() if isinstance(v, torch.Tensor)} for g in self.groups
        ]

    def assert_params_grads_and_groups_unchanged(self) -> None:
        for p, value in zip(self.params, self.values, strict=True):
            assert torch.equal(_bits(p), value), f"param of shape {tuple(p.shape)} changed"
        for p, grad, grad_value in zip(self.params, self.grads, self.grad_values, strict=True):
            assert p.grad is grad, "grad object replaced"
            if grad_value is not None:
                assert torch.equal(_bits(p.grad), grad_value), "grad values changed"
        assert len(self.optimizer.param_groups) == len(self.groups)
        for group, saved, tensors in zip(self.optimizer.param_groups, self.groups,
                                         self.group_values, strict=True):
            assert group.keys() == saved.keys()
            for key, value in saved.items():
                assert group[key] is value, f"param_groups[..][{key!r}] replaced"
            for key, before in tensors.items():
                assert torch.equal(_bits(group[key]), before), f"{key} tensor changed"


def _state_bits(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return {
        id(p): {k: _bits(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                for k, v in state.items()}
        for p, state in optimizer.state.items()
    }


def _assert_state_equal(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> None:
    assert a.keys() == b.keys()
    for pid in a:
        assert a[pid].keys() == b[pid].keys()
        for key, value in a[pid].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[pid][key]), key
            else:
                assert value == b[pid][key], key


def _count_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    optimizer.register_step_pre_hook(hook)
    return calls


@pytest.mark.parametrize("name", list(STATEFUL))
def test_primes_every_trainable_param_and_changes_nothing_else(name: str) -> None:
    ps = _Params()
    optimizer = STATEFUL[name](ps.all())
    frozen_had_state = bool(optimizer.state.get(ps.frozen))  # Adagrad makes state in __init__
    snapshot = _Snapshot(optimizer)

    prime_optimizer(optimizer)

    for p in ps.trainable():
        assert optimizer.state.get(p), f"no state for a param of shape {tuple(p.shape)}"
    # A frozen param never gets a grad in training, so priming must not give it state either.
    assert bool(optimizer.state.get(ps.frozen)) == frozen_had_state
    snapshot.assert_params_grads_and_groups_unchanged()


@pytest.mark.parametrize("name", ["adam", "sgd-nesterov", "rmsprop-momentum-centered"])
def test_primes_params_of_several_groups(name: str) -> None:
    ps = _Params()
    optimizer = STATEFUL[name]([ps.odd, ps.frozen])
    optimizer.add_param_group({"params": [ps.with_grad, ps.plain], "lr": 0.5,
                               "weight_decay": 0.25})
    snapshot = _Snapshot(optimizer)

    prime_optimizer(optimizer)

    for p in (ps.odd, ps.with_grad, ps.plain):
        assert optimizer.state.get(p)
    snapshot.assert_params_grads_and_groups_unchanged()


def test_plain_sgd_has_no_state_to_create() -> None:
    ps = _Params()
    optimizer = torch.optim.SGD(ps.all(), lr=0.1)
    snapshot = _Snapshot(optimizer)

    prime_optimizer(optimizer)

    assert not any(optimizer.state.values())
    snapshot.assert_params_grads_and_groups_unchanged()


def _train_one_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()


@pytest.mark.parametrize("name", CORE)
def test_already_primed_optimizer_is_left_alone(name: str) -> None:
    ps = _Params()
    optimizer = STATEFUL[name](ps.all())
    _train_one_step(optimizer, [ps.with_grad, ps.plain, ps.zeros, ps.odd])
    ps.plain.grad = None
    states = {id(p): dict(s) for p, s in optimizer.state.items()}
    state_bits = _state_bits(optimizer)
    snapshot = _Snapshot(optimizer)
    steps = _count_steps(optimizer)

    prime_optimizer(optimizer)

    assert steps == [0], "stepped an optimizer that needed no priming"
    _assert_state_equal(_state_bits(optimizer), state_bits)
    for p, state in optimizer.state.items():
        assert all(state[k] is v for k, v in states[id(p)].items()), "state tensor replaced"
    snapshot.assert_params_grads_and_groups_unchanged()


@pytest.mark.parametrize("name", LAZY_CORE)
def test_only_params_without_state_are_primed(name: str) -> None:
    ps = _Params()
    optimizer = STATEFUL[name](ps.all())
    _train_one_step(optimizer, [ps.with_grad, ps.plain])
    ps.with_grad.grad = torch.full((2, 3), 7.0)
    ps.plain.grad = None
    trained = {id(ps.with_grad), id(ps.plain)}
    state_bits = _state_bits(optimizer)
    snapshot = _Snapshot(optimizer)
    steps = _count_steps(optimizer)

    prime_optimizer(optimizer)

    assert steps == [1]
    for p in (ps.odd, ps.zeros):
        assert optimizer.state.get(p), "param without state was not primed"
    after = {pid: s for pid, s in _state_bits(optimizer).items() if pid in trained}
    _assert_state_equal(after, state_bits)
    snapshot.assert_params_grads_and_groups_unchanged()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps, lr: torch.optim.Adam(ps, lr=lr, foreach=False),
        lambda ps, lr: torch.optim.Adam(ps, lr=lr, fused=True),
        lambda ps, lr: torch.optim.AdamW(
            ps, lr=lr, weight_decay=torch.tensor(0.1), fused=True  # type: ignore[arg-type]
        ),
        lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
    ],
    ids=["adam", "adam-fused", "adamw-fused-tensor-wd", "sgd-momentum"],
)
def test_tensor_lr_is_restored_as_the_same_tensor(
    make: Callable[[list[nn.Parameter], torch.Tensor], torch.optim.Optimizer],
) -> None:
    ps = _Params()
    lr = torch.tensor(0.01)
    optimizer = make(ps.all(), lr)
    seen: list[float] = []
    optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append(float(opt.param_groups[0]["lr"]))
    )
    snapshot = _Snapshot(optimizer)

    prime_optimizer(optimizer)

    assert seen == [0.0], "the priming step ran with a non-zero lr"
    assert optimizer.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.01)
    for p in ps.trainable():
        assert optimizer.state.get(p)
    snapshot.assert_params_grads_and_groups_unchanged()


def test_weight_decay_does_not_leak_param_values_into_the_placeholder_state() -> None:
    params = [nn.Parameter(torch.full((3,), 5.0))]
    optimizer = torch.optim.Adam(params, lr=0.1, weight_decay=0.5, foreach=False)

    prime_optimizer(optimizer)

    state = optimizer.state[params[0]]
    assert torch.count_nonzero(state["exp_avg"]) == 0
    assert torch.count_nonzero(state["exp_avg_sq"]) == 0


@pytest.mark.parametrize(
    "bad",
    [None, "adam", nn.Linear(2, 2), torch.optim.Adam, {"state": {}, "param_groups": []}],
    ids=["none", "str", "module", "class", "state-dict"],
)
def test_non_optimizer_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"must be a torch\.optim\.Optimizer instance") as info:
        prime_optimizer(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_class_instead_of_instance_says_so() -> None:
    with pytest.raises(ConfigError, match="pass an instance"):
        prime_optimizer(torch.optim.SGD)  # type: ignore[arg-type]


def test_unsupported_optimizer_is_a_config_error_and_restores_everything() -> None:
    ps = _Params()
    optimizer = torch.optim.LBFGS(ps.all())  # its step() needs a closure
    snapshot = _Snapshot(optimizer)

    with pytest.raises(ConfigError, match="LBFGS cannot be primed") as info:
        prime_optimizer(optimizer)

    assert isinstance(info.value.__cause__, TypeError)
    snapshot.assert_params_grads_and_groups_unchanged()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model[2].requires_grad_(False)  # a frozen layer in the middle
    return model


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
    optimizer.zero_grad()
    torch.autograd.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()


def _load_in_place(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Restore the way torch.distributed.checkpoint does: into the tensors state_dict() exposes."""
    target = optimizer.state_dict()
    assert target["state"].keys() == saved["state"].keys(), "state missing for some params"
    for idx, entries in saved["state"].items():
        assert target["state"][idx].keys() == entries.keys(), f"state keys differ for param {idx}"
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                current = target["state"][idx][key]
                assert (current.shape, current.dtype) == (value.shape, value.dtype), key
                current.copy_(value)
            else:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                optimizer.state[params[idx]][key] = value


@pytest.mark.parametrize("in_place", [False, True], ids=["load_state_dict", "in-place"])
@pytest.mark.parametrize("name", CORE)
def test_save_restore_after_priming_reproduces_the_next_step(name: str, in_place: bool) -> None:
    model_a = _model(seed=0)
    optimizer_a = STATEFUL[name](list(model_a.parameters()))
    for step in range(3):
        _train_step(model_a, optimizer_a, seed=step)
    saved_model = copy.deepcopy(model_a.state_dict())
    saved_optimizer = copy.deepcopy(optimizer_a.state_dict())

    model_b = _model(seed=123)
    optimizer_b = STATEFUL[name](list(model_b.parameters()))
    prime_optimizer(optimizer_b)
    model_b.load_state_dict(saved_model)
    if in_place:
        _load_in_place(optimizer_b, saved_optimizer)
    else:
        optimizer_b.load_state_dict(saved_optimizer)

    _train_step(model_a, optimizer_a, seed=99)
    _train_step(model_b, optimizer_b, seed=99)
    after_a, after_b = model_a.state_dict(), model_b.state_dict()
    assert after_a.keys() == after_b.keys()
    for key, a in after_a.items():
        b = after_b[key]
        assert torch.equal(_bits(a), _bits(b)), f"{key} diverged after the restore"


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
