"""The Lightning plugin resumes a model trained by plain SGD (an optimizer without state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_resumes_a_plain_sgd_model(tmp_path: Path) -> None:
    # Plain SGD keeps no per-parameter state: Lightning saves {"state": {}, ...} in a list.
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

    class Sgd(lightning.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 4, generator=g),
                                    torch.randn(8, 2, generator=g)), batch_size=4)

    def fit(max_steps: int, resume: bool) -> Any:
        trainer = lightning.Trainer(
            max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, plugins=[CkptmgrCheckpointIO()],
            callbacks=[ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2,
                                       save_last=True, save_top_k=-1)])
        trainer.fit(Sgd(), data, ckpt_path="last" if resume else None)
        return trainer

    fit(3, resume=False)
    trainer = fit(6, resume=True)  # was KeyError: 'state' in the optimizer's load_state_dict
    assert trainer.global_step == 6
    assert trainer.optimizers[0].state_dict()["state"] == {}
