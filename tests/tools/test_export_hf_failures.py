"""``export --format hf`` when its input or its output fails: chunks that do not tile a tensor
exactly once are refused, and a failed export leaves the output directory as it was."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _metadata import metadata_doc
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

import ckptmgr
from ckptmgr import tools
from ckptmgr.cli import main as cli_main
from ckptmgr.codec.checksum import checksum
from ckptmgr.dcp.shards import CpuShardedTensor
from ckptmgr.errors import (
    ConfigError,
    CorruptCheckpointError,
)
from ckptmgr.tools import export as export_mod


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


@pytest.fixture(scope="module")
def mgr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ckptmgr.CheckpointManager]:
    with ckptmgr.CheckpointManager(str(tmp_path_factory.mktemp("run")), 1) as m:
        yield m
