"""Trust I (issue 25), the Hugging Face paths: ``export --format hf`` refuses chunks that do not
tile a tensor exactly once and leaves the output directory as it was when it fails (defect 4);
``load_initial`` bounds every number of a safetensors header, reads HF indexes and ``torch.save``
files strictly and raises our errors (defect 5); it opens regular files only, so a FIFO never
blocks it, and an index names plain file names only (defect 13)."""

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
from _metadata import metadata_doc
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

import ckptmgr
from ckptmgr import tools
from ckptmgr.cli import main as cli_main
from ckptmgr.codec.checksum import checksum
from ckptmgr.dcp.shards import CpuShardedTensor
from ckptmgr.errors import (
    CkptmgrError,
    ConfigError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ckptmgr.tools import export as export_mod
from ckptmgr.tools._formats import PtWriter, pt_data_pkl

# ------------------------------------------------------------------ defect 4: export --format hf


def _forge_chunks(root: Path, step: int, fqn: str, chunks: list[dict[str, Any]]) -> None:
    """Replace ``fqn``'s chunk list in the step's metadata, the manifest forged to match."""
    sdir = root / str(step)
    manifest = json.loads((sdir / "commit.json").read_text())
    meta_path = sdir / manifest["metadata_file"]
    meta = metadata_doc(meta_path.read_bytes())
    meta["tensors"][fqn]["chunks"] = chunks
    data = json.dumps(meta).encode()
    meta_path.write_bytes(data)
    for entry in manifest["files"]:
        if entry["path"] == manifest["metadata_file"]:
            entry["size"], entry["checksum"] = len(data), checksum(data)
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"])
    manifest["bytes_per_rank"] = {"0": manifest["total_bytes"]}
    (sdir / "commit.json").write_text(json.dumps(manifest))


def _sharded_root(root: Path) -> None:
    """Step 1 holding ``w`` = 0..7 in two stored chunks ([0:4] and [4:8]) and a plain ``b``."""
    with ckptmgr.CheckpointManager(str(root), 1) as mgr:
        mgr.save(1, {"w": CpuShardedTensor(torch.arange(8.0), (2,), (0,)), "b": torch.ones(2)})


def test_export_refuses_a_duplicated_chunk_instead_of_uninitialised_memory(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    _sharded_root(root)
    # [0:4] listed twice: the element counts add up to 8, but [4:8] is in no chunk.
    _forge_chunks(root, 1, "w", [{"offsets": [0], "sizes": [4]}] * 2)
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        tools.export_hf(str(root), 1, tmp_path / "hf")
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        tools.export_step(str(root), 1, tmp_path / "w.safetensors")
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "w.safetensors").exists()
    assert cli_main(["export", str(root), "--step", "1", "--format", "hf",
                     str(tmp_path / "hf-cli")]) == 1
    assert not (tmp_path / "hf-cli" / "model.safetensors.index.json").exists()


CHUNKS = {
    "duplicate": [((0,), (4,)), ((0,), (4,))],
    "past-the-end": [((0,), (5,)), ((4,), (4,))],
    "overlap": [((0,), (4,)), ((2,), (4,))],
    "gap": [((0,), (4,))],
    "negative": [((0,), (4,)), ((-4,), (4,))],
    "wrong-rank": [((0, 0), (4, 1)), ((4,), (4,))],
    "negative-empty": [((0,), (8,)), ((0,), (-1,))],
}


@pytest.mark.parametrize("case", sorted(CHUNKS))
def test_export_checks_chunks_tile_the_tensor(tmp_path: Path, case: str) -> None:
    root = tmp_path / "root"
    _sharded_root(root)
    chunks = [{"offsets": list(o), "sizes": list(s)} for o, s in CHUNKS[case]]
    _forge_chunks(root, 1, "w", chunks)
    with pytest.raises(CorruptCheckpointError, match=r"\bw\b"):
        tools.export_hf(str(root), 1, tmp_path / "hf")


@pytest.mark.parametrize("case", sorted(CHUNKS))
def test_export_assembly_checks_coverage_itself(tmp_path: Path, case: str) -> None:
    """The assembly into a fresh (uninitialised) tensor checks the chunks itself, whatever
    metadata it is handed (here: decoded, then changed in memory past the decoder's checks)."""
    root = tmp_path / "root"
    _sharded_root(root)
    _, source, planned, _ = export_mod._open_step(str(root), 1, None, None, None)
    (w,) = [t for t in planned if t.key == "w"]
    meta = TensorStorageMetadata(w.meta.properties, w.meta.size,
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                  for o, s in CHUNKS[case]])
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        source.tensor("w", meta)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _two_roots(tmp_path: Path) -> tuple[Path, Path]:
    """Two roots with the same structure (so their exports have the same file names) and
    different values; the second's last tensor is damaged on disk."""
    roots = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        state = {f"w{i}": torch.randn(64) for i in range(6)}  # 256 bytes each
        root = tmp_path / f"root{seed}"
        with ckptmgr.CheckpointManager(str(root), 1) as mgr:
            mgr.save(1, state)
        roots.append(root)
    sdir = roots[1] / "1"
    manifest = json.loads((sdir / "commit.json").read_text())
    meta = metadata_doc((sdir / manifest["metadata_file"]).read_bytes())
    (loc,) = [s for s in meta["storage"] if s["fqn"] == "w5"]
    with open(sdir / loc["file"], "r+b") as f:  # flip a byte of w5: its checksum fails
        f.seek(loc["pos"] + 3)
        byte = f.read(1)
        f.seek(loc["pos"] + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    return roots[0], roots[1]


def test_failed_export_leaves_the_existing_export_byte_for_byte(tmp_path: Path) -> None:
    good, damaged = _two_roots(tmp_path)
    out = tmp_path / "hf"
    first = tools.export_hf(str(good), 1, out, max_shard_size=600)  # 3 shards of 2 tensors
    assert len(first.shards) == 3
    (out / "config.json").write_text("{}")  # the user's own file beside the export
    before = _snapshot(out)
    # The damaged tensor is in the last shard: two shards are complete when the export fails.
    with pytest.raises(CorruptCheckpointError, match="w5"):
        tools.export_hf(str(damaged), 1, out, max_shard_size=600)
    assert _snapshot(out) == before  # no file replaced, removed or left behind
    with pytest.raises(CorruptCheckpointError, match="w5"):  # a directory it made goes too
        tools.export_hf(str(damaged), 1, tmp_path / "new", max_shard_size=600)
    assert not (tmp_path / "new").exists()
    assert cli_main(["export", str(damaged), "--step", "1", "--format", "hf", str(out),
                     "--max-shard-size", "600"]) == 1
    assert _snapshot(out) == before


def test_rename_failing_midway_puts_the_old_files_back(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    good, _ = _two_roots(tmp_path)
    out = tmp_path / "hf"
    tools.export_hf(str(good), 1, out, max_shard_size=600)
    before = _snapshot(out)
    torch.manual_seed(5)
    with ckptmgr.CheckpointManager(str(tmp_path / "other"), 1) as mgr:
        mgr.save(1, {f"w{i}": torch.randn(64) for i in range(6)})
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        # The second shard's rename into place fails, after the first one's succeeded.
        if os.fspath(dst).endswith("model-00002-of-00003.safetensors"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(export_mod.os, "replace", replace)
    with pytest.raises(ckptmgr.errors.StorageError, match="as it was"):
        tools.export_hf(str(tmp_path / "other"), 1, out, max_shard_size=600)
    monkeypatch.undo()
    assert _snapshot(out) == before
    # and a successful export over an earlier one replaces it, leaving nothing else behind
    r = tools.export_hf(str(tmp_path / "other"), 1, out, max_shard_size=600)
    assert sorted(p.name for p in out.iterdir()) == sorted([*r.shards, Path(r.index).name])
    torch.manual_seed(5)
    assert torch.equal(load_file(str(out / r.shards[0]))["w0"], torch.randn(64))


def test_export_refuses_names_that_would_overwrite_header_entries(tmp_path: Path) -> None:
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), 1) as mgr:
        mgr.save(1, {"a": torch.ones(2), "a.a": torch.zeros(3)})
    # only="a" writes both "a" and "a.a" as "a": one header entry would replace the other
    with pytest.raises(ConfigError, match="both written as 'a'"):
        tools.export_step(str(tmp_path / "root"), 1, tmp_path / "a.safetensors", only="a")
    with pytest.raises(ConfigError, match="__metadata__"):
        tools.export_hf(str(tmp_path / "root"), 1, tmp_path / "hf",
                        key_map=lambda n: "__metadata__" if n == "a" else n)
    assert not (tmp_path / "a.safetensors").exists() and not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- defect 5: load_initial input


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


# ---------------------------------------------------------- defect 13: FIFOs and directories


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
