"""``CheckpointManager.from_config``: from a YAML file or a ManagerConfig, ``CKPTMGR_PATH``, and
config mistakes reported as ConfigError before anything is written."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptmgr import CheckpointExistsError, CheckpointManager, ConfigError, ManagerConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

YAML = """\
path: {path}
save_interval: 5
overwrite: true
retention:
  max_to_keep: 2
  keep_period: 20
  best_metric: loss
async:
  backpressure: skip
preemption:
  enabled: false
"""


@pytest.fixture(autouse=True)
def _no_env_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTMGR_PATH", raising=False)


def _write(tmp_path: Path, text: str, name: str = "ckpt.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def _exercise(mgr: CheckpointManager) -> None:
    """Behaviour that only the YAML above produces (defaults would differ at each line)."""
    assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
    st = {"w": torch.ones(2)}
    for s, loss in ((0, 0.5), (5, 0.1), (10, 0.9), (15, 0.8), (20, 0.7), (25, 0.6)):
        assert mgr.save(s, st, metrics={"loss": loss})
    assert mgr.all_steps() == [0, 5, 20, 25]  # max_to_keep 2, keep_period 20, best by loss
    assert mgr.best_step() == 5
    mgr.save(25, {"w": torch.zeros(2)})  # overwrite: true
    out = {"w": torch.ones(2)}
    mgr.restore(25, out)
    assert torch.equal(out["w"], torch.zeros(2))


@pytest.mark.parametrize("as_path", [str, Path])
def test_from_yaml_file(tmp_path: Path, as_path: Any) -> None:
    root = tmp_path / "run"
    f = _write(tmp_path, YAML.format(path=root))
    handler = signal.getsignal(signal.SIGTERM)
    with CheckpointManager.from_config(as_path(f)) as mgr:
        assert mgr.path == str(root)
        cfg = mgr.config
        assert (cfg.save_interval, cfg.overwrite, cfg.async_.backpressure) == (5, True, "skip")
        assert cfg.retention.max_to_keep == 2 and cfg.preemption.enabled is False
        assert signal.getsignal(signal.SIGTERM) is handler  # preemption disabled: not installed
        _exercise(mgr)
    assert sorted(os.listdir(root)) == ["0", "20", "25", "5"]


def test_from_manager_config(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cfg = ManagerConfig.from_kwargs(path=str(root), save_interval=5, overwrite=True, max_to_keep=2,
                                    keep_period=20, best_metric="loss", backpressure="skip",
                                    chkpt_on_preemption=False)
    with CheckpointManager.from_config(cfg) as mgr:
        assert mgr.config == cfg
        _exercise(mgr)
    # The same config from YAML builds an equal model.
    with CheckpointManager.from_config(_write(tmp_path, YAML.format(path=root))) as mgr:
        assert mgr.config == cfg
        assert mgr.all_steps() == [0, 5, 20, 25]


def test_a_config_keeps_its_defaults(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager.from_config(_write(tmp_path, f"path: {root}\nsave_interval: 3\n")) as a:
        b = CheckpointManager(str(root), save_interval=3, read_only=True)
        try:
            assert a.config == b.config.model_copy(update={"read_only": False})
        finally:
            b.close()
        a.save(3, {"w": torch.ones(1)})
        with pytest.raises(CheckpointExistsError):  # overwrite defaults to false
            a.save(3, {"w": torch.ones(1)}, force=True)


def test_env_path_overrides_yaml_and_model(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    in_file, from_env = tmp_path / "from-file", tmp_path / "from-env"
    monkeypatch.setenv("CKPTMGR_PATH", str(from_env))
    f = _write(tmp_path, YAML.format(path=in_file))
    cfg = ManagerConfig.from_kwargs(path=str(in_file), save_interval=5)
    for source in (f, cfg, _write(tmp_path, "save_interval: 5\n", "no-path.yaml")):
        with CheckpointManager.from_config(source) as mgr:
            assert mgr.path == str(from_env)
            mgr.save(5, {"w": torch.ones(1)})
            assert mgr.all_steps() == [5]
        assert (from_env / "5" / "commit.json").is_file()
        shutil.rmtree(from_env)
    assert not in_file.exists()  # the file's path was never touched
    # The constructor's own argument is never replaced.
    with CheckpointManager(str(in_file), save_interval=5) as mgr:
        assert mgr.path == str(in_file)


@pytest.mark.parametrize("value", ["", "  "])
def test_blank_env_path_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   value: str) -> None:
    monkeypatch.setenv("CKPTMGR_PATH", value)
    root = tmp_path / "run"
    with CheckpointManager.from_config(_write(tmp_path, YAML.format(path=root))) as mgr:
        assert mgr.path == str(root)


def test_relative_path_is_relative_to_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    confdir, workdir = tmp_path / "conf", tmp_path / "work"
    confdir.mkdir()
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    f = _write(confdir, "path: ./ckpts/run\nsave_interval: 1\n")
    with CheckpointManager.from_config(f) as mgr:
        mgr.save(1, {"w": torch.ones(1)})
    assert (workdir / "ckpts" / "run" / "1" / "commit.json").is_file()
    assert not (confdir / "ckpts").exists()


@pytest.mark.parametrize("name", ["local.yaml", "gcs.yaml", "s3.yaml"])
def test_shipped_configs_run_with_a_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               name: str) -> None:
    root = tmp_path / "run"
    monkeypatch.setenv("CKPTMGR_PATH", str(root))
    with CheckpointManager.from_config(CONFIGS / name) as mgr:
        assert mgr.path == str(root)
        step = mgr.config.save_interval
        mgr.save(step, {"w": torch.ones(2)}, metrics={"val_loss": 0.5})
        out = {"w": torch.zeros(2)}
        mgr.restore(step, out)
        assert torch.equal(out["w"], torch.ones(2))


# -------------------------------------------------------------------------------- mistakes

TYPOS = [
    ("save_intervall: 5\n", "unknown field 'save_intervall' (did you mean 'save_interval'?)"),
    ("save_interval: 5\nretention:\n  max_to_kep: 3\n",
     "unknown field 'retention.max_to_kep' (did you mean 'max_to_keep'?)"),
    ("save_interval: 5\nretention:\n  best_metrc: loss\n",
     "unknown field 'retention.best_metrc' (did you mean 'best_metric'?)"),
    ("save_interval: 5\nasync:\n  backpresure: skip\n",
     "unknown field 'async.backpresure' (did you mean 'backpressure'?)"),
    ("save_interval: 5\npreemtion:\n  enabled: false\n",
     "unknown field 'preemtion' (did you mean 'preemption'?)"),
    ("save_interval: 5\npreemption:\n  grace: 10\n",
     "unknown field 'preemption.grace' (did you mean 'grace_s'?)"),
    ("save_interval: 5\nstorage:\n  option: {}\n",
     "unknown field 'storage.option' (did you mean 'options'?)"),
    ("save_interval: 5\nmax_to_keep: 3\n", "unknown field 'max_to_keep'"),
]


@pytest.mark.parametrize("body,message", TYPOS, ids=[m.split("'")[1] for _, m in TYPOS])
def test_typos_name_the_field_with_a_suggestion(tmp_path: Path, body: str, message: str) -> None:
    root = tmp_path / "run"
    f = _write(tmp_path, f"path: {root}\n{body}")
    with pytest.raises(ConfigError) as ei:
        CheckpointManager.from_config(f)
    assert message in str(ei.value)
    assert str(f) in str(ei.value)  # names the file
    assert isinstance(ei.value, ValueError)
    assert not root.exists()  # nothing was created


BAD_VALUES = [
    ("retention:\n  max_to_keep: -1\n", "retention.max_to_keep must be >= 0, got -1"),
    ("retention:\n  keep_period: 0\n", "retention.keep_period must be >= 1, got 0"),
    ("retention:\n  best_mode: mean\n", "retention.best_mode"),
    ("retention:\n  keep_best: 2\n", "retention.keep_best requires retention.best_metric"),
    ("retention:\n  keep_time_interval: .nan\n", "retention.keep_time_interval"),
    ("async:\n  max_pending_async: 0\n", "async.max_pending_async must be an int >= 1"),
    ("overwrite: yes please\n", "overwrite must be a bool"),
    ("preemption:\n  signals: [SIGKILL]\n", "SIGKILL"),
]


@pytest.mark.parametrize("body,message", BAD_VALUES, ids=[m.split()[0] for _, m in BAD_VALUES])
def test_bad_values_name_field_value_and_rule(tmp_path: Path, body: str, message: str) -> None:
    root = tmp_path / "run"
    f = _write(tmp_path, f"path: {root}\nsave_interval: 5\n{body}")
    with pytest.raises(ConfigError) as ei:
        CheckpointManager.from_config(f)
    assert message in str(ei.value)
    assert not root.exists()


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        CheckpointManager.from_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CheckpointManager.from_config(_write(tmp_path, "path: [unclosed\n"))
    with pytest.raises(ConfigError, match="save_interval is required"):
        CheckpointManager.from_config(_write(tmp_path, f"path: {tmp_path / 'r'}\n", "b.yaml"))
    with pytest.raises(ConfigError, match="storage_options"):  # checked when the storage opens
        CheckpointManager.from_config(_write(
            tmp_path, f"path: {tmp_path / 'r'}\nsave_interval: 1\nstorage:\n  options:\n"
            "    project: p\n", "c.yaml"))
    assert not (tmp_path / "r").exists()
