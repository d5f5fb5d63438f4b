"""The ``ckptmgr`` command line: the real console script in subprocesses (piped and on a
terminal, exit statuses, one-line errors) and ``ckptmgr.cli.main`` in-process for the rest
(memory:// roots only exist in-process)."""

from __future__ import annotations

import io
import json
import os
import pty
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoints import flip_byte, model_state, plain_dcp_save, save_sharded

from ckptmgr import CheckpointManager, cli, tools

safetensors_torch = pytest.importorskip("safetensors.torch")

SCRIPT = Path(sys.executable).with_name("ckptmgr")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("cli") / "run")
    with CheckpointManager(root, save_interval=10) as mgr:
        for step in (10, 20):
            mgr.save(step, model_state(step), metrics={"loss": 1.0 / step})
    save_sharded(root, 30, model_state(30))
    os.makedirs(os.path.join(root, "40"))  # the leftover of a save that never committed
    Path(root, "40", "data-aaaaaaaaaaaa-r00000-000.bin").write_bytes(b"z" * 5)
    return root


@pytest.fixture
def ckpt(template: str, tmp_path: Path) -> str:
    root = str(tmp_path / "run")
    shutil.copytree(template, root)
    return root


def _data_file(root: str, step: int) -> str:
    d = os.path.join(root, str(step))
    return os.path.join(d, sorted(n for n in os.listdir(d) if n.startswith("data-"))[0])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ckptmgr ARGV`` in-process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------- the real console script


def _read_all(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO once the child closed the terminal
            break
        if not chunk:
            break
        data += chunk
    return data


def _s3_server(request: pytest.FixtureRequest) -> Any:
    try:
        return request.getfixturevalue("moto_s3")
    except pytest.FixtureLookupError:
        return None


def test_console_script(ckpt: str, request: pytest.FixtureRequest) -> None:
    """Three real processes at once (each imports torch): JSON on a pipe with nothing on stderr;
    verify of a corrupted root on a terminal (progress bar, exit 3, the file named, one error
    line, no traceback); ``python -m ckptmgr verify`` of an s3:// root on moto with credentials
    passed as options (of a local root when there is no moto)."""
    assert SCRIPT.exists(), f"console script not installed at {SCRIPT}"
    s3 = _s3_server(request)
    s3_url = f"s3://ckpt-tests/{uuid.uuid4().hex}"
    module_run = [sys.executable, "-m", "ckptmgr", "verify", ckpt, "10", "30", "--json"]
    if s3 is not None:
        tools.copy_steps(ckpt, s3_url, [10, 30], dst_options=s3.storage_options())
        request.addfinalizer(lambda: s3.fs().rm(s3_url.removeprefix("s3://"), recursive=True))
        # the secret goes in as an option and must never come out
        module_run = [sys.executable, "-m", "ckptmgr", "verify", s3_url, "--all", "--json",
                      "-o", f"key={s3.key}", "-o", f"secret={s3.secret}",
                      "-o", f"endpoint_url={s3.endpoint_url}"]
    bad_file = _data_file(ckpt, 20)
    flip_byte(bad_file, 7)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "CKPTMGR_PATH")}

    def start(argv: list[str], stderr: Any = subprocess.PIPE) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, env=env)

    master, slave = pty.openpty()
    procs = {
        "ls": start([str(SCRIPT), "ls", ckpt, "--json"]),
        "verify": start([str(SCRIPT), "verify", "--all", ckpt], stderr=slave),
        "module": start(module_run),
    }
    os.close(slave)
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        results[name] = (p.returncode, out.decode(), (err or b"").decode())
    tty = _read_all(master).decode()
    os.close(master)

    code, out, err = results["ls"]
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert [(d["step"], d["committed"]) for d in doc] == [
        (10, True), (20, True), (30, True), (40, False)]
    assert all({"step", "time", "total_bytes", "committed"} <= set(d) for d in doc)
    assert doc[0]["time"].endswith("Z") and doc[0]["total_bytes"] > 0

    code, out, _ = results["verify"]
    assert code == cli.EXIT_CORRUPT
    name = os.path.basename(bad_file)
    assert "step 20: CORRUPT" in out and name in out and "step 10: ok" in out
    assert "verify [" in tty and "100%" in tty and "/s ETA" in tty
    after_bar = tty.rsplit("\r\n", 2)[-2]
    assert after_bar == f"ckptmgr: error: corrupt files in {ckpt}: 20/{name}"
    assert "Traceback" not in tty

    code, out, err = results["module"]
    assert code == 0, err
    doc = json.loads(out)
    assert doc["ok"] and [st["step"] for st in doc["steps"]] == [10, 30]
    if s3 is not None:
        assert s3.secret not in out + err


