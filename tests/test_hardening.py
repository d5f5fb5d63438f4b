"""Hardening (issue 16): preemption sources fire once, SIGINT saves, saving leaves training state
alone, bad local roots and URLs fail at construction, forged sizes fail before allocation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _metadata import metadata_doc

from ckptmgr import CheckpointManager, ConfigError

# ---------------------------------------------------------------- item 4: level sources fire once


def test_preemption_file_left_in_place_fires_once(local_root: str, tmp_path: Path) -> None:
    marker = tmp_path / "preempted"
    marker.write_text("")
    with CheckpointManager(local_root, save_interval=100, chkpt_on_preemption=False,
                           exit_on_preemption=False, preemption_file=str(marker)) as mgr:
        assert mgr.save(1, {"w": torch.ones(1)}) is True  # fires: off-interval step saved
        assert mgr.reached_preemption(1)
        for step in range(2, 6):  # the file is still there: no further forced saves
            assert mgr.save(step, {"w": torch.ones(1)}) is False
        assert mgr.all_steps() == [1]
        marker.unlink()
        assert mgr.save(6, {"w": torch.ones(1)}) is False  # read false: armed again
        marker.write_text("")
        assert mgr.save(7, {"w": torch.ones(1)}) is True
        assert mgr.all_steps() == [1, 7]


def test_preemption_check_fires_on_rising_edge_only(local_root: str) -> None:
    answers = iter([True, True, True, False, True, True])
    with CheckpointManager(local_root, save_interval=100, chkpt_on_preemption=False,
                           exit_on_preemption=False, preemption_check=lambda: next(answers)) as mgr:
        saved = [mgr.save(s, {"w": torch.ones(1)}) for s in range(1, 7)]
    assert saved == [True, False, False, False, True, False]


# ---------------------------------------------------------------- item 5: SIGINT saves, no raise

_SIGINT_SCRIPT = textwrap.dedent("""
    import sys, time, torch, ckptmgr
    mgr = ckptmgr.CheckpointManager(sys.argv[1], save_interval=1000,
                                    preemption_signals=("SIGINT", "SIGTERM"))
    w = torch.zeros(4)
    try:
        for step in range(100000):
            w += 1
            mgr.save(step, {"w": w})
            print("step", step, flush=True)
            time.sleep(0.02)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(3)
