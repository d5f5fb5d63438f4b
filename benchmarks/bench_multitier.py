"""Local tier vs durable tier (S3 server) for the same state: save and restore seconds.

    .venv/bin/python benchmarks/bench_multitier.py [--mib 128] [--reps 3]

One process (world size 1), a state of ``--mib`` MiB in 32 float32 tensors. The local tier is a
directory on this machine's disk (``--local``, default a temp dir); the durable tier is moto's S3
server in this process (tests/_servers.py), as in the test suite. Each repetition saves a new step
to each tier with ``save`` (blocking: staging + write + commit) and restores it; medians and
minimums are printed (the first repetition is a warm-up and discarded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import ckptmgr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--local", default=None)
    args = ap.parse_args()
    from _servers import MotoS3

    server = MotoS3()
    server.make_bucket("bench")
    os.environ.update(AWS_ENDPOINT_URL_S3=server.endpoint_url, AWS_ACCESS_KEY_ID=server.key,
                      AWS_SECRET_ACCESS_KEY=server.secret, AWS_DEFAULT_REGION="us-east-1")
    n = 32
    numel = args.mib * (1 << 20) // 4 // n
    state = {f"t{i}": torch.randn(numel) for i in range(n)}
    local = args.local or tempfile.mkdtemp(prefix="ckptmgr-bench-local-")
    durable = f"s3://bench/{uuid.uuid4().hex}"
    # Two managers over the same state: one only ever due on the local tier, one only durable.
    loc = ckptmgr.CheckpointManager(tempfile.mkdtemp(), save_interval=10**9, local_path=local,
                                    local_interval=1, chkpt_on_preemption=False)
    dur = ckptmgr.CheckpointManager(durable, save_interval=1, chkpt_on_preemption=False)
    times: dict[str, list[float]] = {k: [] for k in ("local save", "local restore",
                                                     "durable save", "durable restore")}
    for rep in range(args.reps + 1):
        step = rep + 1
        for name, mgr in (("local", loc), ("durable", dur)):
            t = time.perf_counter()
            assert mgr.save(step, state)
            save_s = time.perf_counter() - t
            t = time.perf_counter()
            mgr.restore(step, state)
            restore_s = time.perf_counter() - t
            if rep:
                times[f"{name} save"].append(save_s)
                times[f"{name} restore"].append(restore_s)
    loc.close()
    dur.close()
    server.stop()
    mib = args.mib
    print(f"state {mib} MiB, {args.reps} reps (after a warm-up); local tier at {local}")
    print("| operation | median s | min s | MiB/s (median) |")
    print("| --- | --- | --- | --- |")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.3f} | {min(v):.3f} | {mib / med:.0f} |")


if __name__ == "__main__":
    main()
