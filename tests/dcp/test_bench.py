"""The fast byte path (streams, coalesced writes, vectored reads) and the benchmark, end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptmgr import CheckpointManager, CorruptCheckpointError
from ckptmgr.dcp import reader, writer
from ckptmgr.dcp._streams import split_runs
from ckptmgr.errors import StorageError
from ckptmgr.storage import local
from ckptmgr.storage.local import LocalStorage

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("ckptmgr_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "big": torch.randn(300_000, generator=g),                   # split into pieces
        "mat": torch.randn(200, 300, generator=g).t(),              # non-contiguous
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),  # coalesced small items
        "ints": torch.arange(77, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "small": [torch.full((i + 1,), float(i)) for i in range(40)],
        "extra": {"epoch": 7, "name": "run"},
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, list):
            out[k] = [torch.zeros_like(t) for t in v]
        else:
            out[k] = {"epoch": 0, "name": ""}
    return out


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        elif isinstance(v, list):
            assert all(torch.equal(x, y) for x, y in zip(v, b[k], strict=True)), k
        else:
            assert v == b[k], k


@pytest.fixture
def small_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny thresholds, so a small state takes every path: several streams, coalesced batches,
    pieces of a large item, several vectored reads."""
    monkeypatch.setattr(writer, "_MIN_STREAM_BYTES", 1)
    monkeypatch.setattr(writer, "_SMALL", 4096)
    monkeypatch.setattr(writer, "_BATCH", 16384)
    monkeypatch.setattr(writer, "_PIECE", 100_000)
    monkeypatch.setattr(reader, "_MIN_STREAM_BYTES", 1)
    monkeypatch.setattr(reader, "_BATCH", 65536)
    monkeypatch.setattr(reader, "_BATCH_ITEMS", 4)


@pytest.mark.parametrize(("write_threads", "read_threads"), [(1, 1), (3, 2), (2, 5)])
def test_streams_round_trip(local_root: str, small_streams: None, monkeypatch: pytest.MonkeyPatch,
                            write_threads: int, read_threads: int) -> None:
    monkeypatch.setattr(writer, "DEFAULT_NUM_THREADS", write_threads)
    monkeypatch.setattr(reader, "DEFAULT_NUM_THREADS", read_threads)
    state = _state()
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, state)
        info = mgr.step_info(1)
        data = sorted(f.path for f in info.files if f.path.startswith("data-"))
        assert len(data) == write_threads
        assert [p.rsplit("-", 1)[1] for p in data] == [f"{i:03d}.bin" for i in range(len(data))]
        out = _zeros_like(state)
        mgr.restore(1, out)
    _assert_equal(state, out)


def test_memory_backend_uses_ranged_reads(small_streams: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "DEFAULT_NUM_THREADS", 2)
    monkeypatch.setattr(reader, "DEFAULT_NUM_THREADS", 2)
    url = f"memory://bench-tests/{uuid.uuid4().hex}"
    state = _state()
    with CheckpointManager(url, save_interval=1) as mgr:
        mgr.save(1, state)
        out = _zeros_like(state)
        mgr.restore(1, out)
    _assert_equal(state, out)


def test_async_save_with_streams(local_root: str, small_streams: None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "DEFAULT_NUM_THREADS", 2)
    monkeypatch.setattr(writer, "DEFAULT_IO_NICE", 5)  # threads of our own, reniced
    state = _state()
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save_async(1, state)
        mgr.join()
        out = _zeros_like(state)
        mgr.restore(1, out)
    _assert_equal(state, out)


def test_restore_into_non_contiguous_targets(local_root: str, small_streams: None) -> None:
    state = {"w": torch.randn(50, 60), "v": torch.randn(1000)}
    target = {"w": torch.zeros(60, 50).t(), "v": torch.zeros(2000)[::2]}
    assert not target["w"].is_contiguous() and not target["v"].is_contiguous()
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, state)
        mgr.restore(1, target)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["v"], state["v"])


