"""Retention policies: which committed steps to keep.

Each policy is a tiny frozen dataclass with one pure method, ``keep(steps) -> set[int]``, over the
committed steps given ascending by step number. Policies compose with :class:`AnyOf` (their union is
kept). :func:`steps_to_delete` turns a policy into a deletion list and adds the guarantees no policy
can opt out of: the newest committed step and protected (in-flight) steps are never deleted.

Everything here orders by step number, never by clock: a manifest time earlier than its
predecessor's (clock skew) never reorders steps. This module is pure (no I/O, no torch, no fsspec);
the manager calls it only after a new step has committed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ckptmgr.errors import ConfigError

__all__ = [
    "AnyOf",
    "KeepAll",
    "KeepBest",
    "KeepLatest",
    "KeepPeriod",
    "KeepTimeInterval",
    "RetentionPolicy",
    "StepRecord",
    "best_step",
    "build_policy",
    "steps_to_delete",
]

Mode = Literal["min", "max"]
_MODES: tuple[str, ...] = ("min", "max")


# ---------------------------------------------------------------------------------------------
# Validation helpers: each names the field, the value and the rule.


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r} "
                          f"({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_positive_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r} "
                          f"({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _check_mode(name: str, value: object) -> Mode:
    if isinstance(value, str) and value == "min":
        return "min"
    if isinstance(value, str) and value == "max":
        return "max"
    raise ConfigError(f"{name} must be 'min' or 'max', got {value!r}")


def _check_metric(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty str, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Records and the policy protocol.


@dataclass(frozen=True)
class StepRecord:
    """What retention knows about one committed step.

    Attributes:
        step: the step number (an int >= 0); the only ordering retention uses.
        time: unix seconds (UTC) when the step committed, from its manifest. Only
            :class:`KeepTimeInterval` reads it; it may go backwards between steps (clock skew).
        metrics: the metrics saved with the step, e.g. ``{"loss": 0.3}``.
    """

    step: int
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_int("StepRecord.step", self.step, 0)
        if not _is_real(self.time):
            raise ConfigError(f"StepRecord.time must be a number of unix seconds, got "
                              f"{self.time!r} ({type(self.time).__name__})")
        if not isinstance(self.metrics, Mapping):
            raise ConfigError(f"StepRecord.metrics must be a mapping of str -> float, got "
                              f"{type(self.metrics).__name__}")


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which committed steps to keep.

    ``keep`` must be pure: it sees the committed steps ascending by step number (no duplicates) and
    returns the step numbers to keep. It may return steps not in the list; they are ignored.
    Keeping the newest step and in-flight steps is :func:`steps_to_delete`'s job, not the policy's.
    """

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """Returns the step numbers of ``steps`` this policy keeps."""
        ...


def _by_step(steps: Iterable[StepRecord]) -> list[StepRecord]:
    # Callers pass ascending steps; sorting again is cheap and makes each policy safe on its own.
    return sorted(steps, key=lambda r: r.step)


# ---------------------------------------------------------------------------------------------
# Policies.


@dataclass(frozen=True)
class KeepLatest:
    """Keeps the ``k`` newest steps by step number (never by time).

    Attributes:
        k: how many to keep, >= 1.
    """

    k: int

    def __post_init__(self) -> None:
        _check_int("KeepLatest.k", self.k, 1)

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """Returns the ``k`` largest step numbers (all of them when there are fewer)."""
        return {r.step for r in _by_step(steps)[-self.k:]}


@dataclass(frozen=True)
class KeepPeriod:
    """Keeps every step divisible by ``period`` (step 0 included).

    Attributes:
        period: the period in steps, >= 1.
    """

    period: int

    def __post_init__(self) -> None:
        _check_int("KeepPeriod.period", self.period, 1)

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """Returns the steps with ``step % period == 0``."""
        return {r.step for r in steps if r.step % self.period == 0}


@dataclass(frozen=True)
class KeepTimeInterval:
    """Keeps about one step per ``seconds`` of commit time.

    Walks the steps ascending by step number: keeps the first, then each step whose time is at least
    ``seconds`` after the last kept step's time. A step whose time went backwards (clock skew) is
    simply not kept by this policy; it never changes the order or un-keeps an earlier step. The kept
    set of the older steps does not change when newer steps are appended.

    Attributes:
        seconds: the interval, a finite number > 0.
    """

    seconds: float

    def __post_init__(self) -> None:
        _check_positive_seconds("KeepTimeInterval.seconds", self.seconds)

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """Returns the first step and each step at least ``seconds`` after the last one kept."""
        kept: set[int] = set()
        last: float | None = None
        for r in _by_step(steps):
            # NaN times compare False, so such a step is never kept (and never becomes `last`).
            if last is None or r.time >= last + self.seconds:
                if last is None and math.isnan(r.time):
                    continue
                kept.add(r.step)
                last = r.time
        return kept


def _metric_value(record: StepRecord, metric: str) -> float | None:
    """The record's value for ``metric``, or None when missing, not a number, or NaN."""
    value: Any = record.metrics.get(metric)
    if not _is_real(value) or math.isnan(value):
        return None
    return float(value)


def _ranked(steps: Iterable[StepRecord], metric: str, mode: Mode) -> list[int]:
    """Steps that have ``metric``, best first; on a tie the newer (larger) step comes first."""
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * v, -r.step) for r in steps if (v := _metric_value(r, metric)) is not None]
    return [-neg_step for _, neg_step in sorted(scored)]


