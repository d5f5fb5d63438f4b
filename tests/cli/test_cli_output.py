"""What the command line prints: ``ls`` on a path that does not exist, plain DCP steps, ``export``
suffixes, and lines printed while a progress bar is drawn."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import pytest
import torch

import ckptmgr
from ckptmgr import cli
from ckptmgr.errors import ConfigError
from ckptmgr.tools import export_step


def test_ls_on_a_missing_path_is_an_error(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-run"
    assert cli.main(["ls", str(missing)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "does not exist" in err and str(missing) in err
    assert cli.main(["ls", "--json", str(missing)]) == cli.EXIT_ERROR
    # an existing empty root is fine: nothing to list
    missing.mkdir()
    assert cli.main(["ls", str(missing)]) == cli.EXIT_OK
    assert "no checkpoints" in capsys.readouterr().err


def test_ls_shows_plain_dcp_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = tmp_path / "run" / "40"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"never unpickled by ls")
    (step / "__0_0.distcp").write_bytes(b"x" * 8)
    assert cli.main(["ls", "--json", str(tmp_path / "run")]) == cli.EXIT_OK
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["step"] == 40 and entry["status"] == "dcp" and entry["committed"] is False


def test_export_refuses_unknown_suffixes(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptmgr.CheckpointManager(str(root), 1) as mgr:
        mgr.save(1, {"model": {"w": torch.arange(4.0)}})
    for name in ("model.bin", "model.ckpt", "model"):
        with pytest.raises(ConfigError) as ei:
            export_step(str(root), 1, tmp_path / name)
        msg = str(ei.value)
        assert ".safetensors" in msg and ".pt" in msg and ".pth" in msg and "--format" in msg
        assert not (tmp_path / name).exists()
    # an explicit format writes any name
    r = export_step(str(root), 1, tmp_path / "model.bin", format="pt")
    assert r.format == "pt"
    assert torch.equal(torch.load(tmp_path / "model.bin", weights_only=True)["model.w"],
                       torch.arange(4.0))


class _Tty(io.StringIO):
    """One terminal: stdout and stderr both write here, as on a real one."""

    def isatty(self) -> bool:
        return True


def test_lines_printed_during_a_progress_bar_clear_it_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    term = _Tty()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    out = cli._Out(argparse.Namespace(json=False, progress=None))
    bar = out.progress
    assert isinstance(bar, cli._Bar)
    bar.start(1000, "copy")
    bar.advance(500)
    out.say("copying step 7 (1.0 KiB)")
    bar.advance(500)
    bar.finish()
    # What the terminal shows: each \r returns to the line start; the said line must be whole
    # on its own line, not written over the bar.
    screen: list[str] = []
    for raw in term.getvalue().split("\n"):
        visible = ""
        for part in raw.split("\r"):
            visible = part + visible[len(part):]
        screen.append(visible.rstrip())
    said = [ln for ln in screen if "copying step 7" in ln]
    assert said == ["copying step 7 (1.0 KiB)"], screen
    assert any(ln.startswith("copy [") and "100%" in ln for ln in screen), screen


def test_inspect_names_an_aliased_dtype_as_torch_does(tmp_path: Path) -> None:
    # A metadata file may name a dtype by torch's alias ("float", "half"); inspect showed
    # torch's own name when it read dtypes through torch, and still does without it.
    from ckptmgr.codec.checksum import checksum
    from ckptmgr.codec.metadata_file import parse_metadata, serialize_metadata
    from ckptmgr.tools import inspect_step

    root = str(tmp_path / "run")
    with ckptmgr.CheckpointManager(root, 1, save_on_close=False) as mgr:
        mgr.save(5, {"w": torch.ones(3), "h": torch.ones(2, dtype=torch.float16)})
    step_dir = tmp_path / "run" / "5"
    (meta,) = step_dir.glob("metadata-*")
    doc = json.loads(serialize_metadata(parse_metadata(meta.read_bytes()), version=1))
    doc["tensors"]["w"]["dtype"], doc["tensors"]["h"]["dtype"] = "float", "half"
    data = json.dumps(doc).encode()
    meta.write_bytes(data)
    manifest = json.loads((step_dir / "commit.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == meta.name:
            entry["size"], entry["checksum"] = len(data), checksum(data)
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"])
    manifest["bytes_per_rank"] = {"0": manifest["total_bytes"]}
    (step_dir / "commit.json").write_text(json.dumps(manifest))
    details = inspect_step(root, 5)
    assert {t.name: t.dtype for t in details.tensors} == {"h": "float16", "w": "float32"}
