"""Each configuration setting is declared once, as a field of ckptmgr/config.py's models with its
Setting: the constructor's flat arguments, the messages' rules and the flat names in messages are
derived from there, and CheckpointManager's explicit signature agrees with it."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import ckptmgr
from ckptmgr import config
from ckptmgr.config import ManagerConfig
from ckptmgr.errors import ConfigError


def test_every_setting_is_declared_once_with_its_rule_and_description() -> None:
    fields = list(config._settings(ManagerConfig))
    leaves = [(where, info, setting) for where, info, setting in fields if setting is not None]
    sections = [where for where, _, setting in fields if setting is None]
    assert sections == [("storage",), ("retention",), ("async",), ("preemption",), ("local",)]
    assert len(leaves) == len(config._FLAT) == 30
    for where, info, setting in leaves:
        assert info.description, where
        assert config._RULES[".".join(where)] == setting.rule
        assert config._FLAT[setting.arg or where[-1]] == where


def test_the_constructor_signature_agrees_with_the_settings() -> None:
    params = [p for p in inspect.signature(ckptmgr.CheckpointManager.__init__).parameters.values()
              if p.name not in ("self", "process_group", "preemption_check")]
    assert [p.name for p in params] == list(config._FLAT)
    defaults = ManagerConfig.from_kwargs(path="x", save_interval=1).to_kwargs()
    for p in params:
        if p.default is not inspect.Parameter.empty:
            assert p.default == defaults[p.name], p.name
    assert [p.name for p in params[:2]] == ["path", "save_interval"]  # required, no default
    assert all(p.default is inspect.Parameter.empty for p in params[:2])


@pytest.mark.parametrize(("arg", "dotted", "value"), [
    ("async_mode", "async.mode", "fork"),
    ("local_max_to_keep", "local.max_to_keep", "2"),
    ("chkpt_on_preemption", "preemption.enabled", "yes"),
])
def test_messages_name_the_argument_or_the_yaml_path_with_the_settings_rule(
        arg: str, dotted: str, value: Any) -> None:
    rule = config._RULES[dotted]
    with pytest.raises(ConfigError) as flat:
        ManagerConfig.from_kwargs(path="x", save_interval=1, **{arg: value})
    assert str(flat.value) == f"{arg} must be {rule}, got {value!r}"
    section, key = dotted.split(".")
    with pytest.raises(ConfigError) as nested:
        config.load_config({"path": "x", "save_interval": 1, section: {key: value}})
    assert str(nested.value) == f"{dotted} must be {rule}, got {value!r}"
