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
- the JSON metadata (``ckptmgr.dcp.metadata.encode_metadata``: one data file per rank, item
  locations as our writer records them), its bytes and decode time
  (``ckptmgr.dcp.metadata.decode_metadata``);
- the manifest (``ckptmgr.codec.manifest.encode_manifest``) bytes;
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
import ctypes
import functools
import gc
import json
import math
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckptmgr.codec.chunks import Column, GridBoxes
from ckptmgr.codec.manifest import FileEntry, Manifest, encode_manifest
from ckptmgr.codec.metadata import ColumnarStorage, ItemLocation, TensorLocations
from ckptmgr.dcp.metadata import (
    ColumnarLocations,
    GridChunks,
    decode_metadata,
    encode_metadata,
    find_chunk,
)
from ckptmgr.dcp.planner import CkptSavePlanner, plan_token, tagged_plan

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
        name = data_file(rank)
        pos = 0
        for item in plan.items:
            n = item_nbytes(item)
            out[item.index] = ItemLocation(name, pos, n, fake_checksum(rank, pos), "raw")
            pos += n
        per_rank[rank] = pos
    return out, per_rank


def data_file(rank: int) -> str:
    return f"data-0123456789ab-r{rank:05d}-000.bin"


def fake_checksum(rank: int, pos: int) -> str:
    """A checksum-like string, distinct per item (as real ones are: they do not compress)."""
    return f"xxh3_64:{((rank << 40) + pos) * 0x9E3779B97F4A7C15 % (1 << 64):016x}"


