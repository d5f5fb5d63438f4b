"""``load_initial`` (ckptmgr/initial.py) on a user's files: every number of a safetensors header is
bounded, HF indexes and ``torch.save`` files are read strictly and raise our errors, only regular
files are opened (a FIFO never blocks it), and an index names plain file names only."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptmgr
from ckptmgr import tools
from ckptmgr.errors import (
    CkptmgrError,
    ConfigError,
    UnsafeCheckpointError,
)
from ckptmgr.formats.torch_save import PtWriter, pt_data_pkl


@pytest.fixture(scope="module")
def mgr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ckptmgr.CheckpointManager]:
    with ckptmgr.CheckpointManager(str(tmp_path_factory.mktemp("run")), 1) as m:
        yield m


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4)}}


def _st_bytes(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


_DATA = struct.pack("<4f", 1, 2, 3, 4)


def _entry(**kw: Any) -> dict[str, Any]:
    return {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], **kw}}


BAD_HEADERS: dict[str, bytes] = {
    "header-is-a-list": _st_bytes([1, 2], _DATA),
    "entry-is-a-number": _st_bytes({"w": 3}, _DATA),
    "no-shape": _st_bytes({"w": {"dtype": "F32", "data_offsets": [0, 16]}}, _DATA),
    "no-offsets": _st_bytes({"w": {"dtype": "F32", "shape": [4]}}, _DATA),
    "shape-of-strings": _st_bytes(_entry(shape=["4"]), _DATA),
    "shape-of-floats": _st_bytes(_entry(shape=[4.0]), _DATA),
    "negative-shape": _st_bytes(_entry(shape=[-4], data_offsets=[0, 16]), _DATA),
    "bool-shape": _st_bytes(_entry(shape=[True, 4]), _DATA),
    "negative-offset": _st_bytes(_entry(data_offsets=[-8, 8]), _DATA),  # header bytes as data
    "offsets-reversed": _st_bytes(_entry(data_offsets=[16, 0]), _DATA),
    "one-offset": _st_bytes(_entry(data_offsets=[0]), _DATA),
    "offsets-past-the-data": _st_bytes(_entry(data_offsets=[8, 24]), _DATA),
    "huge-offsets": _st_bytes(_entry(data_offsets=[2**64, 2**64 + 16]), _DATA),
    "size-mismatch": _st_bytes(_entry(data_offsets=[0, 12]), _DATA),
    "huge-shape": _st_bytes(_entry(shape=[2**40], data_offsets=[0, 2**42]), _DATA),
    "shape-product-overflows-int64": _st_bytes(_entry(shape=[2**62, 2**62, 0 + 4],
                                                      data_offsets=[0, 16]), _DATA),
    "dtype-a-list": _st_bytes(_entry(dtype=["F32"]), _DATA),
    "dtype-unknown": _st_bytes(_entry(dtype="F33"), _DATA),
    "overlapping-tensors": _st_bytes(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
         "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, _DATA),
    "repeated-name": b"",  # filled below: JSON with "w" twice
    "header-longer-than-the-file": _st_bytes(_entry(), _DATA, length=10**6),
    "header-length-2**63": _st_bytes(_entry(), _DATA, length=2**63),
    "not-utf8": struct.pack("<Q", 8) + b'{"\xff":1}' + _DATA,
    "deep-nesting": struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
    "truncated": _st_bytes(_entry(), _DATA[:10]),
}


_dup = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},' \
       b'"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'


BAD_HEADERS["repeated-name"] = struct.pack("<Q", len(_dup)) + _dup + _DATA


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_malformed_safetensors_raise_config_error(mgr: ckptmgr.CheckpointManager,
                                                  tmp_path: Path, case: str) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(BAD_HEADERS[case])
    state = _state()
    with pytest.raises(ConfigError, match=r"w\.safetensors"):
        mgr.load_initial(path, state)
    assert torch.equal(state["model"]["w"], torch.zeros(4))  # nothing loaded


def test_valid_safetensors_still_load(mgr: ckptmgr.CheckpointManager, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_st_bytes({"__metadata__": {"format": "pt"}, **_entry()}, _DATA))
    state = _state()
    assert mgr.load_initial(path, state)
    assert torch.equal(state["model"]["w"], torch.tensor([1.0, 2, 3, 4]))


def test_every_dtype_export_writes_load_initial_reads(mgr: ckptmgr.CheckpointManager,
                                                      tmp_path: Path) -> None:
    # One table of safetensors dtypes: F8_E4M3FNUZ was written by export, refused by load_initial.
    src = {"a": torch.arange(4.0).to(torch.float8_e4m3fnuz),
           "b": torch.arange(4.0).to(torch.float8_e5m2fnuz),
           "c": torch.arange(4.0).to(torch.float8_e4m3fn)}
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), 1) as m:
        m.save(1, {"model": src})
    tools.export_hf(str(tmp_path / "root"), 1, tmp_path / "hf", prefix="model.")
    state = {"model": {k: torch.zeros(4, dtype=v.dtype) for k, v in src.items()}}
    assert mgr.load_initial(tmp_path / "hf", state)
    for k, v in src.items():
        assert torch.equal(state["model"][k].view(torch.uint8), v.view(torch.uint8)), k


def _hf_dir(d: Path, index: Any) -> Path:
    d.mkdir()
    save_file({"w": torch.tensor([1.0, 2, 3, 4])}, str(d / "model-00001-of-00001.safetensors"))
    text = index if isinstance(index, str) else json.dumps(index)
    (d / "model.safetensors.index.json").write_text(text)
    return d


BAD_INDEXES: dict[str, tuple[Any, type[Exception]]] = {
    "not-json": ("{nope", ConfigError),
    "a-list": ([1], ConfigError),
    "weight-map-a-list": ({"weight_map": ["x"]}, ConfigError),
    "file-name-a-number": ({"weight_map": {"w": 3}}, ConfigError),
    "missing-shard": ({"weight_map": {"w": "model-00009-of-00009.safetensors"}}, ConfigError),
    "dot-dot": ({"weight_map": {"w": ".."}}, UnsafeCheckpointError),
    "dot": ({"weight_map": {"w": "."}}, UnsafeCheckpointError),
    "empty-name": ({"weight_map": {"w": ""}}, UnsafeCheckpointError),
    "nul-in-name": ({"weight_map": {"w": "a\0b"}}, UnsafeCheckpointError),
    "a-path": ({"weight_map": {"w": "../x.safetensors"}}, UnsafeCheckpointError),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_malformed_hf_index_raises_our_errors(mgr: ckptmgr.CheckpointManager, tmp_path: Path,
                                              case: str) -> None:
    index, error = BAD_INDEXES[case]
    d = _hf_dir(tmp_path / "hf", index)
    with pytest.raises(error, match=r"model\.safetensors\.index\.json|hf"):
        mgr.load_initial(d, _state())


def _pt_files(d: Path) -> dict[str, bytes]:
    torch.save({"w": torch.arange(4.0)}, d / "ok.pt")
    good = (d / "ok.pt").read_bytes()
    torch.save({"w": torch.arange(4.0)}, d / "legacy.pt", _use_new_zipfile_serialization=False)
    legacy = (d / "legacy.pt").read_bytes()
    evil = pickle.dumps({"w": threading.Lock})  # a global weights_only refuses
    with zipfile.ZipFile(d / "z.pt", "w") as z:  # a zip whose data.pkl is not a pickle
        z.writestr("archive/data.pkl", b"\x80\x02garbage")
        z.writestr("archive/version", b"3\n")
    with zipfile.ZipFile(d / "bomb.pt", "w") as z:  # asks the C unpickler for a 2**31 memo
        z.writestr("archive/data.pkl", b"\x80\x02}r\xff\xff\xff\x7f.")
        z.writestr("archive/version", b"3\n")
    return {
        "memo-index-2**31": (d / "bomb.pt").read_bytes(),
        "truncated-zip": good[: len(good) // 2],
        "zip-cut-to-header": good[:64],
        "garbage": b"\x00" * 100,
        "empty": b"",
        "plain-pickle-of-a-global": evil,
        "bad-data-pkl": (d / "z.pt").read_bytes(),
        "truncated-legacy": legacy[: len(legacy) - 20],
    }


def test_malformed_torch_save_files_raise_config_error(mgr: ckptmgr.CheckpointManager,
                                                       tmp_path: Path) -> None:
    for case, data in _pt_files(tmp_path).items():
        path = tmp_path / f"{case}.pt"
        path.write_bytes(data)
        with pytest.raises(ConfigError, match=re.escape(f"{case}.pt")) as info:
            mgr.load_initial(path, _state())
        assert isinstance(info.value, CkptmgrError), case


def _pt_claiming(path: Path, numel: int, record_bytes: int) -> None:
    """A zip-format torch.save file whose data.pkl claims ``numel`` float32 elements for a
    storage whose record holds ``record_bytes`` bytes."""
    planned = [SimpleNamespace(name="w", shape=(numel,), out_dtype=torch.float32)]
    with open(path, "wb") as f:
        w = PtWriter(f, "archive")
        w.record("data.pkl", pt_data_pkl(planned))  # type: ignore[arg-type]
        w.record("byteorder", b"little")
        with w.tensor_record("data/0", record_bytes) as rec:
            rec.write(bytes(range(record_bytes)))
        w.record("version", b"3\n")
        w.close()


def test_torch_save_storage_longer_than_its_record_is_refused(mgr: ckptmgr.CheckpointManager,
                                                              tmp_path: Path) -> None:
    # torch.load(mmap=True) slices a storage by the pickle's claim, unchecked: 6 floats from a
    # 16-byte record read the next zip header ("PK\x03\x04...") as weights.
    _pt_claiming(tmp_path / "long.pt", 6, 16)
    state = {"model": {"w": torch.zeros(6)}}
    with pytest.raises(ConfigError, match="needs 24 bytes, its record holds 16"):
        mgr.load_initial(tmp_path / "long.pt", state)
    assert torch.equal(state["model"]["w"], torch.zeros(6))
    _pt_claiming(tmp_path / "ok.pt", 4, 16)  # the same file with a true claim loads
    state = {"model": {"w": torch.zeros(4)}}
    assert mgr.load_initial(tmp_path / "ok.pt", state)
    assert torch.equal(state["model"]["w"].view(torch.uint8), torch.arange(16, dtype=torch.uint8))


def test_pt_export_of_dtypes_without_a_legacy_storage_loads(mgr: ckptmgr.CheckpointManager,
                                                            tmp_path: Path) -> None:
    # torch.save names float8/uint16 storages as bytes (UntypedStorage); export named the dtype
    # as a storage class, which torch.load cannot read.
    src = {"f8": torch.arange(4.0).to(torch.float8_e4m3fn), "u16": torch.arange(3).to(torch.uint16),
           "c128": torch.ones(2, dtype=torch.complex128), "f": torch.ones(2)}
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), 1) as m:
        m.save(1, {"model": src})
    tools.export_step(str(tmp_path / "root"), 1, tmp_path / "m.pt", only="model")
    for mmap in (False, True):
        got = torch.load(tmp_path / "m.pt", weights_only=True, mmap=mmap)
        assert sorted(got) == sorted(src)
        for k, v in src.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8),
                                                           v.view(torch.uint8)), k
    state = {"model": {k: torch.zeros_like(v) for k, v in src.items()}}
    assert mgr.load_initial(tmp_path / "m.pt", state)
    assert torch.equal(state["model"]["u16"], src["u16"])


def _bounded(call: Any, limit_s: float, unblock: Path) -> BaseException | None:
    """Run ``call`` in a thread; if it has not returned after ``limit_s``, open ``unblock`` (a
    FIFO it waits on) for writing so that it ends, and fail."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)  # a reader is waiting: succeeds
        os.close(fd)
        t.join(10)
        pytest.fail(f"load_initial blocked on the FIFO {unblock.name} for {limit_s} s")
    return outcome[0]


