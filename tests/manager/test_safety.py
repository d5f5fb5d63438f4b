"""Safe loading (DESIGN.md section 5).

Confined paths, no symlinks, canonical step names, pickle only on opt-in, bounded manifests, and
credentials that never leak.

Reads are observed with a process-wide audit hook (``open`` events, PEP 578), so "nothing outside
the step directory is read" is checked on what the process really opened, not on what the code
says it does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from _metadata import metadata_doc

from ckptmgr import (
    CheckpointManager,
    CheckpointNotFoundError,
    CkptmgrError,
    CorruptCheckpointError,
    RestoreError,
    UnsafeCheckpointError,
)
from ckptmgr.lease import LEASE_NAME

# ------------------------------------------------------------------------------------ helpers


def _checksum(data: bytes) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def _state(seed: int) -> dict[str, Any]:
    return {"w": torch.arange(8, dtype=torch.float32) + seed, "v": [seed, "tag"]}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(8), "v": None}


def _save_steps(root: str, *steps: int) -> None:
    with CheckpointManager(root, save_interval=1) as mgr:
        for s in steps:
            mgr.save(s, _state(s))


def _manifest(root: str, step: int | str) -> dict[str, Any]:
    with open(os.path.join(root, str(step), "commit.json"), "rb") as f:
        return json.loads(f.read())  # type: ignore[no-any-return]


def _write_manifest(root: str, step: int | str, doc: dict[str, Any]) -> None:
    doc["total_bytes"] = sum(f["size"] for f in doc["files"])
    with open(os.path.join(root, str(step), "commit.json"), "w") as f:
        json.dump(doc, f)


def _data_name(doc: dict[str, Any]) -> str:
    (name,) = [f["path"] for f in doc["files"] if f["path"].startswith("data-")]
    return name


def _replace_metadata(root: str, step: int, mutate: Callable[[dict[str, Any]], bytes | None],
                      ) -> None:
    """Rewrite step's metadata JSON with ``mutate`` (which edits it in place, or returns raw bytes
    to store instead) and keep the manifest's size and checksum of it consistent."""
    doc = _manifest(root, step)
    path = os.path.join(root, str(step), doc["metadata_file"])
    with open(path, "rb") as f:
        md = metadata_doc(f.read())
    raw = mutate(md)
    data = raw if raw is not None else json.dumps(md).encode()
    with open(path, "wb") as f:
        f.write(data)
    for entry in doc["files"]:
        if entry["path"] == doc["metadata_file"]:
            entry["size"], entry["checksum"] = len(data), _checksum(data)
    _write_manifest(root, step, doc)


_EVENTS: list[tuple[str, int]] | None = None
_HOOKED = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _EVENTS is None or event != "open" or not args:
        return
    path = args[0]
    if isinstance(path, (str, bytes, os.PathLike)):
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        _EVENTS.append((os.path.abspath(os.fsdecode(path)), flags))


@pytest.fixture
def opened() -> Iterator[list[tuple[str, int]]]:
    """Every path this process opens while the test runs: (absolute path, open flags)."""
    global _EVENTS, _HOOKED
    if not _HOOKED:  # audit hooks cannot be removed: install one, once, that is off by default
        sys.addaudithook(_audit)
        _HOOKED = True
    _EVENTS = []
    try:
        yield _EVENTS
    finally:
        _EVENTS = None


def _resolved(path: str, flags: int) -> str:
    """Where an open of ``path`` lands: O_NOFOLLOW does not follow a link in the last part."""
    if flags & getattr(os, "O_NOFOLLOW", 0):
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return os.path.realpath(path)


def _within(path: str, directory: str) -> bool:
    directory = os.path.realpath(directory)
    return path == directory or path.startswith(directory + os.sep)


def _opened_outside(events: list[tuple[str, int]], base: Path, allowed: str) -> list[str]:
    """Opens under ``base`` (the test's files) that reached anything outside ``allowed``."""
    out = []
    for path, flags in events:
        where = _resolved(path, flags)
        if (_within(path, str(base)) or _within(where, str(base))) and not _within(where, allowed):
            out.append(f"{path} -> {where}")
    return out


# ------------------------------------------------------------------ paths that escape the step

