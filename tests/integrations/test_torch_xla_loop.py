"""torch_xla's documented CheckpointManager loop, verbatim with only the import changed (issue 17).

The loop below is copied from pytorch/xla ``docs/source/perf/spmd_distributed_checkpoint.md``
("Example usage of the CheckpointManager"); the only edits are the import line and, because a test
cannot write to ``gs://my-bucket``, the root URL literal. After ``restore(max(all_steps()))`` it
enumerates the data loader from 0 again: the due saves of steps already committed are skipped
with one warning each (``save_async`` returns False), the loop runs to its end, and the restored
checkpoint is not touched.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

TORCH_XLA_LOOP = '''
from torch_xla.experimental.distributed_checkpoint import CheckpointManager, prime_optimizer

# Create a CheckpointManager to checkpoint every 10 steps into GCS.
chkpt_mgr = CheckpointManager('gs://my-bucket/my-experiment', 10)

# Select a checkpoint to restore from, and restore if applicable
tracked_steps = chkpt_mgr.all_steps()
if tracked_steps:
    # Choose the highest step
    best_step = max(tracked_steps)
    # Before restoring the checkpoint, the optimizer state must be primed
    # to allow state to be loaded into it.
    prime_optimizer(optim)
    state_dict = {'model': model.state_dict(), 'optim': optim.state_dict()}
    chkpt_mgr.restore(best_step, state_dict)
    model.load_state_dict(state_dict['model'])
    optim.load_state_dict(state_dict['optim'])

# Call `save` or `save_async` every step within the train loop. These methods
# return True when a checkpoint is taken.
for step, data in enumerate(dataloader):
    ...
    state_dict = {'model': model.state_dict(), 'optim': optim.state_dict()}
    if chkpt_mgr.save_async(step, state_dict):
        print(f'Checkpoint taken at step {step}')
'''

IMPORT = ("from torch_xla.experimental.distributed_checkpoint import CheckpointManager, "
          "prime_optimizer")


def _program(root: str) -> str:
    """The loop with the two edits: ckptmgr's import and a root this test can write."""
    assert TORCH_XLA_LOOP.count(IMPORT) == 1 and TORCH_XLA_LOOP.count("'gs://my-bucket/") == 1
    return (TORCH_XLA_LOOP.replace(IMPORT, "from ckptmgr import CheckpointManager, prime_optimizer")
            .replace("'gs://my-bucket/my-experiment'", repr(root)))


def _run(root: str, seed: int, batches: int, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """One training job: a fresh model and optimizer, the verbatim loop, then close the manager."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()  # a trained optimizer: the checkpoint holds its state
    optim.zero_grad()
    namespace: dict[str, Any] = {"model": model, "optim": optim,
                                 "dataloader": [torch.randn(2, 4) for _ in range(batches)]}
    capsys.readouterr()
    exec(compile(_program(root), "torch_xla_loop", "exec"), namespace)
    namespace["chkpt_mgr"].close()
    namespace["printed"] = capsys.readouterr().out.splitlines()
    return namespace


def _files(root: str, step: int) -> dict[str, bytes]:
    base = Path(root) / str(step)
    return {p.name: p.read_bytes() for p in sorted(base.iterdir())}


def test_documented_loop_resumes_and_runs_to_the_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "my-experiment")
    first = _run(root, seed=0, batches=25, capsys=capsys)
    assert first["printed"] == [f"Checkpoint taken at step {s}" for s in (0, 10, 20)]
    assert "tracked_steps" in first and first["tracked_steps"] == []
    saved = {k: v.clone() for k, v in first["model"].state_dict().items()}
    step24 = _files(root, 24)  # close() saved the last step (save_on_close)

    caplog.set_level(logging.WARNING, logger="ckptmgr")
    second = _run(root, seed=1, batches=35, capsys=capsys)
    assert second["best_step"] == 24
    # restored: the model and the optimizer of the first job
    assert all(torch.equal(second["model"].state_dict()[k], v) for k, v in saved.items())
    assert (second["optim"].state_dict()["state"][0]["exp_avg"].tolist()
            == first["optim"].state_dict()["state"][0]["exp_avg"].tolist())
    # enumerate() starts at 0 again: 0, 10 and 20 are committed, skipped with one warning each
    assert second["printed"] == ["Checkpoint taken at step 30"]
    for s in (0, 10, 20):
        skips = [r for r in caplog.records if f"skipping the save of step {s}:" in r.getMessage()]
        assert len(skips) == 1, (s, [r.getMessage() for r in caplog.records])
    # the restored checkpoint is untouched, byte for byte, and still listed
    assert _files(root, 24) == step24
    from ckptmgr import CheckpointManager

    with CheckpointManager(root, 10, read_only=True) as mgr:
        assert mgr.all_steps() == [0, 10, 20, 24, 30, 34]


def test_loop_text_is_torch_xlas() -> None:
    """The embedded text keeps torch_xla's calls (guards against editing the loop itself)."""
    body = textwrap.dedent(TORCH_XLA_LOOP)
    for line in ("chkpt_mgr = CheckpointManager('gs://my-bucket/my-experiment', 10)",
                 "best_step = max(tracked_steps)", "prime_optimizer(optim)",
                 "chkpt_mgr.restore(best_step, state_dict)",
                 "for step, data in enumerate(dataloader):",
                 "if chkpt_mgr.save_async(step, state_dict):"):
        assert line in body, line
