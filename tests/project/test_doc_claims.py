"""A newcomer's first hour, outside the code (issue 17): the documented FSDP run resumes from the
step it says, install lines work from a clone, example outputs are ignored by git, and the
migration guide is linked."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_documented_fsdp_run_resumes_from_the_documented_step() -> None:
    interval = yaml.safe_load((REPO / "configs" / "fsdp.yaml").read_text())["save_interval"]
    example = (REPO / "examples" / "fsdp_torchrun.py").read_text()
    first = re.search(r"--nproc-per-node 2 examples/fsdp_torchrun.py --steps (\d+)\s+# saves every "
                      r"(\d+) steps", example)
    resumed = re.search(r"--nproc-per-node 4 examples/fsdp_torchrun.py --steps \d+\s+# resumes "
                        r"from step (\d+)", example)
    assert first and resumed, "the example's docstring lost its run"
    steps, said_interval = int(first.group(1)), int(first.group(2))
    assert said_interval == interval
    # steps 0 .. steps-1 run; the newest due one is where the next run resumes
    assert max(s for s in range(steps) if s % interval == 0) == int(resumed.group(1))
    assert "--steps 30" in (REPO / "docs" / "distributed.md").read_text()


def test_install_lines_work_from_a_clone() -> None:
    readme = (REPO / "README.md").read_text()
    assert 'pip install -e ".[gcs]"' in readme and 'pip install -e ".[s3]"' in readme
    assert 'pip install "ckptmgr[' not in readme  # not on a registry
    assert "2.9 through 2.14" in readme


def test_example_output_folders_are_ignored() -> None:
    ignored = (REPO / ".gitignore").read_text().split()
    for folder in ("s3-demo/", "checkpoints/", "ckpt-demo/", ".venv-newest/"):
        assert folder in ignored or f"/{folder}" in ignored, folder


def test_migration_guide_is_linked() -> None:
    assert "docs/migrating.md" in (REPO / "README.md").read_text()
    assert "(migrating.md)" in (REPO / "docs" / "index.md").read_text()
    guide = (REPO / "docs" / "migrating.md").read_text()
    for words in ("from ckptmgr import CheckpointManager, prime_optimizer",
                  "exit_on_preemption=False", "trusted=True", "ckptmgr import", "torch.save"):
        assert words in guide, words
