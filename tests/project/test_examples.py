"""The examples run as users run them, and a resumed run reproduces an uninterrupted one."""

from __future__ import annotations

import os
import re
from pathlib import Path

from _procs import Zygote

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(zygote: Zygote, *args: str) -> str:
    # As `python examples/train_toy.py ...` in a fresh process (forked with torch and ckptmgr
    # already imported).
    env = {k: v for k, v in os.environ.items() if k != "CKPTMGR_PATH"}
    out = zygote.run([str(EXAMPLES / "train_toy.py"), *args], timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+) loss (\S+)", text)}


def test_train_toy_resume_matches_uninterrupted(tmp_path: Path, zygote: Zygote) -> None:
    full = _losses(_run(zygote, "--ckpt", str(tmp_path / "full"), "--steps", "40"))
    first = _run(zygote, "--ckpt", str(tmp_path / "split"), "--steps", "25")
    second = _run(zygote, "--ckpt", str(tmp_path / "split"), "--steps", "40")
    assert "resumed from step 24" in second  # close() saved the first run's last step
    resumed = {**_losses(first), **_losses(second)}
    assert sorted(full) == list(range(40))
    assert _losses(second) == {s: full[s] for s in range(25, 40)}
    assert resumed == full
    assert sorted(os.listdir(tmp_path / "split")) == ["24", "30", "39"]
