"""Plan caching in :class:`CkptSavePlanner`: reused for an unchanged structure, never stale."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _procs import run_ranks
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.planner import SavePlan

import ckptmgr
from ckptmgr.dcp.compat import uses_private_entry_points
from ckptmgr.dcp.planner import CkptSavePlanner, PlanTokenError, default_structure_key


def _state(seed: int = 0, n: int = 6) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {**{f"w{i}": torch.randn(8, 4, generator=g) for i in range(n)}, "epoch": seed}


def _plan(planner: CkptSavePlanner, sd: dict[str, Any],
          coordinator: bool = True) -> SavePlan:
    planner.set_up_planner(sd, None, coordinator)
    return planner.create_local_plan()


def _fresh(sd: dict[str, Any]) -> tuple[SavePlan, Any]:
    p = DefaultSavePlanner(flatten_state_dict=False)
    p.set_up_planner(sd, None, True)
    local = p.create_local_plan()
    plans, md = p.create_global_plan([local])
    return plans[0], md


def _global(planner: CkptSavePlanner, plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
    return planner.create_global_plan(plans)


def test_unchanged_structure_reuses_local_and_global_plans() -> None:
    planner = CkptSavePlanner()
    first = _plan(planner, _state(1))
    plans1, md1 = _global(planner, [first])
    second = _plan(planner, _state(2))  # new values, same structure
    plans2, md2 = _global(planner, [second])
    assert second is first
    assert (planner.local_plan_reuses, planner.global_plan_reuses) == (1, 1)
    assert plans2 == plans1 and plans2 is not plans1
    # the metadata is a fresh copy each time: the writer sets storage_data on it
    assert md2 is not md1 and md2.state_dict_metadata == md1.state_dict_metadata
    md2.storage_data = {"written": 1}
    _plan(planner, _state(3))
    _, md3 = _global(planner, [planner.plan])
    assert md3.storage_data is None


@pytest.mark.parametrize("change", [
    "shape", "dtype", "new_key", "dropped_key", "renamed_key", "key_order", "value_to_tensor",
    "requires_grad", "strides", "coordinator"])
def test_a_changed_structure_plans_again(change: str) -> None:
    planner = CkptSavePlanner()
    base = _state()
    _plan(planner, base)
    _global(planner, [planner.plan])
    sd = dict(base)
    coordinator = True
    if change == "shape":
        sd["w1"] = torch.zeros(4, 8)
    elif change == "dtype":
        sd["w1"] = base["w1"].to(torch.float64)
    elif change == "new_key":
        sd["w9"] = torch.zeros(3)
    elif change == "dropped_key":
        del sd["w2"]
    elif change == "renamed_key":
        sd = {("v2" if k == "w2" else k): v for k, v in sd.items()}
    elif change == "key_order":
        sd = dict(reversed(list(sd.items())))
    elif change == "value_to_tensor":
        sd["epoch"] = torch.tensor(3)
    elif change == "requires_grad":
        sd["w1"] = base["w1"].clone().requires_grad_()
    elif change == "strides":
        sd["w1"] = torch.zeros(4, 8).t()
    elif change == "coordinator":
        coordinator = False
    local = _plan(planner, sd, coordinator)
    assert planner.local_plan_reuses == 0
    plans, md = _global(planner, [local])
    # strides and the coordinator flag re-plan locally but give an equal plan: that one is reused
    assert planner.global_plan_reuses == (1 if change in ("strides", "coordinator") else 0)
    expected_plan, expected_md = _fresh(sd)
    assert plans[0] == expected_plan and md.state_dict_metadata == expected_md.state_dict_metadata


def test_flip_flop_between_two_layouts_stays_cached_and_correct() -> None:
    planner = CkptSavePlanner()
    a, b = _state(n=4), _state(n=5)
    for sd in (a, b, a, b, a):
        plans, md = _global(planner, [_plan(planner, sd)])
        expected_plan, expected_md = _fresh(sd)
        assert plans[0] == expected_plan
        assert md.state_dict_metadata == expected_md.state_dict_metadata
    assert (planner.local_plan_reuses, planner.global_plan_reuses) == (3, 3)
    planner.clear_plan_cache()
    _global(planner, [_plan(planner, a)])
    assert planner.local_plan_reuses == 3


def _rank_plans(per_rank: list[dict[str, Any]]) -> list[SavePlan]:
    return [create_default_local_save_plan(sd, r == 0) for r, sd in enumerate(per_rank)]


def test_global_cache_compares_every_rank_and_the_world_size() -> None:
    planner = CkptSavePlanner()
    planner.set_up_planner(_state(), None, True)
    planner.create_local_plan()  # a cacheable structure on the coordinator
    sd0, sd1 = _state(n=4), _state(n=4)
    two = _rank_plans([sd0, sd1])
    g2, _ = planner.create_global_plan(two)
    assert len(g2) == 2
    # same plans (new objects, as gathered from other ranks): reused
    assert planner.create_global_plan(_rank_plans([sd0, sd1]))[0] == g2
    assert planner.global_plan_reuses == 1
    # one rank's plan changed: planned again, and the change is in the metadata
    changed = dict(sd1, w0=torch.zeros(16, 2))
    _, md = planner.create_global_plan(_rank_plans([sd0, changed]))
    assert planner.global_plan_reuses == 1
    assert md.state_dict_metadata["w0"].size == torch.Size([16, 2])  # type: ignore[union-attr]
    # a third rank with the same state: planned again over three ranks
    g3, _ = planner.create_global_plan(_rank_plans([sd0, sd1, sd1]))
    assert planner.global_plan_reuses == 1 and len(g3) == 3
    # a single rank again
    g1, _ = planner.create_global_plan(_rank_plans([sd0]))
    assert planner.global_plan_reuses == 1 and len(g1) == 1


class _NoCache(CkptSavePlanner):
    plan_cache = False


class _OptOutPerSave(CkptSavePlanner):
    def _structure_key(self, state_dict: Any) -> Any:
        return None


class _ExtraItems(CkptSavePlanner):
    """A subclass that plans from more than the flat state folds that into the key."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = 1

    def _structure_key(self, state_dict: Any) -> Any:
        key = super()._structure_key(state_dict)
        return None if key is None else (key, self.extra)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, planner_data=self.extra)