# Each rewrites step 1 so that it points at a file of step 2 (a real, readable file outside step 1).
def _escape_data_in_manifest(root: str, how: str) -> None:
    doc, other = _manifest(root, 1), _manifest(root, 2)
    target = _data_name(other)
    bad = {"dotdot": f"../2/{target}", "inner": f"x/../../2/{target}",
           "absolute": os.path.join(root, "2", target), "backslash": f"..\\2\\{target}"}[how]
    name = _data_name(doc)
    for entry in doc["files"]:
        if entry["path"] == name:
            entry["path"] = bad
    _write_manifest(root, 1, doc)


def _escape_metadata_file(root: str, how: str) -> None:
    doc, other = _manifest(root, 1), _manifest(root, 2)
    bad = {"dotdot": f"../2/{other['metadata_file']}",
           "absolute": os.path.join(root, "2", other["metadata_file"])}[how]
    entry = next(f for f in other["files"] if f["path"] == other["metadata_file"])
    doc["files"] = [f for f in doc["files"] if f["path"] != doc["metadata_file"]]
    doc["files"].append({**entry, "path": bad})
    doc["metadata_file"] = bad
    _write_manifest(root, 1, doc)


def _escape_data_in_metadata(root: str, how: str) -> None:
    other = os.path.join(root, "2", _data_name(_manifest(root, 2)))
    bad = {"dotdot": os.path.relpath(other, os.path.join(root, "1")), "absolute": other,
           "file-url": f"file://{other}"}[how]

    def mutate(md: dict[str, Any]) -> None:
        for item in md["storage"]:
            item["file"] = bad

    _replace_metadata(root, 1, mutate)


def _symlinked_subdirectory(root: str, how: str) -> None:
    """``1/sub`` links to step 2; the manifest names step 2's metadata through it. Every name is
    a plain relative path, so only refusing to follow links keeps the read inside step 1."""
    os.symlink(os.path.join(root, "2"), os.path.join(root, "1", "sub"))
    doc, other = _manifest(root, 1), _manifest(root, 2)
    doc["files"] = [{**f, "path": f"sub/{f['path']}"} for f in other["files"]]
    doc["metadata_file"] = f"sub/{other['metadata_file']}"
    _write_manifest(root, 1, doc)


ESCAPES = [
    pytest.param(_escape_data_in_manifest, "dotdot", id="manifest-file-dotdot"),
    pytest.param(_escape_data_in_manifest, "inner", id="manifest-file-inner-dotdot"),
    pytest.param(_escape_data_in_manifest, "absolute", id="manifest-file-absolute"),
    pytest.param(_escape_data_in_manifest, "backslash", id="manifest-file-backslash"),
    pytest.param(_escape_metadata_file, "dotdot", id="manifest-metadata-dotdot"),
    pytest.param(_escape_metadata_file, "absolute", id="manifest-metadata-absolute"),
    pytest.param(_escape_data_in_metadata, "dotdot", id="metadata-file-dotdot"),
    pytest.param(_escape_data_in_metadata, "absolute", id="metadata-file-absolute"),
    pytest.param(_escape_data_in_metadata, "file-url", id="metadata-file-url"),
]
SYMLINKED_SUBDIR = pytest.param(_symlinked_subdirectory, "", id="symlinked-subdirectory")


def _escape_setup(tmp_path: Path, forge: Callable[[str, str], None], how: str) -> str:
    root = str(tmp_path / "run")
    _save_steps(root, 1, 2)
    forge(root, how)
    return root


@pytest.mark.parametrize("forge,how", [
    *ESCAPES,
    SYMLINKED_SUBDIR,
])
def test_escaping_path_is_refused_before_any_read_outside_the_step(
        tmp_path: Path, opened: list[tuple[str, int]], forge: Callable[[str, str], None],
        how: str) -> None:
    root = _escape_setup(tmp_path, forge, how)
    with CheckpointManager(root, save_interval=1) as mgr:
        assert mgr.all_steps() == [1, 2]  # listed: a manifest exists ...
        opened.clear()
        target = _target()
        with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)) as ei:
            mgr.restore(1, target)  # ... but never loaded
        assert ei.value.step == 1
        assert torch.equal(target["w"], torch.zeros(8)) and target["v"] is None
        assert _opened_outside(opened, tmp_path, os.path.join(root, "1")) == []
        out = {"w": torch.zeros(8), "v": None}
        mgr.restore(2, out)  # the step it pointed at is fine
        assert torch.equal(out["w"], _state(2)["w"])