""")


def test_sigint_as_preemption_signal_saves_and_exits_130(local_root: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "CKPTMGR_PATH")}
    proc = subprocess.Popen([sys.executable, "-c", _SIGINT_SCRIPT, local_root],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    steps: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        steps.append(int(line.split()[1]))
        if steps[-1] >= 3:
            break
    proc.send_signal(signal.SIGINT)
    out = proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    proc.stdout.close()
    proc.stderr.close()
    assert "KeyboardInterrupt" not in out + err, err
    assert proc.returncode == 128 + signal.SIGINT, err
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        newest = mgr.latest_step()
        assert newest is not None and newest >= steps[-1]
        state = {"w": torch.zeros(4)}
        mgr.restore(newest, state)
        assert torch.equal(state["w"], torch.full((4,), float(newest + 1)))


# ---------------------------------------------------------------- item 6: save leaves state alone


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


def test_nul_byte_in_local_path_is_config_error(tmp_path: Path) -> None:
    from ckptmgr import ConfigError

    for url in (f"{tmp_path}/a\x00b", f"file://{tmp_path}/a\x00b"):
        with pytest.raises(ConfigError, match="NUL byte"):
            CheckpointManager(url, save_interval=1, chkpt_on_preemption=False)


def test_credentials_in_file_url_are_refused_without_echo(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr import ConfigError

    monkeypatch.chdir(tmp_path)
    for url in (f"file://alice:hunter2-secret@{tmp_path}/run", "file://alice:hunter2-secret@/x"):
        with pytest.raises(ConfigError, match="cannot carry credentials") as info:
            CheckpointManager(url, save_interval=1, chkpt_on_preemption=False)
        assert "hunter2-secret" not in str(info.value) and "alice" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no directory named after the password


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs of our own, so that it can be remounted read-only (needs CAP_SYS_ADMIN)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "none", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root or no CAP_SYS_ADMIN)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True)


def test_read_only_root_fails_in_constructor_with_path_and_reason(tmpfs: Path) -> None:
    from ckptmgr import ConfigError

    (tmpfs / "existing").mkdir()
    _remount(tmpfs, "ro")
    for root in (tmpfs / "existing", tmpfs / "new" / "run"):
        with pytest.raises(ConfigError, match="read-only file system") as info:
            CheckpointManager(str(root), save_interval=1, chkpt_on_preemption=False)
        assert str(root) in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_chmod_0555_root_fails_in_constructor(tmp_path: Path) -> None:
    from ckptmgr import ConfigError

    root = tmp_path / "run"
    root.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="permission denied"):
        CheckpointManager(str(root), save_interval=1, chkpt_on_preemption=False)


def test_root_read_only_after_construction_save_is_save_error(tmpfs: Path) -> None:
    from ckptmgr import SaveError

    mgr = CheckpointManager(str(tmpfs / "run"), save_interval=1, chkpt_on_preemption=False)
    try:
        assert mgr.save(1, {"w": torch.ones(3)})
        _remount(tmpfs, "ro")
        with pytest.raises(SaveError, match="Read-only file system"):
            mgr.save(2, {"w": torch.ones(3)})
        assert mgr.all_steps() == [1]
    finally:
        _remount(tmpfs, "rw")
        mgr.close()


# ---------------------------------------------------------------- item 13: forged value sizes


def _forge_value_length(root: Path, step: int, fqn: str, length: int) -> Path:
    """Declare ``fqn``'s stored value ``length`` bytes long in a sparse data file, with the
    manifest's sizes and checksums and the item's checksum forged to match."""
    import json

    from ckptmgr.codec.checksum import checksum

    sdir = root / str(step)
    manifest = json.loads((sdir / "commit.json").read_text())
    meta_path = sdir / manifest["metadata_file"]
    meta = metadata_doc(meta_path.read_bytes())
    (loc,) = [s for s in meta["storage"] if s["fqn"] == fqn]
    data = sdir / loc["file"]
    with open(data, "r+b") as f:
        f.truncate(loc["pos"] + length)  # a hole: no bytes on disk
    loc["length"] = length
    loc["checksum"] = checksum(bytes(length)) if length <= 1 << 20 else loc["checksum"]
    meta_bytes = json.dumps(meta).encode()
    meta_path.write_bytes(meta_bytes)
    for entry in manifest["files"]:
        if entry["path"] == manifest["metadata_file"]:
            entry["size"], entry["checksum"] = len(meta_bytes), checksum(meta_bytes)
        elif entry["path"] == loc["file"]:
            entry["size"] = os.path.getsize(data)
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"])
    manifest["bytes_per_rank"] = {"0": manifest["total_bytes"]}
    (sdir / "commit.json").write_text(json.dumps(manifest))
    return data


def test_value_claiming_gigabytes_fails_before_allocating(local_root: str) -> None:
    import resource

    from ckptmgr import CorruptCheckpointError

    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(3), "extra": {"epoch": 3}})
    data = _forge_value_length(Path(local_root), 1, "extra.epoch", 2 << 30)
    assert os.stat(data).st_blocks * 512 < 1 << 20  # sparse: nothing on disk
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with (CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr,
          pytest.raises(CorruptCheckpointError, match="claims") as info):
        mgr.restore(1, {"w": torch.zeros(3), "extra": {"epoch": 0}})
    assert data.name in str(info.value)
    assert time.perf_counter() - t0 < 30
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 256 << 10, f"peak RSS grew by {grown_kib} KiB"


def test_value_larger_than_the_bound_is_refused_at_save(local_root: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr import SaveError
    from ckptmgr.dcp import writer

    monkeypatch.setattr(writer, "MAX_VALUE_BYTES", 1000)
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        with pytest.raises((ConfigError, SaveError), match="Python value may"):
            mgr.save(1, {"w": torch.ones(3), "extra": {"names": ["x" * 50] * 40}})
        assert mgr.all_steps() == []


def test_value_within_file_but_file_short_in_storage(local_root: str) -> None:
    """A claim past the bytes the file has in storage fails naming the file, before reading."""
    from ckptmgr import CorruptCheckpointError

    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(3), "extra": {"epoch": 3}})
    data = _forge_value_length(Path(local_root), 1, "extra.epoch", 4096)
    with open(data, "r+b") as f:  # the file in storage is shorter than the manifest says
        f.truncate(100)
    with (CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr,
          pytest.raises(CorruptCheckpointError) as info):
        mgr.restore(1, {"w": torch.zeros(3), "extra": {"epoch": 0}})
    assert data.name in str(info.value)
