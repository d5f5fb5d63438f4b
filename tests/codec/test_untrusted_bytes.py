"""The parsers of bytes read from storage: crafted metadata (formats 1 and 2), manifests and values
fail with our errors, naming the file; chunk layouts are checked exactly (a duplicated chunk, a gap,
bounds that overflow int64); every number is bounded before anything is allocated; wrong JSON types
are refused."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _metadata import metadata_doc
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptmgr import CheckpointManager, ConfigError, CorruptCheckpointError, StateMismatchError
from ckptmgr.codec.checksum import checksum
from ckptmgr.codec.layout import parse_staging_name, parse_step_name
from ckptmgr.codec.manifest import ManifestError, decode_manifest
from ckptmgr.codec.metadata_columnar import MAGIC
from ckptmgr.codec.values import decode_value, encode_value
from ckptmgr.dcp.metadata import decode_metadata, encode_metadata


def _save(root: str, state: dict[str, Any]) -> Path:
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
    return Path(root) / "1"


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A format-2 metadata file's header and its body."""
    n = int.from_bytes(data[8:16], "little")
    head = json.loads(data[16:16 + n])
    assert isinstance(head, dict)
    return head, data[16 + n + (-(16 + n) % 8):]


def _join(head: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(head).encode()
    out = bytearray(MAGIC) + len(raw).to_bytes(8, "little") + raw
    out += b"\0" * (-len(out) % 8)
    return bytes(out + body)


def _forge(sdir: Path, edit: Callable[[dict[str, Any]], None], *, version: int = 2) -> str:
    """Rewrite the step's metadata (its format-2 header edited by ``edit``, or its format-1
    document when ``version`` is 1) and sign it in the manifest as the writer would: whoever can
    write the files can write the manifest too. Returns the metadata file's name."""
    manifest = json.loads((sdir / "commit.json").read_text())
    name = manifest["metadata_file"]
    data = (sdir / name).read_bytes()
    if version == 2:
        head, body = _split(data)
        edit(head)
        data = _join(head, body)
    else:
        doc = json.loads(encode_metadata(decode_metadata(data), version=1))
        edit(doc)
        data = json.dumps(doc).encode()
    (sdir / name).write_bytes(data)
    for entry in manifest["files"]:
        if entry["path"] == name:
            entry["size"], entry["checksum"] = len(data), checksum(data)
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"])
    (sdir / "commit.json").write_text(json.dumps(manifest))
    return str(name)


def _tensor(head: dict[str, Any], fqn: str) -> dict[str, Any]:
    (entry,) = [t for t in head["tensors"] if t["fqn"] == fqn]
    assert isinstance(entry, dict)
    return entry


def _restore_fails(root: str, state: dict[str, Any], *names: str) -> CorruptCheckpointError:
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as mgr, \
            pytest.raises(CorruptCheckpointError) as ei:
        mgr.restore(1, state)
    for name in names:
        assert name in str(ei.value), str(ei.value)
    return ei.value


def test_duplicated_chunk_is_refused_not_half_restored(local_root: str) -> None:
    w = torch.arange(4.0)
    sdir = _save(local_root, {"w": w})

    def duplicate(head: dict[str, Any]) -> None:
        # Two chunks [0, 2): 4 elements in all, as many as the tensor has, and each chunk's
        # bytes (the first 8 of the data) match its checksum. Before: restored w[2:] untouched.
        t = _tensor(head, "w")
        del t["grid"]
        t["count"], t["table"] = 2, {"r": [[0, 2, 0, 2], [1, 2, 3, 4]]}
        pos = t["loc"]["pos"]["c"]
        data = (sdir / head["files"][0]).read_bytes()[pos:pos + 8]
        bits = int(checksum(data).split(":")[1], 16)
        t["loc"] = {"file": {"c": 0}, "pos": {"c": pos},
                    "sum": {"c": bits - (1 << 64) if bits >= 1 << 63 else bits}}

    name = _forge(sdir, duplicate)
    target = torch.full((4,), -1.0)
    err = _restore_fails(local_root, {"w": target}, name, "'w'", "exactly once")
    assert err.path == name


def test_chunk_bounds_that_overflow_int64_are_refused(local_root: str) -> None:
    sdir = _save(local_root, {"w": torch.arange(4.0)})

    def overflow(head: dict[str, Any]) -> None:
        # A second chunk at 2**62 of 2**62 elements: 2**62 + 2**62 wraps int64 to a negative.
        t = _tensor(head, "w")
        del t["grid"]
        t["count"], t["table"] = 2, {"r": [[0, 4, 1 << 62], [1, 2, 4]]}  # loc: both at pos

    name = _forge(sdir, overflow)
    _restore_fails(local_root, {"w": torch.zeros(4)}, name, "'w'", "outside the tensor")


def test_gap_between_chunks_is_refused(local_root: str) -> None:
    sdir = _save(local_root, {"w": torch.arange(4.0)})

    def gap(head: dict[str, Any]) -> None:
        _tensor(head, "w")["grid"] = [0, 1, 3]  # rows 0, 1, 2: row 3 is in no chunk

    name = _forge(sdir, gap)
    _restore_fails(local_root, {"w": torch.zeros(4)}, name, "'w'", "[3, 4)")


def test_format_1_duplicated_chunk_is_refused(local_root: str) -> None:
    sdir = _save(local_root, {"w": torch.arange(12.0).reshape(4, 3)})

    def duplicate(doc: dict[str, Any]) -> None:
        chunks = doc["tensors"]["w"]["chunks"]
        chunks[:] = [{"offsets": [0, 0], "sizes": [2, 3]}, {"offsets": [0, 0], "sizes": [2, 3]}]

    name = _forge(sdir, duplicate, version=1)
    _restore_fails(local_root, {"w": torch.zeros(4, 3)}, name, "'w'")


def _table_md(size: list[int], boxes: list[tuple[list[int], list[int]]]) -> bytes:
    flat = [x for offsets, sizes in boxes for x in (*offsets, *sizes)]
    head = {"format": "ckptmgr-dcp-metadata", "version": 2, "dcp_version": None,
            "byteorder": sys.byteorder, "files": [], "checksum_prefix": "", "values": [],
            "has_storage": False,
            "tensors": [{"fqn": "w", "dtype": "float32", "size": size, "count": len(boxes),
                         "table": {"q": 0}}]}
    return _join(head, b"".join(int(v).to_bytes(8, sys.byteorder) for v in flat))


# A 3x3 pinwheel: four 1x2 / 2x1 boxes around the centre; exact, but not a grid of tiles.
_PINWHEEL = [([0, 0], [2, 1]), ([0, 1], [1, 2]), ([1, 2], [2, 1]), ([2, 0], [1, 2]),
             ([1, 1], [1, 1])]


@pytest.mark.parametrize("size,boxes,ok", [
    ([3, 3], _PINWHEEL, True),
    # the same volume, the centre in no chunk and (0, 0) in two
    ([3, 3], [*_PINWHEEL[:4], ([0, 0], [1, 1])], False),
    # 2-d tiles, one listed twice in place of another: volumes add up
    ([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 2]), ([0, 0], [2, 2])], False),
    ([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 2]), ([2, 2], [2, 2])], True),
    # tiles of a 3-d tensor, every dimension split, one tile moved onto its neighbour
    ([2, 2, 2], [([i, j, k], [1, 1, 1]) for i in (0, 1) for j in (0, 1) for k in (0, 1)], True),
    ([2, 2, 2], [([i, j, min(k, 0)], [1, 1, 1]) for i in (0, 1) for j in (0, 1)
                 for k in (0, 1)], False),
    # empty chunks anywhere inside are fine, beyond the end they are not
    ([4], [([0], [4]), ([4], [0]), ([2], [0])], True),
    ([4], [([0], [4]), ([5], [0])], False),
])
def test_chunk_layouts_are_checked_exactly(size: list[int],
                                           boxes: list[tuple[list[int], list[int]]],
                                           ok: bool) -> None:
    data = _table_md(size, boxes)
    if ok:
        md = decode_metadata(data).state_dict_metadata["w"]
        assert isinstance(md, TensorStorageMetadata) and len(md.chunks) == len(boxes)
    else:
        with pytest.raises(ManifestError, match="'w'"):
            decode_metadata(data)