@pytest.mark.parametrize("forge,how", [*ESCAPES, SYMLINKED_SUBDIR])
def test_escaping_path_is_unsafe_checkpoint_error(
        tmp_path: Path, forge: Callable[[str, str], None], how: str) -> None:
    root = _escape_setup(tmp_path, forge, how)
    with CheckpointManager(root, save_interval=1) as mgr:
        with pytest.raises(UnsafeCheckpointError, match="step directory"):
            mgr.restore(1, _target())
        if forge is not _escape_data_in_metadata:  # the manifest itself is bad: step_info says so
            with pytest.raises(UnsafeCheckpointError):
                mgr.step_info(1)


# ------------------------------------------------------------------------------------ symlinks


def test_symlinked_step_directory_is_never_listed_read_or_deleted(
        tmp_path: Path, opened: list[tuple[str, int]]) -> None:
    root, elsewhere = str(tmp_path / "run"), str(tmp_path / "elsewhere")
    _save_steps(root, 1)
    _save_steps(elsewhere, 5, 7)
    os.symlink(os.path.join(elsewhere, "5"), os.path.join(root, "5"))  # older than the newest
    os.symlink(os.path.join(elsewhere, "7"), os.path.join(root, "7"))
    # A link named like a staging directory of a crashed save: cleanup removes the link only.
    os.makedirs(os.path.join(elsewhere, "keep"))
    (tmp_path / "elsewhere" / "keep" / "precious.txt").write_text("x")
    os.symlink(os.path.join(elsewhere, "keep"), os.path.join(root, ".tmp-3-0123456789ab"))
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as mgr:
        assert mgr.all_steps() == [1]
        opened.clear()
        for step in (5, 7):
            with pytest.raises(UnsafeCheckpointError, match="link"):
                mgr.restore(step, _target())
            with pytest.raises(UnsafeCheckpointError, match="link"):
                mgr.step_info(step)
        assert _opened_outside(opened, tmp_path, root) == []
        mgr.save(9, _state(9))  # retention and leftover cleanup run: links are not ours
        mgr.save(10, _state(10))
        assert mgr.all_steps() == [10]
    assert os.path.islink(os.path.join(root, "5")) and os.path.islink(os.path.join(root, "7"))
    assert (tmp_path / "elsewhere" / "keep" / "precious.txt").read_text() == "x"
    with CheckpointManager(elsewhere, save_interval=1) as other:
        assert other.all_steps() == [5, 7]  # nothing was deleted through the links
        out = _target()
        other.restore(5, out)
        assert out["v"] == [5, "tag"]


def test_symlinked_file_inside_a_step_is_not_followed(
        tmp_path: Path, opened: list[tuple[str, int]]) -> None:
    root = str(tmp_path / "run")
    _save_steps(root, 1, 2)
    # Step 2's data file has the same size and checksum as step 1's would need: only the
    # link stands between restore and reading it.
    name1, name2 = _data_name(_manifest(root, 1)), _data_name(_manifest(root, 2))
    os.unlink(os.path.join(root, "1", name1))
    os.symlink(os.path.join(root, "2", name2), os.path.join(root, "1", name1))
    with CheckpointManager(root, save_interval=1) as mgr:
        opened.clear()
        target = _target()
        with pytest.raises(RestoreError):
            mgr.restore(1, target)
        assert torch.equal(target["w"], torch.zeros(8))
        assert _opened_outside(opened, tmp_path, os.path.join(root, "1")) == []


def test_symlinked_metadata_file_is_unsafe(tmp_path: Path,
                                           opened: list[tuple[str, int]]) -> None:
    root = str(tmp_path / "run")
    _save_steps(root, 1, 2)
    md1, md2 = _manifest(root, 1)["metadata_file"], _manifest(root, 2)["metadata_file"]
    os.unlink(os.path.join(root, "1", md1))
    os.symlink(os.path.join(root, "2", md2), os.path.join(root, "1", md1))
    with CheckpointManager(root, save_interval=1) as mgr:
        opened.clear()
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore(1, _target())
        assert _opened_outside(opened, tmp_path, os.path.join(root, "1")) == []


# --------------------------------------------------------------------------- step names


