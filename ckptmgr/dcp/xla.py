"""The thin adapter from torch_xla SPMD tensors to :class:`~ckptmgr.dcp.shards.ShardedTensor`.

The only module that imports ``torch_xla``, and only when a state actually holds XLA tensors
(``tensor.device.type == "xla"``), so ckptmgr imports and runs without it. Tested for real in the
XLA lane (torch 2.9 + torch_xla 2.9, ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``; see docs/xla.md).

What torch_xla provides per sharded tensor (``XLAShardedTensor``): its local shards as host copies
of the padded device buffers, with each shard's device, index slices into the global tensor
(``Ellipsis`` when replicated) and replica id; and ``_load_local_shards`` to put padded host buffers
back onto the devices (padded buffers of the exact dtype; the devices named as
``_get_local_shards`` names them, e.g. ``"CPU:0"``). A tensor with no sharding annotation, or a
fully replicated one, is read with one ``.cpu()`` and restored with an in-place ``copy_`` (torch_xla
refuses ``_load_local_shards`` on replicated tensors).

Cost: torch_xla gives a shard's padded shape and device name only together with its data, so
:meth:`XlaShards.layout` copies the local shards to the host once per save or restore (on restore
this is a transient host copy of the current values, freed when the loaded shards go back).

A pending (not yet executed) tensor reports no sharding until ``torch_xla.sync()``:
:func:`wrap_xla_tensors` syncs first; anything building :class:`XlaShards` directly must too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptmgr.dcp.shards import KnownShapeShards, ShardInfo
from ckptmgr.errors import BackendNotInstalledError

__all__ = ["XlaShards", "is_xla_tensor", "wrap_xla_tensors", "zeros_like_sharded"]


def is_xla_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor on an XLA device (checked without importing torch_xla)."""
    return isinstance(value, torch.Tensor) and value.device.type == "xla"


def _torch_xla() -> Any:
    try:
        import torch_xla
        import torch_xla.distributed.spmd  # registers XLAShardedTensor
    except ImportError as e:  # pragma: no cover - only without torch_xla
        raise BackendNotInstalledError(
            "the state holds XLA tensors but torch_xla is not importable: "
            "pip install torch_xla, the release matching your torch (torch_xla 2.9.0 for "
            "torch 2.9.0)") from e
    return torch_xla


class XlaShards(KnownShapeShards):
    """A torch_xla tensor (sharded, replicated or plain XLA) seen through the shard interface.

    Call ``torch_xla.sync()`` before building one (see the module docstring).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        txla = _torch_xla()
        from torch_xla.distributed.spmd import XLAShardedTensor

        self._txla = txla
        self.tensor = tensor.global_tensor if isinstance(tensor, XLAShardedTensor) else tensor
        super().__init__(self.tensor.shape, self.tensor.dtype)
        spec = txla._XLAC._get_xla_sharding_spec(self.tensor)
        # "" for replicated data (no annotation, or annotated fully replicated: type 0).
        replicated = not spec or txla._XLAC._get_xla_sharding_type(self.tensor) == 0
        self.sharding = "" if replicated else str(spec)
        self._shards: list[tuple[torch.Tensor, str]] | None = None
        self._layout: list[ShardInfo] | None = None

    def _fetch(self) -> list[tuple[torch.Tensor, str]]:
        if self._shards is None:
            if not self.sharding:
                self._shards = [(self.tensor.detach().cpu(), str(self.tensor.device))]
            else:
                # Host copies of every local device buffer, padded, with the device names.
                self._shards = [(d, str(dev)) for d, dev in
                                self._txla._XLAC._get_local_shards([self.tensor])[0]]
        return self._shards

    def layout(self) -> list[ShardInfo]:
        if self._layout is not None:
            return list(self._layout)
        shards = self._fetch()
        shape = tuple(self._global_shape)
        if not self.sharding:
            self._layout = [ShardInfo(shards[0][1], (0,) * len(shape), shape, shape, 0)]
            return list(self._layout)
        replica_indices = self._txla._XLAC._get_local_shard_replica_and_indices([self.tensor])[0]
        infos = []
        for (data, device), (replica, indices) in zip(shards, replica_indices, strict=True):
            if indices is Ellipsis or indices == Ellipsis:
                offsets, sizes = (0,) * len(shape), shape
            else:
                offsets = tuple(int(s.start) for s in indices)
                sizes = tuple(int(s.stop) - int(s.start) for s in indices)
            infos.append(ShardInfo(device, offsets, sizes, tuple(data.shape), int(replica)))
        self._layout = infos
        return list(infos)

    def local_shards(self) -> list[torch.Tensor]:
        # Handed out once: the planner or the stager keeps what it needs, the rest is freed.
        shards = self._fetch()
        self._shards = None
        return [d for d, _ in shards]

    def load_local_shards_(self, data: Sequence[torch.Tensor]) -> None:
        layout = self.layout()
        if len(data) != len(layout):
            raise ValueError(f"expected {len(layout)} shards, got {len(data)}")
        self._shards = None
        if not self.sharding:
            with torch.no_grad():
                self.tensor.copy_(data[0].to(self.tensor.device))
            return
        devices = [info.device for info in layout]
        self._txla._XLAC._load_local_shards(self.tensor, [d.contiguous() for d in data], devices)


def wrap_xla_tensors(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` with every XLA tensor replaced by an :class:`XlaShards` (others unchanged)."""
    if not any(is_xla_tensor(v) for v in flat.values()):
        return dict(flat)
    # Run the pending lazy computations first, so the shards hold the values of this step.
    txla = _torch_xla()
    sync = getattr(txla, "sync", None)
    if sync is not None:
        # wait=True: sync() only launches the graph, and _get_local_shards/_load_local_shards do
        # not wait for it ("Trying to access XLA data ... while an async operation is in flight").
        sync(wait=True)
    else:  # pragma: no cover - torch_xla before 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()
        xm.wait_device_ops()
    return {k: XlaShards(v) if is_xla_tensor(v) else v for k, v in flat.items()}


def zeros_like_sharded(tensor: torch.Tensor) -> torch.Tensor:
    """Zeros like an XLA ``tensor``, with its sharding (a plain ``zeros_like`` is unannotated, and
    optimizer state created from it would be replicated on every device for the whole run)."""
    txla = _torch_xla()
    out = torch.zeros_like(tensor)
    if txla._XLAC._get_xla_sharding_spec(tensor):
        txla._XLAC._xla_mark_sharding(out, txla._XLAC._get_xla_op_sharding(tensor))
    return out
