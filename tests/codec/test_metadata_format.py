"""Metadata format 2 (compact, columnar) and format 1 (per-chunk JSON): both decode, format 2
is what saves write, its lazy pieces behave as DCP's lists and dicts, and forged bytes fail
with the errors format 1 gives (issue 18: metadata decode at 16k ranks)."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptmgr
from ckptmgr.codec.manifest import ManifestError, UnsafePathError
from ckptmgr.codec.metadata import ItemLocation
from ckptmgr.codec.metadata_columnar import MAGIC
from ckptmgr.dcp.metadata import (
    ChunkTable,
    ColumnarLocations,
    GridChunks,
    decode_metadata,
    encode_metadata,
    find_chunk,
    overlapping_chunks,
    stored_volume,
)
from ckptmgr.dcp.planner import CkptSavePlanner

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metadata_v1"
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale_sim.py"


def _sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_sim_fmt", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _header(data: bytes) -> dict[str, Any]:
    n = int.from_bytes(data[8:16], "little")
    doc: dict[str, Any] = json.loads(data[16:16 + n])
    return doc


def _with_header(data: bytes, edit: Any) -> bytes:
    """``data`` with its header replaced by ``edit(header)``, the body kept aligned as before."""
    n = int.from_bytes(data[8:16], "little")
    start = 16 + n + (-(16 + n) % 8)
    head = _header(data)
    edit(head)
    raw = json.dumps(head).encode()
    out = bytearray(MAGIC) + len(raw).to_bytes(8, "little") + raw
    out += b"\0" * (-len(out) % 8)
    return bytes(out + data[start:])


def _same(a: Metadata, b: Metadata) -> None:
    assert a.state_dict_metadata == b.state_dict_metadata
    assert b.state_dict_metadata == a.state_dict_metadata
    assert dict(a.storage_data or {}) == dict(b.storage_data or {})
    assert a.planner_data == b.planner_data


# ------------------------------------------------------------------------- format 1 still reads


def test_format_1_root_written_before_format_2_restores(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "root", root)
    (md_file,) = (root / "7").glob("metadata-*.json")
    assert md_file.read_bytes().startswith(b'{"format":"ckptmgr-dcp-metadata","version":1')
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4, 8, generator=g)
    b = torch.randn(8, generator=g).to(torch.bfloat16)
    state: dict[str, Any] = {
        "model": {"w": torch.zeros(4, 8), "b": torch.zeros(8, dtype=torch.bfloat16),
                  "idx": torch.zeros(5, dtype=torch.int64), "scale": torch.tensor(0.0)},
        "extra": {"epoch": 0, "name": "", "lr": [], "none": 1}}
    with ckptmgr.CheckpointManager(str(root), save_interval=1) as mgr:
        assert mgr.all_steps() == [7]
        mgr.restore(7, state)
        assert torch.equal(state["model"]["w"], w) and torch.equal(state["model"]["b"], b)
        assert state["model"]["idx"].tolist() == [0, 1, 2, 3, 4]
        assert float(state["model"]["scale"]) == 0.5
        assert state["extra"] == {"epoch": 3, "name": "run-7", "lr": [0.1, 0.01], "none": None}
        # a new save beside it writes format 2, and both restore
        mgr.save(8, state, force=True)
    (new,) = (root / "8").glob("metadata-*.json")
    assert new.read_bytes().startswith(MAGIC)
    with ckptmgr.CheckpointManager(str(root), save_interval=1) as mgr:
        again = {"model": {"w": torch.zeros(4, 8)}}
        mgr.restore(8, again, allow_partial=True)
        assert torch.equal(again["model"]["w"], w)


def test_format_1_simulated_fsdp_metadata_decodes_and_reencodes_compactly() -> None:
    data = (FIXTURES / "sim4.json").read_bytes()
    v1 = decode_metadata(data)
    v2_bytes = encode_metadata(v1)
    assert v2_bytes.startswith(MAGIC) and len(v2_bytes) < len(data) / 3
    v2 = decode_metadata(v2_bytes)
    _same(v1, v2)
    assert isinstance(v2.storage_data, ColumnarLocations)
    # every sharded tensor became one grid record
    head = _header(v2_bytes)
    assert all("grid" in t for t in head["tensors"])
    assert encode_metadata(v2) == v2_bytes  # the lazy form encodes to the same bytes
    assert decode_metadata(encode_metadata(v2, version=1)).state_dict_metadata == \
        v1.state_dict_metadata


# ------------------------------------------------------------------------------ format 2 shapes


def _irregular() -> Metadata:
    """2-D blocks (not one split dimension), a 0-d tensor, an empty chunk, values, planner
    data, distinct checksums."""
    f32 = TensorProperties(dtype=torch.float32)
    blocks = [ChunkStorageMetadata(torch.Size([r, c]), torch.Size([2, 3]))
              for r in (0, 2) for c in (0, 3)]
    sdm: dict[str, Any] = {
        "a": TensorStorageMetadata(f32, torch.Size([4, 6]), blocks),
        "s": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([]),
                                   [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]),
        "e": TensorStorageMetadata(f32, torch.Size([3, 2]), [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([1, 2])),
            ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([0, 2]))]),
        "v": BytesStorageMetadata(), "p": BytesStorageMetadata(), "nostore": BytesStorageMetadata()}
    storage: dict[MetadataIndex, Any] = {}
    pos = 0
    for fqn in ("a", "s", "e"):
        for i, c in enumerate(sdm[fqn].chunks):
            n = max(1, c.sizes.numel()) * (8 if fqn == "s" else 4)
            if fqn == "e" and not c.sizes.numel():
                n = 0
            storage[MetadataIndex(fqn, c.offsets)] = ItemLocation(
                f"data-0123456789ab-r{i % 3:05d}-000.bin", pos, n,
                f"xxh3_64:{(pos * 2654435761 + i) % (1 << 64):016x}", "raw")
            pos += n
    storage[MetadataIndex("v")] = ItemLocation(
        "data-0123456789ab-r00000-000.bin", pos, 5, "xxh3_64:00000000000000ff", "json")
    storage[MetadataIndex("p")] = ItemLocation(
        "data-0123456789ab-r00001-000.bin", 0, 9, "xxh3_64:ffffffffffffffff", "pickle")
    return Metadata(sdm, planner_data={"a": ("x", "a"), "v": ("x", 0)}, storage_data=storage)


def test_irregular_layouts_values_and_planner_data_round_trip() -> None:
    md = _irregular()
    data = encode_metadata(md)
    assert data.startswith(MAGIC)
    out = decode_metadata(data)
    _same(md, out)
    head = {t["fqn"]: t for t in _header(data)["tensors"]}
    assert "table" in head["a"] and "grid" in head["e"] and "grid" in head["s"]
    assert isinstance(out.state_dict_metadata["a"].chunks, ChunkTable)  # type: ignore[union-attr]
    assert out.storage_data[MetadataIndex("p")].enc == "pickle"
    assert MetadataIndex("nostore") not in out.storage_data
    assert MetadataIndex("a", [1, 0]) not in out.storage_data
    assert len(out.storage_data) == len(md.storage_data)
    # what DCP's broadcast does with it: pickle, compactly
    back = pickle.loads(pickle.dumps(out))
    _same(md, back)


def _one_chunk_each(partial: bool = True) -> Metadata:
    """Tensors of one chunk each: whole tensors of every rank (0-d, empty dimensions), and
    (``partial``) one chunk that is not the whole tensor (a shard away from the origin, a part
    of one): metadata of one rank's view, which decoding refuses (the tensor is not covered)."""
    f32 = TensorProperties(dtype=torch.float32)
    shapes: list[tuple[list[int], list[int], list[int]]] = [  # size, offsets, sizes
        ([], [], []), ([0], [0], [0]), ([7], [0], [7]), ([3, 0, 2], [0, 0, 0], [3, 0, 2]),
        ([4, 5, 6], [0, 0, 0], [4, 5, 6]), ([1, 9], [0, 0], [1, 9]),
        *([([8, 4], [4, 0], [4, 4]), ([8, 4], [0, 0], [4, 4]), ([8, 4], [0, 0], [8, 2])]
          if partial else [])]
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    pos = 0
    for i, (size, offsets, sizes) in enumerate(shapes):
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        sdm[f"t{i}"] = TensorStorageMetadata(f32, torch.Size(size), [chunk])
        n = (torch.Size(sizes).numel() if sizes else 1) * 4
        storage[MetadataIndex(f"t{i}", chunk.offsets)] = ItemLocation(
            f"data-0123456789ab-r00000-{i % 2:03d}.bin", pos, n,
            f"xxh3_64:{(pos * 2654435761 + i) % (1 << 64):016x}", "raw")
        pos += n
    return Metadata(sdm, storage_data=storage)


