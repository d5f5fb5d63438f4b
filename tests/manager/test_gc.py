"""The cyclic garbage collector is paused while save, save_async and restore block the caller,
and left as it was found afterwards (also after a failure, nested and across threads)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckptmgr import CheckpointManager, ConfigError
from ckptmgr._gc import gc_paused


class _Probe:
    """A Stateful value that records whether the collector ran while ckptmgr called it."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(gc.isenabled())
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen.append(gc.isenabled())


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_during_blocking_calls_and_restored(local_root: str, collector_on: None) -> None:
    probe = _Probe()
    state = {"w": torch.randn(64), "probe": probe}
    with CheckpointManager(local_root, save_interval=1) as mgr:
        for call in (lambda: mgr.save(1, state), lambda: mgr.save_async(2, state),
                     lambda: mgr.restore(1, state)):
            n = len(probe.seen)
            call()
            assert len(probe.seen) > n and not any(probe.seen) and gc.isenabled()
            mgr.join()
        with pytest.raises(ConfigError):
            mgr.save(-1, state)
        assert gc.isenabled()
        gc.disable()  # the caller's choice stands
        mgr.save(3, state)
        assert not gc.isenabled()


def test_nested_and_threads(collector_on: None) -> None:
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            entered.set()
            leave.wait(timeout=60)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert entered.wait(timeout=60)
        with gc_paused():
            assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's call still runs
    leave.set()
    t.join()
    assert gc.isenabled()


def test_child_forked_during_a_pause_collects(collector_on: None) -> None:
    import os

    with gc_paused():
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 1)
        assert not gc.isenabled()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
