"""Node loss on simulated nodes (issue 29 item 4): peer replicas and background durable copies.

    .venv/bin/python benchmarks/bench_nodes.py [--mib 256] [--reps 3] [--nodes 4]
        [--base /tmp/base] [--plain] [--quick] [--json out.json]

``--nodes`` simulated nodes of one rank each (tests/_nodes.py: each in its own namespaces with a
tmpfs as its local disk, or ``--plain`` processes with host directories), a state of ``--mib`` MiB
per rank (one int32 DTensor sharded over the ranks), the durable tier on moto's S3 server in this
process (tests/_servers.py). The job is tests/fixtures/node_train.py. Each repetition:

1. ``save`` job, without and with one replica (``local_replicas`` 0, then 1): ``save_async`` of
   step 2 (due on both tiers) then of step 3 (due on the local tier), then
   ``wait_until_finished``. Measured per rank: how long the call for step 3 blocked while step 2's
   durable copy was in flight; the process CPU (every thread) of the saves and their background
   work; bytes sent to peers and bytes on the local disk. The difference between the two jobs is
   what replicas cost.
2. With ``--base`` (a checkout of the code before background durable copies, put first on the
   nodes' ``PYTHONPATH``): the same job without replicas on that code, for the blocked time before.
3. After the job with replicas, one node is lost (SIGKILL of its processes, its disk gone) and
   replaced by an empty one. A restarted job restores the newest step (3, local only) from the
   peers; another, with empty local tiers, restores the newest durable step (2) from the S3 server.
   Measured: restart to restored (from the rank's start: process group, manager, restore).
4. A job killed while the durable copy of its step 2 is on its way (held at a fault proxy in
   front of the S3 server), every node kept: restart to restored of step 2 from the local tier
   while the durable copy the root lacks is owed (made again at construction).

Each figure is the slowest rank's; medians and minimums over the repetitions (the first is not
discarded: every repetition starts new jobs the same way). ``--quick``: 2 nodes, 1 MiB, 1
repetition (a smoke run; tests/project/test_bench_nodes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from _nodes import TRAIN, Job, Nodes, namespace_problem  # noqa: E402
from _servers import Fault, FaultProxy, MotoS3  # noqa: E402

BUCKET = "bench-nodes"


def _run(nodes: list[Any], spec: dict[str, Any], dir: str, env: dict[str, str],
         timeout_s: float) -> dict[int, Any]:
    job = Job(nodes, [str(TRAIN), json.dumps(spec)], dir, env=env, timeout_s=timeout_s)
    try:
        job.wait()
    finally:
        job.close()
    return job.results()


def _spec(root: str, sub: str, numel: int, replicas: int, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "manager": {"path": root, "save_interval": 2, "local_interval": 1,
                    "local_max_to_keep": 1, "local_replicas": replicas, "max_to_keep": 1,
                    "chkpt_on_preemption": False, "collective_timeout_s": 600},
        "local_sub": sub, "numel": numel, "timeout_s": 600}
    spec.update(kw)
    return spec


def _slowest(results: dict[int, Any], *path: str) -> float:
    vals = []
    for r in results.values():
        v: Any = r
        for p in path:
            v = v[p]
        vals.append(float(v))
    return max(vals)


def _save_job(nodes: list[Any], root: str, numel: int, replicas: int, dir: str,
              env: dict[str, str], timeout_s: float) -> tuple[dict[str, float], str]:
    sub = uuid.uuid4().hex
    res = _run(nodes, _spec(root, sub, numel, replicas, saves=[2, 3], async_save=True), dir,
               env, timeout_s)
    out = {"blocked_s": _slowest(res, "save_s", "3"), "first_s": _slowest(res, "save_s", "2"),
           "wait_s": _slowest(res, "wait_s"),
           "cpu_s": sum(float(r["cpu_s"]) for r in res.values()) / len(res),
           "local_bytes": sum(int(r["local_bytes"]) for r in res.values()) / len(res),
           "replica_bytes": sum(int(r["replica_bytes_sent"] or 0) for r in res.values())
           / len(res)}
    return out, sub


def _owed_restart(nodes: list[Any], proxy: FaultProxy, numel: int, d: str,
                  env: dict[str, str], timeout_s: float) -> tuple[dict[int, Any], str]:
    """A job killed while step 2's durable copy is on its way (its first data write held at the
    proxy), every node kept; the restarted job restores step 2 from the local tier while the
    copy the root still lacks is owed."""
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    sub = uuid.uuid4().hex
    key = root.split("://", 1)[1]
    fault = proxy.add(Fault(match=lambda m, p: m in ("PUT", "POST") and f"/{key}/" in p
                            and "data-" in p, reset=True, hold=threading.Event()))
    penv = {**env, "AWS_ENDPOINT_URL_S3": proxy.url}
    job = Job(nodes, [str(TRAIN), json.dumps(_spec(root, sub, numel, 0, saves=[2],
                                                   async_save=True))], f"{d}-killed", env=penv,
              timeout_s=timeout_s)
    try:
        if not fault.arrived.wait(timeout_s):
            raise AssertionError("the durable copy of step 2 never started")
    finally:
        job.close()
        assert fault.hold is not None
        fault.hold.set()
    res = _run(nodes, _spec(root, sub, numel, 0, restore="latest"), f"{d}-owed", penv,
               timeout_s)
    assert all(r["restored"]["step"] == 2 and r["restored"]["consistent"]
               for r in res.values()), res
    return res, root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--mib", type=float, default=256.0, help="MiB of state per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--base", default=None,
                    help="code before background durable copies (e.g. /tmp/base)")
    ap.add_argument("--plain", action="store_true", help="nodes without namespaces")
    ap.add_argument("--quick", action="store_true", help="2 nodes, 1 MiB, 1 repetition")
    ap.add_argument("--json", default=None, help="also write every figure here")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.reps, args.nodes = 1.0, 1, 2
    numel = int(args.mib * (1 << 20)) // 4
    timeout_s = 900.0
    namespaced = not args.plain and namespace_problem() is None
    server = MotoS3()
    server.make_bucket(BUCKET)
    fs = server.fs()
    proxy = FaultProxy(server.endpoint_url)
    env = {"AWS_ENDPOINT_URL_S3": server.endpoint_url, "AWS_ACCESS_KEY_ID": server.key,
           "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_DEFAULT_REGION": "us-east-1"}
    work = tempfile.mkdtemp(prefix="ckptmgr-bench-nodes-")
    names = [f"n{i}" for i in range(args.nodes)]
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    def drop(root: str) -> None:  # moto keeps objects in memory: one root at a time
        path = root.split("://", 1)[1]
        if fs.exists(path):
            fs.rm(path, recursive=True)

    base_nodes = None
    if args.base:
        base_nodes = Nodes(os.path.join(work, "base"), namespaced,
                           env={"PYTHONPATH": args.base})
    nodes = Nodes(os.path.join(work, "nodes"), namespaced)
    try:
        live = nodes.start(names)
        base_live = base_nodes.start(names) if base_nodes is not None else None
        for rep in range(args.reps):
            d = os.path.join(work, f"rep{rep}")
            if base_live is not None:
                root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
                before, _ = _save_job(base_live, root, numel, 0, f"{d}-base", env, timeout_s)
                add("blocked: save after a due durable save, before (base code)",
                    before["blocked_s"])
                drop(root)
            root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
            r0, _ = _save_job(live, root, numel, 0, f"{d}-r0", env, timeout_s)
            drop(root)
            add("blocked: save after a due durable save, after (no replicas)", r0["blocked_s"])
            root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
            r1, sub = _save_job(live, root, numel, 1, f"{d}-r1", env, timeout_s)
            add("blocked: save after a due durable save, after (1 replica)", r1["blocked_s"])
            add("wait_until_finished after the 2 saves, no replicas", r0["wait_s"])
            add("wait_until_finished after the 2 saves, 1 replica", r1["wait_s"])
            add("CPU s per rank for the 2 saves, no replicas", r0["cpu_s"])
            add("CPU s per rank for the 2 saves, 1 replica", r1["cpu_s"])
            add("replica CPU s per rank per local save", (r1["cpu_s"] - r0["cpu_s"]) / 2)
            add("replica MiB sent per rank per local save", r1["replica_bytes"] / 2 / (1 << 20))
            add("local disk MiB per node, 1 replica minus none",
                (r1["local_bytes"] - r0["local_bytes"]) / (1 << 20))
            # Lose the middle node; a replacement with an empty disk joins the restarted job.
            lost = args.nodes // 2
            live[lost].lose()
            live[lost] = nodes.add(names[lost])
            peers = _run(live, _spec(root, sub, numel, 1, restore="latest"), f"{d}-peers", env,
                         timeout_s)
            assert all(r["restored"]["step"] == 3 and r["restored"]["tier"] == "local"
                       and r["restored"]["consistent"] for r in peers.values()), peers
            add("restart to restored, from peers (step 3, local)",
                _slowest(peers, "restored", "restart_to_restored_s"))
            add("  of which restore()", _slowest(peers, "restored", "restore_s"))
            durable = _run(live, _spec(root, uuid.uuid4().hex, numel, 1, restore="latest"),
                           f"{d}-durable", env, timeout_s)
            assert all(r["restored"]["step"] == 2 and r["restored"]["tier"] == "durable"
                       and r["restored"]["consistent"] for r in durable.values()), durable
            add("restart to restored, from the durable tier (step 2, S3 server)",
                _slowest(durable, "restored", "restart_to_restored_s"))
            add("  of which restore() ", _slowest(durable, "restored", "restore_s"))
            drop(root)
            owed, root = _owed_restart(live, proxy, numel, d, env, timeout_s)
            add("restart to restored, nodes kept, a durable copy owed (step 2, local)",
                _slowest(owed, "restored", "restart_to_restored_s"))
            add("  of which restore()  ", _slowest(owed, "restored", "restore_s"))
            drop(root)
            for node in live:  # the next repetition starts with empty disks
                node.wipe_disk()
    finally:
        nodes.close()
        if base_nodes is not None:
            base_nodes.close()
        proxy.stop()
        server.stop()
    load = os.getloadavg()
    print(f"{args.nodes} nodes ({'namespaced, tmpfs disks' if namespaced else 'plain processes'})"
          f", 1 rank each, {args.mib:g} MiB per rank, durable tier on moto S3 in this process; "
          f"{args.reps} repetitions; load average at the end {load[0]:.1f}/{load[1]:.1f}/"
          f"{load[2]:.1f} on {os.cpu_count()} CPUs")
    print("| measure | median | min |")
    print("| --- | --- | --- |")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.median(vals):.3f} | {min(vals):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "namespaced": namespaced,
                                               "rows": rows, "load": load}, indent=1))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"(took {time.perf_counter() - t0:.0f} s)")