def compact_metadata(n: int, layers: int) -> bytes:
    """The metadata of a save at ``n`` ranks built straight in its compact form (no plans, no
    per-chunk objects), so a whole model at 16k ranks fits this machine: the chunks of every
    sharded tensor as a :class:`GridChunks`, locations as columns.

    Chunks are exactly the planner's (checked at small N by tests/codec/test_metadata_format.py);
    storage is modelled as the planner lays it out, except that the replicated items (the 0-d
    ``step`` tensors and the trailing empty chunks) go round-robin to ranks instead of by
    balance_replicated's greedy choice: the same number of items per file, within one.
    """
    keys = state_keys(layers)
    running = torch.zeros(n, dtype=torch.int64)  # bytes each rank's file holds so far
    ranks = torch.arange(n, dtype=torch.int64)
    sdm: dict[str, TensorStorageMetadata] = {}
    locs: dict[str, TensorLocations] = {}
    replicated = 0
    for key, shape, dtype, is_dt in keys:
        itemsize = dtype.itemsize
        if not is_dt:
            chunks = GridBoxes((), 0, 1, 1)
            owner = replicated % n
            replicated += 1
            file_col, pos_col = Column(1, "c", owner), Column(1, "c", int(running[owner]))
            sums = [fake_checksum(owner, int(running[owner]))]
            running[owner] += itemsize
        else:
            rows = shape[0]
            step = -(-rows // n)
            full = rows // step  # ranks with a whole chunk
            tail = rows - full * step  # rows of the one short chunk (0: none)
            count = full + (1 if tail else 0)
            empty = n > count  # ranks after them hold an empty chunk; one is kept
            if empty:
                count += 1
            chunks = GridBoxes(shape, 0, step, count)
            row_bytes = math.prod(shape[1:]) * itemsize
            owners = ranks[:count].clone()
            if empty:
                owners[-1] = count - 1 + replicated % (n - count + 1)
                replicated += 1
            pos = running[owners].clone()
            extent = (rows - torch.arange(count, dtype=torch.int64) * step).clamp(0, step)
            nbytes = extent * row_bytes
            running.index_add_(0, owners, nbytes)
            file_col = _col(owners)
            pos_col = _col(pos)
            sums = None
            sum_tensor = ((owners << 40) + pos) * _signed(0x9E3779B97F4A7C15)  # wraps
        if sums is not None:
            sum_col = Column(1, "c", _signed(int(sums[0][-16:], 16)))
        else:
            sum_col = _col(sum_tensor)
        sdm[key] = TensorStorageMetadata(properties(dtype, key.startswith("model.")),
                                         torch.Size(shape), GridChunks(chunks))  # type: ignore[arg-type]
        locs[key] = TensorLocations(chunks, itemsize, file_col, pos_col, sum_col, "xxh3_64:")
    files = [data_file(r) for r in range(n)]
    md = Metadata(sdm, storage_data=ColumnarLocations(ColumnarStorage(files, locs, {})))
    return encode_metadata(md)


def _signed(bits: int) -> int:
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _col(t: torch.Tensor) -> Column:
    buf = bytearray(ctypes.string_at(t.contiguous().data_ptr(), 8 * t.numel()))
    return Column(t.numel(), "q", buf, 0)


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
    ids = [f"{r:016x}" for r in range(n)]
    gc.collect()
    t = time.perf_counter()
    global_plans, md = planner.create_global_plan(
        [tagged_plan(p, i) for p, i in zip(plans, ids, strict=True)])  # whole plans, tagged
    first_s = time.perf_counter() - t
    # The next save: every rank's plan is unchanged, so each sends a token (what a gather
    # delivers: new objects).
    tokens = [plan_token(i) for i in ids]
    t = time.perf_counter()
    planner.create_global_plan(tokens)
    cached_s = time.perf_counter() - t
    assert planner.global_plan_reuses == 1, "the cached global plan was not used"
    # As before tokens: whole plans again (a new gather: equal plans, new objects), compared
    # item by item.
    again = builder.plans()
    t = time.perf_counter()
    planner.create_global_plan(again)
    cached_whole_s = time.perf_counter() - t
    assert planner.global_plan_reuses == 2, "the cached global plan was not used"
    del again, tokens

    dcp_s = None
    if dcp:
        t = time.perf_counter()
        DefaultSavePlanner(flatten_state_dict=False).create_global_plan(plans)
        dcp_s = time.perf_counter() - t

    md.storage_data, per_rank = storage_data(global_plans)
    t = time.perf_counter()
    blob = encode_metadata(md)
    encode_s = time.perf_counter() - t
    blob_v1 = encode_metadata(md, version=1)
    dcp_blob = dcp_pickle_metadata(md) if dcp else None
    del md, global_plans, plans
    gc.collect()
    decode_s, decoded = timed(functools.partial(decode_metadata, blob))
    chunks = sum(len(getattr(m, "chunks", ())) for m in decoded.state_dict_metadata.values())
    lookup_s = timed(functools.partial(rank_lookups, decoded, n // 2))[0]
    decode_v1_s = timed(functools.partial(decode_metadata, blob_v1), repeat=1)[0]
    dcp_decode_s = None if dcp_blob is None else timed(
        functools.partial(pickle.loads, dcp_blob), repeat=1)[0]
    # The whole model (80 layers) at n ranks, built compactly (no plans: they would not fit).
    t = time.perf_counter()
    full = compact_metadata(n, LAYERS)
    full_build_s = time.perf_counter() - t
    full_decode_s, full_md = timed(functools.partial(decode_metadata, full))
    full_chunks = sum(len(getattr(m, "chunks", ())) for m in full_md.state_dict_metadata.values())
    full_lookup_s = timed(functools.partial(rank_lookups, full_md, n // 2))[0]
    full_pickle = len(pickle.dumps(full_md))  # what the coordinator broadcasts on restore
    files = [FileEntry(data_file(r), b, fake_checksum(r, 0))
             for r, b in per_rank.items()]
    files.append(FileEntry("metadata-0123456789ab.json", len(blob), fake_checksum(0, 0)))
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
        "plan_cached_whole_plans_s": cached_whole_s,
        "metadata_bytes": len(blob), "metadata_encode_s": encode_s,
        "metadata_decode_s": decode_s, "metadata_rank_lookups_s": lookup_s,
        "metadata_v1_bytes": len(blob_v1), "metadata_v1_decode_s": decode_v1_s,
        "dcp_metadata_bytes": None if dcp_blob is None else len(dcp_blob),
        "dcp_metadata_decode_s": dcp_decode_s,
        "full_model_chunks": full_chunks, "full_metadata_bytes": len(full),
        "full_metadata_build_s": full_build_s, "full_metadata_decode_s": full_decode_s,
        "full_metadata_rank_lookups_s": full_lookup_s, "full_metadata_pickled_bytes": full_pickle,
        "manifest_bytes": manifest_bytes,
        # Data file per rank, the metadata, the manifest.
        "objects_written": n + 2,
        **list_calls(),
        "rss_start_bytes": rss0, "peak_rss_bytes": peak_rss_bytes(),
        "state_bytes": sum(per_rank.values()),
    }


def timed(fn: Any, repeat: int = 3) -> tuple[float, Any]:
    """(the median seconds of ``repeat`` calls of ``fn``, its last result)."""
    times, out = [], None
    for _ in range(repeat):
        out = None
        gc.collect()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def rank_lookups(md: Metadata, rank: int) -> int:
    """What one restoring rank asks of the metadata for its own shard of every tensor (same
    world size): the chunk at its offsets, and where its bytes are."""
    found = 0
    storage = md.storage_data
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            grid = m.chunks
            i = min(rank, len(grid) - 1)
            box = grid[i]
            if find_chunk(grid, box.offsets, i) is not None and storage[
                    MetadataIndex(fqn, box.offsets, i)].length >= 0:
                found += 1
    return found


def dcp_pickle_metadata(md: Metadata) -> bytes:
    """``md`` as DCP's FileSystemWriter stores it (pickle; items located by _StorageInfo)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # DCP's own record

    storage = {idx: _StorageInfo(loc.file, loc.offset, loc.length)
               for idx, loc in md.storage_data.items()}
    return pickle.dumps(Metadata(md.state_dict_metadata, storage_data=storage))


class _CountingStorage:
    """A storage that counts list calls (scan_root, list_files, list_dirs)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.lists = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in ("scan_root", "list_files", "list_dirs"):
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.lists += 1
                return attr(*args, **kwargs)
            return counted
        return attr


def list_calls() -> dict[str, int]:
    """List calls of the coordinator for ``all_steps`` and for a restore, counted on a real
    root (a copy of tests/fixtures/metadata_v1/root). The other ranks make none (the
    coordinator broadcasts what it listed: tests/distributed/test_dist_bounded.py), so the counts
    do not depend on the world size."""
    import tempfile

    from ckptmgr.dcp.checkpoint import read_restore_source
    from ckptmgr.step_store import StepStore
    from ckptmgr.storage import open_storage

    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests",
                           "fixtures", "metadata_v1", "root")
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(fixture, d, dirs_exist_ok=True)  # a committed step, written by ckptmgr
        counting = _CountingStorage(open_storage(d))
        store = StepStore(counting)  # type: ignore[arg-type]
        steps = store.scan().committed
        all_steps = counting.lists
        counting.lists = 0
        read_restore_source(store, max(steps), verify=True)
        return {"list_calls_all_steps": all_steps, "list_calls_restore": counting.lists}


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
    def mb(b: float | None) -> str:
        return "-" if b is None else f"{b / 2**20:,.1f}"

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    rows = ["| ranks | layers | write items | plan first (s) | plan cached (s) "
            "| cached, whole plans (s) | DCP plan (s) | manifest (KiB) | objects "
            "| lists all_steps/restore | peak RSS (MiB) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(
            f"| {r['ranks']:,} | {r['layers']} | {r['items']:,} | {s(r['plan_first_s'])} "
            f"| {s(r['plan_cached_s'])} ({100 * r['plan_cached_s'] / r['plan_first_s']:.2f}%) "
            f"| {s(r['plan_cached_whole_plans_s'])} | {s(r['dcp_plan_s'])} "
            f"| {r['manifest_bytes'] / 1024:,.1f} "
            f"| {r['objects_written']:,} | {r['list_calls_all_steps']}/{r['list_calls_restore']} "
            f"| {mb(r['peak_rss_bytes'])} |")
    rows += ["", "Metadata (decode: median of 3; lookups: one rank's chunk + location of every "
             "tensor):", "",
             "| ranks | chunks (1 layer) | MiB | decode (s) | format 1: MiB | format 1 decode (s) "
             "| DCP pickle: MiB | DCP decode (s) | chunks (80 layers) | MiB | decode (s) "
             "| lookups (s) | broadcast pickle MiB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(
            f"| {r['ranks']:,} | {r['chunks']:,} | {mb(r['metadata_bytes'])} "
            f"| {s(r['metadata_decode_s'])} | {mb(r['metadata_v1_bytes'])} "
            f"| {s(r['metadata_v1_decode_s'])} | {mb(r['dcp_metadata_bytes'])} "
            f"| {s(r['dcp_metadata_decode_s'])} | {r['full_model_chunks']:,} "
            f"| {mb(r['full_metadata_bytes'])} | {s(r['full_metadata_decode_s'])} "
            f"| {s(r['full_metadata_rank_lookups_s'])} "
            f"| {mb(r['full_metadata_pickled_bytes'])} |")
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
    a.loglog(ranks, [r["metadata_v1_decode_s"] for r in results], "o--",
             label="metadata decode, format 1 (1 layer)")
    a.loglog(ranks, [r["full_metadata_decode_s"] for r in results], "o-",
             label="metadata decode, format 2 (80 layers)")
    a.set_xlabel("simulated ranks")
    a.set_ylabel("seconds")
    a.legend()
    b.loglog(ranks, [r["full_metadata_bytes"] / 2**20 for r in results], "o-",
             label="metadata MiB (80 layers)")
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
