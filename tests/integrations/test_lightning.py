"""The Lightning plugin with a real ``lightning.Trainer`` on CPU: fit, stop, resume from the newest
step with ``fit(ckpt_path="last")``, state equal to an uninterrupted run (plain SGD, without
optimizer state, too)."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import FaultyFS, Gate, install, reset

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install "
                                            "'ckptmgr[lightning]')")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ckptmgr  # noqa: E402
from ckptmgr.integrations.lightning import DATA_DIR, CkptmgrCheckpointIO  # noqa: E402

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
         seed: int = 1) -> tuple[Tiny, Any]:
    torch.manual_seed(seed)
    model = Tiny()
    ckpt = ModelCheckpoint(dirpath=str(root), every_n_train_steps=4, save_last=True,
                           save_top_k=-1)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[io or CkptmgrCheckpointIO(max_to_keep=3)], callbacks=[ckpt])
    trainer.fit(model, _data(), ckpt_path="last" if resume else None)
    return model, trainer


def _target(pointer: str) -> dict[str, Any]:
    """A pointer file's own target (without what it named before, its fallback)."""
    return {k: v for k, v in json.loads(pointer).items() if k != "ckptmgr_prev"}


def _runs(root: Path) -> list[Path]:
    """The run roots the plugin made under ``root``."""
    return sorted((root / DATA_DIR).iterdir()) if (root / DATA_DIR).is_dir() else []


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
    (run1,) = _runs(root)
    with ckptmgr.CheckpointManager(str(run1), 1, read_only=True) as mgr:
        assert mgr.all_steps() == [4, 8]
        assert "lightning" in mgr.step_info(8).metadata
    # Lightning's names only beside each other: our steps, lease and staging are in .ckptmgr/
    names = sorted(os.listdir(root))
    assert names == [DATA_DIR, "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert _target((root / "last.ckpt").read_text()) == {"ckptmgr_step": 8,
                                                             "ckptmgr_run": run1.name}

    model, trainer = _fit(root, 14, resume=True)
    assert trainer.global_step == 14
    got = _state(model, trainer)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    run2 = next(r for r in _runs(root) if r != run1)  # the resumed run saves into its own root
    with ckptmgr.CheckpointManager(str(run2), 1, read_only=True) as mgr:
        assert mgr.all_steps() == [12]  # steps 9..14 trained again from step 8