def test_corruption_found_in_any_stream(local_root: str, small_streams: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "DEFAULT_NUM_THREADS", 3)
    monkeypatch.setattr(reader, "DEFAULT_NUM_THREADS", 2)
    state = _state()
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, state)
    d = os.path.join(local_root, "1")
    last = sorted(n for n in os.listdir(d) if n.startswith("data-"))[-1]
    with open(os.path.join(d, last), "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0xFF]))
    with CheckpointManager(local_root, save_interval=1) as mgr, pytest.raises(
            CorruptCheckpointError) as ei:
        mgr.restore(1, _zeros_like(state))
    assert last in str(ei.value)


def test_failed_stream_aborts_every_file(local_root: str, small_streams: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "DEFAULT_NUM_THREADS", 3)
    calls = {"n": 0}

    def flaky(real: Any) -> Any:
        def write(self: Any, *args: Any, **kwargs: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 3:
                raise StorageError("disk full (injected)")
            real(self, *args, **kwargs)
        return write

    # Every byte the buffered writer takes passes writev; every byte the direct writer copies
    # passes _copy_in (write_unbuffered's copies too, wherever they are then made).
    monkeypatch.setattr(local._LocalWriter, "writev", flaky(local._LocalWriter.writev))
    monkeypatch.setattr(local._DirectWriter, "_copy_in", flaky(local._DirectWriter._copy_in))
    with CheckpointManager(local_root, save_interval=1) as mgr:
        with pytest.raises(Exception, match="disk full"):
            mgr.save(1, _state())
        assert mgr.all_steps() == []
    leftovers = [n for _, _, names in os.walk(local_root) for n in names if n.startswith("data-")]
    assert leftovers == []


def test_split_runs() -> None:
    assert split_runs([10] * 10, 1, 1) == [0]
    assert split_runs([10] * 10, 2, 1) == [0, 5]
    assert split_runs([10] * 9, 3, 1) == [0, 3, 6]
    assert split_runs([90, 5, 5], 2, 1) == [0, 1]
    assert split_runs([10] * 10, 4, 40) == [0, 5]  # at least 40 bytes per run: two runs
    assert split_runs([5], 8, 1) == [0]


@pytest.mark.parametrize("direct", [True, False])
def test_local_vectored_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    monkeypatch.setattr(local, "_IOV_MAX", 3)
    monkeypatch.setattr(local, "_CHUNK", 10)
    monkeypatch.setattr(local, "DIRECT_IO", direct)
    storage = LocalStorage(str(tmp_path))
    w = storage.open_writer("f")
    parts = [bytes([i]) * (i % 7) for i in range(30)]
    w.writev(parts)
    w.write(b"tail" * 5)
    w.commit()
    blob = b"".join(parts) + b"tail" * 5
    assert storage.read_bytes("f") == blob
    bufs = [bytearray(n) for n in (1, 0, 25, 3, 14)]
    with storage.open_reader("f") as r:
        r.readv_into(2, [memoryview(b) for b in bufs])
    assert b"".join(bufs) == blob[2:2 + 43]
    with storage.open_reader("f") as r, pytest.raises(StorageError, match="ends at byte"):
        r.readv_into(len(blob) - 2, [memoryview(bytearray(5))])


def _direct_supported(path: Path) -> bool:
    w = LocalStorage(str(path)).open_writer("probe")
    w.abort()
    return isinstance(w, local._DirectWriter)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 4096 + 7, 10 * 65536 + 3])
def test_direct_writer_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    monkeypatch.setattr(local, "_DIRECT_BUF", 65536)  # several buffers: the I/O thread runs
    storage = LocalStorage(str(tmp_path))
    data = os.urandom(size)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else torch.empty(0)
    w = storage.open_writer("f")
    assert isinstance(w, local._DirectWriter)
    half = size // 2
    w.write(data[:half])  # read-only bytes
    if size:
        from ckptmgr.dcp.tensor_bytes import tensor_memoryview

        w.writev([tensor_memoryview(t)[half:]])  # writable memory, copied with memmove
    w.commit()
    assert storage.read_bytes("f") == data
    assert os.path.getsize(tmp_path / "f") == size


@pytest.mark.parametrize("copy_all", [False, True])
@pytest.mark.parametrize("shift", [0, 64, 1000, 4095])
def test_direct_writer_unbuffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  shift: int, copy_all: bool) -> None:
    """Writes from the caller's memory land at the offsets returned, between copied writes,
    with zero padding only; several writes in flight, pieces larger than one write split.
    With ``COPY_ALL`` (the default) the same calls copy every byte and pad nothing."""
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    monkeypatch.setattr(local, "COPY_ALL", copy_all)
    monkeypatch.setattr(local, "_SMALL_COPY", 4096)  # these items are written from memory too
    monkeypatch.setattr(local, "_DIRECT_BUF", 65536)
    monkeypatch.setattr(local, "_DIRECT_MAX_WRITE", 3 * 4096)
    from ckptmgr.dcp.tensor_bytes import tensor_memoryview

    rng = torch.Generator().manual_seed(shift)
    backing = torch.randint(0, 256, (400_000,), dtype=torch.uint8, generator=rng)
    storage = LocalStorage(str(tmp_path))
    w = storage.open_writer("f", size_hint=300_000)
    assert isinstance(w, local._DirectWriter)
    expected: list[tuple[int, bytes]] = []
    pos = 0
    for i, n in enumerate((100_000, 5, 8192, 70_001, 4096 * 9, 12_345)):
        src = backing[shift + i * 7:shift + i * 7 + n]
        w.write(b"ab" * i)  # copied bytes between the unbuffered ones
        pos += 2 * i
        start = w.write_unbuffered(tensor_memoryview(src), src)
        assert pos <= start < pos + 4096
        assert start == pos or not copy_all
        expected.append((start, bytes(src.numpy())))
        pos = start + n
    w.write(b"end")
    w.commit()
    blob = (tmp_path / "f").read_bytes()
    assert len(blob) == pos + 3 and blob.endswith(b"end")
    for start, data in expected:
        assert blob[start:start + len(data)] == data


