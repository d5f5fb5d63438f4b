"""Retention through CheckpointManager (DESIGN.md section 7, docs/retention.md): each option, their
union, best_step(), restarts that rebuild the policy's view from the manifests on storage, and the
step a save committed below the newest (a re-save of an older step, as torch_xla's loop does)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch
from _procs import restored_version, state

from ckptmgr import CheckpointManager, CheckpointNotFoundError
from ckptmgr.codec import manifest

Plan = Sequence[tuple[int, dict[str, float] | None]]  # (step, metrics) in save order


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((3,), float(step)), "step": step}


def _check_content(mgr: CheckpointManager) -> None:
    for s in mgr.all_steps():
        out: dict[str, Any] = {"w": torch.zeros(3), "step": -1}
        mgr.restore(s, out)
        assert out["step"] == s and torch.equal(out["w"], torch.full((3,), float(s)))


def _dirs(root: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(root) if n.isdigit())


def _run(root: str, plan: Plan, kwargs: dict[str, Any], *, restart_each: bool
         ) -> list[tuple[list[int], int | None]]:
    """Save ``plan``; after each save record (all_steps, best_step). With ``restart_each``, every
    save is made by a new manager: the policy only knows what the manifests say."""
    history = []
    mgr = CheckpointManager(root, save_interval=1, **kwargs)
    try:
        for step, metrics in plan:
            assert mgr.save(step, _state(step), metrics=metrics) is True
            history.append((mgr.all_steps(), mgr.best_step()))
            if restart_each:  # the next save is made by a new manager
                mgr.close()
                mgr = CheckpointManager(root, save_interval=1, **kwargs)
                assert (mgr.all_steps(), mgr.best_step()) == history[-1]  # read back
    finally:
        mgr.close()
    return history


LOSSES = [0.9, 0.5, 0.7, 0.2, 0.8, 0.6, 0.3, 0.95, 0.4, 0.85]

CASES: list[Any] = [
    pytest.param(dict(max_to_keep=2), [(s, None) for s in range(6)], [4, 5], None,
                 id="max_to_keep"),
    pytest.param(dict(max_to_keep=1), [(s, None) for s in range(4)], [3], None,
                 id="max_to_keep-1"),
    pytest.param(dict(max_to_keep=0), [(s, None) for s in range(5)], [0, 1, 2, 3, 4], None,
                 id="max_to_keep-0-keeps-all"),
    pytest.param(dict(max_to_keep=None, keep_period=4, best_metric="loss"),
                 [(s, {"loss": LOSSES[s]}) for s in range(5)], [0, 1, 2, 3, 4], 3,
                 id="max_to_keep-None-keeps-all"),
    pytest.param(dict(max_to_keep=2, keep_period=4), [(s, None) for s in range(10)],
                 [0, 4, 8, 9], None, id="keep_period"),
    pytest.param(dict(max_to_keep=2, best_metric="loss"),
                 [(s, {"loss": LOSSES[s]}) for s in range(10)], [3, 8, 9], 3, id="best-min"),
    pytest.param(dict(max_to_keep=1, best_metric="loss", best_mode="max", keep_best=2),
                 [(s, {"loss": LOSSES[s]}) for s in range(10)], [0, 7, 9], 7, id="best-max-k2"),
    pytest.param(dict(max_to_keep=1, best_metric="acc", keep_best=3),
                 [(s, {"acc": LOSSES[s]} if s % 2 else {"other": 0.0}) for s in range(10)],
                 [1, 3, 5, 9], 3, id="best-ignores-steps-without-the-metric"),
    pytest.param(dict(max_to_keep=1, keep_period=5, best_metric="loss", keep_best=2),
                 [(s, {"loss": LOSSES[s]}) for s in range(10)], [0, 3, 5, 6, 9], 3,
                 id="union"),
    # Step order, not save order: "newest" is the largest step number.
    pytest.param(dict(max_to_keep=2), [(10, None), (30, None), (20, None), (5, None),
                                       (40, None)], [30, 40], None, id="order-by-step"),
    pytest.param(dict(max_to_keep=1, best_metric="loss"),
                 [(100, {"loss": 0.5}), (50, {"loss": 0.1}), (60, {"loss": 0.9}),
                  (110, {"loss": 0.7})], [50, 110], 50, id="order-by-step-best"),
]


@pytest.mark.parametrize("kwargs,plan,expected,best", CASES)
def test_retention_sequence_and_restarts_agree(tmp_path_factory: pytest.TempPathFactory,
                                               kwargs: dict[str, Any], plan: Plan,
                                               expected: list[int], best: int | None) -> None:
    one_run = str(tmp_path_factory.mktemp("ret") / "run")
    restarts = str(tmp_path_factory.mktemp("ret") / "run")
    history = _run(one_run, plan, kwargs, restart_each=False)
    assert history[-1] == (expected, best)
    assert _dirs(one_run) == expected  # deleted from storage, not only from the listing
    assert _run(restarts, plan, kwargs, restart_each=True) == history
    with CheckpointManager(one_run, save_interval=1, **kwargs) as mgr:
        assert (mgr.all_steps(), mgr.best_step()) == (expected, best)
        _check_content(mgr)


def test_retention_on_every_backend(root: str) -> None:
    kwargs: dict[str, Any] = dict(max_to_keep=2, keep_period=3, best_metric="loss")
    with CheckpointManager(root, save_interval=1, **kwargs) as mgr:
        for s in range(6):
            mgr.save(s, _state(s), metrics={"loss": LOSSES[s]})
        assert mgr.all_steps() == [0, 3, 4, 5] and mgr.best_step() == 3
    with CheckpointManager(root, save_interval=1, **kwargs) as mgr:
        assert mgr.all_steps() == [0, 3, 4, 5] and mgr.best_step() == 3
        _check_content(mgr)
        for pruned in (1, 2):
            with pytest.raises(CheckpointNotFoundError):
                mgr.restore(pruned, _state(0))


def test_the_newest_step_is_the_largest_not_the_last_saved(local_root: str) -> None:
    # The newest step is off the period and has the worst loss: only being newest keeps it.
    kwargs: dict[str, Any] = dict(max_to_keep=1, keep_period=10, best_metric="loss")
    with CheckpointManager(local_root, save_interval=1, **kwargs) as mgr:
        mgr.save(10, _state(10), metrics={"loss": 0.1})
        mgr.save(13, _state(13), metrics={"loss": 9.0})
        assert mgr.all_steps() == [10, 13]
        mgr.save(14, _state(14), metrics={"loss": 8.0})
        assert mgr.all_steps() == [10, 14]
        mgr.save(3, _state(3), metrics={"loss": 7.0})  # saved last, but not the newest step:
        assert mgr.all_steps() == [3, 10, 14]  # kept by the save that committed it
        mgr.save(15, _state(15), metrics={"loss": 8.5})  # then pruned: not newest, period, best
        assert mgr.all_steps() == [10, 15]
        _check_content(mgr)


def test_best_step(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.1})
        assert mgr.best_step() is None  # no best_metric
    with CheckpointManager(local_root, save_interval=1, max_to_keep=3, best_metric="loss") as mgr:
        assert mgr.best_step() == 1  # from the manifest written by the other manager
        mgr.save(2, _state(2), metrics={"loss": float("nan")})
        mgr.save(3, _state(3))
        # A 0-d tensor counts as a number; a tie with step 1: the newer wins.
        mgr.save(4, _state(4), metrics={"loss": torch.tensor(0.1, dtype=torch.float64)})
        assert mgr.best_step() == 4
        assert mgr.all_steps() == [2, 3, 4]  # step 1 lost the tie and is not among the newest 3
        assert mgr.step_info(4).metrics == {"loss": 0.1}
        mgr.save(5, _state(5), metrics={"loss": 0.05})
        assert mgr.all_steps() == [3, 4, 5] and mgr.best_step() == 5
    with CheckpointManager(local_root, save_interval=1, best_metric="loss", best_mode="max") as mgr:
        assert mgr.best_step() == 4
        assert mgr.all_steps() == [3, 4, 5]  # max_to_keep=None: nothing deleted here


def test_restart_with_smaller_retention_prunes_after_the_first_commit(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1) as mgr:
        for s in range(6):
            mgr.save(s, _state(s), metrics={"loss": LOSSES[s]})
    with CheckpointManager(local_root, save_interval=1, max_to_keep=2, best_metric="loss") as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3, 4, 5]  # constructing deletes nothing
        mgr.save(6, _state(6), metrics={"loss": 0.99})
        assert mgr.all_steps() == [3, 5, 6]
    assert _dirs(local_root) == [3, 5, 6]


def _time_kept(times: dict[int, float], interval: float) -> set[int]:
    """Independent oracle of keep_time_interval: walking steps in step order, the first, then each
    step at least ``interval`` seconds after the last kept one."""
    kept: set[int] = set()
    last: float | None = None
    for s in sorted(times):
        if last is None or times[s] >= last + interval:
            kept.add(s)
            last = times[s]
    return kept


class _Clock:
    """The commit-time clock, moved by the test (no sleeps: the times are exact)."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """Manifests stamped with the time of a :class:`_Clock` instead of the wall clock."""
    c = _Clock()

    class _Datetime(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return c.now if tz is None else c.now.astimezone(tz)

    monkeypatch.setattr(manifest, "datetime", _Datetime)
    return c


def _stamp(mgr: CheckpointManager, step: int) -> float:
    stamp = mgr.step_info(step).time  # UTC ISO 8601 from the manifest
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("restart", [False, True])
def test_keep_time_interval(local_root: str, clock: _Clock, restart: bool) -> None:
    interval, k = 0.25, 2
    kwargs: dict[str, Any] = dict(max_to_keep=k, keep_time_interval=interval)
    times: dict[int, float] = {}
    mgr = CheckpointManager(local_root, save_interval=1, **kwargs)
    try:
        for s in range(1, 8):
            if restart:
                mgr.close()
                mgr = CheckpointManager(local_root, save_interval=1, **kwargs)
            mgr.save(s, _state(s))
            times[s] = _stamp(mgr, s)
            assert times[s] == clock.now.timestamp()  # the test's clock stamped the manifest
            clock.advance(0.1)
            by_time = _time_kept(times, interval)
            expected = sorted(by_time | set(sorted(times)[-k:]))
            assert mgr.all_steps() == expected, (times, by_time)
        assert 1 in expected and len(by_time) >= 2 and len(expected) < len(times), expected
    finally:
        mgr.close()
    with CheckpointManager(local_root, save_interval=1, **kwargs) as mgr:
        assert mgr.all_steps() == expected
        _check_content(mgr)


def test_time_interval_orders_by_step_not_by_clock(local_root: str, clock: _Clock) -> None:
    # Steps saved out of order: step 5's commit time is the latest, but it is not the newest step.
    kwargs: dict[str, Any] = dict(max_to_keep=1, keep_time_interval=0.2)
    with CheckpointManager(local_root, save_interval=1, **kwargs) as mgr:
        mgr.save(10, _state(10))
        clock.advance(0.25)
        mgr.save(20, _state(20))  # >= 0.2 s after 10: kept by time
        clock.advance(0.25)
        mgr.save(5, _state(5))  # first by step order, so the time walk now starts at 5 ...
        assert mgr.all_steps() == [5, 20]  # ... and 10 (earlier than 5 on the clock) goes
        assert _stamp(mgr, 5) - _stamp(mgr, 20) == 0.25  # (the test's clock stamped them)
        mgr.save(30, _state(30))  # 20's time is before 5's: never kept by time once 5 anchors
        assert mgr.all_steps() == [5, 30]


def test_retention_keeps_the_step_the_save_committed_below_the_newest(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=100, max_to_keep=1) as mgr:
        for s in (100, 200, 300):
            assert mgr.save(s, state(s)) is True
        assert mgr.all_steps() == [300]
        assert mgr.save(250, state(250), force=True) is True
        assert mgr.all_steps() == [250, 300]  # kept by the save that committed it
        assert restored_version(mgr, 250) == 250
    with CheckpointManager(local_root, save_interval=100, max_to_keep=1) as mgr:
        assert mgr.all_steps() == [250, 300]
        # Later saves count it by step number: it falls out of the newest max_to_keep.
        assert mgr.save(400, state(400)) is True
        assert mgr.all_steps() == [400]


def test_torch_xla_style_loop_resaving_an_older_step_keeps_it(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=10, max_to_keep=1) as mgr:
        for s in (10, 20):
            mgr.save(s, state(s))
        assert mgr.all_steps() == [20]
    # The loop restarts from 0 (no restore): it saves 10 again, which retention had deleted.
    with CheckpointManager(local_root, save_interval=10, max_to_keep=1) as mgr:
        assert mgr.save(10, state(11)) is True
        assert mgr.all_steps() == [10, 20]
        assert restored_version(mgr, 10) == 11
        assert mgr.save(20, state(21)) is False  # already committed: skipped, not replaced
        assert restored_version(mgr, 20) == 20
        assert mgr.save(30, state(30)) is True
        assert mgr.all_steps() == [30]
