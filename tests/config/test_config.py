"""ckptmgr.config: the models, from_kwargs/to_kwargs, YAML loading, messages, configs/, the docs."""

from __future__ import annotations

import inspect
import math
import re
import signal
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

import ckptmgr
from ckptmgr.config import (
    PATH_ENV_VAR,
    AsyncConfig,
    ManagerConfig,
    PreemptionConfig,
    RetentionConfig,
    StorageConfig,
    load_config,
)
from ckptmgr.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted([*ROOT.joinpath("configs").glob("*.yaml"),
                       *ROOT.joinpath("configs").glob("*.yml")])
DOC = ROOT / "docs" / "configuration.md"

# The constructor's defaults (DESIGN.md section 2), besides the required path and save_interval.
DEFAULTS: dict[str, Any] = {
    "max_to_keep": None, "max_pending_async": 1, "num_of_threads": None,
    "chkpt_on_preemption": True, "storage_options": None, "keep_period": None,
    "keep_time_interval": None, "best_metric": None, "best_mode": "min", "keep_best": None,
    "overwrite": False, "backpressure": "block", "verify": True,
    "preemption_signals": (signal.SIGTERM,), "preemption_grace_s": 30.0,
    "exit_on_preemption": True,
    "preemption_file": None, "planner": "auto", "read_only": False, "take_over": False,
    "collective_timeout_s": None,
    "local_path": None, "local_interval": None, "local_max_to_keep": 2, "async_mode": "thread",
    "save_on_close": True, "local_replicas": 0, "reuse_unchanged": False,
}

# Constructor argument -> YAML path, written out here independently of the module's own table.
YAML_PATH = {
    "path": "path", "save_interval": "save_interval", "overwrite": "overwrite",
    "verify": "verify", "planner": "planner", "storage_options": "storage.options",
    "max_to_keep": "retention.max_to_keep", "keep_period": "retention.keep_period",
    "keep_time_interval": "retention.keep_time_interval",
    "best_metric": "retention.best_metric", "best_mode": "retention.best_mode",
    "keep_best": "retention.keep_best", "max_pending_async": "async.max_pending_async",
    "backpressure": "async.backpressure", "num_of_threads": "async.num_of_threads",
    "chkpt_on_preemption": "preemption.enabled", "preemption_signals": "preemption.signals",
    "preemption_grace_s": "preemption.grace_s",
    "exit_on_preemption": "preemption.exit_on_preemption",
    "preemption_file": "preemption.file", "read_only": "read_only", "take_over": "take_over",
    "collective_timeout_s": "collective_timeout_s",
    "local_path": "local.path", "local_interval": "local.interval",
    "local_max_to_keep": "local.max_to_keep", "async_mode": "async.mode",
    "save_on_close": "save_on_close", "local_replicas": "local.replicas",
    "reuse_unchanged": "reuse_unchanged",
}
BASE: dict[str, Any] = {"path": "/tmp/ckpt-run", "save_interval": 10}


@pytest.fixture(autouse=True)
def _no_env_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PATH_ENV_VAR, raising=False)


