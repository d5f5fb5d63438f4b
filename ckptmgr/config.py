"""The validated configuration of a CheckpointManager: pydantic models, YAML loading, messages.

This is the one place where the manager's arguments are validated. The constructor calls
:meth:`ManagerConfig.from_kwargs` with its flat arguments; ``CheckpointManager.from_config`` calls
:func:`load_config` with a YAML file, a mapping or a model. Both return a frozen
:class:`ManagerConfig` with nested sections::

    ManagerConfig        path, save_interval, overwrite, verify, planner, read_only, take_over,
                         collective_timeout_s
    ├── storage          StorageConfig      fsspec options (credentials, endpoint, ...)
    ├── retention        RetentionConfig    which committed steps to keep
    ├── async            AsyncConfig        the single-in-flight save queue
    ├── preemption       PreemptionConfig   signals that trigger a last checkpoint
    └── local            LocalTierConfig    the fast node-local tier (docs/multitier.md)

Every failure is a :class:`~ckptmgr.errors.ConfigError` (the original error as ``__cause__``) whose
message names the field, the value and the rule. Fields are named as the caller spelled them: the
constructor argument (``max_to_keep``) for :meth:`ManagerConfig.from_kwargs`, the dotted YAML path
(``retention.max_to_keep``) otherwise. Values of ``storage.options`` can hold secrets, so they never
appear in messages or in ``repr()``; only their keys do.

Each setting is declared once, as a field of its model annotated with a :class:`Setting`: its type,
default and description (pydantic), the rule its messages state, and the constructor argument that
sets it with that argument's position. The constructor's flat arguments (``from_kwargs``,
``to_kwargs``), the messages' rules and the flat names in messages are all derived from these
fields. ``CheckpointManager.__init__`` keeps its explicit signature (the public API);
``tests/config/test_settings.py`` checks that it agrees with the fields (names, order, defaults).

Pure layer: stdlib, pydantic, PyYAML and :mod:`ckptmgr.errors` only (no torch, no fsspec).
"""

from __future__ import annotations

import difflib
import logging
import os
import signal
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from ckptmgr._redact import redact_url
from ckptmgr.errors import ConfigError

__all__ = [
    "PATH_ENV_VAR",
    "AsyncConfig",
    "LocalTierConfig",
    "ManagerConfig",
    "PreemptionConfig",
    "RetentionConfig",
    "Setting",
    "StorageConfig",
    "check_flag",
    "load_config",
]

log = logging.getLogger(__name__)

PATH_ENV_VAR = "CKPTMGR_PATH"
"""When set and not blank, this environment variable replaces ``path`` in :func:`load_config`."""

# Signals a process cannot catch, so a handler for them could never run.
_UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})
_NO_VALUE: Any = object()

@dataclass(frozen=True)
class Setting:
    """What a config field is to its callers, declared in the field's annotation
    (``Annotated[<type>, Setting(...)]``) beside its type, default and description.

    Attributes:
        rule: what a valid value is, as messages state it: "<name> must be <rule>, got <value>".
        position: the position of the field's CheckpointManager argument among the constructor's
            settings (``process_group`` and ``preemption_check`` are not settings): the order of
            :meth:`ManagerConfig.to_kwargs`.
        arg: the CheckpointManager argument that sets the field, when it is not the field's own
            name (``max_to_keep`` of the local tier is ``local_max_to_keep``).
    """

    rule: str
    position: int
    arg: str | None = None


class _Rule(ValueError):
    """A broken rule raised inside a model; the formatter names the fields in the caller's terms.

    ``template`` holds ``{name}`` for the field being validated and ``{0}``, ``{1}`` for the
    ``fields`` of the same section; ``got`` is appended as ``, got <value>``.
    """

    def __init__(self, template: str, *fields: str, got: Any = _NO_VALUE) -> None:
        super().__init__(template)
        self.template = template
        self.fields = fields
        self.got = got


