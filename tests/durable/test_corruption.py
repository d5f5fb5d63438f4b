"""Damaged checkpoints: flipped bytes, truncated or missing files, bad manifests."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckptmgr import CheckpointManager, CorruptCheckpointError, RestoreError


def _save(root: str) -> dict[str, torch.Tensor]:
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10, dtype=torch.int64),
             "meta": {"epoch": 3}}
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, state)
    return state


def _data_file(root: str) -> str:
    d = os.path.join(root, "1")
    (name,) = [n for n in os.listdir(d) if n.startswith("data-")]
    return os.path.join(d, name)


def _target() -> dict[str, object]:
    return {"a": torch.zeros(1000), "b": torch.zeros(10, dtype=torch.int64), "meta": {"epoch": 0}}


@pytest.mark.parametrize("offset", [0, 1999, 4000, -1])
def test_flipped_data_byte_is_detected(local_root: str, offset: int) -> None:
    _save(local_root)
    path = _data_file(local_root)
    with open(path, "r+b") as f:
        f.seek(offset if offset >= 0 else os.path.getsize(path) - 1)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    with CheckpointManager(local_root, save_interval=1) as mgr:
        with pytest.raises(CorruptCheckpointError) as ei:
            mgr.restore(1, _target())
        assert os.path.basename(path) in str(ei.value)
        assert isinstance(ei.value, RestoreError) and ei.value.step == 1


def test_flipped_byte_ignored_without_verify(local_root: str) -> None:
    state = _save(local_root)
    path = _data_file(local_root)
    with open(path, "r+b") as f:
        f.seek(4)
        assert f.read(1) != b"\x7f"  # the write below changes the file
        f.seek(4)
        f.write(b"\x7f")
    with CheckpointManager(local_root, save_interval=1, verify=False) as mgr:
        target = _target()
        mgr.restore(1, target)  # explicit opt-out: loads without checksums ...
    # ... the damaged byte as it is on disk: exactly one element differs, the rest is intact
    changed = [int((target[k] != state[k]).sum()) for k in ("a", "b")]  # type: ignore[index]
    assert sorted(changed) == [0, 1], changed
    assert target["meta"] == {"epoch": 3}


def test_truncated_data_file(local_root: str) -> None:
    _save(local_root)
    path = _data_file(local_root)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)
    with CheckpointManager(local_root, save_interval=1) as mgr:
        target = _target()
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            mgr.restore(1, target)
        assert torch.equal(target["a"], torch.zeros(1000))  # sizes are checked before reading


def test_missing_data_file(local_root: str) -> None:
    _save(local_root)
    os.unlink(_data_file(local_root))
    with CheckpointManager(local_root, save_interval=1) as mgr, pytest.raises(
            CorruptCheckpointError, match="missing"):
        mgr.restore(1, _target())


@pytest.mark.parametrize("damage", ["garbage", "truncate", "wrong_step", "bad_checksum"])
def test_bad_manifest(local_root: str, damage: str) -> None:
    _save(local_root)
    mpath = os.path.join(local_root, "1", "commit.json")
    with open(mpath, "rb") as f:
        raw = f.read()
    doc = json.loads(raw)
    if damage == "garbage":
        data = b"\x00not json"
    elif damage == "truncate":
        data = raw[:50]
    elif damage == "wrong_step":
        doc["step"] = 2
        data = json.dumps(doc).encode()
    else:
        for entry in doc["files"]:
            if entry["path"].startswith("metadata-"):
                entry["checksum"] = "xxh3_64:" + "0" * 16
        data = json.dumps(doc).encode()
    with open(mpath, "wb") as f:
        f.write(data)
    with CheckpointManager(local_root, save_interval=1) as mgr:
        assert mgr.all_steps() == [1]  # listed (the manifest exists) ...
        with pytest.raises(CorruptCheckpointError):  # ... but refused at restore
            mgr.restore(1, _target())


def test_corrupt_metadata_file(local_root: str) -> None:
    _save(local_root)
    d = os.path.join(local_root, "1")
    (name,) = [n for n in os.listdir(d) if n.startswith("metadata-")]
    with open(os.path.join(d, name), "r+b") as f:
        f.seek(10)
        f.write(b"#")
    with CheckpointManager(local_root, save_interval=1) as mgr, pytest.raises(
            CorruptCheckpointError, match=name):
        mgr.restore(1, _target())
