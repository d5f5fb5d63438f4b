"""restore_latest, and the final save of a normal close() (save_on_close)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks

import ckptmgr
from ckptmgr.errors import ConfigError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _train(state: dict[str, Any], mgr: ckptmgr.CheckpointManager, start: int, stop: int) -> None:
    model, opt = state["model"], state["optim"]
    for step in range(start, stop):
        loss = model(torch.full((2, 4), float(step))).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["extra"]["step"] = step
        mgr.save_async(step, state)


def _state() -> dict[str, Any]:
    model = _model()
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1),
            "extra": {"step": -1}}


def test_restore_latest_on_an_empty_root_leaves_the_state(tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0)}
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=10) as m:
        assert m.restore_latest(state) is None
    assert torch.equal(state["w"], torch.arange(4.0))


def test_close_saves_the_last_step_and_restore_latest_resumes_it(tmp_path: Path) -> None:
    state = _state()
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=10) as m:
        _train(state, m, 0, 25)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=10) as m:
        assert m.all_steps() == [0, 10, 20, 24]
        fresh = _state()
        assert m.restore_latest(fresh) == 24
        assert fresh["extra"]["step"] == 24
        for k, v in fresh["model"].state_dict().items():
            assert torch.equal(v, expected[k]), k
        assert m.restore_latest({"model": fresh["model"]}, allow_partial=True) == 24


def test_close_after_an_exception_saves_nothing(tmp_path: Path) -> None:
    state = _state()
    with pytest.raises(KeyError), ckptmgr.CheckpointManager(str(tmp_path), save_interval=10) as m:
        _train(state, m, 0, 13)
        raise KeyError("training failed")
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=10, read_only=True) as m:
        assert m.all_steps() == [0, 10]

    m = ckptmgr.CheckpointManager(str(tmp_path / "b"), save_interval=10)
    try:
        _train(state, m, 0, 13)
        raise KeyError("training failed")
    except KeyError:
        pass
    finally:
        pass
    try:
        try:
            raise ValueError("propagating")
        finally:
            m.close()  # while the ValueError propagates
    except ValueError:
        pass
    with ckptmgr.CheckpointManager(str(tmp_path / "b"), save_interval=10, read_only=True) as r:
        assert r.all_steps() == [0, 10]


def test_a_state_changed_after_the_call_is_not_saved_and_warns(tmp_path: Path) -> None:
    state = _state()
    m = ckptmgr.CheckpointManager(str(tmp_path), save_interval=10)
    _train(state, m, 0, 13)
    with torch.no_grad():  # a loop that broke in the middle of step 13
        state["model"].weight.add_(1.0)
    with pytest.warns(RuntimeWarning, match=r"steps 11-12 not saved.*force=True"):
        m.close()
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=10, read_only=True) as r:
        assert r.all_steps() == [0, 10]


def test_a_replaced_tensor_is_a_change(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3)}
    m = ckptmgr.CheckpointManager(str(tmp_path), save_interval=10)
    m.save(3, state)
    state["w"] = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="step 3 not saved"):
        m.close()
    assert not (tmp_path / "3").exists()


def test_save_on_close_false_warns_and_saves_nothing(tmp_path: Path) -> None:
    state = _state()
    m = ckptmgr.CheckpointManager(str(tmp_path), save_interval=10, save_on_close=False)
    _train(state, m, 0, 12)
    with pytest.warns(RuntimeWarning, match=r"steps 11-11|step 11.*save_on_close=False"):
        m.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0", "10"]


def test_nothing_newer_means_no_save_and_no_warning(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ckptmgr.CheckpointManager(str(tmp_path), save_interval=5) as m:
            m.save(5, state)
            m.save(3, state)  # older than the newest committed step
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["5"]


def test_save_on_close_config(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"path: {tmp_path / 'r'}\nsave_interval: 5\nsave_on_close: false\n")
    with ckptmgr.CheckpointManager.from_config(str(cfg)) as m:
        assert m.config.save_on_close is False
    with pytest.raises(ConfigError, match="save_on_close"):
        ckptmgr.CheckpointManager(str(tmp_path / "r"), save_interval=5,
                                  save_on_close="yes")  # type: ignore[arg-type]


def _ranks_close(rank: int, world: int, root: str) -> list[int]:
    state = {"w": torch.zeros(4)}  # a plain tensor is the same (replicated) on every rank
    with ckptmgr.CheckpointManager(root, save_interval=4) as m:
        for step in range(7):
            state["w"].add_(1.0)
            m.save_async(step, state)
    with ckptmgr.CheckpointManager(root, save_interval=4) as m:
        got = {"w": torch.zeros(4)}
        assert m.restore_latest(got) == 6
        assert torch.equal(got["w"], torch.full((4,), 7.0))
        return m.all_steps()


def test_close_saves_on_every_rank(tmp_path: Path) -> None:
    res = run_ranks(_ranks_close, 2, str(tmp_path / "root"), timeout_s=120)
    assert res == [[0, 4, 6], [0, 4, 6]]


def test_a_changed_python_value_is_a_change(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3), "loader": {"position": 3}}
    m = ckptmgr.CheckpointManager(str(tmp_path), save_interval=10)
    m.save(3, state)
    state["loader"]["position"] = 4  # the data loader moved on: not step 3's state any more
    with pytest.warns(RuntimeWarning, match="step 3 not saved"):
        m.close()
    assert not (tmp_path / "3").exists()


def test_a_with_block_left_normally_inside_an_except_clause_saves(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3)}
    try:
        raise KeyError("handled")
    except KeyError:
        with ckptmgr.CheckpointManager(str(tmp_path), save_interval=10) as m:
            m.save(3, state)
    assert (tmp_path / "3" / "commit.json").exists()


def test_restore_latest_on_a_reader_sees_steps_committed_after_it_opened(tmp_path: Path) -> None:
    with ckptmgr.CheckpointManager(str(tmp_path), save_interval=1) as w:
        w.save(1, {"w": torch.ones(2)})
        with ckptmgr.CheckpointManager(str(tmp_path), save_interval=1, read_only=True) as r:
            w.save(2, {"w": torch.full((2,), 2.0)})
            got = {"w": torch.zeros(2)}
            assert r.restore_latest(got) == 2 and float(got["w"][0]) == 2.0
            with pytest.raises(ConfigError):
                r.restore_latest([1, 2])  # type: ignore[arg-type]


def test_preemption_at_a_step_the_root_holds_with_a_local_tier(tmp_path: Path) -> None:
    """The preemption save of a step the durable tier holds skips the local tier (one step,
    one version) and is still acknowledged: no raw error."""
    fire = iter([False, True])
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), save_interval=10,
                                   local_path=str(tmp_path / "local"), local_interval=5,
                                   exit_on_preemption=False,
                                   preemption_check=lambda: next(fire, False)) as m:
        state = {"w": torch.ones(2)}
        assert m.save(10, state)
        assert m.save(10, state)  # preemption agreed here: step 10 is the last checkpoint
        assert m.reached_preemption(10)
        assert m.all_steps() == [10]


def _one_rank_fails(rank: int, world: int, root: str) -> list[int]:
    state = {"w": torch.zeros(4)}
    try:
        with ckptmgr.CheckpointManager(root, save_interval=10) as m:
            m.save(3, state)
            if rank == 1:
                raise KeyError("rank 1 failed mid-step")
    except KeyError:
        pass
    with ckptmgr.CheckpointManager(root, save_interval=10, read_only=True) as r:
        return r.all_steps()


def test_an_exception_on_one_rank_stops_the_final_save_on_all(tmp_path: Path) -> None:
    assert run_ranks(_one_rank_fails, 2, str(tmp_path / "root"), timeout_s=120) == [[], []]
