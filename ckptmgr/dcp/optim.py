"""Create a fresh optimizer's state tensors so a checkpoint can be restored into them in place.

torch.optim optimizers create their state (``exp_avg``, ``momentum_buffer``, ...) lazily, in the
first ``step()``. An in-place restore (``torch.distributed.checkpoint.load``) only fills the keys
that ``optimizer.state_dict()`` already exposes, so a fresh optimizer must be primed first.
"""

from __future__ import annotations

import torch

from ckptmgr.dcp.xla import is_xla_tensor, zeros_like_sharded
from ckptmgr.errors import ConfigError

__all__ = ["prime_optimizer"]

# Group entries zeroed for the priming step. The params are copied back bit for bit whatever the
# step does to them; zeroing these keeps the placeholder state free of terms derived from parameter
# values (L2 weight decay adds ``weight_decay * p`` to the gradient before it reaches the moments).
_ZEROED_HYPERPARAMETERS = ("lr", "weight_decay")


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create the optimizer state of every trainable parameter that has none, changing nothing else.

    Runs ``optimizer.step()`` once with zero gradients on the parameters that need state, no
    gradient on all others (torch.optim skips those) and ``lr`` and ``weight_decay`` at zero.
    Afterwards every parameter with ``requires_grad`` has state, as far as the optimizer keeps any
    (SGD without momentum keeps none), and parameter values (bit for bit), ``.grad`` (the same
    objects) and ``param_groups`` (the same hyperparameter objects) are as before. Parameters that
    already have state are not stepped, and an optimizer whose trainable parameters all have state
    is not touched at all, so calling this twice is harmless.

    The new state is a placeholder to restore over, not a starting point for training: step counters
    read 1 and moments are zero. Restore a checkpoint into it (``optimizer.load_state_dict`` or an
    in-place ``torch.distributed.checkpoint`` load) before the next real step.

    Works on DTensor (FSDP2) and XLA SPMD parameters (the new state takes each parameter's
    sharding); run it on every rank, as the step may communicate. It
    briefly holds one zero gradient and one copy of each parameter being primed, and optimizer step
    hooks fire once.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose ``step()`` can run without a closure on dense
            gradients.

    Raises:
        ConfigError: ``optimizer`` is not a ``torch.optim.Optimizer``, or its ``step()`` failed on
            zero gradients (LBFGS needs a closure, SparseAdam sparse gradients); the original is
            ``__cause__``, and parameters, gradients and hyperparameters are restored.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer instance, got {_describe(optimizer)}"
        )
    # .get, not [...]: optimizer.state is a defaultdict and indexing would insert empty entries.
    needs_state = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and not optimizer.state.get(p)
    ]
    if not needs_state:
        return optimizer
    with torch.no_grad():
        _step_on_zero_grads(optimizer, needs_state)
    return optimizer


def _step_on_zero_grads(optimizer: torch.optim.Optimizer, needs_state: list[torch.Tensor]) -> None:
    """Step ``optimizer`` once so that ``needs_state`` gets state; restore params, grads, groups."""
    primed_ids = {id(p) for p in needs_state}
    params: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    saved_grads = [p.grad for p in params]
    # Shallow copies: restoring them puts back the very hyperparameter objects (a tensor lr too).
    saved_groups = [dict(group) for group in optimizer.param_groups]
    # lr=0 does not make a step the identity: float arithmetic quiets signalling NaNs (every
    # optimizer), maximize=True turns -0.0 into +0.0 (SGD, RMSprop), Adafactor and foreach ASGD
    # turn inf into NaN. Copying the bytes back is exact for any optimizer (clone and copy_ move
    # bits, NaN payloads included), at the cost of one copy of the params being primed.
    snapshots = [p.detach().clone() for p in needs_state]
    try:
        for p in params:
            # A param without a grad is skipped by every torch.optim optimizer: neither stepped nor
            # given state. zeros_like keeps DTensor placements, dtype and device; on XLA the
            # sharding must be given explicitly, or the new state would be replicated.
            if id(p) not in primed_ids:
                p.grad = None
            else:
                p.grad = zeros_like_sharded(p) if is_xla_tensor(p) else torch.zeros_like(p)
        for group in optimizer.param_groups:
            for key in _ZEROED_HYPERPARAMETERS:
                if key in group:
                    group[key] = _zero_of(group[key])
        try:
            optimizer.step()
        except Exception as exc:
            raise ConfigError(
                f"optimizer {type(optimizer).__name__} cannot be primed: its step() failed on zero "
                f"gradients ({type(exc).__name__}: {exc}); optimizers whose step() needs a closure "
                "or sparse gradients are not supported"
            ) from exc
    finally:
        for p, snapshot in zip(needs_state, snapshots, strict=True):
            p.copy_(snapshot)
        for p, grad in zip(params, saved_grads, strict=True):
            p.grad = grad
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            group.clear()
            group.update(saved)


def _zero_of(value: object) -> object:
    """A zero of the same kind as ``value``; values that are not numbers are left as they are."""
    if isinstance(value, torch.Tensor):
        # A new tensor rather than fill_: the caller's tensor must come back with its value intact
        # even if the step raises, and fused or capturable kernels need the same dtype and device.
        return torch.zeros_like(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return type(value)(0)
    return value


def _describe(value: object) -> str:
    """Name ``value``'s type for an error message, without printing a possibly huge repr."""
    if isinstance(value, type):
        hint = "; pass an instance" if issubclass(value, torch.optim.Optimizer) else ""
        return f"the class {value.__module__}.{value.__qualname__}{hint}"
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"
