"""The preemption watcher on its own (ckptmgr/preemption.py, DESIGN.md section 8): handlers that
only set a flag and chain the one installed before, real signals sent to this process; the file and
callable sources; putting the previous handlers back."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptmgr import ConfigError
from ckptmgr.preemption import PreemptionWatcher


@pytest.fixture
def seen() -> Iterator[list[int]]:
    """Python handlers on SIGUSR1 and SIGUSR2 that record what reached them (the handlers a user
    had before the watcher); the original handlers come back afterwards."""
    got: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, frame: got.append(signum))
           for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield got
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _send(sig: signal.Signals) -> None:
    # The handler runs on the main thread before the next bytecode after kill() returns.
    os.kill(os.getpid(), sig)


def test_signal_sets_the_flag_and_chains_the_previous_handler(seen: list[int]) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    w = PreemptionWatcher([signal.SIGUSR1])
    try:
        assert w.triggered() == 0 and w.signal_count == 0
        _send(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the handler installed before still runs
        assert w.triggered() == signal.SIGUSR1 and w.signal_count == 1
        assert w.triggered() == signal.SIGUSR1  # stays raised until acknowledged
        _send(signal.SIGUSR1)
        assert w.signal_count == 2 and seen == [signal.SIGUSR1] * 2
        w.acknowledge()
        assert w.triggered() == 0
        _send(signal.SIGUSR1)  # a later signal triggers again
        assert w.triggered() == signal.SIGUSR1 and w.signal_count == 3
    finally:
        w.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_the_first_signal_is_the_one_reported(seen: list[int]) -> None:
    w = PreemptionWatcher([signal.SIGUSR1, signal.SIGUSR2])
    try:
        _send(signal.SIGUSR2)
        _send(signal.SIGUSR1)
        assert w.triggered() == signal.SIGUSR2 and w.signal_count == 2
        assert seen == [signal.SIGUSR2, signal.SIGUSR1]
    finally:
        w.uninstall()


def test_uninstall_restores_default_and_leaves_a_newer_handler(seen: list[int]) -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    w = PreemptionWatcher([signal.SIGUSR1, signal.SIGUSR2])

    def newer(signum: int, frame: Any) -> None:
        pass

    signal.signal(signal.SIGUSR1, newer)  # installed after ours: not ours to remove
    w.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is newer
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    w.uninstall()  # twice is harmless
    assert signal.getsignal(signal.SIGUSR1) is newer


def test_sigint_only_sets_the_flag() -> None:
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        w = PreemptionWatcher([signal.SIGINT])
        try:
            _send(signal.SIGINT)  # no KeyboardInterrupt: it would abort the save it asks for
            assert w.triggered() == signal.SIGINT and w.signal_count == 1
        finally:
            w.uninstall()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)


def test_file_fires_once_per_appearance(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="ckptmgr")
    marker = tmp_path / "preempted"
    w = PreemptionWatcher(file=str(marker))
    assert w.triggered() == 0
    marker.write_text("")
    assert w.triggered() == signal.SIGTERM  # a file means SIGTERM
    assert str(marker) in caplog.text
    assert w.triggered() == signal.SIGTERM  # raised until acknowledged
    w.acknowledge()
    assert w.triggered() == 0  # still there: not a new preemption
    marker.unlink()
    assert w.triggered() == 0
    marker.write_text("")
    assert w.triggered() == signal.SIGTERM  # it appeared again
    w.uninstall()  # no signals: nothing to put back


def test_check_fires_once_per_rising_edge() -> None:
    answers = iter([False, True, True, True, False, True])
    calls: list[int] = []

    def check() -> bool:
        calls.append(1)
        return next(answers)

    w = PreemptionWatcher(check=check)
    assert w.triggered() == 0
    assert w.triggered() == signal.SIGTERM
    w.acknowledge()
    assert w.triggered() == 0  # True again, but not a new preemption
    assert w.triggered() == 0
    assert w.triggered() == 0  # False: armed again
    assert w.triggered() == signal.SIGTERM
    assert len(calls) == 6  # asked once per call while nothing is raised


def test_configuration_errors_and_threads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="preemption_check must be callable"):
        PreemptionWatcher(check=True)  # type: ignore[arg-type]
    errors: list[BaseException] = []
    quiet: list[PreemptionWatcher] = []

    def build() -> None:
        try:
            PreemptionWatcher([signal.SIGUSR1])
        except BaseException as e:
            errors.append(e)
        quiet.append(PreemptionWatcher(file=str(tmp_path / "f")))  # no signals: fine anywhere

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert "main thread" in str(errors[0])
    assert len(quiet) == 1 and quiet[0].triggered() == 0


def test_uninstall_off_the_main_thread_leaves_the_handlers(seen: list[int]) -> None:
    w = PreemptionWatcher([signal.SIGUSR1])
    t = threading.Thread(target=w.uninstall)  # Python cannot change handlers there
    t.start()
    t.join()
    try:
        assert getattr(signal.getsignal(signal.SIGUSR1), "__self__", None) is w
        _send(signal.SIGUSR1)
        assert w.triggered() == signal.SIGUSR1
    finally:
        w.uninstall()
    assert getattr(signal.getsignal(signal.SIGUSR1), "__self__", None) is not w
