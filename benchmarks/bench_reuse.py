"""Sharing unchanged tensors across steps (``reuse_unchanged=True``): bytes written and time until
committed, against the first save and against reuse off.

Scenarios, each on a state of ``--size`` bytes (default 1 GiB, float32):

- ``frozen``: 90% of the bytes frozen (a base model), 10% trained (adapters and their optimizer
  state: changed in place before every save). One root per run, reuse on: the first save writes
  everything; the 2nd and later saves (``--saves`` in all) should write about the trained 10%.
  Per run, the median of the later saves over the first, for bytes written and for the time until
  committed (``save`` returns after the commit). Targets: bytes <= 0.15x, time <= 0.3x.
- ``trained``: every byte changes before every save (full fine-tuning): nothing can be shared, so
  reuse on only adds the hashing. Interleaved pairs (reuse off then on, then on then off, ...),
  each side with its own root and manager; ratio on/off per pair. Target: overhead <= 5%.
- ``async``: the 90% frozen state saved with ``save_async`` in interleaved pairs, reuse off and
  on: the time the caller is blocked (the hash runs on the write threads, after the call returned,
  so it should not grow) and the time until committed.
- ``embedding`` and ``embedding_hot``: one embedding table (rows x 256 float32) where 1% of the
  rows change before every save: ``embedding`` draws the rows uniformly (the worst case for fixed
  chunks: a chunk changes if any of its rows does); ``embedding_hot`` draws them from a Zipf law
  over the row index (a frequency-sorted vocabulary: the frequent tokens' rows, near the start,
  change most). Same measures as ``frozen``.

Floors, measured once per run on the same bytes: ``floor.write`` (the fastest of bench.py's three
ways of writing 64 MiB pieces then fsync: buffered, buffered with streaming writeback, O_DIRECT)
and ``floor.hash`` (xxh3-128 of the whole state on one thread: what the content hash costs at
least). Every run starts on a fresh root, deleted and synced untimed; the first
``--warmup`` runs (pairs, for ``trained``) are discarded; tables give medians and minimums.

Bytes written are measured on disk: the sizes of the files a save created under the root (its
step directory and new shared chunks), found by listing the root before and after, untimed.

Usage::

    python benchmarks/bench_reuse.py --dir /scratch --out benchmarks/results   # 1 GiB, ~3 min
    python benchmarks/bench_reuse.py --quick --dir /tmp                        # 16 MiB, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # benchmarks/ is not a package: bench.py sits beside this file

SCENARIOS = ["frozen", "trained", "embedding", "embedding_hot", "async"]
EMBED_DIM = 256  # columns of the embedding table (1 KiB rows in float32)
CHANGED_ROWS = 0.01  # the fraction of the table's rows changed before each save
FROZEN_SHARE = 0.9  # the fraction of the frozen state's bytes that never changes


# ------------------------------------------------------------------------------------ the states


def frozen_state(total: int, count: int, seed: int = 0) -> tuple[dict[str, torch.Tensor],
                                                                 list[str]]:
    """A flat state of about ``total`` bytes: ``FROZEN_SHARE`` of it in ``base.*`` tensors, the
    rest in ``adapter.*`` tensors; returns it and the keys that change (the adapters)."""
    frozen_bytes = int(total * FROZEN_SHARE)
    n_frozen = max(1, int(count * FROZEN_SHARE))
    base = bench.make_state(frozen_bytes, n_frozen, seed)
    adapters = bench.make_state(total - frozen_bytes, max(1, count - n_frozen), seed + 1)
    state = {f"base.{k}": v for k, v in base.items()}
    state.update({f"adapter.{k}": v for k, v in adapters.items()})
    return state, [k for k in state if k.startswith("adapter.")]


def embedding_state(total: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One ``rows x EMBED_DIM`` float32 table of about ``total`` bytes."""
    rows = max(100, total // (EMBED_DIM * 4))
    gen = torch.Generator().manual_seed(seed)
    table = torch.empty(rows, EMBED_DIM).uniform_(-1, 1, generator=gen)
    return {"embedding.weight": table}


def zipf_weights(n: int, s: float = 1.1) -> torch.Tensor:
    """Probability of drawing row ``i``: proportional to ``1 / (i + 1) ** s``."""
    return 1.0 / torch.arange(1, n + 1, dtype=torch.float64).pow(s)


class Mutator:
    """Changes a state in place before each save, as a training step would (untimed)."""

    def __init__(self, scenario: str, state: dict[str, torch.Tensor], trained: Sequence[str],
                 seed: int = 0) -> None:
        self.scenario = scenario
        self.state = state
        self.trained = list(trained)
        self.gen = torch.Generator().manual_seed(seed)
        self._zipf: torch.Tensor | None = None

    def step(self) -> None:
        if self.scenario in ("frozen", "trained"):
            for k in self.trained:
                # Changes every element's bytes (values are in [-1, 1), 1e-3 is far above their
                # last bit), and never brings back bytes an earlier save wrote.
                self.state[k].add_(1e-3)
            return
        table = self.state["embedding.weight"]
        rows = table.shape[0]
        k = max(1, int(rows * CHANGED_ROWS))
        if self.scenario == "embedding":
            idx = torch.randperm(rows, generator=self.gen)[:k]
        else:
            if self._zipf is None:
                self._zipf = zipf_weights(rows)
            idx = torch.multinomial(self._zipf, k, replacement=False, generator=self.gen)
        table[idx] += 0.5


# ------------------------------------------------------------------------------- measuring tools


def files_under(root: str) -> dict[str, tuple[int, int]]:
    """Every regular file under ``root``: path -> (inode, size)."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            out[os.path.relpath(p, root)] = (st.st_ino, st.st_size)
    return out


def written_between(before: dict[str, tuple[int, int]],
                    after: dict[str, tuple[int, int]]) -> int:
    """Bytes of the files in ``after`` that were not in ``before`` (new path or new inode)."""
    return sum(size for p, (ino, size) in after.items()
               if p not in before or before[p][0] != ino)


def floor_hash(state: dict[str, torch.Tensor]) -> float:
    """Seconds to hash every tensor's bytes with xxh3-128 on one thread."""
    import xxhash

    gc.collect()
    t = time.perf_counter()
    for v in state.values():
        xxhash.xxh3_128(memoryview(v.detach().contiguous().view(torch.uint8).numpy())).digest()
    return time.perf_counter() - t


@dataclass
class Series:
    """Samples (seconds or bytes) of one measure, one per run or pair."""

    name: str
    unit: str
    label: str
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else math.nan

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "unit": self.unit, "label": self.label,
                "samples": self.samples, "median": self.median, "min": self.min}