# -------------------------------------------------------------------------- in-process


def test_ls(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "ls", ckpt)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "TIME", "(UTC)", "SIZE", "WORLD", "METRICS",
                                "NOTE"]
    assert lines[1].split()[:2] == ["10", "committed"] and "loss=0.1" in lines[1]
    assert lines[4].split()[:2] == ["40", "incomplete"]
    code, out, err = run(capsys, "ls", str(tmp_path / "empty"))  # no such directory: an error
    assert code == 1 and out == "" and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, "ls", str(tmp_path / "empty"))
    assert code == 0 and out == "" and "no checkpoints" in err
    code, out, _ = run(capsys, "--json", "ls", str(tmp_path / "empty"))  # option before command
    assert json.loads(out) == []


def test_inspect(ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", ckpt)
    assert code == 0 and out.startswith(f"step 30 in {ckpt}\n")
    assert "world size  2" in out and "2 chunks of [3, 5]" in out and "extra.epoch" in out
    code, out, _ = run(capsys, "inspect", ckpt, "10", "--json")
    doc = json.loads(out)
    assert doc["step"] == 10 and doc["manifest"]["metrics"] == {"loss": 0.1}
    w = {t["name"]: t for t in doc["tensors"]}["model.fc.weight"]
    assert w["shape"] == [6, 5] and w["dtype"] == "float32" and w["bytes"] == 120
    code, out, err = run(capsys, "inspect", ckpt, "99")
    assert code == 1 and out == ""
    assert err == (f"ckptmgr: error: step 99 is not a committed checkpoint in {ckpt}; "
                   "available steps: [10, 20, 30]\n")
    code, _, err = run(capsys, "inspect", ckpt, "40")
    assert code == 1 and "never committed" in err and err.count("\n") == 1
    code, _, err = run(capsys, "inspect", ckpt, "x")
    assert code == cli.EXIT_USAGE and "'latest'" in err


def test_verify(ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", ckpt)
    assert code == 0 and out.startswith("step 30: ok") and err == ""
    code, out, _ = run(capsys, "verify", ckpt, "latest", "10")
    assert code == 0 and out.startswith("step 10: ok") and "step 30: ok" in out
    code, out, err = run(capsys, "verify", ckpt, "10", "20", "--progress")
    assert code == 0 and "step 10: ok" in out and "step 20: ok" in out
    assert "verify [" in err and "ETA" in err  # forced on although stderr is not a terminal
    flip_byte(_data_file(ckpt, 10), 0)
    code, out, err = run(capsys, "verify", ckpt, "--all", "--json")
    assert code == cli.EXIT_CORRUPT
    doc = json.loads(out)
    assert doc["ok"] is False
    bad = {s["step"]: s["corrupt_files"] for s in doc["steps"]}
    assert bad == {10: [os.path.basename(_data_file(ckpt, 10))], 20: [], 30: []}
    assert "corrupt files" in err
    code, _, err = run(capsys, "verify", ckpt, "10", "--all")
    assert code == cli.EXIT_USAGE and "--all" in err


def test_prune(ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "prune", ckpt, "--keep-last", "1", "--incomplete", "--dry-run")
    assert code == 0
    assert out.splitlines() == ["would delete step 10", "would delete step 20",
                                "would remove incomplete leftover 40",
                                "kept steps: 30 (dry run: nothing was deleted)"]
    assert sorted(os.listdir(ckpt)) == ["10", "20", "30", "40"]
    code, out, err = run(capsys, "prune", ckpt, "--keep-last", "1", "--keep-every", "20",
                         "--json")
    assert code == 0 and json.loads(out)["deleted"] == [10] and "deleting step 10" in err
    assert sorted(os.listdir(ckpt)) == ["20", "30", "40"]
    code, _, err = run(capsys, "prune", ckpt)
    assert code == cli.EXIT_USAGE and "--keep-last" in err
    code, _, err = run(capsys, "prune", ckpt, "--keep-last", "-1")
    assert code == cli.EXIT_USAGE


def test_export(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_pt = str(tmp_path / "all.pt")
    code, out, err = run(capsys, "export", ckpt, "latest", out_pt, "--json")
    assert code == 0 and json.loads(out)["num_tensors"] == 6
    assert "left out 3 Python values" in err
    loaded = torch.load(out_pt, weights_only=True)
    assert torch.equal(loaded["model.fc.weight"], model_state(30)["model"]["fc.weight"])
    out_st = str(tmp_path / "model.safetensors")
    code, out, _ = run(capsys, "export", ckpt, "30", out_st, "--only", "model", "--dtype", "bf16")
    assert code == 0 and out.startswith(f"wrote {out_st}: step 30, 4 tensors")
    loaded = safetensors_torch.load_file(out_st)
    assert torch.equal(loaded["fc.weight"], model_state(30)["model"]["fc.weight"].bfloat16())
    code, _, err = run(capsys, "export", ckpt, "10", str(tmp_path / "x.npz"))
    assert code == 1 and "accepted are .safetensors" in err
    code, _, err = run(capsys, "export", ckpt, "10", str(tmp_path / "x.pt"), "--only", "opt")
    assert code == 1 and "no tensors under prefix 'opt'" in err


@pytest.fixture
def mem_root() -> Iterator[str]:
    url = f"memory://cli-tests/{uuid.uuid4().hex}"
    yield url
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_cp(ckpt: str, mem_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "cp", ckpt, mem_root, "--step", "20", "--step", "30")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("copying step 20 (") and lines[1].startswith("copying step 30 (")
    assert lines[2].startswith("copied 2 steps")
    code, out, err = run(capsys, "cp", ckpt, mem_root, "--json")
    assert code == 0
    assert [(r["step"], r["status"]) for r in json.loads(out)] == [
        (10, "copied"), (20, "skipped"), (30, "skipped")]
    code, out, _ = run(capsys, "verify", mem_root, "--all")
    assert code == 0 and out.count(": ok") == 3
    code, _, err = run(capsys, "cp", ckpt, mem_root, "--step", "40")
    assert code == 1 and "never committed" in err


def test_import_needs_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(tmp_path / "dcp")
    plain_dcp_save({"w": torch.ones(2)}, src)
    dst = str(tmp_path / "dst")
    code, _, err = run(capsys, "import", src, dst, "--step", "1")
    assert code == 1 and "--trusted" in err and not os.path.exists(dst)
    code, _, err = run(capsys, "import", src, dst, "--trusted")
    assert code == cli.EXIT_USAGE and "--step" in err
    code, out, _ = run(capsys, "import", src, dst, "--step", "1", "--trusted", "--json")
    assert code == 0 and json.loads(out)["step"] == 1


def test_errors_are_one_redacted_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = "memory://alice:hunter22@cli-tests/none"
    code, _, err = run(capsys, "inspect", url)
    assert code == 1 and err.count("\n") == 1 and "hunter22" not in err and "***@" in err
    code, _, err = run(capsys, "ls", "nosuchscheme://bob:pw-secret@host/x")
    assert code == 1 and "pw-secret" not in err and "unknown URL scheme" in err
    code, _, err = run(capsys, "inspect", url, "--debug")
    assert "Traceback" in err and "hunter22" not in err
    code, _, err = run(capsys, "ls", "memory://cli-tests/x", "-o", "secret_token=abcd1234")
    assert "abcd1234" not in err


def test_progress_bar_draws_bytes_rate_eta() -> None:
    stream = io.StringIO()
    bar = cli._Bar(stream)
    bar.start(3 * 1024 * 1024, "copy")
    bar.advance(1024 * 1024)
    bar.drawn = 0.0  # allow a redraw now
    bar.advance(2 * 1024 * 1024)
    bar.finish()
    text = stream.getvalue()
    assert text.startswith("\rcopy [") and text.endswith("\n")
    assert "100% 3.0 MiB/3.0 MiB" in text and "/s ETA 0:00" in text
    empty = io.StringIO()
    bar = cli._Bar(empty)
    bar.start(0, "verify")
    bar.finish()
    assert empty.getvalue() == ""