def test_the_whole_tensor_shortcut_encodes_as_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder's shortcuts for a tensor of one whole chunk (the common case, taken for the
    plain chunk list) write the bytes its general path writes (taken for any other list, with
    the box built for every chunk)."""
    from ckptmgr.codec import metadata_columnar
    from ckptmgr.codec.chunks import BoxList
    from ckptmgr.codec.metadata_columnar import encode_columnar_metadata
    from ckptmgr.dcp.metadata import to_doc

    class Listed(BoxList):
        """Not exactly a BoxList: the encoder takes its general path."""

    md = _one_chunk_each()
    fast = to_doc(md)
    general = to_doc(md)
    for te in general.tensors.values():
        assert type(te.chunks) is BoxList
        te.chunks.__class__ = Listed
    data = encode_columnar_metadata(fast)
    monkeypatch.setattr(metadata_columnar, "_whole_chunk", lambda grid, size: False)
    assert data is not None and data == encode_columnar_metadata(general)
    monkeypatch.undo()
    whole = _one_chunk_each(partial=False)
    _same(whole, decode_metadata(encode_metadata(whole)))
    grids = {t["fqn"]: t.get("grid") for t in _header(data)["tensors"]}
    assert grids["t0"] == [0, 1, 1] and grids["t1"] == [0, 1, 1] and grids["t4"] == [0, 4, 1]
    assert grids["t6"] is None and grids["t7"] == [0, 4, 1] and grids["t8"] == [1, 2, 1]


def test_metadata_that_does_not_fit_format_2_is_written_as_format_1() -> None:
    md = _irregular()
    idx = MetadataIndex("a", [0, 0])
    md.storage_data[idx] = ItemLocation(  # type: ignore[index]
        "data-0123456789ab-r00000-000.bin", 0, 24, "md5:abc", "raw")
    data = encode_metadata(md)
    assert data.startswith(b"{")
    _same(md, decode_metadata(data))
    with pytest.raises(ValueError, match="version"):
        encode_metadata(md, version=3)


def test_lazy_chunks_behave_as_lists_and_answer_restore_questions() -> None:
    sim = _sim()
    size = (1000, 7)
    n = 48  # 21 rows each, the last 13 ranks short or empty (torch.chunk's rule)
    boxes = [sim.shard0_box(size, n, r) for r in range(n)]
    # DCP's dedup keeps the first empty chunk at the end offset only
    seen: set[tuple[int, ...]] = set()
    chunks = []
    for o, s in boxes:
        if o not in seen:
            seen.add(o)
            chunks.append(ChunkStorageMetadata(torch.Size(o), torch.Size(s)))
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                              torch.Size(size), chunks)})
    grid = decode_metadata(encode_metadata(md)).state_dict_metadata["w"].chunks  # type: ignore
    assert isinstance(grid, GridChunks)
    assert grid == chunks and chunks == grid and list(grid) == chunks
    assert grid[-1] == chunks[-1] and grid[3:6] == chunks[3:6] and len(grid) == len(chunks)
    assert stored_volume(grid) == stored_volume(chunks) == 7000
    for offsets in ((0, 0), (21, 0), (990, 0), (1000, 0), (5, 0), (21, 1), (2000, 0)):
        found = find_chunk(grid, offsets)
        assert found == find_chunk(chunks, offsets)
    for box in (((0, 0), (1000, 7)), ((20, 3), (2, 1)), ((999, 0), (1, 7)), ((50, 0), (0, 7))):
        assert overlapping_chunks(grid, *box) == overlapping_chunks(chunks, *box)


def test_a_save_at_many_simulated_ranks_decodes_to_what_was_planned() -> None:
    sim = _sim()
    builder = sim.PlanBuilder(64, layers=1)
    global_plans, md = CkptSavePlanner().create_global_plan(builder.plans())
    md.storage_data, _ = sim.storage_data(global_plans)
    data = encode_metadata(md)
    out = decode_metadata(data)
    # (format 1 as the reference: both keep a tensor's dtype, not requires_grad)
    _same(decode_metadata(encode_metadata(md, version=1)), out)
    # the benchmark's compact builder (no plans) gives the same chunks and item lengths
    for n in (64, 1000):
        if n != 64:
            global_plans, md = CkptSavePlanner().create_global_plan(
                sim.PlanBuilder(n, layers=1).plans())
            md.storage_data, _ = sim.storage_data(global_plans)
        compact = decode_metadata(sim.compact_metadata(n, layers=1))
        planned = decode_metadata(encode_metadata(md))
        assert compact.state_dict_metadata == planned.state_dict_metadata
        assert {k: v.length for k, v in compact.storage_data.items()} == {
            k: v.length for k, v in md.storage_data.items()}


def test_other_byte_order_is_swapped() -> None:
    sim = _sim()
    global_plans, md = CkptSavePlanner().create_global_plan(sim.PlanBuilder(80, 1).plans())
    md.storage_data, _ = sim.storage_data(global_plans)
    data = encode_metadata(md)
    md = decode_metadata(data)
    assert '"q":' in json.dumps(_header(data))  # packed columns (distinct checksums)
    other = "big" if sys.byteorder == "little" else "little"
    n = int.from_bytes(data[8:16], "little")
    start = 16 + n + (-(16 + n) % 8)
    body = bytearray(data[start:])
    for i in range(0, len(body) - len(body) % 8, 8):
        body[i:i + 8] = body[i:i + 8][::-1]
    swapped = _with_header(data[:start] + bytes(body), lambda h: h.update(byteorder=other))
    _same(md, decode_metadata(swapped))


# ------------------------------------------------------------------------------- forged bytes


def _grid_md() -> bytes:
    chunks = [ChunkStorageMetadata(torch.Size([i * 2, 0]), torch.Size([2, 3])) for i in range(4)]
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                              torch.Size([8, 3]), chunks)},
                  storage_data={MetadataIndex("w", c.offsets): ItemLocation(
                      f"data-0123456789ab-r{i:05d}-000.bin", 0, 24,
                      f"xxh3_64:{i * 977:016x}", "raw") for i, c in enumerate(chunks)})
    return encode_metadata(md)


def _edit_tensor(key: str, value: Any) -> Any:
    def edit(h: dict[str, Any]) -> None:
        h["tensors"][0][key] = value
    return edit


def _edit_loc(col: str, value: Any) -> Any:
    def edit(h: dict[str, Any]) -> None:
        h["tensors"][0]["loc"][col] = value
    return edit


@pytest.mark.parametrize("edit,match", [
    (lambda h: h["files"].__setitem__(0, "../x.bin"), "escapes"),
    (lambda h: h["files"].__setitem__(0, "/etc/passwd"), "escapes"),
    (lambda h: h["files"].__setitem__(0, "sub/x.bin"), "escapes"),
    (lambda h: h.update(version=3), "upgrade ckptmgr"),
    (lambda h: h.update(format="other"), "not ckptmgr"),
    (lambda h: h.update(byteorder="middle"), "byteorder"),
    (_edit_tensor("grid", [0, 2, 6]), "outside the tensor"),
    (_edit_tensor("grid", [0, 3, 5]), "outside the tensor"),
    (_edit_tensor("grid", [0, 0, 4]), "outside the tensor"),
    (_edit_tensor("grid", [2, 2, 4]), "outside the tensor"),
    (_edit_tensor("grid", [0, -2, 4]), ">= 0"),
    (_edit_tensor("dtype", "os.system"), "dtype"),
    (_edit_tensor("size", [8, -3]), "ints >= 0"),
    (_edit_loc("file", {"c": 4}), "out of range"),
    (_edit_loc("file", {"a": [0, 2]}), "out of range"),
    (_edit_loc("pos", {"c": -1}), "out of range"),
    (_edit_loc("pos", {"r": [[0, -5], [2, 4]]}), "out of range"),
    (_edit_loc("pos", {"r": [[0, 5], [3, 2]]}), "runs"),
    (_edit_loc("pos", {"q": 1 << 40}), "outside the metadata"),
    (_edit_loc("pos", {"q": 4}), "outside the metadata"),
    (_edit_loc("pos", {"z": 0}), "column kind"),
    (_edit_loc("sum", "abc"), "bad column"),
])
def test_forged_format_2_is_refused(edit: Any, match: str) -> None:
    data = _with_header(_grid_md(), edit)
    with pytest.raises((ManifestError, UnsafePathError), match=match):
        decode_metadata(data)


def test_forged_packed_columns_are_range_checked() -> None:
    data = _grid_md()
    decode_metadata(data)

    def packed_files(h: dict[str, Any]) -> None:
        h["tensors"][0]["loc"]["file"] = {"q": 0}
    # 8 bytes of body beyond the header: a body of int64 values 0, 0, 0, 1e9 as files
    n = int.from_bytes(data[8:16], "little")
    start = 16 + n + (-(16 + n) % 8)
    body = bytearray(data[start:])
    body[:32] = b"".join(int(v).to_bytes(8, sys.byteorder, signed=True)
                         for v in (0, 1, 2, 10**9))
    bad = _with_header(data[:start] + bytes(body), packed_files)
    with pytest.raises(ManifestError, match="out of range"):
        decode_metadata(bad)


@pytest.mark.parametrize("cut", [8, 15, 20])
def test_truncated_format_2_is_refused(cut: int) -> None:
    with pytest.raises(ManifestError):
        decode_metadata(_grid_md()[:cut])


def test_deep_or_broken_header_is_refused() -> None:
    deep = b"[" * 5000 + b"]" * 5000
    data = MAGIC + len(deep).to_bytes(8, "little") + deep
    with pytest.raises(ManifestError):
        decode_metadata(data)
    data = MAGIC + (3).to_bytes(8, "little") + b"{x}"
    with pytest.raises(ManifestError, match="not valid JSON"):
        decode_metadata(data)