def test_bounce_buffers_are_kept_for_the_next_file(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A committed or aborted file hands its bounce buffers (advised to use huge pages) to the
    next one; idle buffers beyond the bound are unmapped."""
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    import ctypes

    from _memory import vma_flags

    pool = local._BouncePool()
    monkeypatch.setattr(local, "_BOUNCE_POOL", pool)
    storage = LocalStorage(str(tmp_path))
    data = os.urandom(3 * (1 << 20) + 5)
    w = storage.open_writer("a", size_hint=len(data))
    assert isinstance(w, local._DirectWriter)
    maps = list(w._maps)
    assert len(maps) == local._COPY_NBUF
    addr = ctypes.addressof(ctypes.c_char.from_buffer(maps[0]))
    if hasattr(local.mmap, "MADV_HUGEPAGE"):
        assert "hg" in vma_flags(addr)
    w.write(data)
    w.commit()
    w2 = storage.open_writer("b", size_hint=len(data))
    assert isinstance(w2, local._DirectWriter)
    assert {id(m) for m in w2._maps} == {id(m) for m in maps}
    w2.write(data)
    w2.abort()
    assert storage.read_bytes("a") == data and not storage.exists("b")
    monkeypatch.setattr(local, "_POOL_IDLE_MAX", 2 * len(maps[0]))
    fresh = local._BouncePool()
    for m in maps:
        fresh.give(m)
    assert sum(len(v) for v in fresh._idle.values()) == 2
    assert sum(m.closed for m in maps) == len(maps) - 2
    # Another size evicts the idle buffers of the old one to make room (sizes drift).
    other = fresh.take(len(maps[0]) // 2)
    fresh.give(other)
    assert {n: len(v) for n, v in fresh._idle.items()} == {
        len(maps[0]): 1, len(maps[0]) // 2: 1}
    assert sum(m.closed for m in maps) == len(maps) - 1


def test_bounce_pool_after_fork_while_locked() -> None:
    """A child forked while the parent's pool lock is held starts with a fresh pool."""
    held = local._BOUNCE_POOL._lock
    held.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: a locked pool would hang here
            code = 0 if len(local._BOUNCE_POOL.take(4096)) == 4096 else 1
            os._exit(code)
    finally:
        held.release()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung on the inherited pool lock")


def test_padded_file_checksum_covers_every_byte(local_root: str) -> None:
    """The manifest's file checksum is of the whole file, padding included."""
    from ckptmgr.codec.checksum import checksum

    state = {f"t{i}": torch.randn(300_000 + i) for i in range(5)}
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, state)
        info = mgr.step_info(1)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(1, out)
    for f in info.files:
        data = (Path(local_root) / "1" / f.path).read_bytes()
        assert len(data) == f.size and checksum(data) == f.checksum, f.path
    assert all(torch.equal(state[k], out[k]) for k in state)


