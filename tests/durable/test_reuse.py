"""``reuse_unchanged=True`` (issue 30): unchanged tensor chunks shared across steps.

Every listed step restores bit-exact on its own whatever retention, overwrite or a crash deleted;
shared chunks go only when no committed step references them; a root mixes steps written with
and without reuse. Real files (and the S3 server for one case)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _procs import FS_GATE, Zygote, run_ranks

from ckptmgr import CheckpointManager
from ckptmgr.codec.layout import SHARED_DIR
from ckptmgr.dcp import CkptStorageReader
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage

MiB = 1 << 20


def _state(v: int) -> dict[str, Any]:
    """A frozen base (9 MiB: one 8 MiB tensor, cut into two row blocks, and several tensors of
    hundreds of KiB) and a trained part of version ``v`` (about 10%), plus values."""
    g = torch.Generator().manual_seed(0)
    t = torch.Generator().manual_seed(1000 + v)
    return {
        "base": {"emb": torch.randn(2048, 1024, generator=g),
                 **{f"layer{i}": torch.randn(256, 256, generator=g) for i in range(4)}},
        "adapter": {"a": torch.randn(256, 512, generator=t), "b": torch.randn(512, 256,
                                                                               generator=t)},
        "bias": torch.full((8,), float(v)),
        "extra": {"v": v},
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (_zeros_like(v) if isinstance(v, dict) else
                torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1)
            for k, v in state.items()}


def _assert_equal(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _assert_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def _assert_restores(mgr: CheckpointManager, step: int, v: int) -> None:
    target = _zeros_like(_state(v))
    mgr.restore(step, target)  # verify=True: every item's checksum
    _assert_equal(target, _state(v), f"step {step}")


def _files(root: str) -> dict[str, int]:
    """Every file under local ``root``: relative path -> size (the lease file left out)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if not rel.startswith(".ckptmgr-lease"):
                out[rel] = os.path.getsize(os.path.join(d, n))
    return out


def _referenced(root: str) -> set[str]:
    """The shared chunks the committed steps' manifests list."""
    store = StepStore(open_storage(root))
    return {f.path for s in store.committed_steps() for f in store.read_manifest(s).shared}


def _chunks(root: str) -> set[str]:
    return {f"{SHARED_DIR}/{n}" for n in StepStore(open_storage(root)).storage.list_files(
        SHARED_DIR)}


def test_five_saves_keep_two_share_the_frozen_part(tmp_path: Any) -> None:
    plain, reuse = str(tmp_path / "plain"), str(tmp_path / "reuse")
    with CheckpointManager(plain, save_interval=1) as mgr:
        mgr.save(0, _state(0))
    full = sum(_files(plain).values())
    written = []
    with CheckpointManager(reuse, save_interval=1, max_to_keep=2, reuse_unchanged=True) as mgr:
        for v in range(5):
            mgr.save(v, _state(v))
            stats = mgr.last_save_stats
            assert stats is not None
            written.append(stats.bytes)
        assert mgr.all_steps() == [3, 4]
        for s in mgr.all_steps():
            _assert_restores(mgr, s, s)
        info = mgr.step_info(4)
        assert info.total_bytes < 64 << 10  # its own files: metadata, bias, values
    size = sum(_files(reuse).values())
    assert size <= 1.3 * full, (size, full)
    # The later saves write the trained part (1 MiB) and their own small files only.
    assert all(b < 1.2 * MiB for b in written[1:]), written
    assert written[0] > 9 * MiB, written
    assert _chunks(reuse) == _referenced(reuse)  # nothing unreferenced stays
    with CheckpointManager(reuse, save_interval=1, read_only=True) as ro:
        assert ro.all_steps() == [3, 4]
        _assert_restores(ro, 3, 3)
        assert ro.step_info(3).step == 3