@dataclass
class Config:
    size: int
    count: int
    saves: int
    runs: int
    pairs: int
    warmup: int
    dir: str
    scenarios: list[str]


class Bench:
    """Runs the scenarios on fresh roots under one scratch directory."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.scratch = tempfile.mkdtemp(prefix="ckptmgr-bench-reuse-", dir=cfg.dir)
        self.series: dict[str, Series] = {}
        self.saves: dict[str, list[dict[str, Any]]] = {}  # scenario -> every save of every run
        self.loadavg: list[float] = [os.getloadavg()[0]]
        self._buf = memoryview(bytearray(bench._IO_CHUNK))
        self._aligned = mmap.mmap(-1, bench._IO_CHUNK)  # page-aligned, for O_DIRECT
        self._aligned.write(bytes(self._buf))

    def _s(self, name: str, unit: str, label: str) -> Series:
        if name not in self.series:
            self.series[name] = Series(name, unit, label)
        return self.series[name]

    def _root(self, name: str) -> str:
        path = os.path.join(self.scratch, name)
        bench.settle([path])
        return path

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _manager(self, root: str, reuse: bool) -> Any:
        import ckptmgr

        # Keep 2: the newest step is what the next save shares with; older ones are deleted
        # (their unshared chunks too) by retention, whose time counts as the user's would.
        return ckptmgr.CheckpointManager(root, save_interval=1, max_to_keep=2,
                                         chkpt_on_preemption=False, reuse_unchanged=reuse,
                                         save_on_close=False)

    def _timed_save(self, mgr: Any, root: str, step: int,
                    state: dict[str, torch.Tensor]) -> tuple[float, int]:
        """(seconds until ``save`` returned, committed; bytes it created on disk)."""
        os.sync()  # the previous save's writeback is not this one's cost
        before = files_under(root)
        gc.collect()
        t = time.perf_counter()
        saved = mgr.save(step, state)
        seconds = time.perf_counter() - t
        if not saved:
            raise SystemExit(f"step {step} was not saved")
        return seconds, written_between(before, files_under(root))

    def _floors(self, keep: bool, state: dict[str, torch.Tensor], nbytes: int) -> None:
        path = os.path.join(self.scratch, "floor.bin")
        times: list[float] = []
        # As bench.py's floor.write: the fastest of buffered (dd-like), buffered with streaming
        # writeback, and O_DIRECT writes (where the file system takes it), each then fsync.
        for write in (lambda: bench.floor_write(path, nbytes, self._buf),
                      lambda: bench.floor_write(path, nbytes, self._buf, stream=True),
                      lambda: bench.floor_write_direct(path, nbytes, self._aligned)):
            bench.settle([path])
            t = time.perf_counter()
            done = write()
            if done is not False:  # floor_write_direct: False where O_DIRECT is refused
                times.append(time.perf_counter() - t)
        bench.settle([path])
        h = floor_hash(state)
        if keep:
            self._s("floor.write", "s", "write + fsync of the state's bytes, fastest of "
                    "buffered, streaming and O_DIRECT").samples.append(min(times))
            self._s("floor.hash", "s", "xxh3-128 of the state's bytes, one thread"
                    ).samples.append(h)

    # -- scenarios with one root per run: the first save against the later ones

    def run_series(self, scenario: str) -> None:
        cfg = self.cfg
        for run in range(cfg.warmup + cfg.runs):
            keep = run >= cfg.warmup
            if scenario == "frozen":
                state, trained = frozen_state(cfg.size, cfg.count, seed=run)
            else:
                state, trained = embedding_state(cfg.size, seed=run), []
            nbytes = bench.state_bytes(state)
            if scenario == "frozen":
                self._floors(keep, state, nbytes)
            mut = Mutator(scenario, state, trained, seed=run)
            root = self._root(f"{scenario}-{run}")
            times: list[float] = []
            written: list[int] = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with self._manager(root, reuse=True) as mgr:
                    for i in range(cfg.saves):
                        if i:
                            mut.step()
                        s, b = self._timed_save(mgr, root, i + 1, state)
                        times.append(s)
                        written.append(b)
            root_bytes = sum(size for _ino, size in files_under(root).values())
            bench.settle([root])
            tag = "warm-up" if not keep else f"run {run - cfg.warmup + 1}/{cfg.runs}"
            print(f"[bench_reuse] {scenario} {tag}: first {times[0]:.3f} s "
                  f"{written[0] / bench.MiB:.1f} MiB; later "
                  + ", ".join(f"{t:.3f} s {b / bench.MiB:.1f} MiB"
                              for t, b in zip(times[1:], written[1:], strict=True))
                  + f"; load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
            self.loadavg.append(os.getloadavg()[0])
            if not keep:
                continue
            self.saves.setdefault(scenario, []).append(
                {"run": run, "state_bytes": nbytes, "seconds": times, "bytes": written,
                 "root_bytes_after": root_bytes})
            later_t = statistics.median(times[1:])
            later_b = statistics.median(written[1:])
            p = scenario
            self._s(f"{p}.first_s", "s", "first save, reuse on: time until committed"
                    ).samples.append(times[0])
            self._s(f"{p}.later_s", "s", "2nd and later saves: median time until committed"
                    ).samples.append(later_t)
            self._s(f"{p}.first_bytes", "B", "first save: bytes written").samples.append(
                written[0])
            self._s(f"{p}.later_bytes", "B", "2nd and later saves: median bytes written"
                    ).samples.append(later_b)
            self._s(f"{p}.time_ratio", "x", "later / first, time until committed"
                    ).samples.append(later_t / times[0])
            self._s(f"{p}.bytes_ratio", "x", "later / first, bytes written").samples.append(
                later_b / max(1, written[0]))
            self._s(f"{p}.root_ratio", "x", "root size after all saves / state bytes "
                    "(2 steps kept)").samples.append(root_bytes / nbytes)

    # -- every byte changes: reuse off against on, interleaved

    def run_pairs(self) -> None:
        cfg = self.cfg
        state, _ = frozen_state(cfg.size, cfg.count, seed=7)
        every = list(state)
        nbytes = bench.state_bytes(state)
        mut = Mutator("trained", state, every)
        roots = {"off": self._root("trained-off"), "on": self._root("trained-on")}
        step = {"off": 0, "on": 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgrs = {side: self._manager(roots[side], side == "on") for side in roots}
            try:
                for side in ("off", "on"):  # untimed: each side's root holds a step to share with
                    step[side] += 1
                    self._timed_save(mgrs[side], roots[side], step[side], state)
                for i in range(cfg.warmup + cfg.pairs):
                    keep = i >= cfg.warmup
                    order = ("off", "on") if i % 2 == 0 else ("on", "off")
                    got: dict[str, tuple[float, int]] = {}
                    for side in order:
                        mut.step()  # every byte differs from the side's newest step
                        step[side] += 1
                        got[side] = self._timed_save(mgrs[side], roots[side], step[side], state)
                    ratio = got["on"][0] / got["off"][0]
                    tag = "warm-up" if not keep else f"pair {i - cfg.warmup + 1}/{cfg.pairs}"
                    print(f"[bench_reuse] trained {tag}: off {got['off'][0]:.3f} s, on "
                          f"{got['on'][0]:.3f} s, on/off {ratio:.3f}, load "
                          f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
                    self.loadavg.append(os.getloadavg()[0])
                    if not keep:
                        continue
                    self._s("trained.off_s", "s", "save with reuse off: time until committed"
                            ).samples.append(got["off"][0])
                    self._s("trained.on_s", "s", "save with reuse on: time until committed"
                            ).samples.append(got["on"][0])
                    self._s("trained.on_bytes_ratio", "x", "bytes written, on / off"
                            ).samples.append(got["on"][1] / max(1, got["off"][1]))
                    self._s("trained.time_ratio", "x", "per pair, on / off, time until "
                            "committed").samples.append(ratio)
                    self._s("trained.state_bytes", "B", "state bytes").samples.append(nbytes)
            finally:
                for mgr in mgrs.values():
                    mgr.close()
        bench.settle(roots.values())

    # -- save_async: the time the training thread is blocked, reuse off against on, interleaved

    def run_async_pairs(self) -> None:
        cfg = self.cfg
        state, trained = frozen_state(cfg.size, cfg.count, seed=11)
        mut = Mutator("frozen", state, trained)
        roots = {"off": self._root("async-off"), "on": self._root("async-on")}
        step = {"off": 0, "on": 0}

        def timed(side: str) -> tuple[float, float]:
            os.sync()
            gc.collect()
            step[side] += 1
            t = time.perf_counter()
            if not mgrs[side].save_async(step[side], state):
                raise SystemExit(f"step {step[side]} was not saved")
            blocked = time.perf_counter() - t
            mgrs[side].join()
            return blocked, time.perf_counter() - t

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgrs = {side: self._manager(roots[side], side == "on") for side in roots}
            try:
                for side in ("off", "on"):  # untimed: staging buffers, a step to share with
                    timed(side)
                for i in range(cfg.warmup + cfg.pairs):
                    keep = i >= cfg.warmup
                    order = ("off", "on") if i % 2 == 0 else ("on", "off")
                    got: dict[str, tuple[float, float]] = {}
                    for side in order:
                        mut.step()
                        got[side] = timed(side)
                    tag = "warm-up" if not keep else f"pair {i - cfg.warmup + 1}/{cfg.pairs}"
                    print(f"[bench_reuse] async {tag}: blocked off {got['off'][0]:.3f} s, on "
                          f"{got['on'][0]:.3f} s; committed off {got['off'][1]:.3f} s, on "
                          f"{got['on'][1]:.3f} s; load {os.getloadavg()[0]:.2f}",
                          file=sys.stderr, flush=True)
                    self.loadavg.append(os.getloadavg()[0])
                    if not keep:
                        continue
                    for side in ("off", "on"):
                        self._s(f"async.blocked_{side}_s", "s", f"save_async, reuse {side}: time "
                                "the caller was blocked").samples.append(got[side][0])
                    self._s("async.blocked_ratio", "x", "per pair, on / off, time blocked"
                            ).samples.append(got["on"][0] / got["off"][0])
                    self._s("async.committed_ratio", "x", "per pair, on / off, time until "
                            "committed (90% frozen)").samples.append(got["on"][1] / got["off"][1])
            finally:
                for mgr in mgrs.values():
                    mgr.close()
        bench.settle(roots.values())

    def run(self) -> None:
        for scenario in self.cfg.scenarios:
            if scenario == "trained":
                self.run_pairs()
            elif scenario == "async":
                self.run_async_pairs()
            else:
                self.run_series(scenario)


# ------------------------------------------------------------------------------------- report

TARGETS = [
    # (measure, what, limit): the targets, met when the median ratio is at most limit.
    ("frozen.bytes_ratio", "90% frozen: bytes written, later / first saves", 0.15),
    ("frozen.time_ratio", "90% frozen: time until committed, later / first saves", 0.30),
    ("trained.time_ratio", "every byte changes: time with reuse on / off (hash overhead)", 1.05),
]


def summarize(b: Bench) -> dict[str, Any]:
    """The JSON document: config, environment, every series, each save, the targets."""
    cfg = b.cfg
    targets = []
    for name, what, limit in TARGETS:
        s = b.series.get(name)
        if s is None or not s.samples:
            continue
        targets.append({"measure": name, "target": f"{what} <= {limit:g}", "limit": limit,
                        "ratio_median": s.median, "ratio_min": s.min, "met": s.median <= limit})
    import ckptmgr

    return {
        "config": {"size_bytes": cfg.size, "count": cfg.count, "saves": cfg.saves,
                   "runs": cfg.runs, "pairs": cfg.pairs, "warmup": cfg.warmup,
                   "scenarios": cfg.scenarios, "dir": cfg.dir},
        "environment": {"torch": torch.__version__, "ckptmgr": ckptmgr.__version__,
                        "python": platform.python_version(), "cpus": os.cpu_count(),
                        "loadavg": b.loadavg},
        "series": [s.to_json() for s in b.series.values()],
        "saves": b.saves,
        "targets": targets,
    }


def _fmt(value: float, unit: str) -> str:
    if unit == "B":
        return bench_bytes(value)
    if unit == "x":
        return f"{value:.3f}"
    return f"{value:.3f} s"


def bench_bytes(n: float) -> str:
    return f"{n / bench.MiB:.1f} MiB"


def markdown(doc: dict[str, Any]) -> str:
    """The run as Markdown: the measures (median, min) and the targets."""
    c, e = doc["config"], doc["environment"]
    la = e["loadavg"]
    out = [f"State: {c['size_bytes'] / bench.GiB:.2f} GiB; {c['saves']} saves per run, "
           f"{c['runs']} runs and {c['pairs']} interleaved pairs after {c['warmup']} warm-up; "
           f"load average {min(la):.2f}-{max(la):.2f}; torch {e['torch']}, {e['cpus']} CPUs.",
           "", "| measure | what | median | min |", "|---|---|---:|---:|"]
    for s in doc["series"]:
        out.append(f"| `{s['name']}` | {s['label']} | {_fmt(s['median'], s['unit'])} | "
                   f"{_fmt(s['min'], s['unit'])} |")
    if doc["targets"]:
        out += ["", "| target | measure | ratio (median) | ratio (min) | met |",
                "|---|---|---:|---:|---|"]
        for t in doc["targets"]:
            out.append(f"| {t['target']} | `{t['measure']}` | {t['ratio_median']:.3f} | "
                       f"{t['ratio_min']:.3f} | {'PASS' if t['met'] else 'MISS'} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--size", type=bench.parse_size, default=bench.GiB,
                   help="bytes of each scenario's state (default 1GiB)")
    p.add_argument("--count", type=int, default=200,
                   help="tensors of the frozen and trained states (default 200)")
    p.add_argument("--saves", type=int, default=5, help="saves per run (default 5)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per scenario (default 3)")
    p.add_argument("--pairs", type=int, default=6,
                   help="measured interleaved pairs of the trained scenario (default 6)")
    p.add_argument("--warmup", type=int, default=1,
                   help="discarded runs (and pairs) first (default 1)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--dir", default=os.getcwd(), help="scratch directory on the disk to measure")
    p.add_argument("--out", default=None, help="directory for bench_reuse.json and .md")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 16 MiB, 3 saves, 1 run, 2 pairs, no warm-up (seconds)")
    p.add_argument("--nice", type=int, default=0,
                   help="change this process's nice value first (negative needs root)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.count, args.saves, args.runs, args.pairs, args.warmup = (
            16 * bench.MiB, 20, 3, 1, 2, 0)
    if args.saves < 2 or args.runs < 1 or args.pairs < 1 or args.warmup < 0:
        p.error("--saves must be >= 2, --runs and --pairs >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the scenarios; print the Markdown; write the files under ``--out``."""
    args = parse_args(argv)
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + args.nice)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose from {SCENARIOS}")
    cfg = Config(size=args.size, count=args.count, saves=args.saves, runs=args.runs,
                 pairs=args.pairs, warmup=args.warmup, dir=os.path.abspath(args.dir),
                 scenarios=scenarios)
    ckpt_log = logging.getLogger("ckptmgr")
    level = ckpt_log.level
    ckpt_log.setLevel(logging.WARNING)  # one INFO line per save would drown the progress lines
    b = Bench(cfg)
    try:
        b.run()
    finally:
        b.close()
        ckpt_log.setLevel(level)
    doc = summarize(b)
    md = markdown(doc)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_reuse.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(args.out, "bench_reuse.md"), "w") as f:
            f.write(md)
    return doc


if __name__ == "__main__":
    main()
