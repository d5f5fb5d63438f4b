"""ckptmgr.dcp._streams: the run splitter and the stream runner shared by the DCP reader and
writer."""

from __future__ import annotations

import threading

import pytest

from ckptmgr._threads import finish_surely
from ckptmgr.dcp._streams import Stopped, run_streams, split_runs


def test_split_runs_is_balanced() -> None:
    assert split_runs([10] * 10, 1, 1) == [0]
    assert split_runs([10] * 10, 2, 1) == [0, 5]
    assert split_runs([10] * 9, 3, 1) == [0, 3, 6]
    assert split_runs([90, 5, 5], 2, 1) == [0, 1]  # never an empty run
    assert split_runs([10] * 10, 4, 40) == [0, 5]  # at least min_bytes per run: two runs
    assert split_runs([5], 8, 1) == [0]
    assert split_runs([], 4, 1) == [0]
    sizes = [((i * 7919) % 97) + 1 for i in range(1000)]
    starts = split_runs(sizes, 4, 1)
    runs = [sum(sizes[a:b]) for a, b in zip(starts, [*starts[1:], len(sizes)], strict=True)]
    assert len(runs) == 4 and max(runs) - min(runs) <= 2 * max(sizes)


def test_every_stream_runs_and_results_keep_their_order() -> None:
    names: set[str] = set()
    lock = threading.Lock()

    def work(i: int, stop: threading.Event) -> int:
        with lock:
            names.add(threading.current_thread().name)
        return i * i

    assert run_streams(work, 5, name="t") == [0, 1, 4, 9, 16]
    assert names == {f"t-{i}" for i in range(5)}


def test_one_stream_runs_on_the_calling_thread_unless_told() -> None:
    setups: list[str] = []

    def work(i: int, stop: threading.Event) -> str:
        return threading.current_thread().name

    def setup() -> None:
        setups.append(threading.current_thread().name)

    me = threading.current_thread().name
    assert run_streams(work, 1, name="t", thread_setup=setup) == [me]
    assert setups == []  # the calling thread is never set up (e.g. never reniced)
    assert run_streams(work, 1, name="t", always_thread=True, thread_setup=setup) == ["t-0"]
    assert setups == ["t-0"]


def test_first_failure_propagates_and_stops_the_others() -> None:
    failed = threading.Event()
    ended: list[int] = []
    lock = threading.Lock()

    def work(i: int, stop: threading.Event) -> None:
        try:
            if i == 2:
                failed.set()
                raise OSError("disk full (injected)")
            assert failed.wait(30)
            # The others see the stop flag and give up as the writer and reader do.
            assert stop.wait(30)
            raise Stopped
        finally:
            with lock:
                ended.append(i)

    with pytest.raises(OSError, match="disk full"):
        run_streams(work, 4, name="t")
    assert sorted(ended) == [0, 1, 2, 3]  # every stream ended before the error was raised


def test_first_failure_in_time_wins() -> None:
    second = threading.Event()

    def work(i: int, stop: threading.Event) -> None:
        if i == 1:
            raise ValueError("first")
        assert stop.wait(30)
        second.set()
        raise RuntimeError("later")

    with pytest.raises(ValueError, match="first"):
        run_streams(work, 2, name="t")
    assert second.is_set()


def test_finish_surely_joins_through_an_interrupt_then_raises_it() -> None:
    release = threading.Event()
    worker = threading.Thread(target=release.wait, daemon=True)
    worker.start()
    calls = {"n": 0}

    def join() -> None:
        calls["n"] += 1
        if calls["n"] == 1:  # a Ctrl-C during the first join
            release.set()
            raise KeyboardInterrupt("during the join")
        worker.join()

    with pytest.raises(KeyboardInterrupt, match="during the join"):
        finish_surely(join)
    assert calls["n"] == 2 and not worker.is_alive()


def test_an_outside_stop_stops_the_streams_at_their_next_piece() -> None:
    stop = threading.Event()  # the caller's: set here by a stream, as another thread would
    pieces: list[int] = []

    def work(i: int, halt: threading.Event) -> None:
        for k in range(100_000):
            if halt.is_set():
                raise Stopped
            pieces.append(k)
            if len(pieces) >= 10:
                stop.set()

    with pytest.raises(Stopped):
        run_streams(work, 2, name="t", always_thread=True, stop=stop)
    assert len(pieces) < 1000