@dataclass(frozen=True)
class KeepBest:
    """Keeps the ``k`` best steps by ``metrics[metric]``.

    Steps without the metric, or with a NaN or non-numeric value, never count as best. Ties prefer
    the newer step.

    Attributes:
        metric: the metric's name, as passed in ``save(..., metrics={...})``.
        mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"`` (e.g. an accuracy).
        k: how many to keep, >= 1.
    """

    metric: str
    mode: Mode = "min"
    k: int = 1

    def __post_init__(self) -> None:
        _check_metric("KeepBest.metric", self.metric)
        _check_mode("KeepBest.mode", self.mode)
        _check_int("KeepBest.k", self.k, 1)

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """Returns the ``k`` best steps that have the metric."""
        return set(_ranked(steps, self.metric, self.mode)[:self.k])


@dataclass(frozen=True)
class KeepAll:
    """Keeps every step (``max_to_keep`` None or 0, torch_xla's 0)."""

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """Returns every step."""
        return {r.step for r in steps}


@dataclass(frozen=True)
class AnyOf:
    """Keeps each step that any of ``policies`` keeps (their union).

    Attributes:
        policies: the policies; a list is accepted and stored as a tuple. An empty tuple keeps
            nothing (:func:`steps_to_delete` still keeps the newest step).
    """

    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        if isinstance(self.policies, (str, bytes)) or not isinstance(self.policies, Iterable):
            raise ConfigError(f"AnyOf.policies must be a tuple of retention policies, got "
                              f"{type(self.policies).__name__}")
        policies = tuple(self.policies)
        for i, p in enumerate(policies):
            if not isinstance(p, RetentionPolicy):
                raise ConfigError(f"AnyOf.policies[{i}] must be a retention policy with a "
                                  f"keep(steps) method, got {p!r}")
        # Frozen dataclass: the documented way to normalize a field in __post_init__.
        object.__setattr__(self, "policies", policies)

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """Returns the union of what each policy keeps."""
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return kept


# ---------------------------------------------------------------------------------------------
# Entry points used by the manager.


def build_policy(*, max_to_keep: int | None, keep_period: int | None = None,
                 keep_time_interval: float | None = None, best_metric: str | None = None,
                 best_mode: str = "min", keep_best: int | None = None) -> RetentionPolicy:
    """Builds the retention policy of the manager's options, validating each one.

    Args:
        max_to_keep: keep this many newest steps; None or 0 keeps every step (torch_xla's 0), and
            then the other options change nothing.
        keep_period: also keep every step divisible by this (>= 1).
        keep_time_interval: also keep one step per this many seconds (> 0).
        best_metric: also keep the best ``keep_best`` steps by this metric.
        best_mode: ``"min"`` or ``"max"``.
        keep_best: how many best steps to keep (>= 1); defaults to 1 when ``best_metric`` is set.

    Returns:
        :class:`KeepAll`, or :class:`AnyOf` of :class:`KeepLatest` and each option that is set.

    Raises:
        ConfigError: an option has the wrong type or range, or ``keep_best`` is set without
            ``best_metric``.
    """
    if max_to_keep is not None:
        _check_int("retention.max_to_keep", max_to_keep, 0)
    if keep_period is not None:
        _check_int("retention.keep_period", keep_period, 1)
    if keep_time_interval is not None:
        _check_positive_seconds("retention.keep_time_interval", keep_time_interval)
    if best_metric is not None:
        _check_metric("retention.best_metric", best_metric)
    mode = _check_mode("retention.best_mode", best_mode)
    if keep_best is not None:
        _check_int("retention.keep_best", keep_best, 1)
        if best_metric is None:
            raise ConfigError(f"retention.keep_best={keep_best} needs retention.best_metric to be "
                              "set, got best_metric=None")

    if not max_to_keep:
        return KeepAll()
    policies: list[RetentionPolicy] = [KeepLatest(max_to_keep)]
    if keep_period is not None:
        policies.append(KeepPeriod(keep_period))
    if keep_time_interval is not None:
        policies.append(KeepTimeInterval(float(keep_time_interval)))
    if best_metric is not None:
        policies.append(KeepBest(best_metric, mode, 1 if keep_best is None else keep_best))
    return AnyOf(tuple(policies))


def best_step(steps: Sequence[StepRecord], metric: str, mode: str) -> int | None:
    """Returns the single best step by ``metric`` (newer wins a tie), or None if no step has it.

    Raises:
        ConfigError: ``mode`` is not ``"min"`` or ``"max"``, or ``metric`` is not a non-empty str.
    """
    ranked = _ranked(steps, _check_metric("metric", metric), _check_mode("mode", mode))
    return ranked[0] if ranked else None


def steps_to_delete(steps: Sequence[StepRecord], policy: RetentionPolicy, *,
                    protected: Collection[int] = ()) -> list[int]:
    """Returns the committed steps to delete, ascending.

    Call it only after a new step has committed (the coordinator does, in the manager). The result
    never contains the newest committed step (the largest step number), a ``protected`` step (e.g.
    one in flight), or a step ``policy`` keeps. Input order does not matter: steps are sorted by
    step number, never by time.

    Args:
        steps: the committed steps, in any order, each step at most once.
        policy: the retention policy.
        protected: step numbers that must survive whatever the policy says.

    Raises:
        ConfigError: a step appears more than once (a bug in the caller's listing).
    """
    ordered = _by_step(steps)
    if not ordered:
        return []
    dups = sorted({a.step for a, b in itertools.pairwise(ordered) if a.step == b.step})
    if dups:
        raise ConfigError(f"steps must be unique, got duplicates {dups}")
    kept = set(policy.keep(ordered))
    kept.add(ordered[-1].step)  # the newest committed step: the run's only way back
    kept.update(protected)
    return [r.step for r in ordered if r.step not in kept]
