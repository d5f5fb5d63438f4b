"""Retention policies (ckptmgr/policy.py): pure, table-driven, milliseconds."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from ckptmgr.errors import CkptmgrError, ConfigError
from ckptmgr.policy import (
    AnyOf,
    KeepAll,
    KeepBest,
    KeepLatest,
    KeepPeriod,
    KeepTimeInterval,
    RetentionPolicy,
    StepRecord,
    best_step,
    build_policy,
    steps_to_delete,
)

NAN = float("nan")


def R(step: int, time: float | None = None, **metrics: float) -> StepRecord:
    """A record; time defaults to 10 s per step, so the clock agrees with the step order."""
    return StepRecord(step=step, time=float(step * 10) if time is None else time, metrics=metrics)


def steps(*numbers: int) -> list[StepRecord]:
    return [R(n) for n in numbers]


def losses(*pairs: tuple[int, float | None]) -> list[StepRecord]:
    """Records with a ``loss`` metric; None means the step has no loss."""
    return [R(s) if v is None else R(s, loss=v) for s, v in pairs]


# ---------------------------------------------------------------------------------------------
# Each policy's keep().

KEEP_CASES: list[tuple[str, RetentionPolicy, list[StepRecord], set[int]]] = [
    # KeepLatest
    ("latest-empty", KeepLatest(2), [], set()),
    ("latest-single", KeepLatest(2), steps(7), {7}),
    ("latest-k-larger-than-count", KeepLatest(10), steps(1, 2, 3), {1, 2, 3}),
    ("latest-basic", KeepLatest(2), steps(100, 200, 300, 400), {300, 400}),
    ("latest-unsorted", KeepLatest(2), steps(300, 100, 400, 200), {300, 400}),
    ("latest-numeric-not-lexicographic", KeepLatest(1), steps(9, 10, 100), {100}),
    ("latest-clock-backwards", KeepLatest(2),
     [R(1, 500.0), R(2, 400.0), R(3, 300.0), R(4, 100.0)], {3, 4}),
    # KeepPeriod
    ("period-empty", KeepPeriod(100), [], set()),
    ("period-single-off-period", KeepPeriod(100), steps(50), set()),
    ("period-basic", KeepPeriod(100), steps(0, 50, 100, 150, 200, 250), {0, 100, 200}),
    ("period-one-keeps-all", KeepPeriod(1), steps(3, 5, 8), {3, 5, 8}),
    ("period-unsorted", KeepPeriod(10), steps(25, 20, 10, 15), {10, 20}),
    # KeepTimeInterval
    ("time-empty", KeepTimeInterval(10.0), [], set()),
    ("time-single", KeepTimeInterval(10.0), [R(4, 123.0)], {4}),
    ("time-basic", KeepTimeInterval(10.0),
     [R(1, 0.0), R(2, 5.0), R(3, 10.0), R(4, 15.0), R(5, 20.0)], {1, 3, 5}),
    ("time-boundary-inclusive", KeepTimeInterval(10.0), [R(1, 0.0), R(2, 10.0)], {1, 2}),
    ("time-clock-backwards", KeepTimeInterval(10.0),
     [R(1, 100.0), R(2, 50.0), R(3, 105.0), R(4, 110.0)], {1, 4}),
    # Walks by step, not by time: sorted by time it would start at step 2.
    ("time-unsorted-walks-by-step", KeepTimeInterval(10.0),
     [R(3, 110.0), R(1, 100.0), R(2, 50.0)], {1, 3}),
    ("time-forward-jump", KeepTimeInterval(10.0), [R(1, 0.0), R(2, 1000.0), R(3, 5.0)], {1, 2}),
    ("time-nan-first", KeepTimeInterval(10.0), [R(1, NAN), R(2, 0.0), R(3, 10.0)], {2, 3}),
    ("time-nan-later", KeepTimeInterval(10.0), [R(1, 0.0), R(2, NAN), R(3, 10.0)], {1, 3}),
    # KeepBest
    ("best-empty", KeepBest("loss"), [], set()),
    ("best-min", KeepBest("loss"), losses((1, 0.5), (2, 0.1), (3, 0.3)), {2}),
    ("best-max", KeepBest("acc", mode="max"),
     [R(1, acc=0.5), R(2, acc=0.9), R(3, acc=0.7)], {2}),
    ("best-min-k2", KeepBest("loss", k=2), losses((1, 0.5), (2, 0.1), (3, 0.3)), {2, 3}),
    ("best-max-k2", KeepBest("loss", "max", 2), losses((1, 0.5), (2, 0.1), (3, 0.3)), {1, 3}),
    ("best-k-larger-than-count", KeepBest("loss", k=5), losses((1, 0.5), (2, 0.1)), {1, 2}),
    ("best-missing-metric", KeepBest("loss", k=2), losses((1, None), (2, 0.4), (3, None)), {2}),
    ("best-all-missing", KeepBest("loss"), losses((1, None), (2, None)), set()),
    ("best-other-metric-only", KeepBest("loss"), [R(1, acc=0.1)], set()),
    ("best-nan-never-best-min", KeepBest("loss"), losses((1, NAN), (2, 9.0)), {2}),
    ("best-nan-never-best-max", KeepBest("loss", "max"), losses((1, NAN), (2, -9.0)), {2}),
    ("best-all-nan", KeepBest("loss"), losses((1, NAN), (2, NAN)), set()),
    ("best-tie-prefers-newer", KeepBest("loss"), losses((1, 0.5), (2, 0.5), (3, 0.9)), {2}),
    ("best-tie-prefers-newer-k2", KeepBest("loss", k=2),
     losses((1, 0.5), (2, 0.5), (3, 0.5), (4, 0.9)), {2, 3}),
    ("best-tie-max", KeepBest("loss", "max"), losses((3, 0.9), (8, 0.9), (5, 0.1)), {8}),
    ("best-int-values", KeepBest("loss"), losses((1, 3), (2, 2)), {2}),
    ("best-infinite", KeepBest("loss"), losses((1, 0.0), (2, -math.inf)), {2}),
    ("best-ignores-clock", KeepBest("loss"), [R(1, 99.0, loss=0.2), R(2, 1.0, loss=0.2)], {2}),
    # KeepAll
    ("all-empty", KeepAll(), [], set()),
    ("all", KeepAll(), steps(1, 5, 3), {1, 3, 5}),
    # AnyOf
    ("anyof-empty-policies", AnyOf(()), steps(1, 2), set()),
    ("anyof-empty-steps", AnyOf((KeepLatest(1), KeepPeriod(2))), [], set()),
    ("anyof-latest-period", AnyOf((KeepLatest(1), KeepPeriod(100))),
     steps(50, 100, 150, 200, 250), {100, 200, 250}),
    ("anyof-latest-best", AnyOf((KeepLatest(2), KeepBest("loss"))),
     losses((1, 0.1), (2, 0.5), (3, 0.6), (4, 0.7)), {1, 3, 4}),
    ("anyof-overlap", AnyOf((KeepLatest(2), KeepBest("loss", k=2))),
     losses((1, 0.9), (2, 0.5), (3, 0.1), (4, 0.2)), {3, 4}),
    ("anyof-all-four", AnyOf((KeepLatest(1), KeepPeriod(4), KeepTimeInterval(25.0),
                              KeepBest("loss"))),
     [R(s, s * 10.0, loss=abs(s - 3)) for s in range(1, 10)], {1, 3, 4, 7, 8, 9}),
    ("anyof-nested", AnyOf((AnyOf((KeepLatest(1),)), KeepPeriod(3))), steps(1, 2, 3, 4), {3, 4}),
    ("anyof-with-all", AnyOf((KeepLatest(1), KeepAll())), steps(1, 2), {1, 2}),
]


@pytest.mark.parametrize("policy,records,expected", [c[1:] for c in KEEP_CASES],
                         ids=[c[0] for c in KEEP_CASES])
def test_keep(policy: RetentionPolicy, records: list[StepRecord], expected: set[int]) -> None:
    assert policy.keep(records) == expected


# ---------------------------------------------------------------------------------------------
# steps_to_delete: the guarantees on top of any policy.

DELETE_CASES: list[tuple[str, list[StepRecord], RetentionPolicy, set[int], list[int]]] = [
    ("empty", [], KeepLatest(1), set(), []),
    ("single", steps(7), KeepLatest(1), set(), []),
    ("single-period-would-drop-it", steps(7), KeepPeriod(100), set(), []),
    ("period-only-keeps-newest", steps(50, 100, 150), KeepPeriod(100), set(), [50]),
    ("empty-anyof-keeps-newest", steps(1, 2, 3), AnyOf(()), set(), [1, 2]),
    ("latest", steps(1, 2, 3, 4, 5), KeepLatest(2), set(), [1, 2, 3]),
    ("latest-k-larger", steps(1, 2), KeepLatest(5), set(), []),
    ("unsorted-input-ascending-output", steps(5, 1, 4, 2, 3), KeepLatest(2), set(), [1, 2, 3]),
    ("numeric-order", steps(9, 100, 10), KeepLatest(1), set(), [9, 10]),
    # Newest by step survives even though its clock says it is the oldest.
    ("clock-backwards-newest-kept", [R(1, 300.0), R(2, 200.0), R(3, 100.0)],
     KeepLatest(1), set(), [1, 2]),
    ("clock-backwards-time-policy", [R(1, 300.0), R(2, 200.0), R(3, 100.0)],
     KeepTimeInterval(10.0), set(), [2]),
    ("best-newest-kept-too", losses((1, 0.1), (2, 0.5), (3, 0.9)), KeepBest("loss"), set(), [2]),
    ("best-missing-metric", losses((1, None), (2, None), (3, None)), KeepBest("loss"), set(),
     [1, 2]),
    ("protected", steps(1, 2, 3, 4), KeepLatest(1), {2}, [1, 3]),
    ("protected-newest", steps(1, 2, 3), KeepLatest(1), {3}, [1, 2]),
    ("protected-not-listed", steps(1, 2, 3), KeepLatest(1), {99}, [1, 2]),
    ("protected-all", steps(1, 2, 3), AnyOf(()), {1, 2, 3}, []),
    ("keep-all", steps(1, 2, 3), KeepAll(), set(), []),
    ("union", steps(50, 100, 150, 200, 250, 300), AnyOf((KeepLatest(2), KeepPeriod(100))), set(),
     [50, 150]),
    ("policy-returns-unknown-steps", steps(1, 2, 3), KeepPeriod(1000), {500}, [1, 2]),
]


@pytest.mark.parametrize("records,policy,protected,expected", [c[1:] for c in DELETE_CASES],
                         ids=[c[0] for c in DELETE_CASES])
def test_steps_to_delete(records: list[StepRecord], policy: RetentionPolicy, protected: set[int],
                         expected: list[int]) -> None:
    assert steps_to_delete(records, policy, protected=protected) == expected


def test_steps_to_delete_default_protected_and_tuple_input() -> None:
    assert steps_to_delete(tuple(steps(3, 1, 2)), KeepLatest(1)) == [1, 2]


def test_steps_to_delete_rejects_duplicates() -> None:
    with pytest.raises(ConfigError, match=r"steps must be unique, got duplicates \[3\]"):
        steps_to_delete([R(3), R(1), R(3, 999.0)], KeepLatest(1))


# ---------------------------------------------------------------------------------------------
# best_step and build_policy.

BEST_CASES: list[tuple[str, list[StepRecord], str, str, int | None]] = [
    ("empty", [], "loss", "min", None),
    ("none-has-it", losses((1, None), (2, None)), "loss", "min", None),
    ("all-nan", losses((1, NAN)), "loss", "min", None),
    ("min", losses((1, 0.5), (2, 0.1), (3, 0.3)), "loss", "min", 2),
    ("max", losses((1, 0.5), (2, 0.1), (3, 0.3)), "loss", "max", 1),
    ("skips-missing-and-nan", losses((1, None), (2, NAN), (3, 7.0)), "loss", "min", 3),
    ("tie-newer", losses((4, 0.2), (9, 0.2), (6, 0.2)), "loss", "min", 9),
    ("unsorted", losses((3, 0.3), (1, 0.1), (2, 0.2)), "loss", "max", 3),
]


@pytest.mark.parametrize("records,metric,mode,expected", [c[1:] for c in BEST_CASES],
                         ids=[c[0] for c in BEST_CASES])
def test_best_step(records: list[StepRecord], metric: str, mode: str,
                   expected: int | None) -> None:
    assert best_step(records, metric, mode) == expected


BUILD_CASES: list[tuple[str, dict[str, Any], RetentionPolicy]] = [
    ("none-keeps-all", {"max_to_keep": None}, KeepAll()),
    ("zero-keeps-all", {"max_to_keep": 0}, KeepAll()),
    ("zero-ignores-others", {"max_to_keep": 0, "keep_period": 10, "best_metric": "loss"},
     KeepAll()),
    ("latest-only", {"max_to_keep": 3}, AnyOf((KeepLatest(3),))),
    ("period", {"max_to_keep": 3, "keep_period": 1000}, AnyOf((KeepLatest(3), KeepPeriod(1000)))),
    ("time-int-becomes-float", {"max_to_keep": 1, "keep_time_interval": 3600},
     AnyOf((KeepLatest(1), KeepTimeInterval(3600.0)))),
    ("best-defaults-to-one", {"max_to_keep": 2, "best_metric": "loss"},
     AnyOf((KeepLatest(2), KeepBest("loss", "min", 1)))),
    ("best-max-k", {"max_to_keep": 2, "best_metric": "acc", "best_mode": "max", "keep_best": 4},
     AnyOf((KeepLatest(2), KeepBest("acc", "max", 4)))),
    ("everything", {"max_to_keep": 3, "keep_period": 1000, "keep_time_interval": 60.0,
                    "best_metric": "loss", "keep_best": 2},
     AnyOf((KeepLatest(3), KeepPeriod(1000), KeepTimeInterval(60.0), KeepBest("loss", "min", 2)))),
]


@pytest.mark.parametrize("kwargs,expected", [c[1:] for c in BUILD_CASES],
                         ids=[c[0] for c in BUILD_CASES])
def test_build_policy(kwargs: dict[str, Any], expected: RetentionPolicy) -> None:
    assert build_policy(**kwargs) == expected


def test_build_policy_end_to_end() -> None:
    policy = build_policy(max_to_keep=2, keep_period=1000, best_metric="loss", keep_best=1)
    records = [R(s, loss=1.0 / (1 + s % 700)) for s in range(0, 3001, 100)]
    # best: 600, 1300, 2000 and 2700 tie at 1/601, the newest wins: 2700;
    # period: 0, 1000, 2000, 3000; latest: 2900, 3000.
    kept = {0, 1000, 2000, 2700, 2900, 3000}
    assert steps_to_delete(records, policy) == sorted({r.step for r in records} - kept)


def test_policies_are_frozen_hashable_protocol_members() -> None:
    policies: list[RetentionPolicy] = [KeepLatest(1), KeepPeriod(2), KeepTimeInterval(1.0),
                                       KeepBest("loss"), KeepAll(), AnyOf((KeepLatest(1),))]
    for p in policies:
        assert isinstance(p, RetentionPolicy)
        hash(p)
        with pytest.raises(AttributeError):
            p.k = 5  # type: ignore[attr-defined]
    listed = AnyOf([KeepLatest(1)])  # type: ignore[arg-type]
    assert listed.policies == (KeepLatest(1),) and listed == AnyOf((KeepLatest(1),))


# ---------------------------------------------------------------------------------------------
# Validation: ConfigError (also a ValueError) naming the field, the value and the rule.

BAD: list[tuple[str, Callable[[], object], str]] = [
    ("max_to_keep-negative", lambda: build_policy(max_to_keep=-1),
     r"^retention\.max_to_keep must be >= 0, got -1$"),
    ("max_to_keep-bool", lambda: build_policy(max_to_keep=True),
     r"^retention\.max_to_keep must be an int >= 0, got True \(bool\)$"),
    ("max_to_keep-float", lambda: build_policy(max_to_keep=2.0),  # type: ignore[arg-type]
     r"^retention\.max_to_keep must be an int >= 0, got 2\.0 \(float\)$"),
    ("max_to_keep-str", lambda: build_policy(max_to_keep="3"),  # type: ignore[arg-type]
     r"retention\.max_to_keep must be an int >= 0, got '3' \(str\)"),
    ("keep_period-zero", lambda: build_policy(max_to_keep=1, keep_period=0),
     r"^retention\.keep_period must be >= 1, got 0$"),
    ("keep_period-bool", lambda: build_policy(max_to_keep=1, keep_period=True),
     r"retention\.keep_period must be an int >= 1, got True"),
    ("keep_period-checked-even-if-keep-all", lambda: build_policy(max_to_keep=0, keep_period=-5),
     r"retention\.keep_period must be >= 1, got -5"),
    ("interval-zero", lambda: build_policy(max_to_keep=1, keep_time_interval=0),
     r"^retention\.keep_time_interval must be a finite number of seconds > 0, got 0$"),
    ("interval-negative", lambda: build_policy(max_to_keep=1, keep_time_interval=-1.5),
     r"retention\.keep_time_interval .* > 0, got -1\.5"),
    ("interval-nan", lambda: build_policy(max_to_keep=1, keep_time_interval=NAN),
     r"retention\.keep_time_interval .* > 0, got nan"),
    ("interval-inf", lambda: build_policy(max_to_keep=1, keep_time_interval=math.inf),
     r"retention\.keep_time_interval must be a finite .*, got inf"),
    ("interval-bool", lambda: build_policy(max_to_keep=1, keep_time_interval=True),
     r"retention\.keep_time_interval must be a number of seconds > 0, got True \(bool\)"),
    ("interval-str", lambda: build_policy(max_to_keep=1,
                                          keep_time_interval="60"),  # type: ignore[arg-type]
     r"retention\.keep_time_interval must be a number of seconds > 0, got '60' \(str\)"),
    ("best_metric-empty", lambda: build_policy(max_to_keep=1, best_metric=""),
     r"^retention\.best_metric must be a non-empty str, got ''$"),
    ("best_metric-int", lambda: build_policy(max_to_keep=1, best_metric=3),  # type: ignore[arg-type]
     r"retention\.best_metric must be a non-empty str, got 3"),
    ("best_mode", lambda: build_policy(max_to_keep=1, best_metric="loss", best_mode="mean"),
     r"^retention\.best_mode must be 'min' or 'max', got 'mean'$"),
    ("best_mode-case", lambda: build_policy(max_to_keep=1, best_mode="MIN"),
     r"retention\.best_mode must be 'min' or 'max', got 'MIN'"),
    ("keep_best-zero", lambda: build_policy(max_to_keep=1, best_metric="loss", keep_best=0),
     r"^retention\.keep_best must be >= 1, got 0$"),
    ("keep_best-bool", lambda: build_policy(max_to_keep=1, best_metric="loss", keep_best=True),
     r"retention\.keep_best must be an int >= 1, got True"),
    ("keep_best-without-metric", lambda: build_policy(max_to_keep=1, keep_best=2),
     r"retention\.keep_best=2 needs retention\.best_metric to be set, got best_metric=None"),
    ("KeepLatest-zero", lambda: KeepLatest(0), r"^KeepLatest\.k must be >= 1, got 0$"),
    ("KeepLatest-bool", lambda: KeepLatest(True), r"KeepLatest\.k must be an int >= 1, got True"),
    ("KeepPeriod-zero", lambda: KeepPeriod(0), r"^KeepPeriod\.period must be >= 1, got 0$"),
    ("KeepPeriod-float", lambda: KeepPeriod(2.5),  # type: ignore[arg-type]
     r"KeepPeriod\.period must be an int >= 1, got 2\.5 \(float\)"),
    ("KeepTimeInterval-zero", lambda: KeepTimeInterval(0.0),
     r"KeepTimeInterval\.seconds must be a finite number of seconds > 0, got 0\.0"),
    ("KeepTimeInterval-bool", lambda: KeepTimeInterval(False),
     r"KeepTimeInterval\.seconds must be a number of seconds > 0, got False"),
    ("KeepBest-mode", lambda: KeepBest("loss", mode="avg"),  # type: ignore[arg-type]
     r"^KeepBest\.mode must be 'min' or 'max', got 'avg'$"),
    ("KeepBest-k", lambda: KeepBest("loss", k=0), r"^KeepBest\.k must be >= 1, got 0$"),
    ("KeepBest-k-bool", lambda: KeepBest("loss", k=True), r"KeepBest\.k must be an int >= 1"),
    ("KeepBest-metric", lambda: KeepBest(""), r"KeepBest\.metric must be a non-empty str"),
    ("AnyOf-not-policy", lambda: AnyOf((KeepLatest(1), object())),  # type: ignore[arg-type]
     r"AnyOf\.policies\[1\] must be a retention policy"),
    ("AnyOf-not-iterable", lambda: AnyOf(3),  # type: ignore[arg-type]
     r"AnyOf\.policies must be a tuple of retention policies, got int"),
    ("StepRecord-negative", lambda: StepRecord(-1, 0.0),
     r"^StepRecord\.step must be >= 0, got -1$"),
    ("StepRecord-bool", lambda: StepRecord(True, 0.0),
     r"StepRecord\.step must be an int >= 0, got True"),
    ("StepRecord-time", lambda: StepRecord(1, "now"),  # type: ignore[arg-type]
     r"StepRecord\.time must be a number of unix seconds, got 'now'"),
    ("StepRecord-metrics", lambda: StepRecord(1, 0.0, [1.0]),  # type: ignore[arg-type]
     r"StepRecord\.metrics must be a mapping"),
    ("best_step-mode", lambda: best_step([], "loss", "best"),
     r"mode must be 'min' or 'max', got 'best'"),
]


@pytest.mark.parametrize("make,message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_validation(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert isinstance(info.value, ValueError) and isinstance(info.value, CkptmgrError)


# ---------------------------------------------------------------------------------------------
# Property-style: invariants over many random step lists and policies.


def _random_policy(rng: random.Random, depth: int = 0) -> RetentionPolicy:
    kind = rng.randrange(6 if depth < 2 else 5)
    if kind == 0:
        return KeepLatest(rng.randint(1, 6))
    if kind == 1:
        return KeepPeriod(rng.randint(1, 20))
    if kind == 2:
        return KeepTimeInterval(rng.choice([0.5, 5.0, 30.0, 200.0]))
    if kind == 3:
        return KeepBest("loss", rng.choice(["min", "max"]), rng.randint(1, 4))
    if kind == 4:
        return KeepAll() if rng.random() < 0.2 else KeepLatest(1)
    return AnyOf(tuple(_random_policy(rng, depth + 1) for _ in range(rng.randint(0, 4))))


def _random_records(rng: random.Random) -> list[StepRecord]:
    numbers = rng.sample(range(0, 120), rng.randint(0, 25))
    out: list[StepRecord] = []
    t = 1.7e9
    for n in sorted(numbers):
        t += rng.choice([-50.0, -1.0, 0.0, 1.0, 3.0, 10.0, 40.0, 500.0])  # skew included
        metrics: dict[str, float] = {}
        roll = rng.random()
        if roll < 0.6:
            metrics["loss"] = float(rng.randint(0, 5))  # small range: many ties
        elif roll < 0.75:
            metrics["loss"] = NAN
        elif roll < 0.85:
            metrics["acc"] = rng.random()
        out.append(StepRecord(n, t, metrics))
    rng.shuffle(out)
    return out


def _check_invariants(records: Sequence[StepRecord], policy: RetentionPolicy,
                      protected: set[int], deleted: list[int]) -> None:
    present = {r.step for r in records}
    assert set(deleted) <= present
    assert deleted == sorted(set(deleted)), "ascending, no repeats"
    if present:
        assert max(present) not in deleted, "newest deleted"
    assert not protected & set(deleted), "protected deleted"
    in_order = sorted(records, key=lambda r: r.step)
    assert not policy.keep(in_order) & set(deleted), "kept-by-policy deleted"
    # Everything not deleted is justified by the policy, the newest step, or protection.
    survivors = present - set(deleted)
    assert survivors == present & (policy.keep(in_order) | protected | {max(present, default=-1)})


def test_random_invariants() -> None:
    rng = random.Random(20240607)
    for _ in range(1500):
        records = _random_records(rng)
        policy = _random_policy(rng)
        present = [r.step for r in records]
        protected = set(rng.sample(present, min(len(present), rng.randint(0, 2))))
        protected |= {rng.randrange(200)}  # maybe not a listed step
        deleted = steps_to_delete(records, policy, protected=protected)
        _check_invariants(records, policy, protected, deleted)
        # Input order never matters.
        shuffled = list(records)
        rng.shuffle(shuffled)
        assert steps_to_delete(shuffled, policy, protected=protected) == deleted
        # Retention is idempotent: pruning the survivors again deletes nothing.
        survivors = [r for r in records if r.step not in set(deleted)]
        assert steps_to_delete(survivors, policy, protected=protected) == []
