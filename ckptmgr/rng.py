"""``ckptmgr.rng``: the random number generators of this process as a ``Stateful``, per rank.

Exact resume needs every generator a training step draws from back where it was: dropout and
random augmentations draw from torch's generators (CPU and each CUDA device), data pipelines often
from Python's ``random`` or NumPy's global generator. Each rank's generators are its own (HF's
Trainer saves ``rng_state_{rank}.pth``), so :class:`RNGState` keys its state by rank::

    rng.rank0.python   Python ``random``: ``random.getstate()``
    rng.rank0.numpy    NumPy's global generator (only when numpy is importable)
    rng.rank0.torch    torch's CPU generator: ``torch.get_rng_state()`` as bytes
    rng.rank0.cuda     torch's CUDA generators, one bytes per device (once CUDA is initialized)
    rng.rank1.python   ...

Every entry is a Python value (tagged JSON: ints, tuples, bytes), never a tensor: no shape or dtype
to mismatch when the number of CUDA devices changes, and nothing that a staged copy would compare
as "changed since the save call" (``save_on_close``). Every key is written by the one rank that
holds it (distinct keys are never deduplicated as replicated state).

On restore, each rank loads its own key. A rank that did not exist at save time (the world grew)
gets a deterministic state derived from rank 0's saved torch state and its rank number
(:func:`derived_seeds`), so no two ranks share a stream and a rerun of the same resume draws the
same numbers. A generator the step holds no state for on a rank that did exist (numpy installed
since) is seeded by the same rule. Ranks beyond the new world size (the world shrank) are not read.
CUDA devices beyond those saved keep their state; saved devices beyond those present are ignored.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ckptmgr.errors import StateMismatchError

__all__ = ["RNGState", "derived_seeds"]

_DERIVE_TAG = b"ckptmgr.rng/v1"


def _rank() -> int:
    """This process's global rank (0 without a process group): unique across every group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


@functools.cache
def _numpy() -> Any:
    """The numpy module, or None; looked up once (a failed import searches the path again)."""
    try:
        import numpy
    except ImportError:  # numpy is optional for our users
        return None
    return numpy


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.cpu().contiguous()
    np = _numpy()
    if np is not None:  # ten times faster than the list: state_dict() runs at every save call
        return bytes(t.numpy().tobytes())
    return bytes(t.tolist())


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def derived_seeds(rank0_torch_state: bytes, rank: int) -> dict[str, int]:
    """The seeds of a rank whose state a step does not hold: the documented rule.

    ``d = SHA-256(b"ckptmgr.rng/v1" + rank0_torch_state + rank as 8 bytes big-endian)``; the
    Python seed is ``d[0:8]``, the NumPy seed ``d[8:16]`` (given to ``numpy.random.seed`` as two
    32-bit words, low word first), the torch seed ``d[16:24]`` (``torch.manual_seed``: the CPU
    generator and every CUDA device), each read as a big-endian unsigned integer. Distinct slices
    keep the three generators uncorrelated (Python and NumPy seed Mersenne Twisters the same way).

    Args:
        rank0_torch_state: rank 0's saved torch CPU generator state (the ``rank0.torch`` entry).
        rank: the rank to seed.
    """
    d = hashlib.sha256(_DERIVE_TAG + rank0_torch_state + rank.to_bytes(8, "big")).digest()
    return {name: int.from_bytes(d[i:i + 8], "big")
            for name, i in (("python", 0), ("numpy", 8), ("torch", 16))}


