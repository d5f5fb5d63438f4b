"""Peer replicas of the local tier (``local_replicas``, ckptmgr/replicas.py): real gloo ranks as
plain processes, each "node" a distinct ``GROUP_RANK`` and its own ``local_path`` directory; a
node is lost by ending its processes and deleting its directory, then a fresh job resumes.

The durable tier is a local root that never holds the local steps (``save_interval`` 1000), so
a step restored with every part equal to what was saved came from the local tier and its peers.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks

import ckptmgr
from ckptmgr.local_tier import _Held, _whole
from ckptmgr.replicas import plan_holders


def _state(rank: int, step: int, tag: int = 0) -> dict[str, Any]:
    """A state whose every byte says which rank, step and run wrote it (random bits included)."""
    g = torch.Generator().manual_seed(rank * 100_003 + step * 7 + tag * 1_000_003)
    return {"w": torch.randn(257, generator=g), "ramp": torch.arange(100) + 1000 * rank + step,
            "meta": {"rank": rank, "step": step, "tag": tag}}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(257), "ramp": torch.zeros(100, dtype=torch.int64),
            "meta": {"rank": -1, "step": -1, "tag": -1}}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["w"].numpy().tobytes() == b["w"].numpy().tobytes()
            and torch.equal(a["ramp"], b["ramp"]) and a["meta"] == b["meta"])


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _node_dir(nodes: str, node: int) -> str:
    """A node's ``local_path``; one for all (``nodes`` ending in ``shared``): one machine."""
    return nodes if nodes.endswith("shared") else os.path.join(nodes, f"node{node}")


def _manager(rank: int, nodes: str, node_of: list[int], root: str, k: int,
             **kw: Any) -> ckptmgr.CheckpointManager:
    os.environ["GROUP_RANK"] = str(node_of[rank])
    kw.setdefault("local_max_to_keep", 2)
    return ckptmgr.CheckpointManager(root, save_interval=1000, local_path=_node_dir(
        nodes, node_of[rank]), local_interval=1, local_replicas=k, **kw)


def _held(nodes: str, node: int, rank: int) -> dict[str, list[int]]:
    """What rank ``rank`` holds on disk: its own steps and each replica directory's."""
    base = Path(_node_dir(nodes, node), f"rank-{rank}")
    out = {"own": sorted(int(p.name) for p in base.iterdir() if p.name.isdigit())}
    for d in sorted((base / "replicas").glob("rank-*")):
        out[d.name] = sorted(int(p.name) for p in d.iterdir() if (p / "commit.json").exists())
    return out


def _train(rank: int, world: int, nodes: str, node_of: list[int], root: str, k: int,
           steps: list[int], tag: int, mode: str) -> dict[str, Any]:
    """Save ``steps`` (sync, async + join, or sync then a bare close); what each rank holds."""
    logs = _Logs()
    logging.getLogger("ckptmgr").addHandler(logs)
    out: dict[str, Any] = {}
    mgr = _manager(rank, nodes, node_of, root, k)
    for s in steps:
        if mode == "async":
            assert mgr.save_async(s, _state(rank, s, tag))
            mgr.join()  # waits for the replica transfer too: what this rank holds is committed
            out[f"after_join_{s}"] = _held(nodes, node_of[rank], rank)
        else:
            assert mgr.save(s, _state(rank, s, tag))
    out["all"] = mgr.all_steps()
    mgr.close()  # waits for the last transfer
    out["warnings"] = logs.lines
    return out


def _resume(rank: int, world: int, nodes: str, node_of: list[int], root: str, k: int,
            tag: int) -> dict[str, Any]:
    mgr = _manager(rank, nodes, node_of, root, k)
    out: dict[str, Any] = {"all": mgr.all_steps(), "latest": mgr.latest_step()}
    out["tiers"] = {s: mgr.step_info(s).tiers for s in mgr.all_steps()}
    target = _empty()
    out["restored"] = mgr.restore_latest(target)
    step = out["restored"]
    out["exact"] = step is not None and _same(target, _state(rank, step, tag))
    # Every rank's part of step 1 is rank 0's state (saved alike on every rank).
    out["as_rank0"] = step is not None and _same(target, _state(0, step, tag))
    out["meta"] = target["meta"]
    mgr.close()
    out["held"] = _held(nodes, node_of[rank], rank)
    return out


