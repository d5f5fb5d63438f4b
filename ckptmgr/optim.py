"""``ckptmgr.optim``: the public home of :func:`prime_optimizer`, implemented in
:mod:`ckptmgr.dcp.optim` beside the planners it shares the XLA adapter with (imports flow one way:
this module imports ``ckptmgr.dcp``, never the reverse)."""

from __future__ import annotations

from ckptmgr.dcp.optim import prime_optimizer

__all__ = ["prime_optimizer"]