def test_embedding_rows_rewrite_only_their_row_blocks(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    table = torch.randn(16384, 1024)  # 64 MiB: 16 row blocks of 4 MiB
    with CheckpointManager(root, save_interval=1, reuse_unchanged=True) as mgr:
        mgr.save(0, {"emb": table})
        first = mgr.last_save_stats
        assert first is not None and first.bytes >= 64 * MiB
        # 1% of the rows (or fewer), each time inside one block of 1024 rows
        for step, rows in ((1, slice(100, 264)), (2, slice(5200, 5364)), (3, slice(3000, 3070))):
            table[rows] += 1.0
            mgr.save(step, {"emb": table})
            stats = mgr.last_save_stats
            assert stats is not None
            assert 4 * MiB <= stats.bytes < 4 * MiB + (64 << 10), (step, stats.bytes)
        out = {"emb": torch.zeros_like(table)}
        mgr.restore(3, out)
        assert torch.equal(out["emb"], table)
    # Two rows in two blocks: two blocks written.
    with CheckpointManager(root, save_interval=1, reuse_unchanged=True) as mgr:
        table[[10, 9000]] -= 1.0
        mgr.save(4, {"emb": table})
        stats = mgr.last_save_stats
        assert stats is not None and 8 * MiB <= stats.bytes < 8 * MiB + (64 << 10)


def test_overwrite_keeps_one_version_and_drops_its_chunks(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, overwrite=True, reuse_unchanged=True) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.save(2, _state(3), force=True)  # replaces step 2's adapter chunks
        _assert_restores(mgr, 1, 1)
        _assert_restores(mgr, 2, 3)
    assert _chunks(root) == _referenced(root)


def test_a_root_mixes_steps_with_and_without_reuse(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, _state(1))
    with CheckpointManager(root, save_interval=1, reuse_unchanged=True) as mgr:
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))
    manifests = {s: json.loads((tmp_path / "run" / str(s) / "commit.json").read_text())
                 for s in (1, 2, 3)}
    assert manifests[1]["format_version"] == 1 and "shared" not in manifests[1]
    assert manifests[3]["format_version"] == 2 and manifests[3]["shared"]
    # Retention of a manager without reuse removes reuse steps, and then their chunks.
    with CheckpointManager(root, save_interval=1, max_to_keep=2) as mgr:
        for s in (1, 2, 3):
            _assert_restores(mgr, s, s)
        mgr.save(4, _state(4))
        assert mgr.all_steps() == [3, 4]
        _assert_restores(mgr, 3, 3)
        _assert_restores(mgr, 4, 4)
    assert _chunks(root) == _referenced(root) != set()
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as mgr:
        mgr.save(5, _state(5))
        assert mgr.all_steps() == [5]
    assert _chunks(root) == set()  # step 5 was saved whole: no step references a chunk