def _lose(nodes: str, *lost: int) -> None:
    for n in lost:
        shutil.rmtree(Path(nodes, f"node{n}"))


def _durable_steps(root: str) -> list[str]:
    return sorted(p for p in os.listdir(root) if p.isdigit()) if os.path.isdir(root) else []


# ------------------------------------------------------------------------- single process


def test_holders_by_node_ring() -> None:
    # One rank per node: each part on the next node(s), never its own.
    assert plan_holders(["0", "1", "2"], 1) == [[1], [2], [0]]
    assert plan_holders(["0", "1", "2"], 2) == [[1, 2], [2, 0], [0, 1]]
    # Two ranks per node: the same local index on the next node; numeric ids sort as numbers.
    assert plan_holders(["10", "10", "2", "2"], 1) == [[2], [3], [0], [1]]
    # Fewer nodes than k + 1: nodes - 1 replicas; one node: none.
    assert plan_holders(["a", "b"], 3) == [[1], [0]]
    assert plan_holders(["a", "a"], 1) == [[], []]


def test_whole_counts_replicas_and_chooses_the_newest_save() -> None:
    old, new = "1.aaaaaaaaaaaa-3", "2.bbbbbbbbbbbb-1"
    # Rank 1's own copy is gone; rank 0 holds a replica of it: whole, held by rank 0.
    whole, holders = _whole([([_Held(5, True, new)], [(1, _Held(5, True, new))]), ([], [])], 2)
    assert whole == {5: new} and holders == {5: {0: [], 1: [0]}}
    # A damaged replica does not count.
    assert _whole([([_Held(5, True, new)], [(1, _Held(5, False, new))]), ([], [])], 2)[0] == {}
    # A stale node back: both saves are whole; the newer one wins, never a mix.
    reports = [([_Held(5, True, new)], [(1, _Held(5, True, new))]),
               ([_Held(5, True, old)], [(0, _Held(5, True, old))])]
    assert _whole(reports, 2)[0] == {5: new}
    # A void step (its last save failed) is whole nowhere.
    assert _whole(reports, 2, {5})[0] == {}


# ------------------------------------------------------------------------------ two ranks


