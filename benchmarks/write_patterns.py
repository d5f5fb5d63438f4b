"""How fast a disk takes 1 GiB in each pattern of direct writes: write size, writes in flight,
and whether the file is preallocated, interleaved over several rounds.

The local writer writes 16 MiB pieces (1/64 of a 1 GiB file), up to five in flight, into a
preallocated file; ``floor.write_direct`` writes 64 MiB at a time, one in flight, into a file it
extends. On this machine's virtual disk neither pattern is always the faster one (the same hour
gave 16 MiB x6 0.514 s and 64 MiB x1 0.786 s, and pairs where the floor beat our save by 1.24x;
docs/performance.md, "Round 5"), so this measures the disk itself, no CPU work in the way: each
round runs every pattern once, in a shuffled order, from page-aligned buffers of random bytes.

    python benchmarks/write_patterns.py --dir /path/on/the/disk [--rounds 8] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import random
import statistics
import sys
import threading
import time

MIB = 1 << 20
TOTAL = 1 << 30
# (write size, writes in flight, preallocated)
PATTERNS = [(64 * MIB, 1, False), (64 * MIB, 2, True), (32 * MIB, 3, True), (16 * MIB, 1, True),
            (16 * MIB, 3, True), (16 * MIB, 6, True), (16 * MIB, 6, False), (8 * MIB, 4, True)]


def _buffer(size: int, cache: dict[int, mmap.mmap]) -> mmap.mmap:
    if size not in cache:
        m = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        m[:] = os.urandom(size)
        cache[size] = m
    return cache[size]


def write_once(path: str, size: int, in_flight: int, prealloc: bool,
               cache: dict[int, mmap.mmap]) -> float:
    """Seconds to write ``TOTAL`` bytes to a new ``path`` in this pattern, fsync included."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    view = memoryview(_buffer(size, cache))
    offsets: queue.SimpleQueue[int] = queue.SimpleQueue()
    for off in range(0, TOTAL, size):
        offsets.put(off)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            while True:
                try:
                    off = offsets.get_nowait()
                except queue.Empty:
                    return
                os.pwrite(fd, view, off)
        except BaseException as e:  # reported below
            errors.append(e)

    t0 = time.perf_counter()
    try:
        if prealloc:
            os.posix_fallocate(fd, 0, TOTAL)
        threads = [threading.Thread(target=writer) for _ in range(in_flight)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        os.sync()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a directory on the disk to measure")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", help="write the seconds of every round here (JSON)")
    args = p.parse_args(argv)
    if not hasattr(os, "O_DIRECT"):
        print("no O_DIRECT on this platform", file=sys.stderr)
        return 2
    path = os.path.join(args.dir, f".write-patterns-{os.getpid()}.bin")
    cache: dict[int, mmap.mmap] = {}
    try:
        write_once(path, *PATTERNS[0], cache)  # warm-up
    except OSError as e:
        print(f"{args.dir}: direct writes refused ({e})", file=sys.stderr)
        return 2
    seconds: dict[tuple[int, int, bool], list[float]] = {pat: [] for pat in PATTERNS}
    for r in range(args.rounds):
        order = PATTERNS[:]
        random.Random(r).shuffle(order)
        for pat in order:
            seconds[pat].append(write_once(path, *pat, cache))
    print(f"1 GiB of direct writes, {args.rounds} rounds, shuffled; load average "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| write size | in flight | preallocated | median s | min s |")
    print("|---:|---:|---|---:|---:|")
    for (size, n, pre), xs in seconds.items():
        print(f"| {size // MIB} MiB | {n} | {'yes' if pre else 'no'} | "
              f"{statistics.median(xs):.3f} | {min(xs):.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{"write_bytes": s, "in_flight": n, "preallocated": pre, "seconds": xs}
                       for (s, n, pre), xs in seconds.items()], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