@pytest.mark.parametrize("name", ["007", "07", "+7", "7.0", " 7", "7 ", "0x7", "\u0667", "7_0"])
def test_non_canonical_step_directory_is_never_listed_restored_or_deleted(
        tmp_path: Path, opened: list[tuple[str, int]], name: str) -> None:
    root = str(tmp_path / "run")
    _save_steps(root, 7)
    os.rename(os.path.join(root, "7"), os.path.join(root, name))  # a complete, valid step 7
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as mgr:
        assert mgr.all_steps() == [] and mgr.latest_step() is None
        opened.clear()
        with pytest.raises(CheckpointNotFoundError) as ei:
            mgr.restore(7, _target())
        assert ei.value.available == []
        with pytest.raises(CheckpointNotFoundError):
            mgr.step_info(7)
        assert [p for p, _ in opened if _within(p, os.path.join(root, name))] == []
        mgr.save(8, _state(8))
        mgr.save(9, _state(9))  # retention and leftover cleanup leave it alone: not ours
        assert mgr.all_steps() == [9]
    assert sorted(os.listdir(root)) == sorted([name, "9"])
    assert os.path.isfile(os.path.join(root, name, "commit.json"))


def test_canonical_step_is_restored_not_its_non_canonical_twin(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    _save_steps(root, 7)
    shutil.copytree(os.path.join(root, "7"), os.path.join(root, "007"))
    with CheckpointManager(root, save_interval=1) as mgr:
        assert mgr.all_steps() == [7]
        shutil.rmtree(os.path.join(root, "007"))  # proves nothing reads it below
        out = _target()
        mgr.restore(7, out)
        assert out["v"] == [7, "tag"]


# ------------------------------------------------------------------------------------- pickle


class Planted:
    """An object whose unpickling runs code: it creates the directory ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


def test_pickled_value_needs_trusted_before_any_data_io(
        tmp_path: Path, opened: list[tuple[str, int]]) -> None:
    root = str(tmp_path / "run")
    sentinel = tmp_path / "ran"
    with CheckpointManager(root, save_interval=1) as mgr:
        with pytest.raises(UnsafeCheckpointError, match="trusted=True"):
            mgr.save(1, {"w": torch.ones(2), "obj": Planted(str(sentinel))})
        # nothing written (the root holds only the writer lease)
        assert not os.path.isdir(root) or os.listdir(root) == [LEASE_NAME]
        mgr.save(1, {"w": torch.ones(2), "obj": Planted(str(sentinel))}, trusted=True)
        opened.clear()
        target: dict[str, Any] = {"w": torch.zeros(2), "obj": "untouched"}
        with pytest.raises(UnsafeCheckpointError, match="trusted=True") as ei:
            mgr.restore(1, target)
        assert "obj" in str(ei.value)
        data_opens = [p for p, _ in opened if os.path.basename(p).startswith("data-")]
        assert data_opens == []  # refused before any data file was opened
        assert torch.equal(target["w"], torch.zeros(2)) and target["obj"] == "untouched"
        assert not sentinel.exists()
        mgr.restore(1, {"w": target["w"]})  # the tensors alone need no trust
        assert torch.equal(target["w"], torch.ones(2)) and not sentinel.exists()


def _planted_root(tmp_path: Path, sentinel: Path) -> tuple[str, bytes]:
    """A root where a pickle that creates ``sentinel`` sits in every place ckptmgr might read.

    Steps (all listed, as each has a commit.json):
      9  commit.json is a pickle
      10 a valid manifest whose metadata file is a pickle (size and checksum consistent)
      11 a genuine checkpoint whose value "v" is stored with pickle (saved with trusted=True)
      12 like 11, but the metadata claims "v" is tagged JSON
      13 a valid manifest whose data file is a pickle, sizes and checksums consistent
    Elsewhere: DCP-style ``.metadata`` and ``__0_0.distcp`` files, a root-level commit.json, a
    staging directory and a non-canonical step directory holding pickles.
    """
    root = str(tmp_path / "run")
    payload = pickle.dumps(Planted(str(sentinel)))
    with CheckpointManager(root, save_interval=1) as mgr:
        for s in (10, 11, 12, 13):
            mgr.save(s, {"w": torch.ones(4), "v": Planted(str(sentinel))}, trusted=True,
                     metrics={"loss": float(s)})
    os.makedirs(os.path.join(root, "9"))
    with open(os.path.join(root, "9", "commit.json"), "wb") as f:
        f.write(payload)
    _replace_metadata(root, 10, lambda md: payload)

    def json_claim(md: dict[str, Any]) -> None:
        for item in md["storage"]:
            if item["fqn"] == "v":
                item["enc"] = "json"

    _replace_metadata(root, 12, json_claim)
    doc = _manifest(root, 13)
    name = _data_name(doc)
    with open(os.path.join(root, "13", name), "wb") as f:
        f.write(payload)
    for entry in doc["files"]:
        if entry["path"] == name:
            entry["size"], entry["checksum"] = len(payload), _checksum(payload)
    _write_manifest(root, 13, doc)
    os.makedirs(os.path.join(root, ".tmp-14-0123456789ab"))
    os.makedirs(os.path.join(root, "015"))
    for rel in (".metadata", "commit.json", "9/.metadata", "11/.metadata", "11/__0_0.distcp",
                ".tmp-14-0123456789ab/commit.json", ".tmp-14-0123456789ab/.metadata",
                "015/commit.json", "015/.metadata"):
        with open(os.path.join(root, rel), "wb") as f:
            f.write(payload)
    return root, payload


def test_no_planted_pickle_runs_on_construction_listing_info_or_restore(tmp_path: Path) -> None:
    sentinel = tmp_path / "pickle-ran"
    root, payload = _planted_root(tmp_path, sentinel)
    assert not sentinel.exists()
    # best_metric and keep_time_interval make the constructor read every manifest.
    kwargs: dict[str, Any] = dict(save_interval=1, max_to_keep=1, best_metric="loss",
                                  keep_time_interval=3600.0)
    with CheckpointManager(root, **kwargs) as mgr:
        assert mgr.all_steps() == [9, 10, 11, 12, 13]
        assert mgr.latest_step() == 13
        assert mgr.best_step() == 10
        with pytest.raises(CorruptCheckpointError):
            mgr.step_info(9)
        for step in (10, 11, 12, 13):
            assert mgr.step_info(step).step == step
        for step in (9, 10, 11, 12, 13):
            for target in ({"v": None}, {"w": torch.zeros(4), "v": None}):
                with pytest.raises(RestoreError):
                    mgr.restore(step, target)
        for step in (9, 10, 13):  # even the tensor alone: the metadata or the bytes are bad
            with pytest.raises(CorruptCheckpointError):
                mgr.restore(step, {"w": torch.zeros(4)})
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore(11, {"v": None})
        assert not sentinel.exists()
    # A second pass: construction, retention and leftover cleanup.
    with CheckpointManager(root, save_interval=1, max_to_keep=1, best_metric="loss") as mgr:
        mgr.save(20, {"w": torch.ones(4)}, metrics={"loss": 0.0})
        # 9 and 11 also held plain-DCP files: retention deleted our manifest and files and left
        # those, so they are now listed as plain-DCP steps (never written or deleted by us).
        assert mgr.all_steps() == [9, 11, 20]
        assert mgr.step_info(11).format == "dcp"
    assert not sentinel.exists()
    for rel in (".metadata", "commit.json", "015/commit.json"):  # not ours: left alone
        assert os.path.isfile(os.path.join(root, rel)), rel
    # The control: the payload is live, and trusted=True is the one way to run it.
    pickle.loads(payload)
    assert sentinel.is_dir()


def test_trusted_restore_is_the_only_way_a_stored_pickle_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "pickle-ran"
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, {"v": Planted(str(sentinel))}, trusted=True)
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore(1, {"v": None})
        assert not sentinel.exists()
        mgr.restore(1, {"v": None}, trusted=True)
    assert sentinel.is_dir()


# ----------------------------------------------------------------------- bounded manifests


def _peak_bytes(fn: Callable[[], object]) -> int:
    """Peak traced allocation above the baseline while ``fn`` runs (its exception swallowed)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with contextlib.suppress(CkptmgrError):
            fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _oversized_manifest(root: str) -> int:
    _save_steps(root, 1)
    doc = _manifest(root, 1)
    doc["metadata"] = {"pad": "x" * (17 << 20)}  # valid in every way but its size
    _write_manifest(root, 1, doc)
    return os.path.getsize(os.path.join(root, "1", "commit.json"))


def test_oversized_manifest_is_corrupt(local_root: str) -> None:
    size = _oversized_manifest(local_root)
    assert size > 16 << 20
    with CheckpointManager(local_root, save_interval=1, max_to_keep=2, best_metric="loss") as mgr:
        assert mgr.all_steps() == [1]  # construction reads it (for best_metric): tolerated
        with pytest.raises(CorruptCheckpointError, match="limit") as ei:
            mgr.step_info(1)
        assert ei.value.path == "commit.json"
        with pytest.raises(CorruptCheckpointError, match="limit"):
            mgr.restore(1, _target())


def test_oversized_manifest_is_rejected_without_reading_it(local_root: str) -> None:
    size = _oversized_manifest(local_root)
    kwargs: dict[str, Any] = dict(save_interval=1, max_to_keep=2, best_metric="loss")
    peaks = {"construct": _peak_bytes(lambda: CheckpointManager(local_root, **kwargs).close())}
    with CheckpointManager(local_root, save_interval=1) as mgr:
        peaks["step_info"] = _peak_bytes(lambda: mgr.step_info(1))
        peaks["restore"] = _peak_bytes(lambda: mgr.restore(1, _target()))
    assert all(p < size // 8 for p in peaks.values()), (size, peaks)


def test_deeply_nested_manifest_is_rejected_before_parsing(local_root: str) -> None:
    _save_steps(local_root, 1)
    # Depth 900 stays under Python's recursion limit, so only our own depth check stops the JSON
    # parser from building ~60 bytes of lists per byte of file.
    deep = b"[" * 900 + b"]" * 900
    data = b'{"format": "ckptmgr", "pad": [' + b",".join([deep] * 1200) + b"]}"
    with open(os.path.join(local_root, "1", "commit.json"), "wb") as f:
        f.write(data)
    with CheckpointManager(local_root, save_interval=1) as mgr:
        with pytest.raises(CorruptCheckpointError, match="nested"):
            mgr.step_info(1)
        peak = _peak_bytes(lambda: mgr.step_info(1))
        assert peak < 3 * len(data), (peak, len(data))
        with pytest.raises(CorruptCheckpointError, match="nested"):
            mgr.restore(1, _target())


def test_metadata_file_larger_than_the_manifest_says_is_not_read(local_root: str) -> None:
    _save_steps(local_root, 1)
    doc = _manifest(local_root, 1)
    with open(os.path.join(local_root, "1", doc["metadata_file"]), "ab") as f:
        f.write(b" " * (32 << 20))
    with CheckpointManager(local_root, save_interval=1) as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(1, _target())
        peak = _peak_bytes(lambda: mgr.restore(1, _target()))
    assert peak < 4 << 20, peak


@pytest.mark.parametrize("field,value", [("length", 10**12), ("length", 10**6), ("pos", 10**9)])
def test_item_range_beyond_its_file_is_corrupt(local_root: str, field: str, value: int) -> None:
    _save_steps(local_root, 1)

    def stretch(md: dict[str, Any]) -> None:
        for item in md["storage"]:
            if item["fqn"] == "v":
                item[field] = value

    _replace_metadata(local_root, 1, stretch)
    with CheckpointManager(local_root, save_interval=1) as mgr, pytest.raises(
            CorruptCheckpointError):
        mgr.restore(1, _target())


# -------------------------------------------------------------------------------- credentials

SECRET = "pa55-w0rd-Secret"
TOKEN = "t0ken-Secret-value"


def test_credentials_never_in_repr_errors_logs_or_manifests(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    url = f"memory://alice:{SECRET}@host/creds-{tmp_path.name}"
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="ckptmgr"):
        mgr = CheckpointManager(url, save_interval=1, max_to_keep=1,
                                storage_options={"token": TOKEN})
        texts += [repr(mgr), str(mgr), mgr.path]
        assert "alice" not in mgr.path and "host/creds-" in mgr.path
        for s in (1, 2):
            mgr.save(s, {"w": torch.ones(2)})
        info = mgr.step_info(2)
        texts += [repr(info), json.dumps(dict(info.metadata)), json.dumps(dict(info.versions))]
        for call in (lambda: mgr.restore(5, {"w": torch.zeros(2)}),
                     lambda: mgr.save(2, {"w": torch.ones(2)}, force=True),
                     lambda: mgr.restore(2, {"x": torch.zeros(2)})):
            with pytest.raises(CkptmgrError) as ei:
                call()
            texts.append(str(ei.value))
        mgr.close()
    texts += [r.getMessage() for r in caplog.records]
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in fs.find(f"/alice:{SECRET}@host/creds-{tmp_path.name}"):
        if path.endswith((".json",)):
            texts.append(fs.cat_file(path).decode())
    fs.rm(f"/alice:{SECRET}@host/creds-{tmp_path.name}", recursive=True)
    assert len(texts) > 10
    for text in texts:
        assert SECRET not in text and TOKEN not in text, text


def test_credentials_never_in_config_repr(tmp_path: Path) -> None:
    url = f"memory://alice:{SECRET}@host/creds-{tmp_path.name}"
    with CheckpointManager(url, save_interval=1, storage_options={"token": TOKEN}) as mgr:
        texts = [repr(mgr.config), str(mgr.config)]
    for text in texts:
        assert SECRET not in text and TOKEN not in text, text
        assert "host/creds-" in text  # the rest of the URL is still shown
