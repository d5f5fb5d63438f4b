"""A newcomer's mistakes with the CLI get one specific message with the fix, the same in every
command (issue 31 item 5); commands that need no tensor maths start without torch; logs name what
the API lists (item 6); the documentation agrees with the code.

The CLI runs in-process (``cli.main``) except for the one subprocess that checks which commands
import torch: a fresh interpreter is the only place where "torch was not imported" means anything.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptmgr
from ckptmgr import cli

REPO = Path(__file__).resolve().parents[2]

# Each command with the arguments it needs after the root; cp and import take the root as the
# source and the destination respectively.
COMMANDS = {
    "ls": ["ls", "{root}"],
    "inspect": ["inspect", "{root}"],
    "verify": ["verify", "{root}"],
    "prune": ["prune", "{root}", "--keep-last", "1", "--dry-run"],
    "export": ["export", "{root}", "latest", "{tmp}/out.safetensors"],
    "cp": ["cp", "{root}", "{tmp}/copy"],
}


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _argv(command: str, root: str, tmp: Path) -> list[str]:
    return [a.format(root=root, tmp=tmp) for a in COMMANDS[command]]


@pytest.fixture(scope="module")
def small_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three committed steps of a tiny model (10, 20, 30) and a staging leftover of step 40."""
    root = tmp_path_factory.mktemp("cli-messages") / "run"
    model = torch.nn.Linear(3, 2)
    with ckptmgr.CheckpointManager(str(root), save_interval=10) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"model": model}, metrics={"loss": 1.0 / step})
    staging = root / ".tmp-40-0123456789ab"
    staging.mkdir()
    (staging / "data-0123456789ab-r00000-000.bin").write_bytes(b"x" * 8)
    return str(root)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_missing_path_says_it_does_not_exist(command: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-such-run")
    rc, out, err = _run(capsys, _argv(command, missing, tmp_path))
    assert rc == cli.EXIT_ERROR and out == ""
    assert err == (f"ckptmgr: error: {missing} does not exist: no checkpoint root there; check the "
                   "path (a root is the directory holding the step directories)\n")
    assert not (tmp_path / "copy").exists()  # cp created nothing


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_file_is_not_a_root(command: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a root")
    rc, out, err = _run(capsys, _argv(command, str(path), tmp_path))
    assert rc == cli.EXIT_ERROR and out == ""
    assert err == (f"ckptmgr: error: path {str(path)!r} is an existing file; a checkpoint root "
                   "must be a directory: give the directory that holds (or will hold) the step "
                   "directories\n")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_step_directory_names_its_root_and_the_command(
        command: str, small_root: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = os.path.join(small_root, "20")
    rc, out, err = _run(capsys, _argv(command, step_dir, tmp_path))
    assert rc == cli.EXIT_ERROR and out == ""
    fix = {"ls": f"ckptmgr ls {small_root}", "inspect": f"ckptmgr inspect {small_root} 20",
           "verify": f"ckptmgr verify {small_root} 20",
           "prune": f"ckptmgr prune {small_root} ...",
           "export": f"ckptmgr export {small_root} 20 ...",
           "cp": f"ckptmgr cp {small_root} {tmp_path}/copy --step 20"}
    assert err == (f"ckptmgr: error: {step_dir} is step 20 of the checkpoint root {small_root}, "
                   f"not a checkpoint root: run `{fix[command]}`\n")
    assert not (tmp_path / "copy").exists()


def test_step_directory_variants(small_root: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    # A trailing slash, a staging directory, a renamed step directory, a destination.
    rc, _, err = _run(capsys, ["ls", os.path.join(small_root, "30") + "/"])
    assert rc == 1 and f"is step 30 of the checkpoint root {small_root}," in err
    rc, _, err = _run(capsys, ["ls", os.path.join(small_root, ".tmp-40-0123456789ab")])
    assert rc == 1 and (
        "is the unfinished save of step 40 (a staging directory) in the root "
        f"{small_root}, not a checkpoint root: run `ckptmgr ls {small_root}`") in err
    renamed = tmp_path / "best"
    renamed.mkdir()
    for f in Path(small_root, "10").iterdir():
        (renamed / f.name).write_bytes(f.read_bytes())
    rc, _, err = _run(capsys, ["verify", str(renamed)])
    assert rc == 1 and (f"{renamed} is a step directory (it holds commit.json) in the root "
                        f"{tmp_path}, not a checkpoint root: run `ckptmgr verify {tmp_path} STEP`"
                        ) in err
    rc, _, err = _run(capsys, ["cp", small_root, os.path.join(small_root, "10")])
    assert rc == 1 and err.endswith(f"is step 10 of the checkpoint root {small_root}, not a "
                                    f"checkpoint root: run `ckptmgr cp {small_root} "
                                    f"{small_root}`\n")
    # A root whose own name is a number is still a root: its entries are step directories.
    numbered = tmp_path / "2024"
    assert cli.main(["cp", small_root, str(numbered), "--no-progress"]) == 0
    capsys.readouterr()
    rc, out, _ = _run(capsys, ["ls", str(numbered), "--json"])
    assert rc == 0 and [e["step"] for e in json.loads(out)] == [10, 20, 30]


def test_step_directory_on_an_fsspec_store(capsys: pytest.CaptureFixture[str]) -> None:
    # The same check through FsspecStorage (object-store listing) as through local paths.
    root = "memory://cli-messages/run"
    with ckptmgr.CheckpointManager(root, save_interval=10) as mgr:
        mgr.save(10, {"model": torch.nn.Linear(2, 2)})
    rc, out, err = _run(capsys, ["inspect", f"{root}/10"])
    assert (rc, out) == (1, "") and err == (
        f"ckptmgr: error: {root}/10 is step 10 of the checkpoint root {root}, not a checkpoint "
        f"root: run `ckptmgr inspect {root} 10`\n")
    rc, _, err = _run(capsys, ["ls", "memory://cli-messages/nothing"])
    assert rc == 1 and "memory://cli-messages/nothing does not exist" in err


def test_an_empty_root_is_not_an_error_for_ls(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, ["ls", str(tmp_path)])
    assert (rc, out, err) == (0, "", f"ckptmgr: no checkpoints in {tmp_path}\n")


def test_bucket_without_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("s3fs")
    # No credentials anywhere botocore looks (the endpoint is never reached: signing fails).
    for var in [v for v in os.environ if v.startswith("AWS_") and v != "AWS_CA_BUNDLE"]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    endpoint = ["-o", "endpoint_url=http://127.0.0.1:9"]
    for command in ("ls", "inspect", "verify"):
        rc, out, err = _run(capsys, [command, "s3://no-creds-bucket/run", *endpoint])
        assert rc == cli.EXIT_ERROR and out == ""
        assert err == ("ckptmgr: error: no S3 credentials for s3://no-creds-bucket/run: pass -o "
                       "key=... -o secret=..., or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                       "(or AWS_PROFILE, ~/.aws/credentials)\n"), command
    # The destination of cp names its own option.
    src = tmp_path / "src"
    src.mkdir()
    rc, _, err = _run(capsys, ["cp", str(src), "s3://no-creds-bucket/run",
                               "--dst-option", "endpoint_url=http://127.0.0.1:9"])
    assert rc == 1 and "pass --dst-option key=... --dst-option secret=..." in err


def test_readme_demo_installs_only_what_it_needs() -> None:
    readme = (REPO / "README.md").read_text()
    demo, tests = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert 'pip install torch==2.13.0 -e . && .venv/bin/python examples/train_toy.py' in demo
    assert '-e ".[test]" && .venv/bin/python -m pytest' in tests
    assert "about 10 minutes on 2 cores" in readme
    quick = next(line for line in readme.splitlines()
                 if line.startswith(".venv/bin/python -m pytest tests/"))
    for path in quick.split()[3:]:
        assert (REPO / path).is_file(), path


def test_commands_without_tensor_maths_do_not_import_torch(small_root: str,
                                                           tmp_path: Path) -> None:
    """ls, prune and cp answer without torch; inspect and verify fail on a bad root before
    importing it. One fresh interpreter for all of them."""
    program = (
        "import sys\n"
        "from ckptmgr import cli\n"
        "runs = [\n"
        f"    cli.main(['ls', {small_root!r}]),\n"
        f"    cli.main(['prune', {small_root!r}, '--keep-last', '0', '--dry-run']),\n"
        f"    cli.main(['cp', {small_root!r}, {str(tmp_path / 'copy')!r}, '--no-progress']),\n"
        f"    cli.main(['inspect', {str(tmp_path / 'missing')!r}]),\n"
        f"    cli.main(['verify', {os.path.join(small_root, '10')!r}]),\n"
        f"    cli.main(['export', {str(tmp_path / 'missing')!r}, 'x.pt']),\n"
        "]\n"
        "print('RESULT', runs, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "RESULT [0, 0, 0, 1, 1, 1] False", proc.stdout
    assert "copied 3 steps" in proc.stdout
    assert sorted(os.listdir(tmp_path / "copy")) == ["10", "20", "30"]


def test_export_help_lists_every_documented_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "bf16, fp16, fp32, fp64" in help_text
    assert "(also `fp16`, `fp32`, `fp64`)" in (REPO / "docs" / "cli.md").read_text()


def test_docs_no_longer_contradict_the_code() -> None:
    local_yaml = (REPO / "configs" / "local.yaml").read_text()
    assert "must be 1" not in local_yaml and "values > 1 warn" in local_yaml
    # restore primes optimizer objects itself: no doc shows prime_optimizer as a resume step.
    for doc in ("xla.md", "concepts.md"):
        text = (REPO / "docs" / doc).read_text()
        assert "ckptmgr.prime_optimizer(opt)              #" not in text
    assert "call it\nyourself only when the state holds" in (REPO / "docs" / "concepts.md"
                                                               ).read_text()
    # ckptmgr is on no registry: nothing tells anyone to install it from one.
    for folder in ("docs", "configs", "ckptmgr", "examples"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".md", ".yaml", ".py"):
                text = path.read_text()
                for bad in ("pip install ckptmgr", "pip install 'ckptmgr", 'pip install "ckptmgr'):
                    assert bad not in text, (path, bad)


def test_logs_count_and_name_the_tiers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    durable, node = str(tmp_path / "durable"), str(tmp_path / "node")
    model = torch.nn.Linear(4, 3)
    kw: dict[str, Any] = {"save_interval": 10, "local_path": node, "local_interval": 5}
    with ckptmgr.CheckpointManager(durable, **kw) as mgr:
        for step in (10, 15):
            mgr.save(step, {"model": model})
    caplog.set_level(logging.INFO, "ckptmgr")
    with ckptmgr.CheckpointManager(durable, **kw) as mgr:
        steps = mgr.all_steps()
        mgr.restore(15, {"model": model})  # held only by the local tier
        mgr.restore(10, {"model": model})  # on both: the local tier is read first
    with ckptmgr.CheckpointManager(durable, save_interval=10) as mgr:
        mgr.restore(10, {"model": model})  # no local tier: the root
    assert steps == [10, 15]
    opened = [r.getMessage() for r in caplog.records if "CheckpointManager at" in r.getMessage()]
    local_root = os.path.join(node, "rank-0")
    assert opened == [
        f"CheckpointManager at {durable}: 2 committed steps (1 in the root, 1 only on the local "
        f"tier {local_root})",
        f"CheckpointManager at {durable}: 1 committed steps"], opened
    restores = [r for r in caplog.records if getattr(r, "ckptmgr_event", None) == "restore_end"]
    tiers = [r.ckptmgr_stats["tier"] for r in restores]  # type: ignore[attr-defined]
    assert tiers == ["local", "local", "durable"]
    messages = [r.getMessage() for r in restores]
    assert all(f"from the local tier {local_root} (" in m for m in messages[:2]), messages
    assert f"restored step 10 from the durable tier {durable} (" in messages[2]
