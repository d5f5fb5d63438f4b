"""The single-in-flight save queue and the reusable staging buffers it copies the state into.

Contract (DESIGN.md section 6):
1) (caller thread) ``Stager.stage`` copies every tensor of the flat state into host buffers that are
   reused across saves (pinned when the source is on an accelerator) and deep-copies Python
   values, so mutating the live state afterwards never reaches the checkpoint.
2) (caller thread) ``SaveQueue.submit`` starts one worker thread for the job and returns.
3) (worker thread) the job writes, commits and runs retention; its result or exception is kept.
4) (caller thread) ``SaveQueue.wait`` joins the worker and hands back the exception once.
At most one job is in flight; submitting while one runs is a bug (the manager waits first). A
worker thread exists only while a job runs, so interpreter exit waits for the commit instead of
hanging on an idle thread.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptmgr.dcp.shards import ShardedTensor, StagedShards

__all__ = ["SaveQueue", "Stager"]

log = logging.getLogger("ckptmgr")


class Stager:
    """Host copies of a flat state dict in buffers reused while the structure is unchanged."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # Sharded tensors: one buffer per distinct box (replicas are not copied).
        self._shard_buffers: dict[str, dict[Any, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers."""
        bufs = [*self._buffers.values(),
                *(b for boxes in self._shard_buffers.values() for b in boxes.values())]
        return sum(b.numel() * b.element_size() for b in bufs)

    def release(self) -> None:
        """Drop every buffer."""
        self._buffers.clear()
        self._shard_buffers.clear()

    def _buffer(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type != "cpu" and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def stage(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``flat`` (flat key -> tensor or Python value) into staging; returns the copy.

        Blocks until every device-to-host copy has landed.
        """
        out: dict[str, Any] = {}
        accelerator = False
        for key, value in flat.items():
            if not isinstance(value, ShardedTensor):
                self._shard_buffers.pop(key, None)  # the key held a sharded tensor before
            if isinstance(value, DTensor):
                local = value.to_local()
                buf = self._buffer(key, local)
                buf.copy_(local.detach(), non_blocking=local.device.type != "cpu")
                accelerator |= local.device.type != "cpu"
                out[key] = DTensor.from_local(buf, value.device_mesh, value.placements,
                                              run_check=False, shape=value.shape,
                                              stride=value.stride())
            elif isinstance(value, ShardedTensor):
                self._buffers.pop(key, None)
                out[key] = StagedShards.stage(value, self._shard_buffers.setdefault(key, {}))
            elif isinstance(value, torch.Tensor):
                buf = self._buffer(key, value)
                buf.copy_(value.detach(), non_blocking=value.device.type != "cpu")
                accelerator |= value.device.type != "cpu"
                out[key] = buf
            else:
                out[key] = copy.deepcopy(value)
        for key in set(self._buffers) - set(flat):
            del self._buffers[key]
        for key in set(self._shard_buffers) - set(flat):
            del self._shard_buffers[key]
        if accelerator and torch.cuda.is_available():
            torch.cuda.synchronize()
        return out


class SaveQueue:
    """Runs at most one save job at a time on a worker thread; keeps its failure for the caller."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        """Whether a job is running now."""
        t = self._thread
        return t is not None and t.is_alive()

    def has_failed(self) -> bool:
        """Whether a finished job left an error that was not handed back yet."""
        with self._lock:
            return not self.in_flight and self._error is not None

    def submit(self, job: Callable[[], None], *, name: str) -> None:
        """Start ``job`` on a new worker thread.

        Raises:
            RuntimeError: a job is still in flight (the caller must ``wait`` first).
        """
        if self.in_flight:
            raise RuntimeError("a save is already in flight")

        def run() -> None:
            try:
                job()
            except BaseException as e:
                # Kept for the next save/join/close; logged now so a process that exits without
                # joining still reports it.
                log.error("background save failed: %s: %s", type(e).__name__, e)
                with self._lock:
                    self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=False)
        self._thread.start()

    def wait(self) -> BaseException | None:
        """Wait for the job in flight; return its exception (once), or None."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        with self._lock:
            err, self._error = self._error, None
        return err