def test_load_checkpoint_directly_and_remove_keeps_steps(tmp_path: Path) -> None:
    io = CkptmgrCheckpointIO(async_save=False)
    _fit(tmp_path, 4, resume=False, io=io)
    ckpt = io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert ckpt["global_step"] == 4 and ckpt["hyper_parameters"]["lr"] == 0.05
    assert set(ckpt["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    (run,) = _runs(tmp_path)
    step_dir = io.load_checkpoint(str(run / "4"))  # a step directory works too
    assert torch.equal(step_dir["state_dict"]["net.0.weight"], ckpt["state_dict"]["net.0.weight"])
    io.remove_checkpoint(str(tmp_path / "last.ckpt"))
    assert not (tmp_path / "last.ckpt").exists() and (run / "4").is_dir()
    with pytest.raises(ckptmgr.CheckpointNotFoundError):
        io.load_checkpoint(str(tmp_path / "last.ckpt"))
    io.teardown()


# ------------------------------------------------------------------ issue 31: two bugs, layout


def _weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ckpt["state_dict"].items()}


def test_second_run_into_the_same_directory_saves_its_own_weights(tmp_path: Path) -> None:
    first, _ = _fit(tmp_path, 4, resume=False, seed=1)
    second, trainer = _fit(tmp_path, 4, resume=False, seed=2)  # a new run, not a resume
    want = {k: v.detach() for k, v in second.state_dict().items()}
    assert not torch.equal(want["net.0.weight"], first.state_dict()["net.0.weight"])
    cb = trainer.checkpoint_callback
    io = CkptmgrCheckpointIO()
    try:
        # Lightning versions the names it finds taken, as with its own I/O; whatever names it
        # chose, each holds the second run's weights, never the first run's step 4.
        paths = {cb.last_model_path, cb.best_model_path}
        assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
        for path in paths:
            got = _weights(io.load_checkpoint(path))
            for k, v in want.items():
                assert torch.equal(got[k], v), (path, k)
        first_ckpt = io.load_checkpoint(str(tmp_path / "epoch=0-step=4.ckpt"))
        assert torch.equal(first_ckpt["state_dict"]["net.0.weight"],
                           first.state_dict()["net.0.weight"])  # the first run's, untouched
    finally:
        io.teardown()
    assert len(_runs(tmp_path)) == 2
    assert all(n == DATA_DIR or n.endswith(".ckpt") for n in os.listdir(tmp_path))


@pytest.fixture
def faulty() -> Iterator[tuple[type[FaultyFS], str]]:
    fs_cls = install()
    url = f"faulty://lightning-tests/{uuid.uuid4().hex}"
    yield fs_cls, url
    reset()
    fs = fs_cls()
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_async_save_writes_the_pointer_before_returning(
        faulty: tuple[type[FaultyFS], str]) -> None:
    fs_cls, url = faulty
    gate = Gate()
    fs_cls.gate = gate  # holds the step's data files: the save is in flight, not committed
    io = CkptmgrCheckpointIO(async_save=True)
    ckpt = {"global_step": 3, "epoch": 0, "state_dict": {"w": torch.arange(4.0)}}
    try:
        io.save_checkpoint(ckpt, f"{url}/epoch=0-step=3.ckpt")
        gate.wait_arrived()
        fs = fs_cls()
        # Lightning checks the file right after the call (versioning, save_last): it is there
        assert fs.exists(f"{url}/epoch=0-step=3.ckpt")
        assert io.manager(url).all_steps() == []  # ...while the step is still being written
        # and our files are not beside it
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False)) == \
            [DATA_DIR, "epoch=0-step=3.ckpt"]
        gate.open()
        got = io.load_checkpoint(f"{url}/epoch=0-step=3.ckpt")  # waits for the commit
        assert torch.equal(got["state_dict"]["w"], torch.arange(4.0))
    finally:
        gate.open()
        io.teardown()


def test_retention_removes_pointers_of_deleted_steps(tmp_path: Path) -> None:
    io = CkptmgrCheckpointIO(async_save=False, max_to_keep=1)
    _fit(tmp_path, 9, resume=False, io=io)  # steps 4 and 8; retention keeps 8
    assert sorted(os.listdir(tmp_path)) == [DATA_DIR, "epoch=1-step=8.ckpt", "last.ckpt"]
    (run,) = _runs(tmp_path)
    # a pointer whose step is gone (copied from elsewhere, or written by another tool) says so
    (tmp_path / "old.ckpt").write_text(json.dumps({"ckptmgr_step": 4, "ckptmgr_run": run.name}))
    io2 = CkptmgrCheckpointIO()
    try:
        with pytest.raises(ckptmgr.CheckpointNotFoundError, match="deleted by ckptmgr's retention"):
            io2.load_checkpoint(str(tmp_path / "old.ckpt"))
        (tmp_path / "evil.ckpt").write_text(json.dumps({"ckptmgr_step": 4,
                                                        "ckptmgr_run": "../../elsewhere"}))
        with pytest.raises(ckptmgr.ConfigError, match="not a ckptmgr pointer"):
            io2.load_checkpoint(str(tmp_path / "evil.ckpt"))
    finally:
        io2.teardown()


def test_same_step_saved_again_with_changed_weights_keeps_both(tmp_path: Path) -> None:
    io = CkptmgrCheckpointIO(async_save=False)
    w = torch.zeros(3)
    try:
        io.save_checkpoint({"global_step": 5, "state_dict": {"w": w}}, str(tmp_path / "a.ckpt"))
        io.save_checkpoint({"global_step": 5, "state_dict": {"w": w}}, str(tmp_path / "b.ckpt"))
        assert len(_runs(tmp_path)) == 1  # b.ckpt: the same tensors, saved once
        w.add_(1)  # e.g. a manual trainer.save_checkpoint after editing the weights
        io.save_checkpoint({"global_step": 5, "state_dict": {"w": w}}, str(tmp_path / "c.ckpt"))
        got = io.load_checkpoint(str(tmp_path / "c.ckpt"))
        assert torch.equal(got["state_dict"]["w"], torch.ones(3))
        for old in ("a.ckpt", "b.ckpt"):  # still what they pointed to: never overwritten
            assert torch.equal(io.load_checkpoint(str(tmp_path / old))["state_dict"]["w"],
                               torch.zeros(3))
        assert len(_runs(tmp_path)) == 2  # c.ckpt's step 5 went into a new run root
    finally:
        io.teardown()