# hide_input_in_errors: the pydantic error kept as __cause__ must not echo secrets either.
_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                           hide_input_in_errors=True)


# True while an outer validation runs. A model that defines __init__ is validated by calling it,
# also when nested, and pydantic re-locates a nested ValidationError under the outer field; so
# only the outermost call may turn it into a ConfigError.
_VALIDATING: ContextVar[bool] = ContextVar("ckptmgr_config_validating", default=False)


@contextmanager
def _outermost(root: type[BaseModel], *, flat: bool, where: str = "") -> Iterator[None]:
    """Runs a validation, turning its ValidationError into a ConfigError if it is the outermost."""
    if _VALIDATING.get():
        yield
        return
    token = _VALIDATING.set(True)
    try:
        yield
    except ValidationError as e:
        raise ConfigError(where + _describe(e, root=root, flat=flat)) from e
    finally:
        _VALIDATING.reset(token)


class _Section(BaseModel):
    """Base of every config model: constructing one directly raises ConfigError too."""

    model_config = _MODEL_CONFIG

    def __init__(self, **data: Any) -> None:
        with _outermost(type(self), flat=False):
            super().__init__(**data)


# ---------------------------------------------------------------------------------------------
# The models


_Int0 = Annotated[int, Strict(), Field(ge=0)]
_Int1 = Annotated[int, Strict(), Field(ge=1)]
_Seconds = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
_Name = Annotated[str, Strict(), Field(min_length=1)]