def test_fifo_shard_named_by_an_index_does_not_block(mgr: ckptmgr.CheckpointManager,
                                                     tmp_path: Path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    os.mkfifo(d / "model-00001-of-00001.safetensors")  # e.g. a download that never finished
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    fifo = d / "model-00001-of-00001.safetensors"
    err = _bounded(lambda: mgr.load_initial(d, _state()), 10, fifo)
    assert isinstance(err, ConfigError) and "not a regular file" in str(err)


def test_fifo_pt_file_does_not_block(mgr: ckptmgr.CheckpointManager, tmp_path: Path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    os.mkfifo(d / "pytorch_model.bin")
    (d / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
    err = _bounded(lambda: mgr.load_initial(d, _state()), 10, d / "pytorch_model.bin")
    assert isinstance(err, ConfigError) and "not a regular file" in str(err)


def test_symlinked_shards_of_the_hub_cache_still_load(mgr: ckptmgr.CheckpointManager,
                                                      tmp_path: Path) -> None:
    # The hub cache links snapshots/<rev>/<file> to ../../blobs/<hash>: links are followed.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    save_file({"w": torch.tensor([1.0, 2, 3, 4])}, str(blobs / "abc"))
    (blobs / "idx").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    snap = tmp_path / "snapshots" / "rev"
    snap.mkdir(parents=True)
    os.symlink("../../blobs/abc", snap / "model.safetensors")
    os.symlink("../../blobs/idx", snap / "model.safetensors.index.json")
    state = _state()
    assert mgr.load_initial(snap, state)
    assert torch.equal(state["model"]["w"], torch.tensor([1.0, 2, 3, 4]))


def test_fifo_given_as_the_source_is_refused(mgr: ckptmgr.CheckpointManager,
                                             tmp_path: Path) -> None:
    for name in ("w.safetensors", "w.pt"):
        os.mkfifo(tmp_path / name)
        err = _bounded(lambda n=name: mgr.load_initial(tmp_path / n, _state()), 10,
                       tmp_path / name)
        assert isinstance(err, ConfigError) and "not a regular file" in str(err), err
