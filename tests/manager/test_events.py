"""Save events: listeners called in order, a raising listener never breaks a save (logged once),
structured log records carrying SaveStats; the TensorBoard example runs."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import Zygote

import ckptmgr
from ckptmgr.events import CheckpointListener

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class Recorder(CheckpointListener):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.threads: list[str] = []

    def on_save_start(self, step: int) -> None:
        self.calls.append(("start", step))

    def on_save_end(self, stats: ckptmgr.SaveStats) -> None:
        self.calls.append(("end", stats.step, stats.tier, stats.total_bytes))
        self.threads.append(threading.current_thread().name)

    def on_restore_end(self, step: int, bytes_read: int, seconds: float) -> None:
        self.calls.append(("restore", step, bytes_read > 0, seconds >= 0))


class Broken:  # duck-typed: only one event
    def on_save_end(self, stats: ckptmgr.SaveStats) -> None:
        raise RuntimeError("dashboard down")


def test_listeners_order_threads_failures_and_records(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    state = {"w": torch.arange(100.0)}
    rec = Recorder()
    with ckptmgr.CheckpointManager(str(tmp_path), 2) as mgr:
        mgr.add_listener(Broken())
        mgr.add_listener(rec)
        with pytest.raises(TypeError, match="needs one of"):
            mgr.add_listener(object())
        with caplog.at_level(logging.DEBUG, logger="ckptmgr"):
            assert mgr.save(2, state)
            assert not mgr.save(3, state)  # not due: no event
            assert mgr.save_async(4, state)
            mgr.join()
            mgr.restore(4, {"w": torch.zeros(100)})
        assert mgr.all_steps() == [2, 4]  # the broken listener broke nothing
    nbytes = rec.calls[1][3]
    assert rec.calls == [("start", 2), ("end", 2, "durable", nbytes), ("start", 4),
                         ("end", 4, "durable", nbytes), ("restore", 4, True, True)]
    assert rec.threads[1].startswith("ckptmgr-save-")  # async: on the writer thread
    failures = [r for r in caplog.records if "listener Broken.on_save_end raised" in r.message]
    assert [r.levelno for r in failures] == [logging.WARNING, logging.DEBUG]
    assert failures[0].exc_info is not None
    saves = [r for r in caplog.records if getattr(r, "ckptmgr_event", None) == "save_end"]
    assert [r.ckptmgr_stats["step"] for r in saves] == [2, 4]  # type: ignore[attr-defined]
    stats = saves[0].ckptmgr_stats  # type: ignore[attr-defined]
    assert {"blocking_s", "write_s", "bytes", "total_bytes", "throughput_bytes_per_s",
            "tier"} <= set(stats)
    assert any(getattr(r, "ckptmgr_event", None) == "restore_end" for r in caplog.records)


def test_tensorboard_example_runs(tmp_path: Path, zygote: Zygote) -> None:
    out = zygote.run([str(EXAMPLES / "tensorboard_events.py"), "--ckpt", str(tmp_path / "c"),
                      "--logdir", str(tmp_path / "tb")], timeout=300)
    assert out.returncode == 0, out.stderr
    assert "saved steps [10, 20]" in out.stdout