def nested(**kwargs: Any) -> dict[str, Any]:
    """The YAML-shaped mapping of constructor arguments."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        *section, key = YAML_PATH[name].split(".")
        (out.setdefault(section[0], {}) if section else out)[key] = value
    return out


def config_error(fn: Any, *args: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kwargs)
    return ei.value


# ------------------------------------------------------------------------------ configs/*.yaml


def test_config_files_exist() -> None:
    names = {p.name for p in CONFIG_FILES}
    assert {"local.yaml", "gcs.yaml", "s3.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_config_file_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg == load_config(str(path))
    assert ManagerConfig.from_kwargs(**cfg.to_kwargs()) == cfg
    assert cfg.path and cfg.save_interval >= 1


def test_local_yaml_values() -> None:
    cfg = load_config(ROOT / "configs" / "local.yaml")
    assert (cfg.path, cfg.save_interval, cfg.retention.max_to_keep) == (
        "./checkpoints/run-1", 100, 3)
    assert load_config(ROOT / "configs" / "gcs.yaml").path.startswith("gs://")
    assert load_config(ROOT / "configs" / "s3.yaml").path.startswith("s3://")


# ----------------------------------------------------------------- from_kwargs and to_kwargs


def test_defaults_equal_the_constructor_defaults() -> None:
    assert ManagerConfig.from_kwargs(**BASE).to_kwargs() == {**BASE, **DEFAULTS}
    cfg = load_config(BASE)
    assert cfg == ManagerConfig.from_kwargs(**BASE) == ManagerConfig(**BASE)


def test_to_kwargs_matches_the_constructor_signature() -> None:
    params = [p for p in inspect.signature(ckptmgr.CheckpointManager.__init__).parameters.values()
              if p.name not in ("self", "process_group", "preemption_check")]
    kwargs = ManagerConfig.from_kwargs(**BASE).to_kwargs()
    assert [p.name for p in params] == list(kwargs)
    for p in params:
        if p.default is not inspect.Parameter.empty:
            assert kwargs[p.name] == p.default, p.name


def test_round_trip_with_every_option_set() -> None:
    kwargs: dict[str, Any] = {
        "path": "s3://bucket/run", "save_interval": 7, "max_to_keep": 0, "max_pending_async": 1,
        "num_of_threads": 4, "chkpt_on_preemption": False,
        "storage_options": {"endpoint_url": "http://localhost:9000", "anon": True},
        "keep_period": 100, "keep_time_interval": 3600.0, "best_metric": "val/loss",
        "best_mode": "max", "keep_best": 2, "overwrite": True, "backpressure": "skip",
        "verify": False, "preemption_signals": (signal.SIGUSR1, signal.SIGINT),
        "preemption_grace_s": 12.5, "exit_on_preemption": False, "preemption_file": "/tmp/p",
        "planner": "xla_spmd", "read_only": True, "take_over": True,
        "collective_timeout_s": 42.5,
        "local_path": "/local_nvme/run", "local_interval": 50, "local_max_to_keep": 3,
        "async_mode": "process", "save_on_close": False, "local_replicas": 1,
        "reuse_unchanged": True,
    }
    cfg = ManagerConfig.from_kwargs(**kwargs)
    assert cfg.to_kwargs() == kwargs
    assert ManagerConfig.from_kwargs(**cfg.to_kwargs()) == cfg
    assert load_config(nested(**kwargs)) == cfg
    assert cfg.async_.backpressure == "skip" and cfg.preemption.enabled is False
    # model_dump(mode="json") is YAML-ready (signals by name) and loads back to the same model.
    dumped = cfg.model_dump(mode="json", by_alias=True)
    assert dumped["preemption"]["signals"] == ["SIGUSR1", "SIGINT"]
    assert load_config(yaml.safe_load(yaml.safe_dump(dumped))) == cfg


def test_float_fields_accept_ints() -> None:
    cfg = ManagerConfig.from_kwargs(**BASE, keep_time_interval=60, preemption_grace_s=5)
    assert cfg.retention.keep_time_interval == 60.0 and cfg.preemption.grace_s == 5.0
    assert isinstance(cfg.preemption.grace_s, float)


def test_storage_options_are_copied() -> None:
    opts = {"project": "p"}
    cfg = ManagerConfig.from_kwargs(**BASE, storage_options=opts)
    opts["project"] = "changed"
    assert cfg.storage.options == {"project": "p"}
    out = cfg.to_kwargs()["storage_options"]
    out["project"] = "changed"
    assert cfg.storage.options == {"project": "p"}
    assert ManagerConfig.from_kwargs(**BASE, storage_options={}).to_kwargs()[
        "storage_options"] is None


def test_models_are_frozen() -> None:
    cfg = ManagerConfig.from_kwargs(**BASE)
    with pytest.raises(ValidationError):
        cfg.save_interval = 5
    with pytest.raises(ValidationError):
        cfg.retention.max_to_keep = 5


def test_empty_yaml_section_means_defaults(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("path: /tmp/x\nsave_interval: 5\nretention:\n  # max_to_keep: 3\n"
                 "async:\npreemption:\nstorage:\n  options:\n")
    cfg = load_config(f)
    assert cfg == ManagerConfig.from_kwargs(path="/tmp/x", save_interval=5)


# ------------------------------------------------------------------------- invalid values

# (constructor argument, value, message with {} for the field's name)
INVALID: list[tuple[str, Any, str]] = [
    ("path", "", "{} must be a non-empty str, got ''"),
    ("path", None, "{} must be a non-empty str, got NoneType"),
    ("path", 5, "{} must be a non-empty str, got int"),
    ("save_interval", True, "{} must be an int >= 1, got True"),
    ("save_interval", "100", "{} must be an int >= 1, got '100'"),
    ("save_interval", 1.5, "{} must be an int >= 1, got 1.5"),
    ("save_interval", 10.0, "{} must be an int >= 1, got 10.0"),
    ("save_interval", None, "{} must be an int >= 1, got None"),
    ("save_interval", 0, "{} must be >= 1, got 0"),
    ("save_interval", -5, "{} must be >= 1, got -5"),
    ("overwrite", "yes", "{} must be a bool, got 'yes'"),
    ("verify", 0, "{} must be a bool, got 0"),
    ("storage_options", "token=abc", "{} must be None or a dict with str keys, got str"),
    ("storage_options", {1: "v"}, "{} keys must be str, got 1"),
    ("max_to_keep", -1, "{} must be >= 0, got -1"),
    ("max_to_keep", True, "{} must be None or an int >= 0, got True"),
    ("max_to_keep", "3", "{} must be None or an int >= 0, got '3'"),
    ("keep_period", 0, "{} must be >= 1, got 0"),
    ("keep_time_interval", 0, "{} must be > 0, got 0"),
    ("keep_time_interval", -1.0, "{} must be > 0, got -1.0"),
    ("keep_time_interval", True,
     "{} must be None or a finite number of seconds > 0, got True"),
    ("keep_time_interval", "1h", "{} must be None or a finite number of seconds > 0, got '1h'"),
    ("keep_time_interval", math.inf, "{} must be a finite number, got inf"),
    ("best_metric", "", "{} must be a non-empty str, got ''"),
    ("best_metric", 3, "{} must be None or a non-empty str, got 3"),
    ("best_mode", "MAX", "{} must be 'min' or 'max', got 'MAX'"),
    ("best_mode", None, "{} must be 'min' or 'max', got None"),
    ("keep_best", 0, "{} must be >= 1, got 0"),
    ("max_pending_async", 0,
     "{} must be an int >= 1 (one save in flight is the design), got 0"),
    ("max_pending_async", True, "{} must be an int >= 1 (one save is in flight; larger values "
     "act as 1), got True"),
    ("backpressure", "drop", "{} must be 'block' or 'skip', got 'drop'"),
    ("num_of_threads", 0, "{} must be >= 1, got 0"),
    ("num_of_threads", 2.0, "{} must be None or an int >= 1, got 2.0"),
    ("chkpt_on_preemption", 1, "{} must be a bool, got 1"),
    ("chkpt_on_preemption", "true", "{} must be a bool, got 'true'"),
    ("preemption_signals", "SIGKILL",
     "{} cannot include SIGKILL or SIGSTOP (they cannot be caught), got 'SIGKILL'"),
    ("preemption_signals", ["TERM", "STOP"],
     "{} cannot include SIGKILL or SIGSTOP (they cannot be caught), got 'STOP'"),
    ("preemption_signals", [int(signal.SIGKILL)],
     "{} cannot include SIGKILL or SIGSTOP (they cannot be caught), got 9"),
    ("preemption_signals", "SIGFOO",
     "{} must name known signals (e.g. 'SIGTERM', 'TERM' or 15), got 'SIGFOO'"),
    ("preemption_signals", ["SIG_IGN"],
     "{} must name known signals (e.g. 'SIGTERM', 'TERM' or 15), got 'SIG_IGN'"),
    ("preemption_signals", 999, "{} must name known signals, got 999"),
    ("preemption_signals", [1.5], "{} must be a signal name ('SIGTERM' or 'TERM'), a signal "
     "number, or a list of them, got 1.5"),
    ("preemption_signals", [True], "{} must be a signal name ('SIGTERM' or 'TERM'), a signal "
     "number, or a list of them, got True"),
    ("preemption_grace_s", 0, "{} must be > 0, got 0"),
    ("preemption_grace_s", math.nan, "{} must be a finite number, got nan"),
    ("preemption_grace_s", True, "{} must be a finite number of seconds > 0, got True"),
    ("exit_on_preemption", None, "{} must be a bool, got None"),
    ("planner", "xla", "{} must be 'auto', 'dcp' or 'xla_spmd', got 'xla'"),
    ("planner", None, "{} must be 'auto', 'dcp' or 'xla_spmd', got None"),
    ("local_path", "gs://b/x", "{} must be a local directory path (each rank writes its own "
     "node-local disk; the durable tier is path), got 'gs://b/x'"),
    ("local_path", 3, "{} must be None or a local directory path (no URL scheme but file://), "
     "got 3"),
    ("local_interval", True, "{} must be None or an int >= 1, got True"),
    ("local_max_to_keep", 0, "{} must be >= 1, got 0"),
]


@pytest.mark.parametrize("name,value,message", INVALID,
                         ids=[f"{n}={v!r}" for n, v, _ in INVALID])
def test_invalid_value_from_kwargs(name: str, value: Any, message: str) -> None:
    err = config_error(ManagerConfig.from_kwargs, **{**BASE, name: value})
    assert str(err) == message.format(name)
    assert isinstance(err, ValueError) and isinstance(err.__cause__, ValidationError)


@pytest.mark.parametrize("name,value,message", INVALID,
                         ids=[f"{n}={v!r}" for n, v, _ in INVALID])
def test_invalid_value_from_yaml(name: str, value: Any, message: str) -> None:
    err = config_error(load_config, nested(**{**BASE, name: value}))
    assert str(err) == message.format(YAML_PATH[name])
    assert isinstance(err.__cause__, ValidationError)


def test_keep_best_needs_best_metric() -> None:
    err = config_error(ManagerConfig.from_kwargs, **BASE, keep_best=2)
    assert str(err) == "keep_best requires best_metric to be set, got 2"
    err = config_error(load_config, {**BASE, "retention": {"keep_best": 2}})
    assert str(err) == "retention.keep_best requires retention.best_metric to be set, got 2"
    err = config_error(RetentionConfig, keep_best=2)
    assert str(err) == "retention.keep_best requires retention.best_metric to be set, got 2"
    assert ManagerConfig.from_kwargs(**BASE, keep_best=2, best_metric="loss").retention.keep_best


def test_signals_needed_only_when_enabled() -> None:
    err = config_error(ManagerConfig.from_kwargs, **BASE, preemption_signals=[])
    assert str(err) == ("preemption_signals must name at least one signal when "
                        "chkpt_on_preemption is true, got ()")
    err = config_error(load_config, {**BASE, "preemption": {"signals": []}})
    assert str(err) == ("preemption.signals must name at least one signal when "
                        "preemption.enabled is true, got ()")
    cfg = ManagerConfig.from_kwargs(**BASE, preemption_signals=[], chkpt_on_preemption=False)
    assert cfg.preemption.signals == ()


def test_missing_required_fields() -> None:
    assert str(config_error(ManagerConfig.from_kwargs, path="x")) == "save_interval is required"
    assert str(config_error(load_config, {})) == "path is required; save_interval is required"


def test_every_problem_is_reported() -> None:
    err = config_error(load_config, {**BASE, "save_interval": 0,
                                     "retention": {"max_to_keep": -1},
                                     "async": {"backpressure": "x"}})
    assert str(err) == ("save_interval must be >= 1, got 0; retention.max_to_keep must be >= 0, "
                        "got -1; async.backpressure must be 'block' or 'skip', got 'x'")


def test_direct_construction_raises_config_error() -> None:
    assert str(config_error(ManagerConfig, path="x", save_interval=0)) == (
        "save_interval must be >= 1, got 0")
    assert str(config_error(RetentionConfig, max_to_keep=-1)) == (
        "retention.max_to_keep must be >= 0, got -1")
    assert str(config_error(AsyncConfig, max_pending_async=0)) == (
        "async.max_pending_async must be an int >= 1 (one save in flight is the design), got 0")
    assert str(config_error(PreemptionConfig, grace_s=-1)) == (
        "preemption.grace_s must be > 0, got -1")
    assert str(config_error(StorageConfig, options=[])) == (
        "storage.options must be None or a dict with str keys, got list")
    assert str(config_error(ManagerConfig, path="x", save_interval=1,
                            retention={"max_to_keep": -2})) == (
        "retention.max_to_keep must be >= 0, got -2")
    nested_ok = ManagerConfig(path="x", save_interval=1, retention=RetentionConfig(max_to_keep=2))
    assert nested_ok.retention.max_to_keep == 2


def test_a_section_must_be_a_mapping() -> None:
    err = config_error(load_config, {**BASE, "retention": [3]})
    assert str(err) == "retention must be a mapping, got [3]"


# -------------------------------------------------------------------------- unknown names


@pytest.mark.parametrize("name,message", [
    ("max_to_kep", "unknown argument 'max_to_kep' (did you mean 'max_to_keep'?)"),
    ("save_intervall", "unknown argument 'save_intervall' (did you mean 'save_interval'?)"),
    ("preemption_signal", "unknown argument 'preemption_signal' "
     "(did you mean 'preemption_signals'?)"),
    ("zzz", "unknown argument 'zzz'"),
    ("process_group", "process_group is not part of the config; pass it to the CheckpointManager"),
])
def test_unknown_argument(name: str, message: str) -> None:
    err = config_error(ManagerConfig.from_kwargs, **BASE, **{name: 1})
    assert str(err) == message


@pytest.mark.parametrize("data,message", [
    ({"retention": {"max_to_kep": 3}},
     "unknown field 'retention.max_to_kep' (did you mean 'max_to_keep'?)"),
    ({"asynch": {"backpressure": "skip"}}, "unknown field 'asynch' (did you mean 'async'?)"),
    ({"preemption": {"signal": ["TERM"]}},
     "unknown field 'preemption.signal' (did you mean 'signals'?)"),
    ({"async": {"backpresure": "skip"}},
     "unknown field 'async.backpresure' (did you mean 'backpressure'?)"),
    ({"verfy": True}, "unknown field 'verfy' (did you mean 'verify'?)"),
    ({"storage": {"option": {}}}, "unknown field 'storage.option' (did you mean 'options'?)"),
    ({"storage": {"endpoint_url": "http://x"}},
     "unknown field 'storage.endpoint_url' (fsspec options go under storage.options)"),
    ({"retention": {"wibble": 1}}, "unknown field 'retention.wibble'"),
])
def test_unknown_yaml_key(data: dict[str, Any], message: str) -> None:
    assert str(config_error(load_config, {**BASE, **data})) == message


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "typo.yaml"
    f.write_text("path: /tmp/x\nsave_interval: 5\nretention:\n  max_to_kep: 3\n")
    assert str(config_error(load_config, f)) == (
        f"config file {str(f)!r}: unknown field 'retention.max_to_kep' "
        "(did you mean 'max_to_keep'?)")


# ---------------------------------------------------------------------------- CKPTMGR_PATH


def test_env_path_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPTMGR_PATH", "s3://env-bucket/run-9")
    assert load_config(ROOT / "configs" / "local.yaml").path == "s3://env-bucket/run-9"
    assert load_config({"save_interval": 5}).path == "s3://env-bucket/run-9"
    cfg = ManagerConfig.from_kwargs(**BASE)
    assert cfg.path == BASE["path"]  # the constructor's own argument is never replaced
    assert load_config(cfg).path == "s3://env-bucket/run-9"
    assert load_config(cfg).retention == cfg.retention
    f = tmp_path / "no-path.yaml"
    f.write_text("save_interval: 5\n")
    assert load_config(f).path == "s3://env-bucket/run-9"


@pytest.mark.parametrize("value", ["", "   "])
def test_blank_env_path_is_ignored(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CKPTMGR_PATH", value)
    assert load_config(BASE).path == BASE["path"]
    cfg = ManagerConfig.from_kwargs(**BASE)
    assert load_config(cfg) is cfg
    assert str(config_error(load_config, {"save_interval": 5})) == "path is required"


# --------------------------------------------------------------------------- bad YAML files


def test_yaml_syntax_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("path: /tmp/x\nsave_interval: 5\nretention: [max_to_keep: 3\n")
    err = config_error(load_config, f)
    assert re.fullmatch(rf"config file {re.escape(repr(str(f)))} is not valid YAML: .+ at line "
                        r"\d+, column \d+", str(err)), str(err)
    assert isinstance(err.__cause__, yaml.YAMLError)


def test_yaml_duplicate_key(tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("path: /tmp/x\nsave_interval: 5\nretention:\n  max_to_keep: 3\n"
                 "  max_to_keep: 4\n")
    err = config_error(load_config, f)
    assert str(err) == (f"config file {str(f)!r} is not valid YAML: found duplicate key "
                        "'max_to_keep' at line 5, column 3")


def test_yaml_merge_keys_still_work(tmp_path: Path) -> None:
    f = tmp_path / "merge.yaml"
    f.write_text("path: /tmp/x\nsave_interval: 5\n"
                 "retention:\n  <<: {max_to_keep: 3, keep_period: 10}\n  keep_period: 20\n")
    assert load_config(f).retention.keep_period == 20
    assert load_config(f).retention.max_to_keep == 3


@pytest.mark.parametrize("text,message", [
    ("- 1\n- 2\n", "must hold a mapping at top level, got list"),
    ("just a string\n", "must hold a mapping at top level, got str"),
    ("", "is empty; it needs at least save_interval and path"),
    ("# only comments\n", "is empty; it needs at least save_interval and path"),
])
def test_yaml_top_level_not_a_mapping(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    assert str(config_error(load_config, f)) == f"config file {str(f)!r} {message}"


def test_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    err = config_error(load_config, missing)
    assert str(err) == f"config file {str(missing)!r} does not exist"
    assert isinstance(err.__cause__, FileNotFoundError)
    err = config_error(load_config, tmp_path)
    assert str(err).startswith(f"cannot read config file {str(tmp_path)!r}")
    assert isinstance(err.__cause__, OSError)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"path: \xff\xfe\n")
    err = config_error(load_config, binary)
    assert str(err) == f"config file {str(binary)!r} is not UTF-8 text"


def test_bad_source_type() -> None:
    err = config_error(load_config, 42)
    assert str(err) == "config must be a ManagerConfig, a YAML file path or a mapping, got int"


# ----------------------------------------------------------------------------------- secrets

SECRET = "s3cr3t-T0ken-value"


def _whole_text(err: BaseException) -> str:
    """The message and the full traceback, causes included, as a user would see them."""
    return str(err) + "".join(traceback.format_exception(type(err), err, err.__traceback__))


@pytest.mark.parametrize("call", [
    lambda: ManagerConfig.from_kwargs(**BASE, storage_options=f"token={SECRET}"),
    lambda: ManagerConfig.from_kwargs(path="s3://b/r", storage_options={"token": SECRET},
                                      save_interval=0),
    lambda: ManagerConfig.from_kwargs(**BASE, storage_options={1: SECRET}),
    lambda: load_config({**BASE, "storage": SECRET}),
    lambda: load_config({**BASE, "storage": {"token": SECRET}}),
    lambda: load_config({**BASE, "storage": {"options": SECRET}}),
    lambda: load_config({**BASE, "storage": {"options": [SECRET]}}),
    lambda: load_config({**BASE, "storage": {"options": {"token": SECRET}}, "verify": "no"}),
    lambda: ManagerConfig.from_kwargs(path=f"s3://user:{SECRET}@host/b".encode(),
                                      save_interval=1),
    lambda: StorageConfig(options=SECRET),  # type: ignore[arg-type]
], ids=["options-str", "other-error", "bad-key", "storage-str", "storage-extra", "options-str-yaml",
        "options-list", "yaml-other-error", "path-bytes", "direct"])
def test_secrets_not_echoed(call: Any) -> None:
    with pytest.raises(ConfigError) as ei:
        call()
    assert SECRET not in _whole_text(ei.value)


def test_secrets_not_in_yaml_errors(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text(f"path: s3://b/r\nsave_interval: 5\nstorage:\n  options:\n"
                 f"    secret: \"{SECRET}\n")  # unterminated string: a syntax error
    err = config_error(load_config, f)
    assert SECRET not in _whole_text(err)
    f.write_text(f"path: s3://b/r\nsave_interval: 5\nstorage:\n  options:\n"
                 f"    secret: {SECRET}\n    secret: {SECRET}\n")
    err = config_error(load_config, f)
    assert "duplicate key 'secret'" in str(err) and SECRET not in _whole_text(err)


def test_secrets_not_in_repr() -> None:
    cfg = ManagerConfig.from_kwargs(**BASE, storage_options={"secret": SECRET, "key": "AKIA"})
    for text in (repr(cfg), str(cfg), repr(cfg.storage), str(cfg.storage)):
        assert SECRET not in text and "AKIA" not in text
        assert "'secret'" in text  # the key is shown
    assert cfg.storage.options["secret"] == SECRET  # the value itself is kept


# ----------------------------------------------------------------------------------- signals


@pytest.mark.parametrize("given,expected", [
    ("SIGTERM", (signal.SIGTERM,)),
    ("TERM", (signal.SIGTERM,)),
    ("sigusr1", (signal.SIGUSR1,)),
    (" usr2 ", (signal.SIGUSR2,)),
    (15, (signal.SIGTERM,)),
    (signal.SIGINT, (signal.SIGINT,)),
    (["TERM", 2, "SIGUSR1"], (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)),
    (("SIGTERM", "TERM", 15, signal.SIGTERM), (signal.SIGTERM,)),  # duplicates collapse
])
def test_signals_by_name_or_number(given: Any, expected: tuple[signal.Signals, ...]) -> None:
    cfg = ManagerConfig.from_kwargs(**BASE, preemption_signals=given)
    assert cfg.preemption.signals == expected
    assert all(type(s) is signal.Signals for s in cfg.preemption.signals)
    assert load_config(nested(**BASE, preemption_signals=given)) == cfg


def test_signals_from_yaml_text(tmp_path: Path) -> None:
    f = tmp_path / "sig.yaml"
    f.write_text("path: /tmp/x\nsave_interval: 5\npreemption:\n  signals: [TERM, SIGUSR1, 2]\n")
    assert load_config(f).preemption.signals == (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    f.write_text("path: /tmp/x\nsave_interval: 5\npreemption:\n  signals: SIGINT\n")
    assert load_config(f).preemption.signals == (signal.SIGINT,)


# -------------------------------------------------------------------------------------- docs


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out: list[str] = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_fields(ann, key + ".")
        else:
            out.append(key)
    return out


def test_docs_cover_every_field() -> None:
    text = DOC.read_text()
    leaves = _leaf_fields(ManagerConfig)
    assert set(leaves) == set(YAML_PATH.values())  # the test's own table is complete, too
    missing = [f for f in leaves if f"| `{f}` |" not in text]
    assert not missing, f"docs/configuration.md lacks a table row for {missing}"
    kwargs = ManagerConfig.from_kwargs(**BASE).to_kwargs()
    missing = [k for k in kwargs if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md does not name the arguments {missing}"
    example = re.search(r"^```yaml\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert example is not None, "docs/configuration.md has no full YAML example"
    data = yaml.safe_load(example.group(1))
    assert load_config(data).path == data["path"]
    assert set(_leaf_keys(data)) == set(leaves), "the YAML example should set every field"


def _leaf_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict) and key != "options":
            out += _leaf_keys(value, prefix + key + ".")
        else:
            out.append(prefix + key)
    return out


def test_layer_is_pure() -> None:
    source = (ROOT / "ckptmgr" / "config.py").read_text()
    for mod in ("torch", "fsspec"):
        assert not re.search(rf"^\s*(import|from) {mod}\b", source, re.MULTILINE), mod
    assert PATH_ENV_VAR == "CKPTMGR_PATH"