class RNGState:
    """The generators of this process (Python ``random``, NumPy's global generator, torch CPU and
    every CUDA device), saved and restored per rank as a ``Stateful``.

    Put one in the state given to every ``save``/``save_async``/``restore`` on every rank::

        state = {"model": model, "optim": optim, "rng": ckptmgr.RNGState()}

    ``state_dict()`` captures the generators when called (the manager calls it when a save is
    taken); restoring sets them. The rank is read at each call (the global rank, 0 without a
    process group), so the object can be made before ``init_process_group``. See the module
    docstring for the keys and for what a rank that did not exist at save time gets.
    """

    def _parts(self) -> dict[str, Any]:
        parts: dict[str, Any] = {
            "python": random.getstate(),
            "torch": _tensor_bytes(torch.get_rng_state()),
        }
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            parts["numpy"] = (str(kind), keys.tolist(), int(pos), int(has_gauss), float(cached))
        # Only once CUDA is initialized: reading its generators would initialize it (in a
        # process that may fork data workers), and until then they hold only the seed that
        # torch.manual_seed queued, which a resumed run queues the same way.
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if torch.cuda.is_available() and initialized:
            parts["cuda"] = [_tensor_bytes(s) for s in torch.cuda.get_rng_state_all()]
        return parts

    def state_dict(self) -> dict[str, Any]:
        """``{"rank<r>": {generator: state}}`` for this rank ``r``, captured now."""
        return {f"rank{_rank()}": self._parts()}

    def state_dict_for_restore(self, saved_keys: Collection[str]) -> dict[str, Any]:
        """(restore) What this rank loads, given the keys the step holds under this object's path:
        its own entries that exist, plus ``rank0.torch`` when some generator must be derived.

        Called by ckptmgr's restore instead of :meth:`state_dict`. When the step holds no entry
        of any rank (it was saved without an RNGState), this rank's own keys are asked for, so
        the restore reports them missing (``StateMismatchError``) unless ``allow_partial``.
        """
        rank = _rank()
        mine = self._parts()
        present = {name: v for name, v in mine.items() if f"rank{rank}.{name}" in saved_keys}
        if (present.keys() | {"cuda"}) >= mine.keys():
            # Every generator has a saved state (CUDA devices without one keep theirs).
            return {f"rank{rank}": present}
        if "rank0.torch" not in saved_keys:
            return {f"rank{rank}": mine}
        out: dict[str, Any] = {f"rank{rank}": present} if present else {}
        out.setdefault("rank0", {})["torch"] = mine["torch"]
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the generators from a state dict of :meth:`state_dict`'s form (this rank's entry),
        or derive them (:func:`derived_seeds`) from ``rank0.torch`` where this rank's are absent.

        Raises:
            StateMismatchError: the state dict holds neither this rank's entry nor rank 0's torch
                state.
        """
        rank = _rank()
        own = state_dict.get(f"rank{rank}") or {}
        rank0 = state_dict.get("rank0") or {}
        seeds = derived_seeds(bytes(rank0["torch"]), rank) if "torch" in rank0 else None
        if not own and seeds is None:
            raise StateMismatchError(
                f"RNGState.load_state_dict: no state for rank {rank} and no rank0.torch entry to "
                f"derive one from (keys: {sorted(state_dict)[:8]}); give it a dict that "
                f"RNGState.state_dict() returned")
        np = _numpy()

        def derived(name: str) -> int:
            if seeds is None:
                raise StateMismatchError(
                    f"RNGState.load_state_dict: rank {rank}'s entry has no {name!r} state and "
                    "there is no rank0.torch entry to derive one from")
            return seeds[name]

        if "python" in own:
            version, internal, gauss = own["python"]
            random.setstate((version, tuple(internal), gauss))
        else:
            random.seed(derived("python"))
        if np is not None:
            if "numpy" in own:
                kind, keys, pos, has_gauss, cached = own["numpy"]
                np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                                     cached))
            else:
                s = derived("numpy")
                np.random.seed([s & 0xFFFFFFFF, s >> 32])
        if "torch" in own:
            torch.set_rng_state(_bytes_tensor(bytes(own["torch"])))
        else:
            torch.manual_seed(derived("torch"))  # also seeds every CUDA device
        if "cuda" in own and torch.cuda.is_available():
            for device, state in enumerate(own["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(_bytes_tensor(bytes(state)), device)