@pytest.mark.parametrize("cls", [_NoCache, _OptOutPerSave])
def test_subclasses_can_opt_out(cls: type[CkptSavePlanner]) -> None:
    planner = cls()
    for seed in range(3):
        _global(planner, [_plan(planner, _state(seed))])
    assert (planner.local_plan_reuses, planner.global_plan_reuses) == (0, 0)


def test_a_subclass_key_extension_invalidates() -> None:
    planner = _ExtraItems()
    _global(planner, [_plan(planner, _state())])
    _plan(planner, _state())
    assert planner.local_plan_reuses == 1
    planner.extra = 2
    _plan(planner, _state())
    assert planner.local_plan_reuses == 1


def test_structure_key_holds_no_tensor_and_refuses_unknown_tensor_types() -> None:
    key = default_structure_key(_state())
    assert key is not None

    def walk(x: Any) -> None:
        assert not isinstance(x, torch.Tensor)
        if isinstance(x, tuple):
            for y in x:
                walk(y)

    walk(key)
    param = {"p": torch.nn.Parameter(torch.zeros(3))}
    assert default_structure_key(param) is not None

    class Sub(torch.Tensor):
        pass

    assert default_structure_key({"s": torch.zeros(3).as_subclass(Sub)}) is None


def test_manager_reuses_plans_and_restores_what_changed(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    with ckptmgr.CheckpointManager(root, save_interval=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        planner = mgr._durable.planners.get(False)
        assert (planner.local_plan_reuses, planner.global_plan_reuses) == (2, 2)
        assert planner.state_dict == {}  # no reference to the saved tensors between saves
        grown = dict(_state(4), w1=torch.arange(12.0).reshape(3, 4), w9=torch.ones(2))
        mgr.save(4, grown)
        assert planner.local_plan_reuses == 2
        mgr.save_async(5, grown)
        mgr.join()
        assert planner.local_plan_reuses == 3
        for step, expected in ((3, _state(3)), (5, grown)):
            target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                      for k, v in expected.items()}
            mgr.restore(step, target)
            for k, v in expected.items():
                assert (torch.equal(target[k], v) if isinstance(v, torch.Tensor)
                        else target[k] == v), (step, k)


def test_dcp_entry_points_found() -> None:
    # torch 2.9 and 2.13 both have the private functions with the checked signature
    assert uses_private_entry_points() == (True, True)


def test_public_dcp_fallback(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr.dcp import compat as _compat

    def changed(state_dict: Any, writer: Any, *, group: Any = None) -> None:
        raise AssertionError("never called")

    assert _compat._private(type("M", (), {"f": staticmethod(changed)}), "f",
                            _compat._SAVE_PARAMS) is None
    assert _compat._private(object(), "missing", _compat._SAVE_PARAMS) is None
    monkeypatch.setattr(_compat, "_save_state_dict", None)
    monkeypatch.setattr(_compat, "_load_state_dict", None)
    assert uses_private_entry_points() == (False, False)
    with ckptmgr.CheckpointManager(str(tmp_path / "ckpt"), save_interval=1) as mgr:
        mgr.save(1, _state(1))  # DCP's single-process warning stays silenced (-W error)
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                  for k, v in _state(1).items()}
        mgr.restore(1, target)
    expected = _state(1)
    assert all(torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v
               for k, v in expected.items())


def _ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(48.0).reshape(8, 6)

    def state(placement: Any, rows: int = 8) -> dict[str, Any]:
        return {"d": distribute_tensor(full[:rows].clone(), mesh, [placement]),
                "r": torch.full((5,), float(rows)), "epoch": rows}

    out: dict[str, Any] = {}
    with ckptmgr.CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, state(Shard(0)))
        mgr.save(2, state(Shard(0)))
        planner = mgr._durable.planners.get(False)
        out["reuse_same"] = (planner.local_plan_reuses, planner.global_plan_reuses)
        out["tokens"] = planner.plan_tokens_sent
        mgr.save(3, state(Replicate()))  # placements changed: every rank plans again
        mgr.save(4, state(Shard(0), rows=6))  # shape changed
        out["reuse_after"] = (planner.local_plan_reuses, planner.global_plan_reuses)
        results = {}
        for step, placement, rows in ((2, Shard(0), 8), (3, Replicate(), 8), (4, Shard(0), 6)):
            target = {"d": distribute_tensor(torch.zeros(rows, 6), mesh, [placement]),
                      "r": torch.zeros(5), "epoch": None}
            mgr.restore(step, target)
            results[step] = (torch.equal(target["d"].full_tensor(), full[:rows]),
                             float(target["r"][0]), target["epoch"])
        out["results"] = results
    return out


