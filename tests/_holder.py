"""A CheckpointManager living in another real process, driven by the test one call at a time.

``Holder(root, **kwargs)`` spawns a process that builds ``CheckpointManager(root, **kwargs)`` and
then serves calls (``save``, ``save_async``, ``join``, ``restore_version``, ``close``) from a
queue; each call blocks the test until the child answered, so the order of events between the two
processes is the order of the test's lines, never a guess about timing. Errors come back as
``(type name, message)`` instead of being raised in the child. ``save_loop`` overwrites one step
(versions 2, 3, ...) until a stop file appears, creating ``<stop file>.started`` after the first.

``gate_dir``: once the test creates ``<gate_dir>/armed``, every data-file write of the child waits
at its open: the child creates ``<gate_dir>/arrived`` and waits for ``<gate_dir>/open``. So "the
child's save is in flight, its commit still to come" is a fact the test arranged.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
from typing import Any

import torch

TIMEOUT_S = 60.0


def state(v: int) -> dict[str, Any]:
    """A small state whose every part says which version ``v`` it is."""
    return {"w": torch.full((64, 16), float(v)), "ramp": torch.arange(50) + v, "v": v}


def target() -> dict[str, Any]:
    return {"w": torch.zeros(64, 16), "ramp": torch.zeros(50, dtype=torch.int64), "v": -1}


def restored_version(mgr: Any, step: int) -> int:
    """Restore ``step`` with ``mgr``; the version it holds, checking every part agrees."""
    out = target()
    mgr.restore(step, out)
    v = out["v"]
    assert isinstance(v, int), out
    assert torch.equal(out["w"], torch.full((64, 16), float(v))), f"w mixed with version {v}"
    assert torch.equal(out["ramp"], torch.arange(50) + v), f"ramp mixed with version {v}"
    return v


def wait_for_file(path: str, timeout_s: float = TIMEOUT_S) -> None:
    """Block until ``path`` exists (a gate between processes)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared in {timeout_s} s")
        time.sleep(0.005)


def _gate_data_writes(gate_dir: str) -> None:
    """(child) Hold data-file writes at the file gate in ``gate_dir`` once it is armed."""
    import ckptmgr.manager

    real_open = ckptmgr.manager.open_storage

    def open_storage(*args: Any, **kwargs: Any) -> Any:
        storage = real_open(*args, **kwargs)
        real_writer = storage.open_writer

        def open_writer(path: str, size_hint: int | None = None) -> Any:
            if (os.path.basename(path).startswith("data-")
                    and os.path.exists(os.path.join(gate_dir, "armed"))):
                open(os.path.join(gate_dir, "arrived"), "w").close()
                wait_for_file(os.path.join(gate_dir, "open"))
            return real_writer(path, size_hint)

        storage.open_writer = open_writer
        return storage

    ckptmgr.manager.open_storage = open_storage  # type: ignore[assignment]


def _serve(root: str, kwargs: dict[str, Any], env: dict[str, str], gate_dir: str | None,
           calls: Any, answers: Any) -> None:
    os.environ.update(env)
    from ckptmgr import CheckpointManager

    if gate_dir is not None:
        _gate_data_writes(gate_dir)

    try:
        mgr = CheckpointManager(root, **kwargs)
    except BaseException as e:  # reported to the test, which decides
        answers.put(("err", (type(e).__name__, str(e))))
        return
    answers.put(("ok", os.getpid()))
    while True:
        op, args, kw = calls.get(timeout=TIMEOUT_S)
        try:
            if op == "save":
                result: Any = mgr.save(args[0], state(args[1]), **kw)
            elif op == "save_async":
                result = mgr.save_async(args[0], state(args[1]), **kw)
            elif op == "restore_version":
                result = restored_version(mgr, args[0])
            elif op == "save_loop":  # save args[0] again and again until args[1] exists
                result = 0
                while not os.path.exists(args[1]):
                    result += 1
                    mgr.save(args[0], state(1 + result), force=True)
                    if result == 1:
                        open(args[1] + ".started", "w").close()
            elif op == "all_steps":
                result = mgr.all_steps()
            else:
                result = getattr(mgr, op)(*args, **kw)
            answers.put(("ok", result))
        except BaseException as e:
            answers.put(("err", (type(e).__name__, str(e))))
        if op == "close":
            return


class Holder:
    """A manager in a spawned process (see the module docstring).

    Raises:
        AssertionError: the child did not answer within ``TIMEOUT_S``.
    """

    def __init__(self, root: str, *, env: dict[str, str] | None = None,
                 gate_dir: str | None = None, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._calls = ctx.Queue()
        self._answers = ctx.Queue()
        kwargs.setdefault("save_interval", 1)
        self.proc = ctx.Process(target=_serve, args=(root, kwargs, env or {}, gate_dir,
                                                     self._calls, self._answers), daemon=True)
        self.proc.start()
        self.status, self.value = self._answer()
        self._served = self.status == "ok"
        self.pid: int = self.proc.pid  # type: ignore[assignment]

    def _answer(self) -> tuple[str, Any]:
        try:
            status, value = self._answers.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"the child process did not answer in {TIMEOUT_S} s") from None
        return status, value

    def send(self, op: str, *args: Any, **kw: Any) -> None:
        """Start ``mgr.<op>`` in the child without waiting; :meth:`answer` collects it."""
        self._calls.put((op, args, kw))
        self._served = self._served and op != "close"  # the child returns after close

    def answer(self) -> tuple[str, Any]:
        """The answer to the call sent last."""
        return self._answer()

    def call(self, op: str, *args: Any, **kw: Any) -> tuple[str, Any]:
        """Run ``mgr.<op>`` in the child; ("ok", result) or ("err", (type name, message))."""
        self.send(op, *args, **kw)
        return self._answer()

    def ok(self, op: str, *args: Any, **kw: Any) -> Any:
        """:meth:`call`, asserting it succeeded; its result."""
        status, value = self.call(op, *args, **kw)
        assert status == "ok", f"{op}{args} failed in the child: {value}"
        return value

    def stop(self) -> None:
        """Close the child's manager if it is alive, and reap the process."""
        if self.proc.is_alive() and self._served:
            self.send("close")
            with contextlib.suppress(queue.Empty):  # then killed below
                self._answers.get(timeout=TIMEOUT_S)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
