"""A 16k-rank save, by simulation: the coordinator's side of a ckptmgr save of Llama-3-70B under
FSDP2 at N ranks, without N processes (issue 18, item 6).

Every simulated rank's local plan is built from its shard boxes (torch.chunk's rule for
``Shard(0)``: tiles of ceil(n/N) rows, trailing ranks short or empty), item for item what our
``CkptSavePlanner.create_local_plan`` makes for that rank's staged state (the smoke test checks
that at small N against the planner itself on ``StagedDTensor`` stand-ins). Then, in this one
process, as the coordinator would after gathering the plans:

- global planning with our planner: first (no cache) and cached (a fresh copy of the same plans,
  as a new gather would deliver them);
- DCP's own ``DefaultSavePlanner.create_global_plan`` on the same plans (its dedup and metadata);
- the JSON metadata (``ckptmgr.dcp.encode_metadata``: one data file per rank, item locations as
  our writer records them), its bytes and decode time (``ckptmgr.dcp.decode_metadata``);
- the manifest (``ckptmgr.manifest.encode_manifest``) bytes;
- objects written per step, and list calls for ``all_steps`` and ``restore`` (by the protocol:
  the coordinator lists, then broadcasts);
- the coordinator's memory: peak RSS of the process that did all this (each N runs in its own
  process), and the RSS it started with.

Model: 80 layers (wq 8192x8192, wk/wv 1024x8192, wo 8192x8192, w1/w3 28672x8192, w2 8192x28672,
two norms of 8192), embedding and output 128256x8192, final norm; bf16 parameters, fp32 AdamW
``exp_avg``/``exp_avg_sq`` (DTensors, ``Shard(0)``) and a 0-d fp32 ``step`` per parameter
(replicated on every rank, as FSDP2 keeps it). ``--layers`` simulates fewer layers: every layer
has the same shapes, so each figure but the fixed ones grows linearly in layers (checked by the
``--layers`` sweep the README's command runs at 1k ranks).

Run: ``python benchmarks/scale_sim.py --ranks 1024,4096,16384 --out benchmarks/results``
(each N in a subprocess; ``--max-items`` skips an N whose plans would not fit in memory).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckptmgr.dcp import CkptSavePlanner, ItemLocation, decode_metadata, encode_metadata
from ckptmgr.manifest import FileEntry, Manifest, encode_manifest

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, LAYERS = 8192, 28672, 128256, 64, 8, 80


def model_shapes(layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-70B's parameters (name, shape), torchtitan's names."""
    kv = HIDDEN // HEADS * KV_HEADS
    out: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (HIDDEN, HIDDEN)),
                (p + "attention.wk.weight", (kv, HIDDEN)),
                (p + "attention.wv.weight", (kv, HIDDEN)),
                (p + "attention.wo.weight", (HIDDEN, HIDDEN)),
                (p + "feed_forward.w1.weight", (INTER, HIDDEN)),
                (p + "feed_forward.w2.weight", (HIDDEN, INTER)),
                (p + "feed_forward.w3.weight", (INTER, HIDDEN)),
                (p + "attention_norm.weight", (HIDDEN,)),
                (p + "ffn_norm.weight", (HIDDEN,))]
    out += [("norm.weight", (HIDDEN,)), ("output.weight", (VOCAB, HIDDEN))]
    return out


def state_keys(layers: int) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
    """(flat key, global shape, dtype, is a DTensor) of the model + AdamW state, in flat order."""
    params = model_shapes(layers)
    keys = [(f"model.{n}", s, torch.bfloat16, True) for n, s in params]
    for n, s in params:
        keys += [(f"optim.state.{n}.exp_avg", s, torch.float32, True),
                 (f"optim.state.{n}.exp_avg_sq", s, torch.float32, True),
                 (f"optim.state.{n}.step", (), torch.float32, False)]
    return keys