@pytest.mark.slow
def test_two_ranks_reuse_and_replan(tmp_path: Any) -> None:
    r0, r1 = run_ranks(_ranks, 2, str(tmp_path / "ckpt"))
    assert r0["reuse_same"] == (1, 1) and r1["reuse_same"] == (1, 0)  # global: coordinator only
    assert r0["tokens"] == r1["tokens"] == 1  # the second save sent tokens, not plans
    assert r0["reuse_after"] == (1, 1) and r1["reuse_after"] == (1, 0)
    for r in (r0, r1):
        assert r["results"] == {2: (True, 8.0, 8), 3: (True, 8.0, 8), 4: (True, 6.0, 6)}


# ------------------------------------------------------------------- tokens instead of plans


class _Rank:
    """One simulated rank's planner; rank 0 is the coordinator."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.planner = CkptSavePlanner()

    def local(self, sd: dict[str, Any]) -> SavePlan:
        self.planner.set_up_planner(sd, None, self.rank == 0)
        return self.planner.create_local_plan()


def _save(ranks: list[_Rank], states: list[dict[str, Any]], *,
          delivered: bool = True) -> tuple[list[SavePlan], list[SavePlan], Any]:
    """One save's planning: local plans, the coordinator's global plan, finish_plan on every
    rank (unless the save failed before that: ``delivered=False``)."""
    sent = [r.local(sd) for r, sd in zip(ranks, states, strict=True)]
    plans, md = ranks[0].planner.create_global_plan(sent)
    if delivered:
        for r, p in zip(ranks, plans, strict=True):
            r.planner.finish_plan(p)
    return sent, plans, md


def test_unchanged_plans_travel_as_tokens_and_reuse_the_global_plan() -> None:
    ranks = [_Rank(r) for r in range(3)]
    states = [_state(r, n=4) for r in range(3)]
    sent1, plans1, md1 = _save(ranks, states)
    assert all(p.items for p in sent1)  # whole plans first
    sent2, plans2, md2 = _save(ranks, states)
    assert all(p.items == [] for p in sent2)  # then a token each
    assert [r.planner.plan_tokens_sent for r in ranks] == [1, 1, 1]
    assert ranks[0].planner.global_plan_reuses == 1
    assert plans2 == plans1 and md2.state_dict_metadata == md1.state_dict_metadata
    # one rank changes: it sends its whole plan, the others tokens; planned again, correctly
    states[1] = dict(states[1], w0=torch.zeros(16, 2))
    sent3, plans3, md3 = _save(ranks, states)
    assert [bool(p.items) for p in sent3] == [False, True, False]
    assert ranks[0].planner.global_plan_reuses == 1
    expected = _rank_plans(states)
    fresh = CkptSavePlanner()
    fresh.set_up_planner(states[0], None, True)
    fresh.create_local_plan()
    expected_plans, expected_md = fresh.create_global_plan(expected)
    assert plans3 == expected_plans
    assert md3.state_dict_metadata == expected_md.state_dict_metadata


def test_a_save_that_failed_before_finish_plan_resends_whole_plans() -> None:
    ranks = [_Rank(r) for r in range(2)]
    states = [_state(r) for r in range(2)]
    _save(ranks, states)
    _save(ranks, states, delivered=False)  # tokens sent, the save failed after planning
    sent, _, _ = _save(ranks, states)
    assert all(p.items for p in sent)  # not sure the coordinator kept them: whole plans
    sent, _, _ = _save(ranks, states)
    assert all(not p.items for p in sent)


def test_a_token_the_coordinator_lost_fails_one_save_then_heals() -> None:
    ranks = [_Rank(r) for r in range(2)]
    states = [_state(r) for r in range(2)]
    _save(ranks, states)
    ranks[0].planner.clear_plan_cache()  # the coordinator forgot (rank 1 did not)
    with pytest.raises(PlanTokenError, match="rank 1 sent a token"):
        _save(ranks, states)
    sent, _, md = _save(ranks, states)  # the failed save never reached finish_plan
    assert all(p.items for p in sent)
    assert md.state_dict_metadata["w0"].size == torch.Size([8, 4])  # type: ignore[union-attr]


def test_subclasses_that_extend_the_local_plan_never_send_tokens() -> None:
    planner = _ExtraItems()
    for _ in range(3):
        planner.set_up_planner(_state(), None, True)
        plan = planner.create_local_plan()
        assert plan.items
        plans, _ = planner.create_global_plan([plan])
        planner.finish_plan(plans[0])
    assert planner.plan_tokens_sent == 0 and planner.global_plan_reuses == 2
