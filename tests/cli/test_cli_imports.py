"""The command line starts without torch: ``--help``, ``python -m ckptmgr --help`` and ``ls --json``
import no torch, and ``import ckptmgr`` is lazy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import ckptmgr

REPO = Path(__file__).resolve().parents[2]


# Prints which heavy modules the command imported (it runs the CLI in-process, then reports).
_PROBE = """
import sys
from ckptmgr.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
heavy = sorted(m for m in ("torch", "numpy", "pydantic", "yaml") if m in sys.modules)
sys.stderr.write("HEAVY=" + ",".join(heavy) + "\\n")
sys.exit(rc)
"""


def _probe(*argv: str) -> tuple[int, str, list[str]]:
    p = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    heavy = [ln for ln in p.stderr.splitlines() if ln.startswith("HEAVY=")]
    assert heavy, p.stderr
    return p.returncode, p.stdout, [m for m in heavy[-1][6:].split(",") if m]


def test_help_imports_no_torch() -> None:
    rc, out, heavy = _probe("--help")
    assert rc == 0 and "ls" in out and "export" in out
    assert "torch" not in heavy, heavy


def test_python_dash_m_help_imports_no_torch() -> None:
    code = ("import runpy, sys\nsys.argv = ['ckptmgr', '--help']\n"
            "try:\n    runpy.run_module('ckptmgr', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "NO-TORCH"
    # and the real thing runs
    p = subprocess.run([sys.executable, "-m", "ckptmgr", "--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0 and "usage: ckptmgr" in p.stdout


def test_ls_json_imports_no_torch(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptmgr.CheckpointManager(str(root), 1) as mgr:
        mgr.save(3, {"w": torch.zeros(2)})
    rc, out, heavy = _probe("ls", "--json", str(root))
    assert rc == 0 and [e["step"] for e in json.loads(out)] == [3]
    assert heavy == [], heavy


def test_import_ckptmgr_is_lazy() -> None:
    code = ("import sys, ckptmgr\nassert 'torch' not in sys.modules\n"
            "assert ckptmgr.CheckpointManager.__name__ == 'CheckpointManager'\n"
            "assert 'torch' in sys.modules\n"
            "print(sorted(set(ckptmgr.__all__) - set(dir(ckptmgr))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_inspect_and_verify_import_no_torch(tmp_path: Path) -> None:
    # the metadata is read by ckptmgr.codec (numpy for its checks), never through torch
    root = tmp_path / "run"
    with ckptmgr.CheckpointManager(str(root), 1) as mgr:
        mgr.save(3, {"w": torch.zeros(2), "epoch": 1})
    rc, out, heavy = _probe("inspect", "--json", str(root), "3")
    assert rc == 0 and json.loads(out)["step"] == 3
    assert "torch" not in heavy, heavy
    rc, out, heavy = _probe("verify", str(root))
    assert rc == 0, out
    assert "torch" not in heavy, heavy