def test_a_checkpoint_without_global_step_is_refused_clearly(tmp_path: Path) -> None:
    io = CkptmgrCheckpointIO(async_save=False)
    try:  # ddp_spawn's launcher hands the bare state_dict to the plugin
        with pytest.raises(ckptmgr.ConfigError, match=r"'global_step'.*ddp_spawn"):
            io.save_checkpoint({"w": torch.zeros(2)}, str(tmp_path / ".temp.ckpt"))
        assert not (tmp_path / ".temp.ckpt").exists()
    finally:
        io.teardown()


def test_root_elsewhere_leaves_only_ckpt_files(tmp_path: Path) -> None:
    ckpts, data = tmp_path / "ckpts", tmp_path / "data"
    _fit(ckpts, 9, resume=False, io=CkptmgrCheckpointIO(root=str(data)))
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    (run,) = sorted(data.iterdir())
    pointer = _target((ckpts / "last.ckpt").read_text())
    assert pointer == {"ckptmgr_step": 8, "ckptmgr_run": run.name, "ckptmgr_root": str(data)}
    # the pointer names the root: a plugin without root= (a later run) resumes from it
    _, trainer = _fit(ckpts, 10, resume=True)
    assert trainer.global_step == 10
    with pytest.raises(ckptmgr.ConfigError, match="root must be"):
        CkptmgrCheckpointIO(root="")


def test_pointers_of_the_plugin_before_runs_still_load(tmp_path: Path) -> None:
    io = CkptmgrCheckpointIO(async_save=False)
    io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.arange(3.0)}},
                       str(tmp_path / "a.ckpt"))
    io.teardown()
    # the earlier layout: steps in DIR itself, pointers without a run
    (run,) = _runs(tmp_path)
    for entry in run.iterdir():
        entry.rename(tmp_path / entry.name)
    (tmp_path / "a.ckpt").write_text(json.dumps({"ckptmgr_step": 4}))
    io2 = CkptmgrCheckpointIO()
    try:
        got = io2.load_checkpoint(str(tmp_path / "a.ckpt"))
        assert torch.equal(got["state_dict"]["w"], torch.arange(3.0))
    finally:
        io2.teardown()


def test_two_checkpoint_callbacks_share_one_run_root(tmp_path: Path) -> None:
    """Two ModelCheckpoint callbacks save the same steps; the second one changes the callbacks'
    own tensors (scores) between the two saves of a step: still one run root, each step once."""
    torch.manual_seed(1)
    model = Tiny()
    a = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=4, save_last=True,
                        save_top_k=-1)
    b = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=4, monitor="train_loss",
                        save_top_k=2, filename="tl-{step}")

    class Logged(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

    model = Logged()
    trainer = L.Trainer(max_steps=12, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[CkptmgrCheckpointIO(max_to_keep=2)], callbacks=[a, b])
    trainer.fit(model, _data())
    runs = _runs(tmp_path)
    assert len(runs) == 1, runs
    steps = sorted(int(p.name) for p in runs[0].iterdir() if p.name.isdigit())
    assert steps == [8, 12], steps


def test_a_pointer_to_a_step_that_never_committed_falls_back(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    """last.ckpt is rewritten when the save starts; if the process dies before the commit, it
    names a step that is not there: loading it reads what it named before, with a warning."""
    _fit(tmp_path, 8, resume=False)
    last = tmp_path / "last.ckpt"
    before = json.loads(last.read_text())
    io = CkptmgrCheckpointIO()
    expected = io.load_checkpoint(str(last))
    # What point() writes for a save of step 12 that then never commits.
    last.write_text(json.dumps({**before, "ckptmgr_step": 12,
                                "ckptmgr_prev": {k: v for k, v in before.items()
                                                 if k != "ckptmgr_prev"}}))
    got = io.load_checkpoint(str(last))
    assert got["global_step"] == expected["global_step"] == 8
    assert all(torch.equal(got["state_dict"][k], v) for k, v in expected["state_dict"].items())
    assert "never committed" in caplog.text
    io.teardown()


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
