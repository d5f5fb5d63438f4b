"""``async_mode="process"``: a persistent writer process per rank, with real processes and signals.

Gates, not sleeps: a writer is held mid-save with SIGSTOP (it cannot move until SIGCONT), so "the
writer dies during the save" is arranged, not guessed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks

import ckptmgr
from ckptmgr import AsyncSaveError, CheckpointManager, ConfigError
from ckptmgr.errors import LeaseError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="async_mode='process' needs Linux (memfd)")


def _gone(pid: int) -> bool:
    """The process ``pid`` exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        assert time.monotonic() < deadline, f"process {pid} is still alive"
        time.sleep(0.02)


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 16)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "extra": {"epoch": 1, "tags": ["a", "b"]},
            "big": torch.arange(100_000, dtype=torch.float64)}


def _writer_pid(mgr: CheckpointManager) -> int:
    pid = mgr._writer.pid  # type: ignore[union-attr]
    assert pid is not None
    return pid


def test_round_trip_snapshot_retention_and_close(local_root: str) -> None:
    state = _state()
    mgr = CheckpointManager(local_root, save_interval=1, max_to_keep=2, async_mode="process")
    pid = _writer_pid(mgr)
    assert pid != os.getpid()
    snapshots = {}
    for step in range(4):
        assert mgr.save_async(step, state)
        snapshots[step] = state["big"].clone()
        state["big"].add_(1.0)  # after save_async returned: must not reach the checkpoint
        state["extra"]["epoch"] += 1
    mgr.join()
    assert mgr.all_steps() == [2, 3]  # retention ran in the writer process
    stats = mgr.last_save_stats
    assert stats is not None and stats.step == 3 and stats.bytes > 800_000
    assert _writer_pid(mgr) == pid  # one persistent writer
    mgr.close()
    assert _gone(pid)  # close() leaves no process behind

    fresh = _state(seed=1)
    with CheckpointManager(local_root, save_interval=1) as reader:
        assert reader.all_steps() == [2, 3]
        reader.restore(3, fresh)
    assert torch.equal(fresh["big"], snapshots[3])
    assert fresh["extra"] == {"epoch": 4, "tags": ["a", "b"]}
    for a, b in zip(fresh["model"].parameters(), _state()["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_writer_sigkilled_mid_save_or_idle_is_replaced(local_root: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    with CheckpointManager(local_root, save_interval=1, async_mode="process") as mgr:
        mgr.save_async(0, state)
        mgr.join()
        pid = _writer_pid(mgr)
        os.kill(pid, signal.SIGSTOP)  # the gate: the writer cannot move
        assert mgr.save_async(1, state)  # staged, handed over, not written
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(AsyncSaveError, match="killed by SIGKILL") as info:
            mgr.save_async(2, state)
        assert info.value.step == 1
        assert mgr.all_steps() == [0]  # nothing of step 1 became visible
        assert mgr.save_async(2, state)  # the failure was raised once; a new writer saves
        mgr.join()
        assert _writer_pid(mgr) != pid
        assert mgr.all_steps() == [0, 2]
        idle = _writer_pid(mgr)  # a writer that dies while idle lost no save: replaced silently
        os.kill(idle, signal.SIGKILL)
        mgr._writer._proc.wait(timeout=60)  # type: ignore[union-attr]  # reaped: it is dead
        assert mgr.save_async(3, state)
        mgr.join()
        assert _writer_pid(mgr) not in (pid, idle)
        assert mgr.all_steps() == [0, 2, 3]
    assert "this rank's writer process died" in caplog.text
    with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == [0, 2, 3]
        reader.restore(2, _state(seed=3))


_PARENT = textwrap.dedent("""
    import sys, torch, ckptmgr
    root = sys.argv[1]
    mgr = ckptmgr.CheckpointManager(root, save_interval=1, async_mode="process")
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    mgr.save(0, state)
    print("writer", mgr._writer.pid, flush=True)
    assert sys.stdin.readline().strip() == "go"
    mgr.save_async(1, state)
    print("queued", flush=True)
    sys.stdin.readline()  # killed here
""")


def test_parent_sigkill_takes_the_writer_down_and_commits_nothing(local_root: str,
                                                                   tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    with subprocess.Popen([sys.executable, str(script), local_root], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline().split()
            assert line[:1] == ["writer"], line
            writer = int(line[1])
            os.kill(writer, signal.SIGSTOP)  # the writer will hold step 1 when the parent dies
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "queued"
            proc.kill()
            proc.wait()
            os.kill(writer, signal.SIGCONT)
            _wait_gone(writer)  # no orphan writer
        finally:
            if proc.poll() is None:
                proc.kill()
    with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == [0]  # step 1 never became visible
        out = {"w": torch.zeros(1 << 16)}
        reader.restore(0, out)
        assert torch.equal(out["w"], torch.arange(1 << 16, dtype=torch.float32))


def _two_ranks(rank: int, world: int, root: str) -> list[int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(4000.0).reshape(40, 100)
    state = {"shard": torch.arange(1000.0), "extra": {"epoch": 5},  # DDP-style: replicated
             "fsdp": distribute_tensor(full, mesh, [Shard(0)])}
    mgr = CheckpointManager(root, save_interval=1, async_mode="process")
    mgr.save_async(0, state)
    mgr.save_async(1, state)
    mgr.join()
    if rank == 1:  # rank 1's writer dies during the save of step 2; rank 0's waits for it
        os.kill(_writer_pid(mgr), signal.SIGSTOP)
    mgr.save_async(2, state)
    if rank == 1:
        os.kill(_writer_pid(mgr), signal.SIGKILL)
    dist.barrier()
    try:
        mgr.save_async(3, state)
        raise AssertionError("the lost save was not reported")
    except AsyncSaveError as e:
        assert e.step == 2
    assert mgr.save_async(3, state)  # new writers on both ranks
    mgr.join()
    steps = mgr.all_steps()
    out = {"shard": torch.zeros(1000), "extra": {"epoch": -1},
           "fsdp": distribute_tensor(torch.zeros(40, 100), mesh, [Shard(0)])}
    mgr.restore(3, out)
    assert torch.equal(out["shard"], state["shard"]) and out["extra"] == {"epoch": 5}
    assert torch.equal(out["fsdp"].full_tensor(), full)
    mgr.close()
    return steps


@pytest.mark.slow
def test_two_ranks_writer_group_and_a_dead_writer(local_root: str) -> None:
    results = run_ranks(_two_ranks, 2, local_root, timeout_s=120)
    assert results == [[0, 1, 3], [0, 1, 3]]


def test_bad_mode_and_memory_root_are_clear_errors(local_root: str) -> None:
    with pytest.raises(ConfigError, match="async"):
        CheckpointManager(local_root, save_interval=1, async_mode="fork")
    with pytest.raises(ConfigError, match="memory://"):
        CheckpointManager("memory://run", save_interval=1, async_mode="process")
    cfg = ckptmgr.ManagerConfig.from_kwargs(path=local_root, save_interval=1,
                                            async_mode="process")
    assert cfg.async_.mode == "process"


def test_local_tier_beside_the_writer_process(local_root: str, tmp_path: Path) -> None:
    state = {"w": torch.arange(10.0), "extra": {"a": 1}}
    with CheckpointManager(local_root, save_interval=4, local_path=str(tmp_path / "nvme"),
                           local_interval=1, async_mode="process") as mgr:
        for step in range(6):
            state["w"].add_(1)
            mgr.save_async(step, state)
        mgr.join()
        assert mgr.all_steps() == [0, 4, 5]
        assert mgr.step_info(4).tiers == ("durable", "local")
        assert mgr.step_info(5).tiers == ("local",)
        out = {"w": torch.zeros(10), "extra": {"a": 0}}
        mgr.restore(5, out)
        assert torch.equal(out["w"], state["w"]) and out["extra"] == {"a": 1}
    with CheckpointManager(local_root, save_interval=4, read_only=True) as reader:
        out = {"w": torch.zeros(10), "extra": {"a": 0}}
        reader.restore(4, out)  # the durable copy the writer process wrote
        assert torch.equal(out["w"], torch.arange(10.0) + 5)


def test_xla_sharded_state_is_saved_from_a_thread(local_root: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from ckptmgr.dcp.shards import CpuShardedTensor

    full = torch.arange(24.0).reshape(6, 4)
    state = {"w": CpuShardedTensor(full, (2, 2), (0, 1)), "plain": torch.ones(3)}
    with CheckpointManager(local_root, save_interval=1, async_mode="process") as mgr:
        assert mgr.save_async(0, state)
        mgr.join()
        assert mgr.all_steps() == [0]
        out = {"w": CpuShardedTensor(torch.zeros(6, 4), (4,), (0, None)), "plain": torch.zeros(3)}
        mgr.restore(0, out)
    assert torch.equal(out["w"].to_full(), full) and torch.equal(out["plain"], torch.ones(3))
    assert "saved from a thread of the training process" in caplog.text


def test_writer_commits_only_while_the_trainer_holds_the_lease(local_root: str) -> None:
    state = _state()
    mgr = CheckpointManager(local_root, save_interval=1, async_mode="process")
    try:
        mgr.save_async(0, state)
        mgr.join()
        pid = _writer_pid(mgr)
        os.kill(pid, signal.SIGSTOP)  # hold the save of step 1 until the lease has moved
        assert mgr.save_async(1, state)
        other = CheckpointManager(local_root, save_interval=1, take_over=True)
        os.kill(pid, signal.SIGCONT)
        with pytest.raises(AsyncSaveError) as info:
            mgr.join()
        assert isinstance(info.value.__cause__, LeaseError)
        assert other.all_steps() == [0]  # the fenced writer made nothing visible
        other.close()
    finally:
        with contextlib.suppress(ckptmgr.CkptmgrError):
            mgr.close()


def _kib(pid: int | str, field: str, file: str = "status") -> int:
    with open(f"/proc/{pid}/{file}") as f:
        return sum(int(line.split()[1]) for line in f if line.split(":")[0] in field.split("+"))


def test_memory_is_bounded_and_flat_over_20_saves(local_root: str) -> None:
    """Process mode (thread mode: tests/manager/test_async.py, in a fresh process)."""
    mode = "process"
    mib = 1 << 20
    state = {f"t{i}": torch.rand(1 << 20) for i in range(8)}  # 32 MiB
    nbytes = 32 * mib
    with CheckpointManager(local_root, save_interval=1, max_to_keep=1, async_mode=mode) as mgr:
        mgr.save_async(0, state)  # imports, pools and the staging buffers reach their size
        mgr.join()
        base = _kib("self", "VmRSS") * 1024 - nbytes  # the staging buffers are extra memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: peaks of earlier tests in this process do not count
        writer = mgr._writer.pid if mgr._writer is not None else None
        w_base = _kib(writer, "Private_Clean+Private_Dirty", "smaps_rollup") if writer else 0
        peaks, w_peaks = [], []
        for step in range(1, 21):
            if step == 10:  # a changed shape: its buffer is replaced, the old arena retired
                state["t0"] = torch.rand(1 << 19)
            for t in state.values():
                t.add_(1.0)
            mgr.save_async(step, state)
            mgr.join()
            peaks.append(_kib("self", "VmHWM") * 1024)
            if writer:
                w_peaks.append(_kib(writer, "Private_Clean+Private_Dirty", "smaps_rollup"))
        assert mgr.all_steps() == [20]
        assert mgr._writer is None or mgr._writer.pid == writer
    # The training process: staging (1x) plus at most 0.15x, flat (no buffer or arena leaks).
    extra = max(peaks) - base
    assert extra <= 1.15 * nbytes, f"{mode}: {extra / nbytes:.2f}x the state"
    assert peaks[-1] - peaks[4] <= 0.25 * nbytes  # a leaked staging copy would be 1x
    if w_peaks:  # the writer's own memory (the arena is shared, not private) does not grow
        assert (max(w_peaks) - w_base) * 1024 <= 0.1 * nbytes


@pytest.mark.parametrize("root", ["s3", "gcs"], indirect=True)
def test_object_stores_from_the_writer_process(root: str) -> None:
    """The writer opens the bucket as the trainer does: environment (s3fs) and fsspec's
    configuration set in code (gcsfs here) both reach it."""
    state = _state()
    with CheckpointManager(root, save_interval=1, max_to_keep=1, async_mode="process",
                           overwrite=True) as mgr:
        for step in (0, 1, 1):
            mgr.save_async(step, state, force=True)
        mgr.join()
        assert mgr.all_steps() == [1]
        out = _state(seed=2)
        mgr.restore(1, out)
    assert torch.equal(out["big"], state["big"])


def test_a_restart_racing_the_failed_save_keeps_the_new_writer(
        local_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's ensure() restarts the writer before the save thread has handled the old one's
    death: that thread must not mark the new writer dead (a second restart) nor hand arenas to
    the old one as sent (the new one would never map them)."""
    import ckptmgr.writer_process as wp

    state = _state()
    with CheckpointManager(local_root, save_interval=1, async_mode="process") as mgr:
        mgr.save_async(0, state)
        mgr.join()
        gated, restarted = threading.Event(), threading.Event()
        real_start, real_died = wp.WriterProcess._start, wp._died_message

        def start(self: Any, comm: Any, lease: Any) -> None:
            real_start(self, comm, lease)
            restarted.set()

        def died(rank: int, code: int | None, why: str | None) -> str:
            if threading.current_thread() is not threading.main_thread():  # the save thread
                gated.set()
                assert restarted.wait(60)  # the gate: the caller restarts the writer first
            return real_died(rank, code, why)

        monkeypatch.setattr(wp.WriterProcess, "_start", start)
        monkeypatch.setattr(wp, "_died_message", died)
        pid = _writer_pid(mgr)
        os.kill(pid, signal.SIGSTOP)
        assert mgr.save_async(1, state)
        os.kill(pid, signal.SIGKILL)
        assert gated.wait(60)  # the save thread saw the death (and reaped the writer)
        with pytest.raises(AsyncSaveError, match="killed by SIGKILL") as info:
            mgr.save_async(2, state)
        assert info.value.step == 1
        new = _writer_pid(mgr)  # the writer started by that call is alive and kept
        assert new != pid
        state["t"] = torch.ones(7)  # a new arena, sent to the new writer
        assert mgr.save_async(2, state)
        mgr.join()
        assert _writer_pid(mgr) == new
        assert mgr.all_steps() == [0, 2]


def test_storage_options_the_writer_cannot_read_are_clear_errors(
        local_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from ckptmgr._dist import Comm
    from ckptmgr._shm import ArenaSet
    from ckptmgr.writer_process import WriterProcess

    def writer(options: dict[str, Any]) -> WriterProcess:
        cfg = ckptmgr.ManagerConfig.from_kwargs(path=local_root, save_interval=1,
                                                async_mode="process", storage_options=options)
        return WriterProcess(cfg, ArenaSet())

    main = type("Main", (), {"__module__": "__main__"})  # as defined by a training script
    for bad in ({"lock": threading.Lock()}, {"retries": main()}):
        wp = writer(bad)
        with pytest.raises(ConfigError, match=r"storage.options.*async_mode='thread'"):
            wp.ensure(Comm(None), None)
        assert wp.pid is None  # nothing started
    # A value of a module that exists only in this process: the writer cannot import it.
    module = types.ModuleType("ckptmgr_test_only_here")
    only_here = type("OnlyHere", (int,), {"__module__": module.__name__})
    module.OnlyHere = only_here  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    wp = writer({"retries": only_here(3)})
    wp.ensure(Comm(None), None)
    try:
        assert wp._conn is not None
        kind, err = wp._conn.recv()  # the writer says why, instead of dying with a traceback
        assert kind == "err" and isinstance(err, ConfigError), err
        assert "storage.options" in str(err) and "ckptmgr_test_only_here" in str(err)
    finally:
        wp.close()


def test_a_file_system_registered_in_code_reaches_the_writer(tmp_path: Path) -> None:
    import fsspec
    from _custom_fs import AliasFileSystem

    fsspec.register_implementation("ckptalias", AliasFileSystem, clobber=True)
    root = f"ckptalias://{tmp_path}/run"
    with CheckpointManager(root, save_interval=1, async_mode="process") as mgr:
        mgr.save_async(0, {"w": torch.ones(3)})
        mgr.join()
        assert mgr.all_steps() == [0]
    assert (tmp_path / "run" / "0").is_dir()

    class InScript(AliasFileSystem):  # stands for a class of the training script
        protocol = ("ckptmain",)

    InScript.__module__ = "__main__"
    fsspec.register_implementation("ckptmain", InScript, clobber=True)
    with pytest.raises(ConfigError, match="__main__"):
        CheckpointManager(f"ckptmain://{tmp_path}/other", save_interval=1, async_mode="process")


def test_preemption_does_not_wait_for_a_stuck_writer(local_root: str) -> None:
    """A writer that cannot finish (frozen here) is stopped after a third of the grace period;
    the last checkpoint is then taken by the training process."""
    preempted = [False]
    state = _state()
    with CheckpointManager(local_root, save_interval=1, async_mode="process",
                           exit_on_preemption=False, preemption_grace_s=1.5,
                           preemption_check=lambda: preempted[0]) as mgr:
        mgr.save_async(0, state)
        mgr.join()
        os.kill(_writer_pid(mgr), signal.SIGSTOP)  # stuck for good
        mgr.save_async(1, state)
        preempted[0] = True
        assert mgr.save_async(2, state)  # waits 0.5 s for the stuck save, then saves step 2
        assert mgr.reached_preemption(2)
        assert mgr.all_steps() == [0, 2]