def test_direct_writer_io_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    monkeypatch.setattr(local, "_DIRECT_BUF", 65536)
    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", pwrite)
    storage = LocalStorage(str(tmp_path))
    w = storage.open_writer("f")
    with pytest.raises(StorageError, match="No space left"):
        for _ in range(20):
            w.write(b"x" * 65536)
        w.commit()
    w.abort()
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("room", [1, 64])
def test_failed_commit_hands_each_bounce_buffer_back_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int) -> None:
    """A write that fails at commit, then the writer's second abort (as dcp/writer does): no
    buffer is pooled twice or closed in the pool, the abort raises nothing, and the next files
    get whole, distinct buffers (``room``: idle buffers the pool may keep)."""
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    bufsize = 65536
    monkeypatch.setattr(local, "_DIRECT_BUF", bufsize)
    monkeypatch.setattr(local, "_POOL_IDLE_MAX", room * bufsize)
    pool = local._BouncePool()
    monkeypatch.setattr(local, "_BOUNCE_POOL", pool)
    real = os.pwrite
    fail = {"on": True}

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if fail["on"] and offset >= 4 * bufsize:  # the file's last (padded) write, at commit
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", pwrite)
    storage = LocalStorage(str(tmp_path))
    w = storage.open_writer("f", size_hint=4 * bufsize + 100)
    assert isinstance(w, local._DirectWriter)
    with pytest.raises(StorageError, match="No space left"):
        w.write(b"a" * (4 * bufsize + 100))
        w.commit()
    w.abort()  # again: must neither raise nor give the buffers back a second time
    idle = [m for ms in pool._idle.values() for m in ms]
    assert len({id(m) for m in idle}) == len(idle) <= room
    assert not any(m.closed for m in idle)
    fail["on"] = False
    a = storage.open_writer("a", size_hint=4 * bufsize)
    b = storage.open_writer("b", size_hint=4 * bufsize)
    assert isinstance(a, local._DirectWriter) and isinstance(b, local._DirectWriter)
    assert not {id(m) for m in a._maps} & {id(m) for m in b._maps}
    a.write(b"A" * (4 * bufsize))
    b.write(b"B" * (4 * bufsize))
    a.commit()
    b.commit()
    assert storage.read_bytes("a") == b"A" * (4 * bufsize)
    assert storage.read_bytes("b") == b"B" * (4 * bufsize)


