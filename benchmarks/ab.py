"""Interleaved A/B: two variants run alternately N times on the same state; medians, minimums and
the ratio B/A with its spread.

One run of a benchmark decides nothing on a shared machine (the same 1 GiB write took 1.4-3.7 s
within an hour here). This harness alternates the two variants, A then B, then B then A, ... (the
order flips every pair, so neither always runs on a disk the other just warmed or flushed), and
judges the change by the per-pair ratios B/A: their median and interquartile range, next to each
variant's median and minimum seconds.

A variant is a string of whitespace-separated tokens:

- an operation (at most one; default ``--op``): ``floor.write_dd``, ``floor.write_stream``,
  ``floor.write_direct``, ``floor.read``, ``torch.save``, ``torch.load``, ``safetensors.save``,
  ``safetensors.load``, ``dcp.save``, ``dcp.load``, ``ckptmgr.save``,
  ``ckptmgr.save_async`` (until committed), ``ckptmgr.save_async.blocked`` (until the call
  returns; the save is then waited for, untimed), ``ckptmgr.save_async.compute_lost`` (the
  seconds of a 2-thread compute loop lost while the save runs: bench.py's ``ComputeLoop``, its
  blocked part included; reported in place of seconds), ``ckptmgr.restore``. The floors and
  the cold reads are bench.py's own (``benchmarks/bench.py``); reads are cold (its ``PageCache``);
- settings, applied only while that variant's trial runs: ``NAME=VALUE`` sets an environment
  variable; ``package.module.ATTR=VALUE`` sets a module attribute (the value read as a Python
  literal when it is one, else kept as a string), e.g. ``ckptmgr.storage.local.DIRECT_IO=False``
  (a class attribute too: ``ckptmgr.storage.local._DirectWriter.write_unbuffered=None``);
- or the whole variant ``cmd:<shell command>``: the command's wall time (settings as environment
  variables go before ``cmd:``), run with the scratch directory as ``$AB_DIR``.

Before a ckptmgr write is first timed, untimed saves let this process's choice of direct or
buffered writes finish learning (bench.settle_path_choice; reported as ``learning_saves``), so
the pairs measure the path a long run writes with, not the learning's two files on the other.

Usage::

    python benchmarks/ab.py --a floor.write_stream --b floor.write_direct --size 1GiB --pairs 10
    python benchmarks/ab.py --op ckptmgr.save --a "ckptmgr.storage.local.DIRECT_IO=True" \\
        --b "ckptmgr.storage.local.DIRECT_IO=False" --size 1GiB --pairs 12 --nice -10
    python benchmarks/ab.py --a ckptmgr.restore --b dcp.load --size 1GiB --pairs 10
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # benchmarks/ is not a package: bench.py sits beside this file

COMPUTE_MIN_S = 1.5  # the compute loop runs at least this long per trial (the save ends first)
OPS = ["floor.write_dd", "floor.write_stream", "floor.write_direct", "floor.read", "torch.save",
       "torch.load", "safetensors.save", "safetensors.load", "dcp.save", "dcp.load",
       "ckptmgr.save", "ckptmgr.save_async", "ckptmgr.save_async.blocked",
       "ckptmgr.save_async.compute_lost", "ckptmgr.restore"]


# ------------------------------------------------------------------------------------ variants


@dataclass
class Variant:
    """One side of the comparison: an operation (or a shell command) and its settings."""

    label: str
    op: str
    env: dict[str, str] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    command: str | None = None


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_variant(text: str, default_op: str) -> Variant:
    """``"[OP] [NAME=VALUE ...]"`` or ``"[NAME=VALUE ...] cmd:<command>"`` -> :class:`Variant`.

    Raises:
        SystemExit: an unknown operation, or two of them.
    """
    head, sep, command = text.partition("cmd:")
    op: str | None = None
    env: dict[str, str] = {}
    attrs: dict[str, Any] = {}
    for tok in shlex.split(head):
        if "=" in tok:
            name, value = tok.split("=", 1)
            if "." in name:
                attrs[name] = _literal(value)
            else:
                env[name] = value
        elif op is None and tok in OPS:
            op = tok
        else:
            raise SystemExit(f"variant {text!r}: {tok!r} is not one of {OPS} (or a second "
                             "operation), nor NAME=VALUE")
    if sep:
        return Variant(text, "cmd", env, attrs, command.strip())
    return Variant(text, op or default_op, env, attrs)


def _owner(name: str, label: str) -> tuple[Any, str]:
    """The object holding the attribute ``name`` names (``pkg.module.ATTR`` or
    ``pkg.module.Class.ATTR``: the longest importable prefix, then attributes) and its name."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for p in parts[cut:-1]:
                obj = getattr(obj, p)
        except AttributeError:
            break
        if hasattr(obj, parts[-1]):
            return obj, parts[-1]
        break
    raise SystemExit(f"variant {label!r}: no attribute {name!r}")


