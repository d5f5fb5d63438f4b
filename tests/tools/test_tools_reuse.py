"""ckptmgr.tools on a root whose steps share chunks (``reuse_unchanged=True``), mixed with a step
saved without reuse: list, inspect, verify (a deleted or damaged shared chunk is reported against
every step that references it), copy (a copied step stands alone), prune (chunks go only when no
kept step references them) and export."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoints import (
    REUSE_STEPS,
    assert_reuse_restores,
    base_chunks,
    flip_byte,
    reuse_state,
    save_reuse_root,
)

from ckptmgr import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
    tools,
)
from ckptmgr.codec.layout import SHARED_DIR, is_shared_chunk_path
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage

STEPS = REUSE_STEPS


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("reuse") / "run")
    save_reuse_root(root)
    return root


@pytest.fixture
def ckpt(template: str, tmp_path: Path) -> str:
    root = str(tmp_path / "run")
    shutil.copytree(template, root)
    return root


def manifests(root: str) -> dict[int, Any]:
    store = StepStore(open_storage(root, writable=False))
    return {s: store.read_manifest(s) for s in store.committed_steps()}


def test_the_root_holds_shared_chunks(template: str) -> None:
    m = manifests(template)
    assert m[10].shared == ()  # saved without reuse: everything in its directory
    for s in STEPS[1:]:
        assert len(m[s].shared) == 3 and all(is_shared_chunk_path(f.path) for f in m[s].shared)
    # The base is stored once; each step adds its own adapter chunk.
    assert len(os.listdir(os.path.join(template, SHARED_DIR))) == 2 + 3


def test_list_and_usage(template: str) -> None:
    by_step = {e.step: e for e in tools.list_steps(template)}
    m = manifests(template)
    assert by_step[10].shared_bytes == by_step[10].shared_chunks == 0
    assert by_step[10].total_bytes > 6 << 20  # the whole state, in its own files
    for s in STEPS[1:]:
        e = by_step[s]
        assert (e.total_bytes, e.shared_bytes, e.shared_chunks) == (
            m[s].total_bytes, m[s].shared_bytes, 3)
        assert e.total_bytes < 64 << 10 and e.shared_bytes > 6 << 20
        j = e.to_json()
        assert j["shared_bytes"] == e.shared_bytes and j["shared_chunks"] == 3
        assert j["total_bytes"] == e.total_bytes  # the existing field keeps its meaning
    usage = tools.shared_usage(template)
    unique = {f.path: f.size for s in STEPS[1:] for f in m[s].shared}
    assert (usage.chunks, usage.nbytes) == (len(unique), sum(unique.values()))


def test_inspect_shows_own_and_shared_bytes(template: str) -> None:
    d = tools.inspect_step(template, 30)
    m = manifests(template)[30]
    assert d.shared == m.shared and d.shared_bytes == m.shared_bytes
    assert d.info.total_bytes == m.total_bytes
    by_name = {t.name: t for t in d.tensors}
    assert by_name["model.base.weight"].shared_bytes == 3072 * 512 * 4
    assert by_name["model.adapter.weight"].shared_bytes == 64 * 64 * 4
    assert by_name["model.adapter.bias"].shared_bytes == 0  # too small to share
    j = d.to_json()
    assert j["manifest"]["shared_bytes"] == m.shared_bytes
    assert [f["path"] for f in j["manifest"]["shared"]] == [f.path for f in m.shared]
    plain = tools.inspect_step(template, 10)
    assert plain.shared == () and all(t.shared_bytes == 0 for t in plain.tensors)


def test_verify_reads_each_chunk_once(template: str) -> None:
    results = tools.verify_steps(template, all_steps=True)
    assert [r.step for r in results] == list(STEPS) and all(r.ok for r in results)
    r = {x.step: x for x in results}
    assert r[10].shared_chunks == 0 and r[10].bytes_checked > 6 << 20
    assert r[20].shared_chunks == 3 and r[20].shared_checked_before == 0
    # Later steps share the base: its two chunks are not read again.
    assert r[30].shared_checked_before == r[40].shared_checked_before == 2
    assert r[30].bytes_checked < 1 << 20
    assert r[20].to_json()["shared_chunks"] == 3


def test_verify_reports_a_deleted_chunk_against_every_step(ckpt: str) -> None:
    gone = base_chunks(ckpt)[0]
    os.remove(os.path.join(ckpt, gone))
    r = {x.step: x for x in tools.verify_steps(ckpt, all_steps=True)}
    assert r[10].ok
    for s in STEPS[1:]:
        assert r[s].corrupt_files == [gone], s
        assert [p.reason for p in r[s].problems] == ["shared chunk is missing"]


def test_verify_reports_a_flipped_chunk_against_every_step(ckpt: str) -> None:
    bad = base_chunks(ckpt)[1]
    flip_byte(os.path.join(ckpt, bad), 1000)
    r = {x.step: x for x in tools.verify_steps(ckpt, all_steps=True)}
    assert r[10].ok
    for s in STEPS[1:]:
        assert r[s].corrupt_files == [bad], s
        reasons = " ".join(p.reason for p in r[s].problems)
        assert "checksum is" in reasons and "'model.base.weight'" in reasons
    # One step asked for alone is checked the same way.
    (only,) = tools.verify_steps(ckpt, [30])
    assert only.corrupt_files == [bad]


def test_verify_catches_a_chunk_whose_bytes_are_not_its_name(ckpt: str) -> None:
    """A chunk replaced by another chunk's bytes (sizes equal) fails its checksum, and a manifest
    whose checksum was forged to match still fails the name (the xxh3-128 of the bytes)."""
    a, b = base_chunks(ckpt)
    shutil.copyfile(os.path.join(ckpt, b), os.path.join(ckpt, a))
    r = {x.step: x for x in tools.verify_steps(ckpt, all_steps=True)}
    assert all(r[s].corrupt_files == [a] for s in STEPS[1:])


def test_copy_of_a_reuse_step_stands_alone(ckpt: str, tmp_path: Path) -> None:
    dst = str(tmp_path / "copy")
    (res,) = tools.copy_steps(ckpt, dst, [30])
    m = manifests(ckpt)[30]
    assert (res.status, res.shared_copied, res.shared_present) == ("copied", 3, 0)
    assert res.nbytes == m.total_bytes + m.shared_bytes
    # Only what step 30 references went over; the copy restores from that root alone.
    assert sorted(os.listdir(os.path.join(dst, SHARED_DIR))) == sorted(
        f.path.rpartition("/")[2] for f in m.shared)
    shutil.rmtree(ckpt)  # nothing of the source is needed any more
    assert_reuse_restores(dst, 30)
    assert all(r.ok for r in tools.verify_steps(dst, all_steps=True))


def test_copy_shares_chunks_the_destination_holds(ckpt: str, tmp_path: Path) -> None:
    dst = str(tmp_path / "copy")
    tools.copy_steps(ckpt, dst, [20])
    results = {r.step: r for r in tools.copy_steps(ckpt, dst)}
    assert results[20].status == "skipped"
    assert results[10].shared_copied == results[10].shared_present == 0
    assert (results[30].shared_copied, results[30].shared_present) == (1, 2)
    for s in STEPS:
        assert_reuse_restores(dst, s)


def test_copy_with_a_missing_source_chunk_commits_nothing(ckpt: str, tmp_path: Path) -> None:
    gone = base_chunks(ckpt)[0]
    os.remove(os.path.join(ckpt, gone))
    dst = str(tmp_path / "copy")
    with pytest.raises(CorruptCheckpointError, match="shared chunk is missing at the source"):
        tools.copy_steps(ckpt, dst, [30])
    assert tools.list_steps(dst) == []


def test_copy_with_a_damaged_source_chunk_commits_nothing(ckpt: str, tmp_path: Path) -> None:
    bad = base_chunks(ckpt)[1]
    flip_byte(os.path.join(ckpt, bad), 5)
    dst = str(tmp_path / "copy")
    with pytest.raises(CorruptCheckpointError, match="checksum of the source"):
        tools.copy_steps(ckpt, dst, [40])
    assert tools.list_steps(dst) == []
    assert not [n for n in os.listdir(os.path.join(dst, SHARED_DIR)) if bad.endswith(n)]


def test_copy_never_writes_through_a_linked_chunk_directory(ckpt: str, tmp_path: Path) -> None:
    dst = tmp_path / "copy"
    dst.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dst / SHARED_DIR).symlink_to(elsewhere)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        tools.copy_steps(ckpt, str(dst), [20])
    assert list(elsewhere.iterdir()) == []


def test_prune_keeps_every_chunk_a_kept_step_needs(ckpt: str) -> None:
    m = manifests(ckpt)
    dry = tools.prune_steps(ckpt, keep_last=1, dry_run=True)
    assert dry.deleted == (10, 20, 30) and dry.removed_chunks
    assert len(os.listdir(os.path.join(ckpt, SHARED_DIR))) == 5  # nothing removed
    real = tools.prune_steps(ckpt, keep_last=1)
    assert real.deleted == (10, 20, 30) and real.failed == ()
    # The adapters of steps 20 and 30 go; the base and step 40's adapter stay.
    assert set(real.removed_chunks) == set(dry.removed_chunks) == {
        f.path for s in (20, 30) for f in m[s].shared} - {f.path for f in m[40].shared}
    assert real.removed_chunk_bytes == 2 * 64 * 64 * 4
    assert real.to_json()["removed_chunks"] == list(real.removed_chunks)
    assert sorted(os.listdir(os.path.join(ckpt, SHARED_DIR))) == sorted(
        f.path.rpartition("/")[2] for f in m[40].shared)
    assert_reuse_restores(ckpt, 40)


def test_prune_incomplete_removes_unreferenced_chunks(ckpt: str) -> None:
    leftover = os.path.join(ckpt, SHARED_DIR, "ab" * 16)
    Path(leftover).write_bytes(b"x" * 100)  # a chunk no step lists (a crashed save's)
    temp = os.path.join(ckpt, SHARED_DIR, "cd" * 16 + ".tmp-0123456789ab")
    Path(temp).write_bytes(b"y" * 7)
    foreign = os.path.join(ckpt, SHARED_DIR, "README")
    Path(foreign).write_text("not a chunk")
    r = tools.prune_steps(ckpt, incomplete=True)
    assert r.deleted == () and set(r.removed_chunks) == {
        f"{SHARED_DIR}/{'ab' * 16}", f"{SHARED_DIR}/{'cd' * 16}.tmp-0123456789ab"}
    assert r.removed_chunk_bytes == 107
    assert os.path.exists(foreign)  # never ours: never removed
    for s in STEPS:
        assert_reuse_restores(ckpt, s)


def test_export_of_a_reuse_step(template: str, tmp_path: Path) -> None:
    out = tmp_path / "w.pt"
    r = tools.export_step(template, 40, out, only="model")
    assert r.num_tensors == 3
    got = torch.load(out, weights_only=True)
    for k, v in reuse_state(40)["model"].items():
        assert torch.equal(got[k], v), k


def test_export_names_a_damaged_shared_chunk(ckpt: str, tmp_path: Path) -> None:
    bad = base_chunks(ckpt)[0]
    flip_byte(os.path.join(ckpt, bad), 17)
    with pytest.raises(CorruptCheckpointError, match=bad):
        tools.export_step(ckpt, 20, tmp_path / "w.pt")
    assert not (tmp_path / "w.pt").exists()


def test_copy_to_and_from_a_store_without_rename(template: str, tmp_path: Path) -> None:
    """memory:// (no rename, as object stores): chunks are written in place, the manifest last;
    the copy restores and copies back to a local root."""
    import fsspec

    mem = f"memory://reuse-tools/{uuid.uuid4().hex}"
    try:
        results = tools.copy_steps(template, mem, [30, 40])
        assert [(r.shared_copied, r.shared_present) for r in results] == [(3, 0), (1, 2)]
        assert tools.shared_usage(mem).chunks == 4
        assert all(r.ok for r in tools.verify_steps(mem, all_steps=True))
        assert_reuse_restores(mem, 40)
        back = str(tmp_path / "back")
        tools.copy_steps(mem, back, [40])
        assert_reuse_restores(back, 40)
    finally:
        fsspec.filesystem("memory").rm(mem.removeprefix("memory://"), recursive=True)


def test_export_names_a_missing_shared_chunk(ckpt: str, tmp_path: Path) -> None:
    gone = base_chunks(ckpt)[0]
    os.remove(os.path.join(ckpt, gone))
    with pytest.raises(CorruptCheckpointError, match=f"{gone}: shared chunk is missing"):
        tools.export_step(ckpt, 30, tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


def test_export_hf_of_a_reuse_step(template: str, tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    h = tools.export_hf(template, 30, tmp_path / "hf", max_shard_size="4MiB")
    assert h.prefix == "model" and len(h.shards) >= 2
    got: dict[str, torch.Tensor] = {}
    for shard in h.shards:
        got.update(safetensors_torch.load_file(str(tmp_path / "hf" / shard)))
    for k, v in reuse_state(30)["model"].items():
        assert torch.equal(got[k], v), k