def test_plain_dcp_load_reads_a_reuse_step(tmp_path: Any) -> None:
    root = tmp_path / "run"
    with CheckpointManager(str(root), save_interval=1, reuse_unchanged=True) as mgr:
        mgr.save(7, _state(7))
    target = _zeros_like(_state(7))
    del target["extra"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.load(target, storage_reader=CkptStorageReader(str(root / "7")))
    want = _state(7)
    del want["extra"]
    _assert_equal(target, want)


def test_async_process_mode_shares_chunks(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, max_to_keep=2, reuse_unchanged=True,
                           async_mode="process") as mgr:
        for v in range(3):
            mgr.save_async(v, _state(v))
        mgr.join()
        stats = mgr.last_save_stats
        assert stats is not None and stats.bytes < 1.2 * MiB
        assert mgr.all_steps() == [1, 2]
        _assert_restores(mgr, 1, 1)
        _assert_restores(mgr, 2, 2)
    assert _chunks(root) == _referenced(root)


def test_clean_up_keeps_every_chunk_when_a_manifest_is_unreadable(tmp_path: Any) -> None:
    root = tmp_path / "run"
    with CheckpointManager(str(root), save_interval=1, reuse_unchanged=True) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    stray = root / SHARED_DIR / ("0" * 32)
    stray.write_bytes(b"x")  # unreferenced: a crash's leftover
    leftover_tmp = root / SHARED_DIR / ("1" * 32 + ".tmp-0123456789ab")
    leftover_tmp.write_bytes(b"y")
    foreign = root / SHARED_DIR / "notes.txt"
    foreign.write_bytes(b"mine")
    (root / "1" / "commit.json").write_bytes(b"{not json")
    store = StepStore(open_storage(str(root)), fence=lambda: None)
    assert store.remove_unreferenced_chunks() == []  # step 1 might reference any chunk
    assert stray.exists()
    (root / "1" / "commit.json").unlink()
    removed = store.remove_unreferenced_chunks()
    assert not stray.exists() and not leftover_tmp.exists() and foreign.exists()
    assert f"{SHARED_DIR}/{'0' * 32}" in removed
    assert _chunks(str(root)) - {f"{SHARED_DIR}/notes.txt"} == _referenced(str(root))
    with CheckpointManager(str(root), save_interval=1, read_only=True) as ro:
        _assert_restores(ro, 2, 2)


def test_restore_names_a_missing_chunk(tmp_path: Any) -> None:
    from ckptmgr.errors import CorruptCheckpointError

    root = tmp_path / "run"
    with CheckpointManager(str(root), save_interval=1, reuse_unchanged=True) as mgr:
        mgr.save(1, _state(1))
    gone = sorted(_referenced(str(root)))[0]
    (root / gone).unlink()
    with (CheckpointManager(str(root), save_interval=1, read_only=True) as ro,
          pytest.raises(CorruptCheckpointError, match=gone)):
        _assert_restores(ro, 1, 1)


@pytest.fixture
def s3_root(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = request.getfixturevalue("moto_s3")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"s3://ckpt-tests/{uuid.uuid4().hex}"
    yield url
    fs = server.fs()
    path = url.split("://", 1)[1]
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_reuse_on_s3(s3_root: str) -> None:
    with CheckpointManager(s3_root, save_interval=1, max_to_keep=2, reuse_unchanged=True) as mgr:
        for v in range(4):
            mgr.save(v, _state(v))
        stats = mgr.last_save_stats
        assert stats is not None and stats.bytes < 1.2 * MiB
        assert mgr.all_steps() == [2, 3]
        _assert_restores(mgr, 2, 2)
        _assert_restores(mgr, 3, 3)
    fs, path = fsspec.core.url_to_fs(s3_root)
    fs.invalidate_cache()
    chunks = {p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1]
              for p in fs.find(f"{path}/{SHARED_DIR}")}
    store = StepStore(open_storage(s3_root))
    referenced = {f.path for s in store.committed_steps() for f in store.read_manifest(s).shared}
    assert chunks == referenced


def test_interpreter_exit_waits_for_a_reuse_commit(tmp_path: Any, zygote: Zygote) -> None:
    """The save in flight at interpreter exit writes its chunks and commits (its chunk writers
    are not concurrent.futures', which refuse work once the interpreter exits)."""
    root = str(tmp_path / "run")
    code = ("import sys, torch, ckptmgr\n"
            "m = ckptmgr.CheckpointManager(sys.argv[1], save_interval=1, reuse_unchanged=True)\n"
            "m.save_async(7, {'w': torch.arange(1 << 21, dtype=torch.float32)})\n")
    out = zygote.run([root], code=code, timeout=180)
    assert out.returncode == 0, out.stderr
    with CheckpointManager(root, save_interval=1, read_only=True) as ro:
        assert ro.all_steps() == [7]
        target = {"w": torch.zeros(1 << 21)}
        ro.restore(7, target)
        assert torch.equal(target["w"], torch.arange(1 << 21, dtype=torch.float32))
    assert _referenced(root) and _chunks(root) == _referenced(root)


# ------------------------------------------------------------------ two ranks, DTensor shards


def _global(v: int) -> dict[str, torch.Tensor]:
    """The global tensors of version ``v``: zeros (both ranks' shards hold the same bytes, so
    both write one chunk at once), a frozen base and a trained part."""
    return {"zeros": torch.zeros(1024, 1024),
            "base": torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0)),
            "trained": torch.randn(512, 256, generator=torch.Generator().manual_seed(v))}


def _ranks_save(rank: int, world: int, root: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    written = []
    with CheckpointManager(root, save_interval=1, reuse_unchanged=True, max_to_keep=2,
                           save_on_close=False) as mgr:
        for v in (1, 2, 3):
            state = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in _global(v).items()}
            mgr.save(v, {"model": state, "replicated": torch.full((64, 64), float(v))})
            stats = mgr.last_save_stats
            assert stats is not None
            written.append(stats.bytes)
        target = {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)])
                  for k, t in _global(3).items()}
        mgr.restore(2, {"model": target})
        for k, t in _global(2).items():
            assert torch.equal(target[k].full_tensor(), t), k
    return written