def test_tiny_metadata_with_a_huge_count_fails_before_allocating(local_root: str) -> None:
    head = {"format": "ckptmgr-dcp-metadata", "version": 2, "dcp_version": None,
            "byteorder": sys.byteorder, "files": [], "checksum_prefix": "", "values": [],
            "has_storage": False,
            "tensors": [{"fqn": "w", "dtype": "float32", "size": [1 << 40], "count": 10**13,
                         "table": {"c": 0}}]}
    data = _join(head)
    assert len(data) < 400
    start = time.monotonic()
    with pytest.raises(ManifestError, match="'w'"):  # before: 160 TB asked of the allocator
        decode_metadata(data)
    assert time.monotonic() - start < 5

    sdir = _save(local_root, {"w": torch.zeros(2)})

    def huge(h: dict[str, Any]) -> None:
        t = _tensor(h, "w")
        del t["grid"]
        t["count"], t["table"] = 10**13, {"c": 0}

    name = _forge(sdir, huge)
    _restore_fails(local_root, {"w": torch.zeros(2)}, name, "'w'")


@pytest.mark.parametrize("data", [
    b'{"__bytes__": 5}', b'{"__tuple__": 5}', b'{"__dict__": [[1]]}', b'{"__dict__": 3}',
    b'{"__odict__": [[[1], 2]]}', b'{"__float__": []}', b"1" * 5000,
])
def test_malformed_values_are_value_errors(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a tagged JSON value") as ei:
        decode_value(data)
    assert type(ei.value) is ValueError


def test_value_not_stored_as_json_is_never_unpickled(local_root: str) -> None:
    sdir = _save(local_root, {"w": torch.zeros(2), "extra": {"epoch": 3}})

    def raw(head: dict[str, Any]) -> None:
        (value,) = [v for v in head["values"] if v[0] == "extra.epoch"]
        value[5] = "raw"  # before: passed the trusted check, then went to torch.load

    name = _forge(sdir, raw)
    _restore_fails(local_root, {"extra": {"epoch": 0}}, name, "extra.epoch")


def _manifest() -> dict[str, Any]:
    return {"format": "ckptmgr", "format_version": 1, "step": 5,
            "time": "2026-11-22T08:00:00.000000Z", "attempt": "0123456789ab", "world_size": 1,
            "mesh": None, "byteorder": "little", "versions": {}, "metrics": {}, "metadata": {},
            "metadata_file": "metadata-0123456789ab.json",
            "files": [{"path": "metadata-0123456789ab.json", "size": 10,
                       "checksum": "xxh3_64:" + "0" * 16}],
            "bytes_per_rank": {"0": 10}, "total_bytes": 10}


@pytest.mark.parametrize("field,value", [
    ("step", 2**63), ("step", 2**70), ("world_size", 2**70), ("world_size", True),
    ("metrics", {"loss": 10**400}), ("bytes_per_rank", {"²": 1}), ("bytes_per_rank", {"0": -1}),
    ("bytes_per_rank", {"9" * 5000: 1}), ("time", "0001-01-01T00:00:00"),
    ("attempt", "../../x"), ("files", {"a": 1}), ("metrics", [1]), ("step", "5"),
])
def test_manifest_fields_are_bounded_and_typed(field: str, value: Any) -> None:
    doc = _manifest()
    decode_manifest(json.dumps(doc).encode())
    doc[field] = value
    with pytest.raises(ManifestError):
        decode_manifest(json.dumps(doc).encode())


def test_manifest_with_a_huge_number_is_corrupt(local_root: str) -> None:
    sdir = _save(local_root, {"w": torch.zeros(2)})
    text = (sdir / "commit.json").read_text()
    huge = '"world_size": ' + "9" * 5000  # over Python's 4300 digits: json raises ValueError
    (sdir / "commit.json").write_text(text.replace('"world_size": 1', huge))
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr, \
            pytest.raises(CorruptCheckpointError, match=r"commit\.json"):
        mgr.restore(1, {"w": torch.zeros(2)})


@pytest.mark.parametrize("key,value", [
    ("size", [2**63]), ("size", [2**40, 2**40]), ("size", [True, 2]), ("grid", [0, 2**63, 1]),
    ("grid", [0, 1.5, 1]), ("pos", {"a": [0, 2**63]}), ("pos", {"c": 2**64}),
    ("file", {"c": -1}), ("sum", {"c": float("nan")}),
])
def test_metadata_numbers_are_bounded(key: str, value: Any) -> None:
    tensor: dict[str, Any] = {"fqn": "w", "dtype": "float32", "size": [2, 2], "grid": [0, 2, 1],
                              "loc": {"file": {"c": 0}, "pos": {"c": 0}, "sum": {"c": 0}}}
    head = {"format": "ckptmgr-dcp-metadata", "version": 2, "dcp_version": None,
            "byteorder": sys.byteorder, "files": ["data-0123456789ab-r00000-000.bin"],
            "checksum_prefix": "xxh3_64:", "values": [], "has_storage": True,
            "tensors": [tensor]}
    decode_metadata(_join(head))
    (tensor["loc"] if key in tensor["loc"] else tensor)[key] = value
    with pytest.raises(ManifestError):
        decode_metadata(_join(head))


def test_step_names_beyond_int64_are_not_steps() -> None:
    assert parse_step_name(str(2**63 - 1)) == 2**63 - 1
    assert parse_step_name("9999999999999999999") is None
    assert parse_staging_name(".tmp-9999999999999999999-0123456789ab") is None


def test_every_value_that_saves_restores_and_deeper_ones_are_refused() -> None:
    # Before: depth was counted in JSON levels on decode (a tuple is two) and in value levels on
    # encode, so a value of 60 nested tuples saved and then never restored.
    value: Any = 0
    for _ in range(99):
        value = (value,)
    assert decode_value(encode_value(value)) == value
    for deep in (b"[" * 150 + b"]" * 150, b"[" * 100_000):
        with pytest.raises(ValueError, match="not a tagged JSON value"):
            decode_value(deep)


@pytest.mark.parametrize("mesh", [{"shape": 5}, {"shape": [2], "dim_names": 7}, [1, {"shape": {}}]])
def test_a_crafted_saved_mesh_is_shown_not_iterated(local_root: str, mesh: Any) -> None:
    # The manifest's mesh is any JSON; the restore report used to iterate it (TypeError).
    sdir = _save(local_root, {"x": torch.ones(2)})
    manifest = json.loads((sdir / "commit.json").read_text())
    manifest["mesh"] = mesh
    (sdir / "commit.json").write_text(json.dumps(manifest))
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr, \
            pytest.raises(StateMismatchError, match="shape"):
        mgr.restore(1, {"x": torch.zeros(3)})


def test_grids_of_more_chunks_than_any_job_writes_are_refused() -> None:
    # A grid states any number of chunks in a few bytes: two of 2**61 made len(storage_data)
    # raise OverflowError.
    head = {"format": "ckptmgr-dcp-metadata", "version": 2, "dcp_version": None,
            "byteorder": sys.byteorder, "files": ["data-0123456789ab-r00000-000.bin"],
            "checksum_prefix": "xxh3_64:", "values": [], "has_storage": True,
            "tensors": [{"fqn": fqn, "dtype": "float32", "size": [2**61], "grid": [0, 1, 2**61],
                         "loc": {"file": {"c": 0}, "pos": {"c": 0}, "sum": {"c": 0}}}
                        for fqn in ("a", "b")]}
    with pytest.raises(ManifestError, match="chunks"):
        decode_metadata(_join(head))


def _forge_value_length(root: Path, step: int, fqn: str, length: int) -> Path:
    """Declare ``fqn``'s stored value ``length`` bytes long in a sparse data file, with the
    manifest's sizes and checksums and the item's checksum forged to match."""
    import json

    from ckptmgr.codec.checksum import checksum

    sdir = root / str(step)
    manifest = json.loads((sdir / "commit.json").read_text())
    meta_path = sdir / manifest["metadata_file"]
    meta = metadata_doc(meta_path.read_bytes())
    (loc,) = [s for s in meta["storage"] if s["fqn"] == fqn]
    data = sdir / loc["file"]
    with open(data, "r+b") as f:
        f.truncate(loc["pos"] + length)  # a hole: no bytes on disk
    loc["length"] = length
    loc["checksum"] = checksum(bytes(length)) if length <= 1 << 20 else loc["checksum"]
    meta_bytes = json.dumps(meta).encode()
    meta_path.write_bytes(meta_bytes)
    for entry in manifest["files"]:
        if entry["path"] == manifest["metadata_file"]:
            entry["size"], entry["checksum"] = len(meta_bytes), checksum(meta_bytes)
        elif entry["path"] == loc["file"]:
            entry["size"] = os.path.getsize(data)
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"])
    manifest["bytes_per_rank"] = {"0": manifest["total_bytes"]}
    (sdir / "commit.json").write_text(json.dumps(manifest))
    return data


def test_value_claiming_gigabytes_fails_before_allocating(local_root: str) -> None:
    import resource

    from ckptmgr import CorruptCheckpointError

    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(3), "extra": {"epoch": 3}})
    data = _forge_value_length(Path(local_root), 1, "extra.epoch", 2 << 30)
    assert os.stat(data).st_blocks * 512 < 1 << 20  # sparse: nothing on disk
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with (CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr,
          pytest.raises(CorruptCheckpointError, match="claims") as info):
        mgr.restore(1, {"w": torch.zeros(3), "extra": {"epoch": 0}})
    assert data.name in str(info.value)
    assert time.perf_counter() - t0 < 30
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 256 << 10, f"peak RSS grew by {grown_kib} KiB"


def test_value_larger_than_the_bound_is_refused_at_save(local_root: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr import SaveError
    from ckptmgr.dcp import writer

    monkeypatch.setattr(writer, "MAX_VALUE_BYTES", 1000)
    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        with pytest.raises((ConfigError, SaveError), match="Python value may"):
            mgr.save(1, {"w": torch.ones(3), "extra": {"names": ["x" * 50] * 40}})
        assert mgr.all_steps() == []


def test_value_within_file_but_file_short_in_storage(local_root: str) -> None:
    """A claim past the bytes the file has in storage fails naming the file, before reading."""
    from ckptmgr import CorruptCheckpointError

    with CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(3), "extra": {"epoch": 3}})
    data = _forge_value_length(Path(local_root), 1, "extra.epoch", 4096)
    with open(data, "r+b") as f:  # the file in storage is shorter than the manifest says
        f.truncate(100)
    with (CheckpointManager(local_root, save_interval=1, chkpt_on_preemption=False) as mgr,
          pytest.raises(CorruptCheckpointError) as info):
        mgr.restore(1, {"w": torch.zeros(3), "extra": {"epoch": 0}})
    assert data.name in str(info.value)