def test_benchmark_end_to_end(tmp_path: Path) -> None:
    bench = _bench()
    out = tmp_path / "out"
    # A smoke run: every measure is made and reported; the payload size is not the point.
    methods = [m for m in bench.ALL_METHODS if m != "async_modes"]  # next test: writer processes
    doc = bench.main(["--size", "1MiB", "--count", "8", "--reps", "1", "--warmup", "0",
                      "--dir", str(tmp_path), "--out", str(out), "--compute-min-s", "0.1",
                      "--methods", ",".join(methods)])
    names = {r["name"] for r in doc["rows"]}
    for name in ("floor.copy", "floor.write", "floor.read", "torch.save", "torch.load",
                 "dcp.save", "dcp.load", "dcp_async.blocking", "dcp_async.total",
                 "dcp_async_reused.total", "ckptmgr.save", "ckptmgr.save_async.blocking",
                 "ckptmgr.save_async.total", "ckptmgr.restore", "compute_lost.dcp_async",
                 "compute_lost.ckptmgr"):
        assert name in names, name
    if importlib.util.find_spec("safetensors") is not None:
        assert {"safetensors.save", "safetensors.load"} <= names
    assert {t["measure"] for t in doc["targets"]} == {
        "ckptmgr.save_async.total", "ckptmgr.restore", "compute_lost.ckptmgr",
        "ckptmgr.save_async.blocking"}
    saved = json.loads((out / "bench.json").read_text())
    assert saved["config"]["size_bytes"] == doc["config"]["size_bytes"]
    assert "| `ckptmgr.restore` |" in (out / "bench.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # scratch data removed


def test_benchmark_async_modes(tmp_path: Path) -> None:
    """Issue 19 item 5's rows: ckptmgr's process and thread modes and DCP's thread and process
    async_save under the compute loop, each writer process warmed first; none is left running."""
    import torch.distributed as dist

    bench = _bench()
    doc = bench.main(["--size", "1MiB", "--count", "8", "--reps", "1", "--warmup", "0",
                      "--dir", str(tmp_path), "--compute-min-s", "0.1",
                      "--methods", "floors,async_modes"])
    names = {r["name"] for r in doc["rows"]}
    for mode in bench.ASYNC_MODES:
        assert {f"compute_lost.{mode}", f"blocked.{mode}", f"bg_total.{mode}"} <= names, mode
    assert {t["target"] for t in doc["targets"]} >= {
        "process mode: compute lost <= 0.5x DCP's process mode",
        "process mode: compute lost <= 0.25x DCP's thread mode",
        "process mode: blocking <= 1.2x warm copy"}
    assert not dist.is_initialized()  # the bench's 1-rank group is gone
    from torch.distributed.checkpoint import _async_process_executor as dcp_process

    assert dcp_process._CHECKPOINT_PROCESS is None
    assert list(tmp_path.iterdir()) == []


def _depth_reference(data: bytes, limit: int) -> bool:
    """The byte-by-byte scan check_json_depth replaced: True when ``data`` is too deep."""
    depth, in_str, escape = 0, False, False
    for byte in data:
        if in_str:
            if escape:
                escape = False
            elif byte == 0x5C:
                escape = True
            elif byte == 0x22:
                in_str = False
        elif byte == 0x22:
            in_str = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def _rejects(data: bytes, limit: int) -> bool:
    from ckptmgr.codec.manifest import ManifestError, check_json_depth

    try:
        check_json_depth(data, limit)
    except ManifestError:
        return True
    return False


def test_check_json_depth_matches_the_byte_scan() -> None:
    import random

    rng = random.Random(5)

    def doc(depth: int) -> Any:
        if depth == 0:
            return rng.choice([1, "a[b{c\\\"]", None, "}}]]", 2.5, "\\"])
        if rng.random() < 0.5:
            return [doc(depth - 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}[{{": doc(depth - 1) for i in range(rng.randint(0, 3))}

    for _ in range(300):  # well-formed JSON: exactly the same answers
        data = json.dumps(doc(rng.randint(0, 8))).encode()
        for limit in range(0, 10):
            assert _rejects(data, limit) == _depth_reference(data, limit), (data, limit)
    alphabet = b'[]{}"\\ax'
    for _ in range(3000):  # anything: never accepts what the scan rejected
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for limit in (0, 1, 2, 4):
            if _depth_reference(data, limit):
                assert _rejects(data, limit), (data, limit)


def _python_lines(fn: Any, budget: int) -> int:
    """How many lines of ``ckptmgr/codec/manifest.py`` Python runs during ``fn()``: a measure of
    interpreted work that does not depend on the machine's speed or load.

    Raises:
        AssertionError: more than ``budget`` lines (stopped there: a byte-by-byte scan of a
            large input would run millions).
    """
    from ckptmgr.codec import manifest

    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count > budget:
                raise AssertionError(f"more than {budget} Python lines: not the fast path")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == manifest.__file__ else None

    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_check_json_depth_is_fast_on_large_and_hostile_input() -> None:
    big = json.dumps({f"k{i}": {"chunks": [[i, i + 1], [0, 4]], "s": "x[" * 5}
                      for i in range(15000)}).encode()
    hostile = [big, b'"' + b'\\"' * 400_000 + b"\\", b"[" * 1_000_000, b"[]" * 500_000,
               b'"' * 1_000_000]
    assert all(len(data) <= 1 << 20 for data in hostile)  # the fast path
    for data in hostile:  # C speed: a bounded number of Python lines, whatever the input
        lines = _python_lines(lambda data=data: _rejects(data, 64), budget=1000)
        assert lines <= 4 * 64 + 40, (lines, data[:20])
    assert not _rejects(big, 4) and _rejects(big, 3)
    assert _rejects(b"[" * 1_000_000, 64) and not _rejects(b"[]" * 500_000, 1)
    # larger input takes the byte scan, with the same answers
    large = b"[" * 65 + b"1" * (2 << 20) + b"]" * 65
    assert _rejects(large, 64) and not _rejects(large, 65)


@pytest.mark.parametrize(("copy_all", "nbuf", "div", "least", "mib_for_file_mib"), [
    (True, 6, 64, 4, {0: 4, 256: 4, 1024: 16, 4096: 64, 102400: 64}),  # the default
    (False, 3, 32, 8, {0: 8, 256: 8, 1024: 32, 2048: 64, 102400: 64}),
])
def test_direct_buffer_size_bounds_the_extra_memory(
        monkeypatch: pytest.MonkeyPatch, copy_all: bool, nbuf: int, div: int, least: int,
        mib_for_file_mib: dict[int, int]) -> None:
    """Copying every item (the default): six buffers of 1/64 of the file, 4-64 MiB each, under
    ~10% of a large file and 384 MiB; else three of 1/32, 8-64 MiB."""
    monkeypatch.setattr(local, "COPY_ALL", copy_all)
    assert (local._COPY_NBUF if copy_all else local._DIRECT_NBUF) == nbuf
    mib = 1 << 20
    assert local.direct_buffer_size(None) == local._DIRECT_BUF == 64 * mib
    for file_mib, buf_mib in mib_for_file_mib.items():
        assert local.direct_buffer_size(file_mib * mib) == buf_mib * mib, file_mib
    for size in (1, 300 * mib + 7, 5 << 30):
        buf = local.direct_buffer_size(size)
        assert buf % 4096 == 0
        assert nbuf * buf <= max(nbuf * least * mib, size * nbuf / div + nbuf * mib)