def test_two_ranks_share_shards_and_restore_at_another_world_size(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    written = run_ranks(_ranks_save, 2, root, timeout_s=180)
    assert all(w[1] <= 320 << 10 and w[2] <= 320 << 10 for w in written), written  # trained
    with CheckpointManager(root, save_interval=1, read_only=True) as ro:  # world size 1
        assert ro.all_steps() == [2, 3]
        for step in (2, 3):
            target = {"model": {k: torch.zeros_like(t) for k, t in _global(step).items()},
                      "replicated": torch.zeros(64, 64)}
            ro.restore(step, target)
            _assert_equal(target["model"], _global(step), f"step {step}")
            assert torch.equal(target["replicated"], torch.full((64, 64), float(step)))
    assert _chunks(root) - _referenced(root) <= {
        p for p in _chunks(root) if ".tmp-" in p}  # a rank that lost the race left its temporary


# ---------------------------------------------------------------------------- SIGKILL loop

# A writer saves two steps with reuse and retention, then arms the file-system gate (tests/_procs:
# its ``kill_at``-th call that changes or syncs files blocks until the test SIGKILLs it) and keeps
# saving; kill_at=0 counts the calls of one save instead.
_WRITER = FS_GATE + "import torch\nfrom typing import Any\n" + inspect.getsource(_state) + r"""
import sys, ckptmgr

root, first, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mgr = ckptmgr.CheckpointManager(root, save_interval=1, max_to_keep=2, reuse_unchanged=True,
                                chkpt_on_preemption=False)
for v in (first, first + 1):
    mgr.save(v, _state(v))
count = arm(kill_at)
v = first + 2
while True:
    print("begin", v, flush=True)
    mgr.save(v, _state(v))
    print("done", v, flush=True)
    if kill_at == 0:
        print("calls", count[0], flush=True)
        sys.exit(0)
    v += 1
"""


def _writer(zygote: Zygote, root: str, first: int, kill_at: int) -> list[tuple[str, int]]:
    run = zygote.spawn([root, str(first), str(kill_at)], code=_WRITER)
    assert run.stdout is not None
    seen: list[tuple[str, int]] = []
    while line := run.stdout.readline():
        word, arg = line.split()
        if word == "gate":
            run.kill()
            seen.append((word, 0))
            break
        seen.append((word, int(arg)))
    out, err = run.communicate(120)
    seen += [(w, int(a)) for w, a in (x.split() for x in out.splitlines())]
    assert run.returncode in (0, -signal.SIGKILL), (run.returncode, seen, err)
    return seen


@pytest.mark.slow
def test_sigkill_during_saves_with_retention_loses_nothing_committed(
        tmp_path: Any, zygote: Zygote) -> None:
    root = str(tmp_path / "run")
    counted = _writer(zygote, str(tmp_path / "count"), 0, 0)
    (calls,) = [n for w, n in counted if w == "calls"]
    assert calls >= 8, counted  # chunks, data, metadata, manifest, retention, clean-up
    # Every call of a save gets a kill, up to 12 spread over them (each run takes ~1 s).
    kills = sorted({1 + i * (calls - 1) // 11 for i in range(12)} if calls > 12
                   else set(range(1, calls + 1)))
    for n, kill_at in enumerate(kills):
        first = 10 * (n + 1)
        seen = _writer(zygote, root, first, kill_at)
        assert ("gate", 0) in seen, seen
        with CheckpointManager(root, save_interval=1, read_only=True) as ro:
            steps = ro.all_steps()
            assert steps and steps[-1] >= first + 1, (kill_at, steps)
            for s in steps:
                _assert_restores(ro, s, s)  # every listed step whole, bit-exact
    # The next clean save removes whatever the crashes left unreferenced.
    with CheckpointManager(root, save_interval=1, max_to_keep=2, reuse_unchanged=True) as mgr:
        last = max(mgr.all_steps()) + 1
        mgr.save(last, _state(last))
        for s in mgr.all_steps():
            _assert_restores(mgr, s, s)
    assert _chunks(root) == _referenced(root)
    assert not [p for p in _files(root) if p.startswith(".tmp-")]