@contextlib.contextmanager
def applied(v: Variant) -> Iterator[None]:
    """``v``'s settings in force for the block, then the previous values back."""
    old_env = {k: os.environ.get(k) for k in v.env}
    old_attrs: list[tuple[Any, str, Any]] = []
    try:
        os.environ.update(v.env)
        for name, value in v.attrs.items():
            owner, attr = _owner(name, v.label)
            old_attrs.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(old_attrs):
            setattr(mod, attr, value)
        for k, old in old_env.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


# ------------------------------------------------------------------------------- operations


class Runner:
    """Times one trial of a variant on the shared state of a :class:`bench.Bench`: untimed
    preparation (old outputs deleted and synced, reads made cold), then the operation."""

    def __init__(self, b: bench.Bench) -> None:
        self.b = b
        self._mgrs: dict[str, Any] = {}
        self._steps: dict[str, int] = {}
        self._ready: set[str] = set()  # read sides whose files exist
        self._loop: bench.ComputeLoop | None = None
        self.learning_saves = 0  # untimed saves while the path choice learned

    def close(self) -> None:
        for mgr in self._mgrs.values():
            mgr.close()

    def trial(self, side: str, v: Variant) -> float:
        """Seconds of one trial of ``v`` (``side`` names its own scratch files)."""
        with applied(v):
            return getattr(self, "_" + v.op.replace(".", "_"))(side, v)

    # -- helpers

    def _name(self, side: str, what: str) -> str:
        return f"{side}-{what}"

    def _manager(self, side: str) -> Any:
        if side not in self._mgrs:
            import ckptmgr

            self._mgrs[side] = ckptmgr.CheckpointManager(
                self.b._path(self._name(side, "ckptmgr")), save_interval=1,
                chkpt_on_preemption=False)
            self._steps[side] = 0
        return self._mgrs[side]

    def _settled(self, side: str) -> Any:
        """``side``'s manager, after the untimed saves that let the path choice learn (under
        the trial's settings; bench.settle_path_choice)."""
        mgr = self._manager(side)
        self.learning_saves += bench.settle_path_choice(
            lambda: mgr.save(self._fresh_step(side), self.b.state), self.b.scratch, self.b.nbytes)
        return mgr

    def _fresh_step(self, side: str) -> int:
        """A new step of ``side``'s manager; older steps deleted and synced first (untimed)."""
        mgr = self._manager(side)
        root = self.b._path(self._name(side, "ckptmgr"))
        for s in mgr.all_steps():
            shutil.rmtree(os.path.join(root, str(s)), ignore_errors=True)
        os.sync()
        self._steps[side] += 1
        return self._steps[side]

    def _write_floor(self, side: str, fn: Callable[[str], Any]) -> float:
        name = self._name(side, "floor.bin")
        self.b._settle(name)
        return self.b._timed(lambda: fn(self.b._path(name)))

    def _cold_read(self, side: str, what: str, write: Callable[[], None],
                   read: Callable[[], Any]) -> float:
        key = f"{side}:{what}"
        if key not in self._ready:
            write()  # once, untimed: every trial reads the same files
            os.sync()
            self._ready.add(key)
        self.b._cold(self._name(side, what))
        return self.b._timed(read)

    # -- the operations (one method each, named after it)

    def _floor_write_dd(self, side: str, v: Variant) -> float:
        return self._write_floor(side, lambda p: bench.floor_write(p, self.b.nbytes, self.b._buf))

    def _floor_write_stream(self, side: str, v: Variant) -> float:
        return self._write_floor(side, lambda p: bench.floor_write(
            p, self.b.nbytes, self.b._buf, stream=True))

    def _floor_write_direct(self, side: str, v: Variant) -> float:
        def write(p: str) -> None:
            if not bench.floor_write_direct(p, self.b.nbytes, self.b._aligned):
                raise SystemExit("floor.write_direct: this file system refuses O_DIRECT")

        return self._write_floor(side, write)

    def _floor_read(self, side: str, v: Variant) -> float:
        p = self.b._path(self._name(side, "read.bin"))
        return self._cold_read(side, "read.bin",
                               lambda: bench.floor_write(p, self.b.nbytes, self.b._buf),
                               lambda: bench.floor_read(p, self.b._buf))

    def _torch_save(self, side: str, v: Variant) -> float:
        import torch

        name = self._name(side, "torch.pt")
        self.b._settle(name)

        def save() -> None:
            with open(self.b._path(name), "wb") as f:
                torch.save(self.b.state, f)
                f.flush()
                os.fsync(f.fileno())

        return self.b._timed(save)

    def _torch_load(self, side: str, v: Variant) -> float:
        import torch

        p = self.b._path(self._name(side, "load.pt"))

        def write() -> None:
            with open(p, "wb") as f:
                torch.save(self.b.state, f)

        return self._cold_read(side, "load.pt", write,
                               lambda: torch.load(p, weights_only=True))

    def _safetensors_save(self, side: str, v: Variant) -> float:
        from safetensors.torch import save_file

        name = self._name(side, "st.safetensors")
        self.b._settle(name)

        def save() -> None:
            save_file(self.b.state, self.b._path(name))
            bench._fsync_path(self.b._path(name))

        return self.b._timed(save)

    def _safetensors_load(self, side: str, v: Variant) -> float:
        from safetensors.torch import load_file, save_file

        p = self.b._path(self._name(side, "load.safetensors"))
        return self._cold_read(side, "load.safetensors", lambda: save_file(self.b.state, p),
                               lambda: load_file(p))

    def _dcp_save(self, side: str, v: Variant) -> float:
        import torch.distributed.checkpoint as dcp

        name = self._name(side, "dcp")
        self.b._settle(name)
        return self.b._timed(lambda: dcp.save(
            self.b.state, storage_writer=dcp.FileSystemWriter(self.b._path(name)), no_dist=True))

    def _dcp_load(self, side: str, v: Variant) -> float:
        import torch.distributed.checkpoint as dcp

        d = self.b._path(self._name(side, "dcp-load"))
        return self._cold_read(
            side, "dcp-load",
            lambda: dcp.save(self.b.state, storage_writer=dcp.FileSystemWriter(d), no_dist=True),
            lambda: dcp.load(self.b.target, storage_reader=dcp.FileSystemReader(d),
                             no_dist=True))

    def _ckptmgr_save(self, side: str, v: Variant) -> float:
        mgr = self._settled(side)
        step = self._fresh_step(side)
        return self.b._timed(lambda: mgr.save(step, self.b.state))

    def _ckptmgr_save_async(self, side: str, v: Variant) -> float:
        mgr = self._settled(side)
        step = self._fresh_step(side)

        def save() -> None:
            mgr.save_async(step, self.b.state)
            mgr.join()

        return self.b._timed(save)

    def _ckptmgr_save_async_blocked(self, side: str, v: Variant) -> float:
        mgr = self._settled(side)
        step = self._fresh_step(side)
        try:
            return self.b._timed(lambda: mgr.save_async(step, self.b.state))
        finally:
            mgr.join()  # untimed, still under v's settings

    def _ckptmgr_save_async_compute_lost(self, side: str, v: Variant) -> float:
        mgr = self._settled(side)
        step = self._fresh_step(side)
        if self._loop is None:
            self._loop = bench.ComputeLoop(calibrate_s=max(0.1, min(0.6, COMPUTE_MIN_S / 2)))
        res = self._loop.run_during(lambda: bench._start_manager_save(mgr, step, self.b.state),
                                    COMPUTE_MIN_S)
        return float(res["lost_s"])

    def _ckptmgr_restore(self, side: str, v: Variant) -> float:
        mgr = self._manager(side)
        key = f"{side}:restore"
        if key not in self._ready:
            mgr.save(self._fresh_step(side), self.b.state)  # untimed, under v's settings
            os.sync()
            self._ready.add(key)
        step = self._steps[side]
        self.b._cold(self._name(side, "ckptmgr"))
        return self.b._timed(lambda: mgr.restore(step, self.b.target))

    def _cmd(self, side: str, v: Variant) -> float:
        assert v.command is not None, "parse_variant sets it"
        env = {**os.environ, "AB_DIR": self.b.scratch, "AB_SIDE": side}
        t = time.perf_counter()
        subprocess.run(v.command, shell=True, check=True, env=env, cwd=self.b.scratch)
        return time.perf_counter() - t


