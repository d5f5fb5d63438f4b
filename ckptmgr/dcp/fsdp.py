"""A model and its optimizers as one ``Stateful``, for FSDP2, HSDP, DDP and plain models alike.

``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` turn a (possibly
sharded) model and its optimizers into state dicts keyed by canonical parameter names, with
DTensor shards where the model is sharded. Those are what can be resharded: a checkpoint written
by FSDP2 on 2 ranks restores into FSDP2 on 3 or 4 ranks, into HSDP, or into a plain model in a
process without a process group. :class:`ModelOptimizerState` makes that one line::

    state = {"app": ModelOptimizerState(model, optimizer), "progress": {"step": 0}}
    mgr.save(step, state)          # on every rank
    mgr.restore(step, state)       # on every rank, in place, resharding as needed
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from ckptmgr.dcp.optim import prime_optimizer
from ckptmgr.errors import ConfigError

__all__ = ["ModelOptimizerState"]


class ModelOptimizerState(Stateful):
    """A model and its optimizers, saved and restored through ``get_state_dict``/``set_state_dict``.

    Its state dict is ``{"model": {...}, "optim": {...}}`` with canonical parameter names (the
    names of the unwrapped model: no ``module.`` prefix from DDP, none from FSDP2), so a checkpoint
    taken under one parallelism and world size restores under another.

    Both methods are collective when the model is sharded: every rank calls them (the manager's
    ``save`` and ``restore`` do). ``state_dict()`` includes zero placeholders for optimizer state
    that does not exist yet (made by :func:`ckptmgr.prime_optimizer`, then taken out of the
    optimizer again), so a fresh optimizer can be restored into in place while a save changes
    nothing in the optimizer.

    Args:
        model: the model: plain, ``fully_shard``-ed (FSDP2/HSDP), DDP, or tensor-parallel.
        optimizers: one optimizer, several (their states are merged by parameter name), or None
            for the model alone.
        options: ``StateDictOptions`` for both directions (None: sharded state, strict load).

    Raises:
        ConfigError: ``model`` is not an ``nn.Module`` or an optimizer is not a
            ``torch.optim.Optimizer``.
    """

    def __init__(self, model: torch.nn.Module,
                 optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
                 *, options: StateDictOptions | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizers is None:
            optims: tuple[torch.optim.Optimizer, ...] = ()
        elif isinstance(optimizers, torch.optim.Optimizer):
            optims = (optimizers,)
        else:
            optims = tuple(optimizers)
        for i, o in enumerate(optims):
            if not isinstance(o, torch.optim.Optimizer):
                raise ConfigError(
                    f"optimizers[{i}] must be a torch.optim.Optimizer, got {type(o).__name__}")
        self.model = model
        self.optimizers = optims
        self.options = options

    def __repr__(self) -> str:
        names = ", ".join(type(o).__name__ for o in self.optimizers) or "no optimizer"
        return f"ModelOptimizerState({type(self.model).__name__}, {names})"

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` (no ``"optim"`` without optimizers). Collective when
        the model is sharded. Tensors are the live parameters and state (no copies), so an
        in-place load fills them directly.

        Leaves every optimizer exactly as it was: parameters without state (unused branches,
        unrouted experts) get zero placeholder entries in the returned dict, so that a fresh
        optimizer can be restored into, but not in the optimizer itself, whose next ``step()``
        (Adam's bias correction counts steps) is the one it would have been without the call.
        """
        placeholders: list[tuple[torch.optim.Optimizer, torch.Tensor, dict[str, Any] | None]] = []
        try:
            for optim in self.optimizers:
                # get_state_dict would create missing state itself, but only when no parameter
                # has a gradient, and it would leave it in the optimizer.
                for group in optim.param_groups:
                    for p in group["params"]:
                        if p.requires_grad and not optim.state.get(p):
                            placeholders.append((optim, p, optim.state.get(p)))
                prime_optimizer(optim)
            model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        finally:
            # The placeholders stay reachable from the returned dict only (a restore fills them
            # and load_state_dict hands them back); the optimizers' own state is as before.
            for optim, p, before in placeholders:
                if before is None:
                    optim.state.pop(p, None)
                else:
                    optim.state[p] = before
        out: dict[str, Any] = {"model": model_sd}
        if self.optimizers:
            out["optim"] = optim_sd
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the model and optimizers from a dict shaped like :meth:`state_dict`'s. Collective
        when the model is sharded.

        Raises:
            ConfigError: ``state_dict`` has no ``"model"``, or no ``"optim"`` while there are
                optimizers.
        """
        if "model" not in state_dict or (self.optimizers and "optim" not in state_dict):
            raise ConfigError(
                f"{self!r}.load_state_dict needs the keys 'model' and 'optim' (got "
                f"{sorted(map(str, state_dict))})")
        set_state_dict(self.model, self.optimizers, model_state_dict=dict(state_dict["model"]),
                       optim_state_dict=dict(state_dict.get("optim", {})), options=self.options)
