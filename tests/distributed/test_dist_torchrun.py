"""examples/fsdp_torchrun.py under torchrun: 2 ranks, then resumed with 1 and with 4 (gloo, CPU).

The run's state digest at each saved step must equal the digest a resumed run prints right after
restoring it at another world size: the resharded restore is bit-exact end to end.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from _procs import Zygote

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp_torchrun.py"
# `python -m torch.distributed.run` as the zygote's `-c` program.
TORCHRUN = ("import runpy; "
            "runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)")


def _torchrun(zygote: Zygote, nproc: int, ckpt: Path, steps: int) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CKPTMGR_PATH"}
    # c10d rendezvous on port 0: the launcher's store binds a free port itself (race-free), and
    # the workers use that store, so no port is guessed.
    args = [f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
            str(EXAMPLE), "--ckpt", str(ckpt), "--steps", str(steps), "--save-interval", "10",
            "--digest"]
    # `python -m torch.distributed.run ...`, the launcher forked from the zygote (torch already
    # imported: a few seconds less per launch); it starts its workers as fresh interpreters.
    out = zygote.run(args, code=TORCHRUN, timeout=300, env=env)
    assert out.returncode == 0, f"torchrun x{nproc} failed:\n{out.stdout}\n{out.stderr[-4000:]}"
    return out.stdout


def _digests(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+) digest (\w+)", text)}


@pytest.mark.slow
def test_fsdp_example_resumes_at_other_world_sizes(tmp_path: Path, zygote: Zygote) -> None:
    ckpt = tmp_path / "run"
    first = _torchrun(zygote, 2, ckpt, 25)
    saved = _digests(first)
    assert sorted(saved) == [0, 10, 20, 24]  # 24: the last step, saved by close()

    second = _torchrun(zygote, 1, ckpt, 35)
    assert "resumed from step 24 (saved by 2 ranks, now 1)" in second
    assert _digests(second)[24] == saved[24]

    third = _torchrun(zygote, 4, ckpt, 45)
    assert "resumed from step 34 (saved by 1 ranks, now 4)" in third
    assert _digests(third)[34] == _digests(second)[34]
    assert "done: committed steps [0, 34, 40, 44]" in third  # max_to_keep 3 + keep_period 1000
