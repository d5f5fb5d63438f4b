"""The reader's windows of staged reads (ckptmgr.dcp.reader): destinations that are not a whole
contiguous CPU tensor of the stored dtype (a CUDA tensor, another dtype, a view) are read into
host buffers a window at a time; the next window is read while the calling thread copies the last
one out. Here on CPU with windows of a few KiB, so one small state spans many windows: the values
land bit-exact with and without the pipeline, staging stays within its bound, the read of the
next window overlaps the copy-out of the last (a gate, not a clock), and a failure in any window
leaves no reader thread behind."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptmgr.dcp import CkptStorageReader, CkptStorageWriter, reader
from ckptmgr.errors import CorruptCheckpointError

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is (disabled, )?unavailable or uninitialized:UserWarning")

WINDOW = 4096


@pytest.fixture(autouse=True)
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "_WINDOW", WINDOW)
    monkeypatch.setattr(reader, "_MAX_BUFFERED", 2 * WINDOW)


def _state() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and sizes: many under a window, two over one, empty ones."""
    g = torch.Generator().manual_seed(7)
    sd: dict[str, torch.Tensor] = {}
    for i in range(24):
        n = [1, 3, 100, 333, 700, 1000][i % 6]
        sd[f"f{i}"] = torch.randn(n, generator=g)
    sd["big1"] = torch.randn(3000, generator=g)  # 12,000 bytes: over a window
    sd["bool"] = torch.rand(77, generator=g) > 0.5
    sd["i64"] = torch.randint(-(2**40), 2**40, (5, 9), generator=g)
    sd["c64"] = torch.randn(17, dtype=torch.complex64, generator=g)
    sd["empty"] = torch.empty(0, 4)
    sd["scalar"] = torch.tensor(3.5)
    sd["big2"] = torch.randn(40, 50, generator=g)  # 8,000 bytes
    return sd


def _targets(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Destinations that are all staged: even float32 ones go to bf16, odd ones to a transposed
    (non-contiguous) view; the others to a view of a larger tensor. Returns the state to load
    into and the expected values."""
    target: dict[str, torch.Tensor] = {}
    expected: dict[str, Any] = {}
    for i, (k, v) in enumerate(sd.items()):
        if v.dtype == torch.float32 and v.dim() == 1 and i % 2 == 0:
            target[k] = torch.zeros(v.shape, dtype=torch.bfloat16)
            expected[k] = v.bfloat16()
        elif v.dim() == 2 and v.numel():
            target[k] = torch.zeros(v.shape[1], v.shape[0], dtype=v.dtype).t()
            expected[k] = v
        else:
            target[k] = torch.zeros((2, *v.shape), dtype=v.dtype)[1]
            expected[k] = v
        assert not (target[k].is_contiguous() and target[k].dtype == v.dtype
                    and target[k].storage_offset() == 0) or v.numel() == 0
    return target, expected


class _Spy:
    """Counts the windows and the staging bytes held at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.windows = self.held = self.peak = 0
        place, release = reader._Staging.place, reader._Staging.release

        def spy_place(st: Any, window: Any) -> Any:
            buf = place(st, window)
            self.windows += 1
            self.held += 0 if buf is None else buf.numel()
            self.peak = max(self.peak, self.held)
            return buf

        def spy_release(st: Any, window: Any, buf: Any) -> None:
            self.held -= 0 if buf is None else buf.numel()
            release(st, window, buf)

        monkeypatch.setattr(reader._Staging, "place", spy_place)
        monkeypatch.setattr(reader._Staging, "release", spy_release)


@pytest.mark.parametrize("pipeline", [True, False])
def test_staged_reads_in_many_windows_land_bit_exact(tmp_path: Path, pipeline: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "PIPELINE", pipeline)
    sd = _state()
    dcp.save(sd, storage_writer=CkptStorageWriter(str(tmp_path)))
    target, expected = _targets(sd)
    spy = _Spy(monkeypatch)
    dcp.load(target, storage_reader=CkptStorageReader(str(tmp_path)))
    for k, v in expected.items():
        assert target[k].dtype == v.dtype and torch.equal(target[k], v), k
    assert spy.windows >= 6 and spy.held == 0
    # Two windows' buffers at most, or the 12,000-byte chunk's alone.
    assert spy.peak <= max(2 * WINDOW, 12032)
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptmgr-restore")]


def test_the_next_window_is_read_while_the_last_is_copied_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=CkptStorageWriter(str(tmp_path)))
    target, expected = _targets(sd)
    second_read = threading.Event()
    fetched: list[int] = []
    fetch, commit = reader.CkptStorageReader._fetch_window, reader.CkptStorageReader._commit_window

    def spy_fetch(self: Any, reads: Any, *stop: Any) -> None:
        fetched.append(len(reads))
        if len(fetched) == 2:
            second_read.set()
        fetch(self, reads, *stop)

    def gated_commit(self: Any, reads: Any, planner: Any) -> None:
        if len(fetched) <= 2:  # the first window's copy-out waits for the second read
            assert second_read.wait(30), "the next window was not read during the copy-out"
        commit(self, reads, planner)

    monkeypatch.setattr(reader.CkptStorageReader, "_fetch_window", spy_fetch)
    monkeypatch.setattr(reader.CkptStorageReader, "_commit_window", gated_commit)
    dcp.load(target, storage_reader=CkptStorageReader(str(tmp_path)))
    assert len(fetched) >= 6
    for k, v in expected.items():
        assert torch.equal(target[k], v), k


def _failure(e: BaseException) -> BaseException:
    assert isinstance(e, CheckpointException), e
    f = e.failures[min(e.failures)]
    return f[0] if isinstance(f, tuple) else f


def test_a_corrupt_chunk_in_a_late_window_fails_the_restore_and_leaves_no_thread(
        tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=CkptStorageWriter(str(tmp_path)))
    (data,) = sorted(p for p in tmp_path.iterdir() if p.name.startswith("data-"))
    raw = bytearray(data.read_bytes())
    at = raw.find(sd["big2"].numpy().tobytes())  # the last window's chunk
    assert at > 0
    raw[at + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    target, _ = _targets(sd)
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=CkptStorageReader(str(tmp_path)))
    err = _failure(info.value)
    assert isinstance(err, CorruptCheckpointError) and "'big2'" in str(err)
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptmgr-restore")]


def test_a_read_error_in_the_next_window_waits_for_it_and_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second window's read fails while the first is copied out: the error reaches the
    caller only after every read ended, and no window after it is read."""
    sd = _state()
    dcp.save(sd, storage_writer=CkptStorageWriter(str(tmp_path)))
    target, _ = _targets(sd)
    fetched: list[int] = []
    fetch = reader.CkptStorageReader._fetch_window

    def failing_fetch(self: Any, reads: Any, *stop: Any) -> None:
        fetched.append(len(reads))
        if len(fetched) == 2:
            raise OSError(5, "Input/output error (injected)")
        fetch(self, reads, *stop)

    monkeypatch.setattr(reader.CkptStorageReader, "_fetch_window", failing_fetch)
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=CkptStorageReader(str(tmp_path)))
    assert "injected" in str(_failure(info.value))
    assert len(fetched) == 2
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptmgr-restore")]