def test_lose_one_of_two_nodes_resumes_from_peers(tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    a = run_ranks(_train, 2, nodes, [0, 1], root, 1, [1, 2, 3], 0, "async", timeout_s=120)
    for r, res in enumerate(a):
        assert res["all"] == [2, 3]
        # save_async + join: the replica of the peer's step is committed when join returns.
        assert res["after_join_2"][f"rank-{1 - r}"] == [1, 2]
        # Retention deleted the replicas with their step.
        assert _held(nodes, r, r) == {"own": [2, 3], f"rank-{1 - r}": [2, 3]}
    assert _durable_steps(root) == []

    _lose(nodes, 1)
    b = run_ranks(_resume, 2, nodes, [0, 1], root, 1, 0, timeout_s=120)
    for res in b:
        assert res["all"] == [2, 3] and res["latest"] == 3, res
        assert res["tiers"] == {2: ("local",), 3: ("local",)}, res
        assert res["restored"] == 3 and res["exact"], res
    assert _durable_steps(root) == []
    # The lost node's rank received its part of the step it restored and keeps it (healed).
    assert b[1]["held"] == {"own": [3]}, b[1]["held"]


def test_close_waits_for_the_transfer_and_k_above_the_nodes_warns(tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    a = run_ranks(_train, 2, nodes, [0, 1], root, 3, [4], 0, "sync", timeout_s=120)
    for r, res in enumerate(a):
        assert _held(nodes, r, r) == {"own": [4], f"rank-{1 - r}": [4]}  # close waited
        assert any("local_replicas=3 but the job spans 2 node(s)" in w
                   for w in res["warnings"]), res["warnings"]
    # One node: no replicas at all, one warning, saves as without them.
    one = str(tmp_path / "one")
    b = run_ranks(_train, 2, one, [0, 0], root + "1", 1, [1], 0, "sync", timeout_s=120)
    assert all(any("spans 1 node(s)" in w for w in res["warnings"]) for res in b)
    assert _held(one, 0, 0) == {"own": [1]} and _held(one, 0, 1) == {"own": [1]}


def test_one_local_path_for_every_rank_and_one_rank_directory_wiped(tmp_path: Path) -> None:
    # Every rank on one machine with one local_path, nodes told apart by GROUP_RANK only: all a
    # rank holds is inside <local_path>/rank-<r>, so wiping that directory loses one "node".
    nodes, root = str(tmp_path / "shared"), str(tmp_path / "root")
    run_ranks(_train, 2, nodes, [0, 1], root, 1, [5, 6], 0, "sync", timeout_s=120)
    assert sorted(os.listdir(nodes)) == ["rank-0", "rank-1"]
    shutil.rmtree(Path(nodes, "rank-0"))
    res = run_ranks(_resume, 2, nodes, [0, 1], root, 1, 0, timeout_s=120)
    assert all(r["all"] == [5, 6] and r["restored"] == 6 and r["exact"] for r in res), res


def test_stale_directory_of_a_returning_node_is_never_mixed_in(tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    run_ranks(_train, 2, nodes, [0, 1], root, 1, [3, 4], 1, "sync", timeout_s=120)
    stale = tmp_path / "stale-node1"
    shutil.copytree(Path(nodes, "node1"), stale)  # node 1 as it was: steps 3, 4 of run 1
    run_ranks(_train, 2, nodes, [0, 1], root, 1, [3, 4], 2, "sync", timeout_s=120)
    _lose(nodes, 1)
    shutil.copytree(stale, Path(nodes, "node1"))  # node 1 comes back with run 1's files
    res = run_ranks(_resume, 2, nodes, [0, 1], root, 1, 2, timeout_s=120)
    for r in res:
        assert r["restored"] == 4 and r["exact"] and r["meta"]["tag"] == 2, r


# ---------------------------------------------------------------------------- three ranks


def test_a_damaged_replica_is_not_counted(tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    run_ranks(_train, 3, nodes, [0, 1, 2], root, 1, [2, 3], 0, "sync", timeout_s=120)
    # A flipped byte in the only replica of rank 1's step 3 (held by rank 2: the ring
    # 0 -> 1 -> 2 -> 0), then node 1 lost: step 3 has no whole copy of rank 1's part.
    rep = Path(nodes, "node2", "rank-2", "replicas", "rank-1", "3")
    data = next(p for p in rep.iterdir() if p.name.startswith("data-"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    _lose(nodes, 1)
    res = run_ranks(_resume, 3, nodes, [0, 1, 2], root, 1, 0, timeout_s=120)
    assert all(r["all"] == [2] and r["restored"] == 2 and r["exact"] for r in res), res


def _durable_then_local(rank: int, world: int, nodes: str, node_of: list[int], root: str,
                        k: int) -> list[int]:
    with _manager(rank, nodes, node_of, root, k) as mgr:
        # Both tiers; the same on every rank: DCP stores a plain tensor once, as replicated.
        assert mgr.save(1, _state(0, 1), force=True)
        for s in (2, 3):
            assert mgr.save(s, _state(rank, s))
        return mgr.all_steps()


@pytest.mark.parametrize("lost", [(1,), (1, 2)], ids=["one-lost", "two-lost"])
def test_durable_fallback_when_a_part_has_no_copy(tmp_path: Path, lost: tuple[int, ...]) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    assert run_ranks(_durable_then_local, 3, nodes, [0, 1, 2], root, 1,
                     timeout_s=120)[0] == [1, 2, 3]
    assert _durable_steps(root) == ["1"]
    _lose(nodes, *lost)
    res = run_ranks(_resume, 3, nodes, [0, 1, 2], root, 1, 0, timeout_s=120)
    want = 3 if len(lost) == 1 else 1  # two lost neighbours with k=1: the durable step
    for r in res:
        assert r["restored"] == want and (r["exact"] if want == 3 else r["as_rank0"]), r
        assert r["all"] == ([1, 2, 3] if want == 3 else [1]), r


def _resave_fails_on_rank_1(rank: int, world: int, nodes: str, root: str) -> dict[str, Any]:
    import ckptmgr.local_tier as local_tier

    out: dict[str, Any] = {}
    with _manager(rank, nodes, [0, 1], root, 1) as mgr:
        assert mgr.save(1, _state(rank, 1, 1))
        mgr.join()  # step 1 of save 1 is held twice: by each rank and by its peer
        out["held_before"] = _held(nodes, rank, rank)
        real = local_tier.write_step
        if rank == 1:
            def disk_full(*args: Any, **kwargs: Any) -> Any:
                raise OSError(28, "No space left on device (injected)")
            local_tier.write_step = disk_full  # type: ignore[assignment]
        try:
            mgr.save(1, _state(rank, 1, 2))
        except ckptmgr.errors.SaveError:
            out["failed"] = True
        finally:
            local_tier.write_step = real  # type: ignore[assignment]
        out["listed"] = mgr.all_steps()
    out["held_after"] = _held(nodes, rank, rank)
    with _manager(rank, nodes, [0, 1], root, 1) as mgr:
        out["listed_after_restart"] = mgr.all_steps()
    return out


def test_a_failed_resave_is_whole_nowhere_replicas_of_the_older_save_included(
        tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    res = run_ranks(_resave_fails_on_rank_1, 2, nodes, root, timeout_s=120)
    for r, out in enumerate(res):
        assert out["held_before"] == {"own": [1], f"rank-{1 - r}": [1]}, out
        assert out["failed"] and out["listed"] == [] and out["listed_after_restart"] == [], out
        assert out["held_after"] == {"own": [], f"rank-{1 - r}": []}, out


def _resume_after_first_holder_lost_its_copy(rank: int, world: int, nodes: str,
                                             root: str) -> dict[str, Any]:
    with _manager(rank, nodes, [0, 1, 2], root, 2) as mgr:
        latest = mgr.latest_step()
        if rank == 0:  # after the agreement: rank 0 was to send rank 1's part, and cannot
            shutil.rmtree(Path(nodes, "node0", "rank-0", "replicas", "rank-1", str(latest)))
        target = _empty()
        mgr.restore(latest, target)
        return {"latest": latest, "exact": _same(target, _state(rank, latest))}


def test_a_holder_whose_copy_went_bad_is_followed_by_the_next(tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    run_ranks(_train, 3, nodes, [0, 1, 2], root, 2, [7], 0, "sync", timeout_s=120)
    assert _held(nodes, 0, 0) == {"own": [7], "rank-1": [7], "rank-2": [7]}
    _lose(nodes, 1)
    res = run_ranks(_resume_after_first_holder_lost_its_copy, 3, nodes, root, timeout_s=120)
    assert all(r["latest"] == 7 and r["exact"] for r in res), res


def _save_async_beside_a_held_transfer(rank: int, world: int, nodes: str, node_of: list[int],
                                       root: str) -> dict[str, Any]:
    """Hold step 1's replica transfer mid-way (an event of this process); ``save_async(2)``
    must return while it is held: the next local save waits for it on the save's own thread."""
    from ckptmgr import replicas

    release = threading.Event()
    real = replicas.Sender.messages

    def messages(self: Any) -> Any:
        for i, message in enumerate(real(self)):
            if self.step == 1 and i == 2:
                release.wait(120)
            yield message

    replicas.Sender.messages = messages  # type: ignore[method-assign]
    mgr = _manager(rank, nodes, node_of, root, 1)
    assert mgr.save(1, _state(rank, 1))  # returns after the local commit; transfer held
    # A watchdog releases it if save_async waited for the transfer (then the test fails).
    watchdog = threading.Timer(30.0, release.set)
    watchdog.start()
    assert mgr.save_async(2, _state(rank, 2))
    returned_while_held = not release.is_set()
    release.set()
    watchdog.cancel()
    mgr.join()
    out = {"returned_while_held": returned_while_held, "all": mgr.all_steps(),
           "held": _held(nodes, node_of[rank], rank)}
    mgr.close()
    return out


def test_save_async_does_not_wait_for_the_previous_transfer(tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    res = run_ranks(_save_async_beside_a_held_transfer, 2, nodes, [0, 1], root, timeout_s=120)
    for r, out in enumerate(res):
        assert out["returned_while_held"], out
        assert out["all"] == [1, 2]
        assert out["held"] == {"own": [1, 2], f"rank-{1 - r}": [1, 2]}


_EXIT_WITHOUT_CLOSE = """
import os, sys, torch, torch.distributed as dist, ckptmgr
rank, base = int(sys.argv[1]), sys.argv[2]
os.environ["GROUP_RANK"] = str(rank)
dist.init_process_group("gloo", init_method=f"file://{base}/store", rank=rank, world_size=2)
mgr = ckptmgr.CheckpointManager(f"{base}/root", save_interval=1000, local_path=f"{base}/node{rank}",
                                local_interval=1, local_replicas=1)
for s in (1, 2):
    mgr.save(s, {"w": torch.randn(1 << 20) + rank, "s": s})
print("saved", flush=True)
"""


def test_interpreter_exit_without_close_waits_for_the_transfer(tmp_path: Path,
                                                               zygote: Any) -> None:
    # A training script that ends without close(): the process exits cleanly (a daemon transfer
    # thread killed inside a gloo call aborted it, status 134) with step 2's replicas committed.
    runs = [zygote.spawn([str(r), str(tmp_path)], code=_EXIT_WITHOUT_CLOSE) for r in (0, 1)]
    outs = [run.communicate(120) for run in runs]
    for run, (out, err) in zip(runs, outs, strict=True):
        assert run.returncode == 0 and "saved" in out, err
    for r in (0, 1):
        assert _held(str(tmp_path), r, r) == {"own": [1, 2], f"rank-{1 - r}": [1, 2]}


# Fault hook (test-only: no real part parks a gloo worker on demand): the transfer's last
# collective is an all_gather on the replica group (the second of its all_gather_object).
# On rank 0 the gloo worker that completes it runs a done-callback that waits until interpreter
# exit began; rank 1 joins the collective only once that callback is attached (a file gate), so
# the worker, not the transfer thread, runs it. The transfer thread goes on at completion, so
# the worker is still finishing the collective when the script ends: a worker that lost the CPU
# there is what aborted a run (it took the GIL during finalization, at status -6).
_PARK_THE_LAST_GATHER = """
import atexit, threading, time
import torch.distributed.distributed_c10d as c10d
exiting = threading.Event()
def begin_exit():
    sys.setswitchinterval(1000)  # the main thread keeps the GIL from here until it blocks
    exiting.set()
atexit.register(begin_exit)  # registered after ckptmgr's exit hook: runs before it
real, calls, attached = c10d.all_gather, [0], f"{base}/attached"
def all_gather(tensor_list, tensor, group=None, async_op=False):
    me = threading.current_thread()
    if async_op or me.name != "ckptmgr-replicas-2":
        return real(tensor_list, tensor, group=group, async_op=async_op)
    calls[0] += 1
    if calls[0] < 2:
        return real(tensor_list, tensor, group=group, async_op=async_op)
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(attached) and time.monotonic() < deadline:
            time.sleep(0.005)
        return real(tensor_list, tensor, group=group, async_op=async_op)
    fut = real(tensor_list, tensor, group=group, async_op=True).get_future()
    fut.add_done_callback(lambda _: None if threading.current_thread() is me else exiting.wait())
    open(attached, "x").close()
    fut.wait()  # completed: the callbacks run after the waiters are woken
c10d.all_gather = all_gather
"""


def test_interpreter_exit_without_close_while_gloo_finishes_the_last_collective(
        tmp_path: Path, zygote: Any) -> None:
    # Without ckptmgr's exit hook (ckptmgr/_exit.py: the groups of a manager not closed are
    # destroyed, their workers joined, before finalization) rank 0 aborted in 4 of 4 runs.
    code = _EXIT_WITHOUT_CLOSE.replace("for s in (1, 2):", _PARK_THE_LAST_GATHER
                                       + "for s in (1, 2):")
    runs = [zygote.spawn([str(r), str(tmp_path)], code=code) for r in (0, 1)]
    outs = [run.communicate(120) for run in runs]
    for run, (out, err) in zip(runs, outs, strict=True):
        assert run.returncode == 0 and "saved" in out, err
    assert (tmp_path / "attached").exists()  # the worker was parked: the case was armed
    for r in (0, 1):
        assert _held(str(tmp_path), r, r) == {"own": [1, 2], f"rank-{1 - r}": [1, 2]}


def _native_threads() -> int:
    """Threads of this process that Python did not start (torch's: gloo workers and loops)."""
    return len(os.listdir("/proc/self/task")) - len(threading.enumerate())


def _exit_hook_without_close(rank: int, world: int, nodes: str, node_of: list[int],
                             root: str) -> dict[str, Any]:
    from ckptmgr import _exit

    before = _native_threads()
    mgr = _manager(rank, nodes, node_of, root, 1)
    mgr.save(1, _state(rank, 1))
    mgr._local.wait_replicas()  # type: ignore[union-attr]
    with_groups = _native_threads()
    _exit._at_exit()  # what the interpreter runs at exit (close() never called)
    out: dict[str, Any] = {"before": before, "with_groups": with_groups,
                           "after": _native_threads()}
    try:
        mgr.save(2, _state(rank, 2))
    except ckptmgr.CkptmgrError as e:
        out["save_after"] = str(e)
    _exit._at_exit()  # a second run (or a close() after it) finds nothing left to do
    mgr.close()
    return out


def test_the_exit_hook_ends_the_groups_of_a_manager_never_closed(tmp_path: Path) -> None:
    # Four groups of ckptmgr's per rank (caller, save worker, replica transfer, uploader), each
    # with gloo threads that only end once nothing holds the group any more.
    res = run_ranks(_exit_hook_without_close, 2, str(tmp_path / "nodes"), [0, 1],
                    str(tmp_path / "root"), timeout_s=120)
    for r in res:
        assert r["with_groups"] > r["before"] and r["after"] == r["before"], r
        assert "closed" in r["save_after"], r


def _train_beside_a_file_named_replicas(rank: int, world: int, nodes: str, node_of: list[int],
                                        root: str) -> dict[str, Any]:
    logs = _Logs()
    logging.getLogger("ckptmgr").addHandler(logs)
    if rank == 0:  # where rank 0's replicas go, a file: listing it fails with an OSError
        base = Path(_node_dir(nodes, node_of[rank]), "rank-0")
        base.mkdir(parents=True)
        (base / "replicas").write_text("not a directory")
    mgr = _manager(rank, nodes, node_of, root, 1)
    saved = mgr.save(1, _state(rank, 1))
    out = {"saved": saved, "all": mgr.all_steps(), "warnings": logs.lines}
    mgr.close()
    return out


def test_an_unlistable_replicas_entry_warns_and_never_hangs_the_peers(tmp_path: Path) -> None:
    nodes, root = str(tmp_path / "nodes"), str(tmp_path / "root")
    res = run_ranks(_train_beside_a_file_named_replicas, 2, nodes, [0, 1], root, timeout_s=120)
    assert all(r["saved"] and r["all"] == [1] for r in res), res
    assert any("cannot list" in w for w in res[0]["warnings"]), res[0]["warnings"]
