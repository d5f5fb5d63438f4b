"""The ``ckptmgr`` commands on a root whose steps share chunks (``reuse_unchanged=True``), mixed
with a step saved without reuse (``ckptmgr.cli.main`` in-process): what ls, inspect, verify,
cp, prune and export print, their exit statuses, and the errors that name the fix."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from _checkpoints import (
    REUSE_STEPS,
    assert_reuse_restores,
    base_chunks,
    flip_byte,
    model_state,
    reuse_state,
    save_reuse_root,
)
from test_cli import run

from ckptmgr import CheckpointManager, cli
from ckptmgr.codec.layout import SHARED_DIR


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("cli-reuse") / "run")
    save_reuse_root(root)
    return root


@pytest.fixture
def ckpt(template: str, tmp_path: Path) -> str:
    root = str(tmp_path / "run")
    shutil.copytree(template, root)
    return root


def test_ls_shows_shared_bytes(template: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "ls", template)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "TIME", "(UTC)", "SIZE", "SHARED", "WORLD",
                                "METRICS", "NOTE"]
    rows = {ln.split()[0]: ln for ln in lines[1:5]}
    assert rows["10"].split()[6] == "-"  # saved without reuse: no shared bytes
    assert all("6.0 MiB" in rows[str(s)] for s in REUSE_STEPS[1:])
    # What the chunks take once against what the steps reference.
    assert lines[5].startswith(f"shared chunks: 5 in {SHARED_DIR}/, 6.0 MiB stored once (18.0 "
                               "MiB referenced")
    code, out, _ = run(capsys, "ls", template, "--json")
    doc = {d["step"]: d for d in json.loads(out)}
    assert doc[10]["shared_bytes"] == doc[10]["shared_chunks"] == 0
    assert doc[20]["shared_chunks"] == 3 and doc[20]["shared_bytes"] > 6 << 20
    assert doc[20]["total_bytes"] < 64 << 10  # the step's own files, as before


def test_ls_of_a_root_without_reuse_prints_as_before(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "plain")
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, model_state(1))
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "SHARED" not in out and "shared chunks" not in out
    assert out.splitlines()[0].split() == ["STEP", "STATUS", "TIME", "(UTC)", "SIZE", "WORLD",
                                           "METRICS", "NOTE"]
    code, out, _ = run(capsys, "inspect", root)
    assert code == 0 and "shared" not in out.lower()
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and out.startswith("step 1: ok (2 files, ") and "shared" not in out


def test_inspect_shows_own_and_shared_bytes(template: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", template, "30")
    assert code == 0
    assert f"shared chunks (3, 6.0 MiB, under the root's {SHARED_DIR}/):" in out
    assert out.count(f"  {SHARED_DIR}/") == 3
    header = next(ln for ln in out.splitlines() if ln.strip().startswith("NAME  "))
    assert header.split() == ["NAME", "DTYPE", "SHAPE", "BYTES", "SHARED", "SHARDING"]
    code, out, _ = run(capsys, "inspect", template, "30", "--json")
    doc = json.loads(out)
    assert len(doc["manifest"]["shared"]) == 3 and doc["manifest"]["shared_bytes"] > 6 << 20
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.base.weight"]["shared_bytes"] == tensors["model.base.weight"]["bytes"]
    assert tensors["model.adapter.bias"]["shared_bytes"] == 0
    code, out, _ = run(capsys, "inspect", template, "10")  # the step saved without reuse
    assert code == 0 and "shared chunks" not in out and "SHARED" not in out


def test_verify_intact_and_damaged_shared_chunks(ckpt: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", ckpt, "--all")
    assert code == 0
    assert "step 30: ok (2 files, " in out and "3 shared chunks, 6.0 MiB, 2 of them checked " \
                                               "above)" in out
    chunk = base_chunks(ckpt)[0]
    flip_byte(os.path.join(ckpt, chunk), 123)
    code, out, err = run(capsys, "verify", ckpt, "--all")
    assert code == cli.EXIT_CORRUPT
    assert "step 10: ok" in out
    for s in REUSE_STEPS[1:]:
        assert f"step {s}: CORRUPT" in out
    assert out.count(f"  {chunk}: checksum is") == 3
    assert f"corrupt files in {ckpt}: {chunk} (steps 20, 30, 40)" in err
    os.remove(os.path.join(ckpt, chunk))
    code, out, err = run(capsys, "verify", ckpt, "40", "--json")
    assert code == cli.EXIT_CORRUPT
    (step,) = json.loads(out)["steps"]
    assert step["corrupt_files"] == [chunk] and step["shared_chunks"] == 3
    assert step["problems"] == [{"path": chunk, "reason": "shared chunk is missing"}]
    assert f"{chunk} (step 40)" in err


def test_cp_of_a_reuse_step_into_an_empty_root(ckpt: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    dst = str(tmp_path / "backup")
    code, out, _ = run(capsys, "cp", ckpt, dst, "--step", "30")
    assert code == 0
    assert "copying step 30 (" in out and "+ 3 shared chunks, 6.0 MiB)" in out
    assert "copied 1 steps (6.0 MiB), skipped 0" in out
    shutil.rmtree(ckpt)
    assert_reuse_restores(dst, 30)
    code, out, _ = run(capsys, "verify", dst)
    assert code == 0 and "step 30: ok" in out
    code, out, _ = run(capsys, "ls", dst, "--json")
    assert [(d["step"], d["shared_chunks"]) for d in json.loads(out)] == [(30, 3)]


def test_cp_json_counts_chunks_copied_and_present(ckpt: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    dst = str(tmp_path / "backup")
    assert run(capsys, "cp", ckpt, dst, "--step", "20")[0] == 0
    code, out, err = run(capsys, "cp", ckpt, dst, "--step", "30", "--step", "40", "--json")
    assert code == 0 and "copying step 30" in err
    doc = {d["step"]: d for d in json.loads(out)}
    assert (doc[30]["shared_copied"], doc[30]["shared_present"]) == (1, 2)
    assert (doc[40]["shared_copied"], doc[40]["shared_present"]) == (1, 2)


def test_cp_refuses_a_source_with_a_missing_chunk(ckpt: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    chunk = base_chunks(ckpt)[0]
    os.remove(os.path.join(ckpt, chunk))
    dst = str(tmp_path / "backup")
    code, _, err = run(capsys, "cp", ckpt, dst, "--step", "20")
    assert code == cli.EXIT_ERROR
    assert f"step 20: {chunk}: shared chunk is missing at the source" in err
    assert "ckptmgr verify" in err and len(err.strip().splitlines()) == 1
    assert run(capsys, "ls", dst, "--json")[1].strip() == "[]"


def test_prune_removes_chunks_no_kept_step_references(ckpt: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "prune", ckpt, "--keep-last", "2", "--dry-run")
    assert code == 0
    assert "would remove 1 unreferenced shared chunks (16.0 KiB)" in out
    assert len(os.listdir(os.path.join(ckpt, SHARED_DIR))) == 5
    code, out, _ = run(capsys, "prune", ckpt, "--keep-last", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["deleted"] == [10, 20] and len(doc["removed_chunks"]) == 1
    assert doc["removed_chunk_bytes"] == 64 * 64 * 4
    assert len(os.listdir(os.path.join(ckpt, SHARED_DIR))) == 4
    for s in (30, 40):
        assert_reuse_restores(ckpt, s)
    assert run(capsys, "verify", ckpt, "--all")[0] == 0


def test_export_of_a_reuse_step(template: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "model.pt"
    code, out, _ = run(capsys, "export", template, "40", str(out_file), "--only", "model")
    assert code == 0 and "3 tensors" in out
    got = torch.load(out_file, weights_only=True)
    assert torch.equal(got["base.weight"], reuse_state(40)["model"]["base.weight"])


def test_the_chunk_directory_is_not_a_root(template: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    chunks = os.path.join(template, SHARED_DIR)
    for argv, fix in ((["ls", chunks], f"ckptmgr ls {template}`"),
                      (["verify", chunks], f"ckptmgr verify {template} ...`"),
                      (["cp", template, chunks], f"ckptmgr cp {template} {template}`")):
        code, _, err = run(capsys, *argv)
        assert code == cli.EXIT_ERROR, argv
        assert "is the directory of shared chunks" in err and fix in err, err
        assert len(err.strip().splitlines()) == 1