def shard0_box(shape: tuple[int, ...], n: int, rank: int) -> tuple[tuple[int, ...],
                                                                    tuple[int, ...]]:
    """The chunk rank ``rank`` of ``n`` holds of a ``Shard(0)`` DTensor (torch.chunk's rule)."""
    rows = shape[0]
    c = -(-rows // n)
    start = min(rank * c, rows)
    return (start, *([0] * (len(shape) - 1))), (min(start + c, rows) - start, *shape[1:])


def properties(dtype: torch.dtype, requires_grad: bool) -> TensorProperties:
    """What ``TensorProperties.create_from_tensor`` records for a contiguous host tensor."""
    return TensorProperties(dtype=dtype, requires_grad=requires_grad)


class PlanBuilder:
    """Builds each simulated rank's local plan from its shard boxes.

    Objects that are equal on every rank (a tensor's global size and properties, a replicated
    step's whole write item) are built once, as unpickling would not share them: plans from a real
    gather take somewhat more memory than these.
    """

    def __init__(self, n: int, layers: int) -> None:
        self.n = n
        self.keys = state_keys(layers)
        self._props = {(dt, rg): properties(dt, rg) for dt in (torch.bfloat16, torch.float32)
                       for rg in (False, True)}
        self._sizes = {s: torch.Size(s) for _, s, _, _ in self.keys}
        self._steps = {}
        for key, _, dtype, is_dt in self.keys:
            if not is_dt:
                zero = torch.Size(())
                self._steps[key] = WriteItem(
                    index=MetadataIndex(key, zero), type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(zero, zero),
                                                properties=self._props[(dtype, False)],
                                                size=zero))

    def local_plan(self, rank: int) -> SavePlan:
        items: list[WriteItem] = []
        boxes: dict[tuple[int, ...], tuple[torch.Size, torch.Size]] = {}
        for key, shape, dtype, is_dt in self.keys:
            if not is_dt:
                items.append(self._steps[key])
                continue
            b = boxes.get(shape)
            if b is None:
                o, s = shard0_box(shape, self.n, rank)
                b = boxes[shape] = (torch.Size(o), torch.Size(s))
            offsets, sizes = b
            items.append(WriteItem(
                index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=self._props[(dtype, key.startswith("model."))],
                    size=self._sizes[shape])))
        return SavePlan(items)

    def plans(self) -> list[SavePlan]:
        return [self.local_plan(r) for r in range(self.n)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def storage_data(plans: list[SavePlan]) -> tuple[dict[MetadataIndex, ItemLocation],
                                                 dict[int, int]]:
    """Item locations as our writer records them (one data file per rank, items back to back,
    an xxh3-64 checksum each), and bytes per rank."""
    out: dict[MetadataIndex, ItemLocation] = {}
    per_rank: dict[int, int] = {}
    for rank, plan in enumerate(plans):
        name = f"data-0123456789ab-r{rank}-0.bin"
        pos = 0
        for item in plan.items:
            n = item_nbytes(item)
            out[item.index] = ItemLocation(name, pos, n, "0123456789abcdef", "raw")
            pos += n
        per_rank[rank] = pos
    return out, per_rank


def run_one(n: int, layers: int, dcp: bool) -> dict[str, Any]:
    """Every measurement at ``n`` ranks (in this process)."""
    rss0 = rss_bytes()
    builder = PlanBuilder(n, layers)
    t = time.perf_counter()
    plans = builder.plans()
    build_s = time.perf_counter() - t
    items = sum(len(p.items) for p in plans)

    planner = CkptSavePlanner()
    # The coordinator's own local plan sets the cache key, as in a real save.
    planner.set_up_planner({}, is_coordinator=True)
    planner._key = (True, ("simulated", n, layers))  # what create_local_plan would set
    gc.collect()
    t = time.perf_counter()
    global_plans, md = planner.create_global_plan(plans)
    first_s = time.perf_counter() - t
    again = builder.plans()  # a new gather: equal plans, new objects
    t = time.perf_counter()
    planner.create_global_plan(again)
    cached_s = time.perf_counter() - t
    assert planner.global_plan_reuses == 1, "the cached global plan was not used"
    del again

    dcp_s = None
    if dcp:
        t = time.perf_counter()
        DefaultSavePlanner(flatten_state_dict=False).create_global_plan(plans)
        dcp_s = time.perf_counter() - t

    md.storage_data, per_rank = storage_data(global_plans)
    t = time.perf_counter()
    blob = encode_metadata(md)
    encode_s = time.perf_counter() - t
    del md, global_plans, plans
    gc.collect()
    t = time.perf_counter()
    decoded = decode_metadata(blob)
    decode_s = time.perf_counter() - t
    chunks = sum(len(getattr(m, "chunks", ())) for m in decoded.state_dict_metadata.values())
    del decoded

    files = [FileEntry(f"data-0123456789ab-r{r}-0.bin", b, "0123456789abcdef")
             for r, b in per_rank.items()]
    files.append(FileEntry("metadata-0123456789ab.json", len(blob), "0123456789abcdef"))
    manifest = Manifest(step=1000, time="2026-01-01T00:00:00.000000Z", attempt="0123456789ab",
                        world_size=n, metadata_file="metadata-0123456789ab.json",
                        files=tuple(files), bytes_per_rank=per_rank,
                        versions={"ckptmgr": "x", "torch": torch.__version__},
                        mesh={"shape": [n], "dim_names": ["dp_shard"], "device_type": "cuda"})
    manifest_bytes = len(encode_manifest(manifest))
    return {
        "ranks": n, "layers": layers, "keys": len(builder.keys), "items": items,
        "chunks": chunks, "build_plans_s": build_s,
        "plan_first_s": first_s, "plan_cached_s": cached_s, "dcp_plan_s": dcp_s,
        "metadata_bytes": len(blob), "metadata_encode_s": encode_s,
        "metadata_decode_s": decode_s, "manifest_bytes": manifest_bytes,
        # Data file per rank, the metadata, the manifest.
        "objects_written": n + 2,
        # The coordinator lists the root once (all_steps: at construction and after each
        # commit, then broadcast) and the step once on restore (then broadcast).
        "list_calls_all_steps": 1, "list_calls_restore": 1,
        "rss_start_bytes": rss0, "peak_rss_bytes": peak_rss_bytes(),
        "state_bytes": sum(per_rank.values()),
    }


def child(n: int, layers: int, dcp: bool, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", str(n), "--layers", str(layers)]
    if not dcp:
        cmd.append("--no-dcp")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"simulation at {n} ranks failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def table(results: list[dict[str, Any]]) -> str:
    def mb(b: float) -> str:
        return f"{b / 2**20:,.1f}"

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    rows = ["| ranks | layers | write items | plan first (s) | plan cached (s) | DCP plan (s) "
            "| metadata (MiB) | decode (s) | manifest (KiB) | objects | lists all_steps/restore "
            "| peak RSS (MiB) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(
            f"| {r['ranks']:,} | {r['layers']} | {r['items']:,} | {s(r['plan_first_s'])} "
            f"| {s(r['plan_cached_s'])} | {s(r['dcp_plan_s'])} | {mb(r['metadata_bytes'])} "
            f"| {s(r['metadata_decode_s'])} | {r['manifest_bytes'] / 1024:,.1f} "
            f"| {r['objects_written']:,} | {r['list_calls_all_steps']}/{r['list_calls_restore']} "
            f"| {mb(r['peak_rss_bytes'])} |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ranks = [r["ranks"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.loglog(ranks, [r["plan_first_s"] for r in results], "o-", label="ckptmgr plan (first)")
    a.loglog(ranks, [r["plan_cached_s"] for r in results], "o-", label="ckptmgr plan (cached)")
    if all(r["dcp_plan_s"] is not None for r in results):
        a.loglog(ranks, [r["dcp_plan_s"] for r in results], "o--", label="DCP default plan")
    a.loglog(ranks, [r["metadata_decode_s"] for r in results], "o-", label="metadata decode")
    a.set_xlabel("simulated ranks")
    a.set_ylabel("seconds")
    a.legend()
    b.loglog(ranks, [r["metadata_bytes"] / 2**20 for r in results], "o-", label="metadata MiB")
    b.loglog(ranks, [r["manifest_bytes"] / 2**20 for r in results], "o-", label="manifest MiB")
    b.loglog(ranks, [r["peak_rss_bytes"] / 2**20 for r in results], "o-",
             label="coordinator peak RSS MiB")
    b.set_xlabel("simulated ranks")
    b.legend()
    layers = results[0]["layers"]
    fig.suptitle(f"Llama-3-70B shapes ({layers} of 80 layers), FSDP2 Shard(0), coordinator side")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--no-dcp", action="store_true", help="skip DCP's default planner")
    ap.add_argument("--dcp-max-ranks", type=int, default=4096,
                    help="run DCP's default planner only up to this many ranks (its validation "
                         "is quadratic in ranks)")
    ap.add_argument("--out", default=None, help="directory for scale-sim.{json,md,png}")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.layers, not args.no_dcp)))
        return
    results = []
    for n in (int(x) for x in args.ranks.split(",")):
        r = child(n, args.layers, not args.no_dcp and n <= args.dcp_max_ranks, args.timeout_s)
        results.append(r)
        print(json.dumps(r), flush=True)
    text = table(results)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"scale-sim-{args.layers}l")
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(text + "\n")
        plot(results, base + ".png")


if __name__ == "__main__":
    main()
