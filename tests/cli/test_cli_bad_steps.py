"""One bad step does not break ``ls`` or ``verify --all``, and nothing read from storage reaches the
terminal with its control characters."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ckptmgr import (
    CheckpointManager,
    cli,
)


@pytest.fixture
def root_with_a_bad_step(tmp_path: Path) -> str:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.full((2,), float(s))},
                     metrics={"loss\x1b[31m\x1b]0;pwned\x07": 0.5},
                     metadata={"note\x1b[2J": "x\rgone\u202e"})
    path = os.path.join(root, "2", "commit.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"][0]["path"] = "../../etc/passwd"
    with open(path, "w") as f:
        json.dump(manifest, f)
    return root


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_every_other_step_and_marks_the_bad_one(
        root_with_a_bad_step: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "ls", root_with_a_bad_step)
    assert code == cli.EXIT_OK, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"1", "2", "3"}, out
    assert "committed" in rows["1"] and "committed" in rows["3"]
    assert "unreadable" in rows["2"] and "escapes the step directory" in rows["2"]
    code, out, err = _run(capsys, "ls", root_with_a_bad_step, "--json")
    assert code == cli.EXIT_OK
    assert [(e["step"], e["status"]) for e in json.loads(out)] == [
        (1, "committed"), (2, "unreadable"), (3, "committed")]


def test_verify_all_reports_the_bad_step_as_damage(
        root_with_a_bad_step: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "verify", root_with_a_bad_step, "--all")
    assert code == cli.EXIT_CORRUPT, (out, err)  # documented: 3 on damage
    assert "step 1: ok" in out and "step 3: ok" in out and "step 2: CORRUPT" in out
    assert "2/commit.json" in err


def test_strings_from_storage_reach_the_terminal_escaped(
        root_with_a_bad_step: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["inspect", root_with_a_bad_step, "3"], ["ls", root_with_a_bad_step],
                 ["verify", root_with_a_bad_step, "--all"],
                 ["inspect", root_with_a_bad_step, "2"]):
        _, out, err = _run(capsys, *argv)
        for text in (out, err):
            controls = [c for c in text if (ord(c) < 32 and c != "\n") or 0x7f <= ord(c) < 0xa0
                        or c == "\u202e"]
            assert not controls, (argv, controls, text)
    _, out, _ = _run(capsys, "inspect", root_with_a_bad_step, "3")
    assert "loss\\x1b[31m\\x1b]0;pwned\\x07=0.5" in out, out
    assert cli.printable("a\x1bb\nc\u202ed\x9b") == "a\\x1bb\\nc\\u202ed\\x9b"
    assert cli.printable("plain text, ünïcode") == "plain text, ünïcode"


def test_a_manifest_naming_an_escaping_path_in_a_metadata_file_is_damage_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    path = os.path.join(root, "1", "commit.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["metadata_file"] = "../../../etc/passwd"
    with open(path, "w") as f:
        json.dump(manifest, f)
    code, out, err = _run(capsys, "verify", root, "--all")
    assert code == cli.EXIT_CORRUPT, (out, err)
    code, out, err = _run(capsys, "ls", root)
    assert code == cli.EXIT_OK and "unreadable" in out, (out, err)
