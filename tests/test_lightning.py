"""The Lightning plugin with a real ``lightning.Trainer`` on CPU: fit, stop, resume from the newest
step with ``fit(ckpt_path="last")``, state equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install "
                                            "'ckptmgr[lightning]')")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ckptmgr  # noqa: E402
from ckptmgr.integrations.lightning import CkptmgrCheckpointIO  # noqa: E402

pytestmark = [
    # Lightning's own warnings, not ours: its pytree use under torch 2.13, and its advice on
    # CPU data loaders and the tiny run.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
    # ...and its notice on resuming into the directory it saved to (what resuming is)
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g))
    return DataLoader(ds, batch_size=4, shuffle=False)  # 4 steps per epoch: saves end epochs


def _fit(root: Path, max_steps: int, *, resume: bool, io: CkptmgrCheckpointIO | None = None,
         ) -> tuple[Tiny, Any]:
    torch.manual_seed(1)
    model = Tiny()
    ckpt = ModelCheckpoint(dirpath=str(root), every_n_train_steps=4, save_last=True,
                           save_top_k=-1)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[io or CkptmgrCheckpointIO(max_to_keep=3)], callbacks=[ckpt])
    trainer.fit(model, _data(), ckpt_path="last" if resume else None)
    return model, trainer


def _state(model: Tiny, trainer: Any) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    opt = trainer.optimizers[0].state_dict()
    for pid, s in opt["state"].items():
        for k, v in s.items():
            out[f"optim.{pid}.{k}"] = v.clone()
    return out


def test_fit_stop_resume_equals_uninterrupted(tmp_path: Path) -> None:
    full_model, full_trainer = _fit(tmp_path / "full", 14, resume=False)
    want = _state(full_model, full_trainer)

    root = tmp_path / "split"
    _fit(root, 9, resume=False)  # stops at step 9: steps 4 and 8 are saved, last.ckpt is 8
    with ckptmgr.CheckpointManager(str(root), 1, read_only=True) as mgr:
        assert mgr.all_steps() == [4, 8]
        assert "lightning" in mgr.step_info(8).metadata
    names = sorted(os.listdir(root))
    assert names == ["4", "8", "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert json.loads((root / "last.ckpt").read_text()) == {"ckptmgr_step": 8}

    model, trainer = _fit(root, 14, resume=True)
    assert trainer.global_step == 14
    got = _state(model, trainer)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with ckptmgr.CheckpointManager(str(root), 1, read_only=True) as mgr:
        assert mgr.all_steps() == [4, 8, 12]  # steps 9..14 trained again from step 8


def test_load_checkpoint_directly_and_remove_keeps_steps(tmp_path: Path) -> None:
    io = CkptmgrCheckpointIO(async_save=False)
    _fit(tmp_path, 4, resume=False, io=io)
    ckpt = io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert ckpt["global_step"] == 4 and ckpt["hyper_parameters"]["lr"] == 0.05
    assert set(ckpt["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    step_dir = io.load_checkpoint(str(tmp_path / "4"))  # a step directory works too
    assert torch.equal(step_dir["state_dict"]["net.0.weight"], ckpt["state_dict"]["net.0.weight"])
    io.remove_checkpoint(str(tmp_path / "last.ckpt"))
    assert not (tmp_path / "last.ckpt").exists() and (tmp_path / "4").is_dir()
    with pytest.raises(ckptmgr.CheckpointNotFoundError):
        io.load_checkpoint(str(tmp_path / "last.ckpt"))
    io.teardown()