# ----------------------------------------------------------------------------------- statistics


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of ``xs``."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ratio(y: float, x: float) -> float:
    """``y / x``, or NaN where ``x`` is not positive (no ratio)."""
    return y / x if x > 0 else float("nan")


def summarize(a: Variant, b: Variant, samples_a: list[float], samples_b: list[float],
              first: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a run: both variants' samples, medians, minimums, and the per-pair
    ratios B/A (median, interquartile range, min, max)."""
    # A pair whose A took 0 (a compute loss can be 0) has no ratio; it still counts as a pair.
    ratios = [y / x for x, y in zip(samples_a, samples_b, strict=True) if x > 0]

    def side(v: Variant, xs: list[float]) -> dict[str, Any]:
        return {"variant": v.label, "op": v.op, "env": v.env, "attrs": {
            k: repr(x) for k, x in v.attrs.items()}, "command": v.command, "samples_s": xs,
            "median_s": statistics.median(xs) if xs else float("nan"),
            "min_s": min(xs) if xs else float("nan")}

    sa, sb = side(a, samples_a), side(b, samples_b)
    return {
        **meta, "a": sa, "b": sb, "first_of_pair": first,
        "ratio_b_over_a": {
            "pairs": len(ratios), "pairs_run": len(samples_a), "per_pair": ratios,
            "median": statistics.median(ratios) if ratios else float("nan"),
            "q1": quantile(ratios, 0.25), "q3": quantile(ratios, 0.75),
            "min": min(ratios, default=float("nan")), "max": max(ratios, default=float("nan")),
            "of_medians": _ratio(sb["median_s"], sa["median_s"]),
            "of_mins": _ratio(sb["min_s"], sa["min_s"]),
            "b_faster_pairs": sum(y < x for x, y in zip(samples_a, samples_b, strict=True)),
        },
    }


def markdown(doc: dict[str, Any]) -> str:
    """The run as a short Markdown table."""
    r = doc["ratio_b_over_a"]
    out = [f"State: {doc['size_bytes'] / bench.GiB:.2f} GiB in {doc['count']} tensors; "
           f"{r['pairs']} interleaved pairs after {doc['warmup']} warm-up"
           + (f" and {doc['learning_saves']} untimed saves while the path choice learned"
              if doc.get("learning_saves") else "") + "; reads "
           f"{doc['cache']}; load average {doc['loadavg'][0]:.2f} -> {doc['loadavg'][1]:.2f}.",
           "", "| variant | median s | min s |", "|---|---:|---:|"]
    for key in ("a", "b"):
        s = doc[key]
        out.append(f"| {key.upper()}: `{s['variant']}` | {s['median_s']:.3f} | "
                   f"{s['min_s']:.3f} |")
    run = r.get("pairs_run", r["pairs"])
    out += ["", f"B/A per pair: median **{r['median']:.3f}** (IQR {r['q1']:.3f}-{r['q3']:.3f}, "
            f"min {r['min']:.3f}, max {r['max']:.3f}"
            + (f"; of the {r['pairs']} pairs whose A took more than 0" if r["pairs"] != run
               else "")
            + f"); B faster in {r['b_faster_pairs']}/{run} pairs; ratio of medians "
            f"{r['of_medians']:.3f}, of mins {r['of_mins']:.3f}."]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ CLI


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--a", required=True, help="variant A (see the module docstring)")
    p.add_argument("--b", required=True, help="variant B")
    p.add_argument("--op", default="ckptmgr.save", choices=OPS,
                   help="operation of a variant that names none (default ckptmgr.save)")
    p.add_argument("--pairs", type=int, default=10, help="measured pairs (default 10)")
    p.add_argument("--warmup", type=int, default=1, help="discarded pairs first (default 1)")
    p.add_argument("--size", type=bench.parse_size, default=bench.GiB,
                   help="state size (default 1GiB)")
    p.add_argument("--count", type=int, default=816, help="number of tensors (default 816)")
    p.add_argument("--dir", default=os.getcwd(), help="scratch directory on the disk to measure")
    p.add_argument("--out", default=None, help="write the JSON document to this file")
    p.add_argument("--cache-drop", choices=["auto", "fadvise", "drop_caches"], default="auto")
    p.add_argument("--nice", type=int, default=0,
                   help="change this process's nice value first (negative needs root)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the pairs; print the Markdown summary; write the JSON under ``--out``."""
    args = parse_args(argv)
    if args.nice:
        # Before any thread exists: Linux nice values are per thread and inherited.
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + args.nice)
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    a, b = parse_variant(args.a, args.op), parse_variant(args.b, args.op)
    cfg = bench.Config(size=args.size, count=args.count, reps=args.pairs, warmup=args.warmup,
                       dir=os.path.abspath(args.dir), methods=[], compute_min_s=0.2,
                       write_threads=[], read_threads=[], io_nice=[], cache_drop=args.cache_drop)
    import logging

    ckpt_log = logging.getLogger("ckptmgr")
    level = ckpt_log.level
    ckpt_log.setLevel(logging.WARNING)  # one INFO line per save would drown the progress lines
    b0 = bench.Bench(cfg)
    runner = Runner(b0)
    samples: dict[str, list[float]] = {"a": [], "b": []}
    first: list[str] = []
    load0 = os.getloadavg()[0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's single-process warnings
            for i in range(args.warmup + args.pairs):
                order = [("a", a), ("b", b)] if i % 2 == 0 else [("b", b), ("a", a)]
                got = {side: runner.trial(side, v) for side, v in order}
                keep = i >= args.warmup
                if keep:
                    samples["a"].append(got["a"])
                    samples["b"].append(got["b"])
                    first.append(order[0][0])
                tag = "warm-up" if not keep else f"pair {i - args.warmup + 1}/{args.pairs}"
                print(f"[ab] {tag}: A {got['a']:.3f} s, B {got['b']:.3f} s, B/A "
                      f"{_ratio(got['b'], got['a']):.3f}, load {os.getloadavg()[0]:.2f}",
                      file=sys.stderr, flush=True)
    finally:
        runner.close()
        b0.close()
        ckpt_log.setLevel(level)
    meta = {"size_bytes": b0.nbytes, "count": args.count, "warmup": args.warmup,
            "learning_saves": runner.learning_saves,
            "dir": cfg.dir, "cache": b0.cache.label, "nice": args.nice,
            "loadavg": [load0, os.getloadavg()[0]]}
    doc = summarize(a, b, samples["a"], samples["b"], first, meta)
    print(markdown(doc))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