class StorageConfig(_Section):
    """Options passed to the fsspec filesystem (endpoint, project, credentials, ...).

    Values are never shown in errors or ``repr()``: they may be secrets.
    """

    options: Annotated[dict[Annotated[str, Strict()], Any],
                       Setting("None or a dict with str keys", 6, "storage_options")] = Field(
        default_factory=dict, description="keyword arguments for the fsspec filesystem")

    @field_validator("options", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        yield "options", dict.fromkeys(self.options, "<redacted>")


class RetentionConfig(_Section):
    """Which committed steps to keep: the union of latest-k, every N steps, one per time interval
    and best-k by a metric."""

    max_to_keep: Annotated[_Int0 | None, Setting("None or an int >= 0", 2)] = Field(
        default=None, description="keep this many newest steps; None or 0 keeps every step")
    keep_period: Annotated[_Int1 | None, Setting("None or an int >= 1", 7)] = Field(
        default=None, description="also keep every step divisible by this")
    keep_time_interval: Annotated[
        _Seconds | None, Setting("None or a finite number of seconds > 0", 8)] = Field(
        default=None, description="also keep one step per this many seconds")
    best_metric: Annotated[_Name | None, Setting("None or a non-empty str", 9)] = Field(
        default=None, description="also keep the best keep_best steps by this metric")
    best_mode: Annotated[Literal["min", "max"], Setting("'min' or 'max'", 10)] = Field(
        default="min", description="whether the best metric value is the lowest or the highest")
    keep_best: Annotated[_Int1 | None, Setting("None or an int >= 1", 11)] = Field(
        default=None, description="how many best steps to keep (needs best_metric)")

    @model_validator(mode="after")
    def _best_needs_metric(self) -> RetentionConfig:
        if self.keep_best is not None and self.best_metric is None:
            raise _Rule("{0} requires {1} to be set", "keep_best", "best_metric",
                        got=self.keep_best)
        return self


class AsyncConfig(_Section):
    """The background save queue: one save in flight, and what a save does while one is."""

    max_pending_async: Annotated[int, Strict(), Setting(
        "an int >= 1 (one save is in flight; larger values act as 1)", 3)] = Field(
        default=1, description="saves in flight: ckptmgr keeps one; values > 1 are accepted "
        "(torch_xla code keeps running) with a warning and act as 1")
    backpressure: Annotated[Literal["block", "skip"], Setting("'block' or 'skip'", 13)] = Field(
        default="block", description="wait for the in-flight save, or skip the new one")
    num_of_threads: Annotated[_Int1 | None, Setting("None or an int >= 1", 4)] = Field(
        default=None, description="writer threads per rank; None lets ckptmgr choose")
    mode: Annotated[Literal["thread", "process"],
                    Setting("'thread' or 'process'", 26, "async_mode")] = Field(
        default="thread", description="where background saves run: a thread of the training "
        "process, or one persistent writer process per rank (Linux; docs/performance.md)")

    @field_validator("max_pending_async")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise _Rule("{name} must be an int >= 1 (one save in flight is the design)",
                        got=value)
        if value > 1:
            log.warning("max_pending_async=%d: ckptmgr keeps one save in flight; a new save "
                        "waits for it (backpressure) instead of queueing", value)
        return value


_SIGNALS_RULE = "a signal name ('SIGTERM' or 'TERM'), a signal number, or a list of them"


def _to_signal(item: Any) -> signal.Signals:
    if isinstance(item, signal.Signals):
        sig = item
    elif isinstance(item, int) and not isinstance(item, bool):
        try:
            sig = signal.Signals(item)
        except ValueError:
            raise _Rule("{name} must name known signals", got=item) from None
    elif isinstance(item, str):
        name = item.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name.startswith("SIG_") or name not in signal.Signals.__members__:
            raise _Rule("{name} must name known signals (e.g. 'SIGTERM', 'TERM' or 15)", got=item)
        sig = signal.Signals[name]
    else:
        raise _Rule("{name} must be " + _SIGNALS_RULE, got=item)
    if sig in _UNCATCHABLE:
        raise _Rule("{name} cannot include SIGKILL or SIGSTOP (they cannot be caught)", got=item)
    return sig


def _to_signals(value: Any) -> tuple[signal.Signals, ...]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out: list[signal.Signals] = []
    for item in items:
        sig = _to_signal(item)
        if sig not in out:
            out.append(sig)
    return tuple(out)


class PreemptionConfig(_Section):
    """The last checkpoint taken when a preemption signal arrives."""

    enabled: Annotated[bool, Strict(), Setting("a bool", 5, "chkpt_on_preemption")] = Field(
        default=True, description="take a last checkpoint when a preemption signal arrives")
    signals: Annotated[tuple[signal.Signals, ...], BeforeValidator(_to_signals),
                       Setting(_SIGNALS_RULE, 15, "preemption_signals")] = Field(
        default=(signal.SIGTERM,), description="the signals that mean preemption")
    grace_s: Annotated[_Seconds, Setting("a finite number of seconds > 0", 16,
                                         "preemption_grace_s")] = Field(
        default=30.0, description="seconds the scheduler allows between the signal and the kill")
    exit_on_preemption: Annotated[bool, Strict(), Setting("a bool", 17)] = Field(
        default=True, description="exit (128 + signal) after the last checkpoint commits")
    file: Annotated[Annotated[str, Strict(), Field(min_length=1)] | None, Setting(
        "a path string (a file whose appearance means preemption)", 18, "preemption_file")] = Field(
        default=None, description="a file whose appearance also means preemption")

    @model_validator(mode="after")
    def _some_signal_when_enabled(self) -> PreemptionConfig:
        if self.enabled and not self.signals:
            raise _Rule("{0} must name at least one signal when {1} is true", "signals", "enabled",
                        got=self.signals)
        return self

    @field_serializer("signals", when_used="json")
    def _signal_names(self, value: tuple[signal.Signals, ...]) -> list[str]:
        return [s.name for s in value]


def _local_dir(value: Any) -> Any:
    """A node-local directory: a plain path or a ``file://`` URL (made a plain path)."""
    if not isinstance(value, str):
        return value
    if value.startswith("file://"):
        value = value[len("file://"):]
    if "://" in value or value.startswith("memory:") or not value.strip():
        raise _Rule("{name} must be a local directory path (each rank writes its own node-local "
                    "disk; the durable tier is path)", got=value)
    return value


class LocalTierConfig(_Section):
    """The fast tier: every rank writes its own files to a node-local directory
    (docs/multitier.md)."""

    path: Annotated[Annotated[str, Strict(), BeforeValidator(_local_dir)] | None, Setting(
        "None or a local directory path (no URL scheme but file://)", 23, "local_path")] = Field(
        default=None, description="node-local directory (NVMe, /dev/shm); each rank writes "
        "<path>/rank-<r>; None: no local tier")
    interval: Annotated[_Int1 | None, Setting("None or an int >= 1", 24, "local_interval")] = Field(
        default=None, description="a step is due on the local tier when step % interval == 0")
    max_to_keep: Annotated[_Int1, Setting("an int >= 1", 25, "local_max_to_keep")] = Field(
        default=2, description="newest local steps kept on every rank")
    replicas: Annotated[_Int0, Setting("an int >= 0", 28, "local_replicas")] = Field(
        default=0, description="each rank's local step is also held by this many ranks on other "
        "nodes (peer replicas, sent in the background); 0: none")

    @model_validator(mode="after")
    def _path_and_interval_together(self) -> LocalTierConfig:
        if self.interval is not None and self.path is None:
            raise _Rule("{0} requires {1} to be set", "interval", "path", got=self.interval)
        if self.path is not None and self.interval is None:
            raise _Rule("{0} requires {1} to be set", "path", "interval", got=self.path)
        return self


_SECTIONS = ("storage", "retention", "async", "preemption", "local")


class ManagerConfig(_Section):
    """Everything a CheckpointManager is configured with (all but the process group).

    Build one with :meth:`from_kwargs` (the constructor's flat arguments) or :func:`load_config`
    (a YAML file or a mapping); the constructor takes it back with :meth:`to_kwargs`.
    """

    path: Annotated[_Name, Setting("a non-empty str", 0)] = Field(
        description="root directory or fsspec URL of the checkpoints")
    save_interval: Annotated[_Int1, Setting("an int >= 1", 1)] = Field(
        description="a step is due when step % save_interval == 0")
    overwrite: Annotated[bool, Strict(), Setting("a bool", 12)] = Field(
        default=False, description="allow re-saving a committed step")
    verify: Annotated[bool, Strict(), Setting("a bool", 14)] = Field(
        default=True, description="check sizes and checksums on restore")
    planner: Annotated[Literal["auto", "dcp", "xla_spmd"],
                       Setting("'auto', 'dcp' or 'xla_spmd'", 19)] = Field(
        default="auto", description="how states are planned: 'auto' picks 'xla_spmd' when the "
        "state holds XLA (or other sharded) tensors, else 'dcp'")
    read_only: Annotated[bool, Strict(), Setting("a bool", 20)] = Field(
        default=False, description="open the root as a reader: no writer lease, saves refused")
    take_over: Annotated[bool, Strict(), Setting("a bool", 21)] = Field(
        default=False, description="take the root's writer lease even from a live holder")
    save_on_close: Annotated[bool, Strict(), Setting("a bool", 27)] = Field(
        default=True, description="a normal close() saves the newest step given to save or "
        "save_async when it is newer than the newest committed step (never after an exception, "
        "never a state changed since that call)")
    reuse_unchanged: Annotated[bool, Strict(), Setting("a bool", 29)] = Field(
        default=False, description="durable tier: a tensor chunk equal (by 128-bit content hash) "
        "to one already stored in the root is referenced instead of written again")
    collective_timeout_s: Annotated[
        _Seconds | None, Setting("None or a finite number of seconds > 0", 22)] = Field(
        default=None, description="no collective of ckptmgr waits longer; None: the "
        "CKPTMGR_COLLECTIVE_TIMEOUT_S environment variable if set, else 600 s")
    storage: StorageConfig = Field(default_factory=StorageConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    local: LocalTierConfig = Field(default_factory=LocalTierConfig)

    @model_validator(mode="after")
    def _local_is_not_the_root(self) -> ManagerConfig:
        if self.local.path is not None and self.local.path.rstrip("/") == self.path.rstrip("/"):
            raise _Rule("{0} must differ from {1} (the durable tier)", "local.path", "path",
                        got=self.local.path)
        return self

    @model_validator(mode="before")
    @classmethod
    def _empty_section_is_default(cls, data: Any) -> Any:
        # A YAML section whose keys are all commented out loads as None: that means "defaults".
        if isinstance(data, Mapping) and any(data.get(s, 0) is None for s in _SECTIONS):
            return {k: v for k, v in data.items() if not (k in _SECTIONS and v is None)}
        return data

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # The URL may carry user:password@ (the value itself is kept for the storage).
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if name == "path" and isinstance(value, str) else value

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ManagerConfig:
        """Validates the constructor's flat arguments (all but ``process_group``).

        Raises:
            ConfigError: an unknown argument (with a suggestion) or an invalid value; the message
                names the constructor argument, the value and the rule.
        """
        unknown = [k for k in kwargs if k not in _FLAT]
        if unknown:
            raise ConfigError("; ".join(_unknown_argument(k) for k in unknown))
        data: dict[str, Any] = {}
        for name, value in kwargs.items():
            *section, field = _FLAT[name]
            (data.setdefault(section[0], {}) if section else data)[field] = value
        with _outermost(cls, flat=True):
            return cls.model_validate(data)
        raise AssertionError("unreachable")  # mypy: a context manager may swallow exceptions

    def to_kwargs(self) -> dict[str, Any]:
        """The constructor's flat arguments, in its order (``from_kwargs`` takes them back).

        ``storage_options`` is a copy, or None when empty (the constructor's default).
        """
        out: dict[str, Any] = {}
        for name, where in _FLAT.items():
            obj: Any = self
            for part in where:
                obj = getattr(obj, _attr(type(obj), part))
            out[name] = obj
        out["storage_options"] = dict(self.storage.options) or None
        return out


def _attr(model: type[BaseModel], key: str) -> str:
    """The attribute name of the field that ``key`` (alias or name) spells, or ``key`` itself."""
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return name
    return key


def _submodel(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    info = model.model_fields.get(_attr(model, key))
    ann = info.annotation if info is not None else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _keys(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


# Section model -> its key in ManagerConfig, so a section built on its own names "retention.x".
_SECTION_OF: dict[type[BaseModel], str] = {
    sub: key for key in _keys(ManagerConfig) if (sub := _submodel(ManagerConfig, key)) is not None}


def _settings(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], FieldInfo, Setting | None]]:
    """(the field's keys from ManagerConfig, the field, its Setting) for every field under
    ``model``; a section's Setting is None."""
    for name, info in model.model_fields.items():
        where = (*prefix, info.alias or name)
        sub = _submodel(model, where[-1])
        if sub is not None:
            yield where, info, None
            yield from _settings(sub, where)
            continue
        found = [m for m in info.metadata if isinstance(m, Setting)]
        if len(found) != 1:
            raise TypeError(f"config field {'.'.join(where)} needs exactly one Setting in its "
                            f"annotation, has {len(found)}")
        yield where, info, found[0]


def _derive() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The rules by dotted YAML path, and constructor argument -> keys, in constructor order."""
    rules: dict[str, str] = {}
    args: list[tuple[int, str, tuple[str, ...]]] = []
    for where, _, setting in _settings(ManagerConfig):
        if setting is None:
            rules[".".join(where)] = "a mapping"
            continue
        rules[".".join(where)] = setting.rule
        args.append((setting.position, setting.arg or where[-1], where))
    args.sort()
    if [a[0] for a in args] != list(range(len(args))) or len({a[1] for a in args}) != len(args):
        raise TypeError("config Settings need distinct arguments at positions 0.."
                        f"{len(args) - 1}, got {[(a[0], a[1]) for a in args]}")
    return rules, {arg: where for _, arg, where in args}


# The rule of each field as the caller's message states it, keyed by the dotted YAML path; and
# each constructor argument -> where it lives in the model (section alias, field), in constructor
# order. Both derived from the fields' Settings.
_RULES, _FLAT = _derive()
_DOTTED_TO_FLAT = {".".join(where): name for name, where in _FLAT.items()}


# ---------------------------------------------------------------------------------------------
# Messages


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_argument(name: str) -> str:
    if name == "process_group":
        return "process_group is not part of the config; pass it to the CheckpointManager"
    return f"unknown argument {name!r}{_suggest(name, list(_FLAT))}"


def _show(dotted: str, value: Any) -> str:
    if dotted.split(".")[0] in ("storage", "path") and not (isinstance(value, str) and not value):
        # storage options may be secrets and a URL may carry user:password: name the type only.
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(err: ValidationError, *, root: type[BaseModel], flat: bool) -> str:
    """One line naming each failed field, its value and its rule."""
    prefix = (_SECTION_OF[root],) if root in _SECTION_OF else ()
    return "; ".join(_describe_one(e, root=root, prefix=prefix, flat=flat)
                     for e in err.errors(include_url=False))


def _describe_one(e: Mapping[str, Any], *, root: type[BaseModel], prefix: tuple[str, ...],
                  flat: bool) -> str:
    # Split the location into the model fields it walks through and what follows (dict keys).
    model: type[BaseModel] | None = root
    names: list[str] = list(prefix)
    rest: list[Any] = []
    for part in e["loc"]:
        if model is not None and not rest and isinstance(part, str) and part in _keys(model):
            names.append(part)
            model = _submodel(model, part)
        else:
            rest.append(part)

    def display(dotted: str) -> str:
        return _DOTTED_TO_FLAT.get(dotted, dotted) if flat else dotted

    dotted = ".".join(names)
    name = display(dotted)
    kind, value, ctx = e["type"], e.get("input"), e.get("ctx", {})
    if kind == "extra_forbidden" and rest:
        key = str(rest[0])
        owner = model if model is not None else root
        hint = _suggest(key, _keys(owner))
        if not hint and dotted == "storage":
            hint = " (fsspec options go under storage.options)"
        return f"unknown field {'.'.join([*names, key])!r}{hint}"
    if rest and rest[-1] == "[key]":
        return f"{name} keys must be str, got {rest[0]!r}"
    if kind == "missing":
        return f"{name} is required"
    rule = ctx.get("error")
    if isinstance(rule, _Rule):
        # A model validator's location is its section; its rule names fields of that section.
        fields = [display(".".join([*names, f])) for f in rule.fields]
        text = rule.template.replace("{name}", name)
        for i, field_name in enumerate(fields):
            text = text.replace(f"{{{i}}}", field_name)
        return text if rule.got is _NO_VALUE else f"{text}, got {_show(dotted, rule.got)}"
    if kind in ("greater_than_equal", "greater_than"):
        op = ">=" if kind == "greater_than_equal" else ">"
        bound = ctx.get("ge", ctx.get("gt"))
        return f"{name} must be {op} {bound:g}, got {_show(dotted, value)}"
    if kind == "finite_number":
        return f"{name} must be a finite number, got {_show(dotted, value)}"
    if kind == "string_too_short":
        return f"{name} must be a non-empty str, got {_show(dotted, value)}"
    rule_text = _RULES.get(dotted, e["msg"].lower())
    return f"{name} must be {rule_text}, got {_show(dotted, value)}"


# ---------------------------------------------------------------------------------------------
# YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        # An alias can multiply a small file into an exponential structure (a "billion laughs"
        # of nested aliases); a config never needs one.
        if self.check_event(yaml.events.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a ckptmgr config: write the "
                "value out", self.peek_event().start_mark)  # type: ignore[no-untyped-call]
        return super().compose_node(parent, index)


_MAX_CONFIG_BYTES = 1 << 20
_MAX_CONFIG_DEPTH = 32


def _read_yaml(path: str) -> Any:
    try:
        # Parse from the stream, not a string: marks then carry no snippet of the file's text,
        # which could hold a secret, into the original error kept as __cause__.
        with open(path, encoding="utf-8") as f:
            if os.fstat(f.fileno()).st_size > _MAX_CONFIG_BYTES:
                raise ConfigError(f"config file {path!r} is larger than "
                                  f"{_MAX_CONFIG_BYTES} bytes; a ckptmgr config is a few lines")
            return yaml.load(f, Loader=_StrictLoader)  # a SafeLoader subclass
    except ConfigError:
        raise
    except RecursionError as e:
        raise ConfigError(f"config file {path!r} is nested too deeply to be a ckptmgr "
                          "config") from e
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path!r} does not exist") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text") from e
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or "syntax error"
        raise ConfigError(f"config file {path!r} is not valid YAML: {problem}{where}") from e
    except ValueError as e:  # a scalar YAML cannot convert, e.g. an int of 4301+ digits
        raise ConfigError(f"config file {path!r} holds a value that cannot be read: {e}") from e


def _check_keys(data: Any, where: str, path: str = "", depth: int = 0) -> None:
    """Every mapping key in a config is a str, and nesting is bounded.

    Raises:
        ConfigError: names the first key that is not a str (or where nesting goes too deep).
    """
    if path == "storage.options":
        return  # the model's own rule for it names the field the same way
    if depth > _MAX_CONFIG_DEPTH:
        raise ConfigError(f"{where}{path or 'the config'} is nested deeper than "
                          f"{_MAX_CONFIG_DEPTH} levels")
    if isinstance(data, Mapping):
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}{path + ' ' if path else ''}keys must be str, got "
                                  f"{key!r}")
            _check_keys(value, where, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            _check_keys(value, where, f"{path}[{i}]", depth + 1)


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a real bool (flags of the public API are never truthy objects).

    Raises:
        ConfigError: anything else, e.g. ``"false"``, ``1``, ``[False]`` (names the flag).
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool (True or False), got {value!r} "
                          f"({type(value).__name__})")
    return value


def load_config(
        source: ManagerConfig | str | os.PathLike[str] | Mapping[str, Any]) -> ManagerConfig:
    """The validated config of a model, a YAML file or a mapping (nested as in the YAML).

    When the ``CKPTMGR_PATH`` environment variable is set and not blank it replaces ``path``
    (then a file or mapping may leave ``path`` out). A relative ``path`` is relative to the
    process's working directory, not to the YAML file. Local; no I/O besides reading the file.

    Raises:
        ConfigError: a missing or unreadable file, invalid YAML, a top level that is not a mapping,
            an unknown key (with a suggestion) or an invalid value (named by its dotted path).
    """
    env = os.environ.get(PATH_ENV_VAR, "")
    env_path = env if env.strip() else None
    if isinstance(source, ManagerConfig):
        if env_path is None:
            return source
        log.info("config path replaced by $%s", PATH_ENV_VAR)  # the URL may carry credentials
        return source.model_copy(update={"path": env_path})
    where = ""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        data = _read_yaml(path)
        where = f"config file {path!r}: "
        if data is None:
            raise ConfigError(f"config file {path!r} is empty; it needs at least save_interval "
                              "and path")
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path!r} must hold a mapping at top level, got "
                              f"{type(data).__name__}")
    elif isinstance(source, Mapping):
        data = source
    else:
        raise ConfigError("config must be a ManagerConfig, a YAML file path or a mapping, got "
                          f"{type(source).__name__}")
    _check_keys(data, where)
    if env_path is not None:
        log.info("config path replaced by $%s", PATH_ENV_VAR)
        data = {**data, "path": env_path}
    with _outermost(ManagerConfig, flat=False, where=where):
        return ManagerConfig.model_validate(data)
    raise AssertionError("unreachable")  # mypy: a context manager may swallow exceptions
