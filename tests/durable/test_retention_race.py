"""A reader racing retention is told the step was deleted while it was read
(CheckpointNotFoundError), not "No such file" (StorageError) or "damaged" (verify exit 3)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import Gate

from ckptmgr import (
    CheckpointManager,
    CheckpointNotFoundError,
    cli,
)
from ckptmgr.storage.local import LocalStorage


def _gate_data_reads(obj: Any, gate: Gate, names: tuple[str, ...]) -> None:
    """Hold every read of a data file through ``obj``'s methods ``names`` at ``gate``."""
    for name in names:
        method = getattr(obj, name)

        def held(path: str, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            if "/data-" in path:
                gate.pass_()
            return _method(path, *args, **kwargs)

        setattr(obj, name, held)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the test
            errors.append(e)

    t = threading.Thread(target=run, name="reader")
    t.start()
    return t, errors


def test_reader_racing_retention_is_told_the_step_was_deleted(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as writer:
        writer.save(1, {"w": torch.ones(1000), "v": 1})
        reader = CheckpointManager(root, save_interval=1, read_only=True)
        gate = Gate()
        # The reader has read step 1's manifest and metadata; its data reads wait here.
        _gate_data_reads(reader._durable.store.storage, gate,
                         ("open_reader", "read_into", "read_bytes"))
        t, errors = _in_thread(lambda: reader.restore(1, {"w": torch.zeros(1000), "v": 0}))
        gate.wait_arrived()
        writer.save(2, {"w": torch.full((1000,), 2.0), "v": 2})  # retention deletes step 1
        assert writer.all_steps() == [2]
        gate.open()
        t.join(60)
        reader.close()
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CheckpointNotFoundError), errors
    text = str(errors[0])
    assert "step 1 was deleted" in text and "while it was being read" in text, text
    assert "available steps: [2]" in text, text
    assert errors[0].available == [2]


def test_cli_verify_racing_retention_says_deleted_not_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as writer:
        writer.save(1, {"w": torch.ones(1000)})
        gate = Gate()
        # The CLI's reads of data files wait here (the writer's thread passes).
        read_into = LocalStorage.read_into

        def held(self: LocalStorage, path: str, *args: Any) -> None:
            if "/data-" in path and threading.current_thread().name == "reader":
                gate.pass_()
            read_into(self, path, *args)

        monkeypatch.setattr(LocalStorage, "read_into", held)
        code: list[int] = []
        t, errors = _in_thread(lambda: code.append(cli.main(["verify", root, "1"])))
        gate.wait_arrived()
        writer.save(2, {"w": torch.full((1000,), 2.0)})  # retention deletes step 1
        gate.open()
        t.join(60)
    monkeypatch.undo()
    assert not errors and code == [cli.EXIT_ERROR], (errors, code)  # not 3: nothing is damaged
    out, err = capsys.readouterr()
    assert "CORRUPT" not in out and "step 1 was deleted" in err, (out, err)


def test_cli_inspect_racing_retention_says_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as writer:
        writer.save(1, {"w": torch.ones(10)})
        gate = Gate()
        read_bytes = LocalStorage.read_bytes

        def held(self: LocalStorage, path: str, *args: Any) -> bytes:
            # inspect has read the manifest; its read of the metadata file waits here
            if "/metadata-" in path and threading.current_thread().name == "reader":
                gate.pass_()
            return read_bytes(self, path, *args)

        monkeypatch.setattr(LocalStorage, "read_bytes", held)
        code: list[int] = []
        t, errors = _in_thread(lambda: code.append(cli.main(["inspect", root, "1"])))
        gate.wait_arrived()
        writer.save(2, {"w": torch.full((10,), 2.0)})  # retention deletes step 1
        gate.open()
        t.join(60)
    monkeypatch.undo()
    _, err = capsys.readouterr()
    assert not errors and code == [cli.EXIT_ERROR], (errors, code, err)
    assert "step 1 was deleted" in err and "available steps: [2]" in err, err
