"""Operator tools over a checkpoint root: list, inspect, verify, prune, export, copy and import.

These are the library functions behind the ``ckptmgr`` command line (see ``docs/cli.md``); each
can be called from Python too::

    from ckptmgr import tools

    for s in tools.list_steps("gs://bucket/run-7"):
        print(s.step, s.committed, s.total_bytes)
    report = tools.verify_steps("/ckpt/run-7", all_steps=True)
    tools.export_step("/ckpt/run-7", 1000, "model.safetensors", only="model", dtype="bf16")
    tools.import_dcp("/ckpt/dcp-run/step-500", "/ckpt/run-7", 500, trusted=True)

Every function is local (no process group) and works on any storage the library supports. They
read manifests and metadata as the manager does: JSON only, every path checked to stay inside its
step directory; only :func:`import_dcp` runs pickle (DCP's own ``.metadata``), and only with
``trusted=True``. Errors are :class:`~ckptmgr.errors.CkptmgrError` subclasses naming the step and
the file.

What they must not break (DESIGN.md sections 5 and 7):
- :func:`prune_steps` uses the library's retention policies and never deletes the newest committed
  step; a step is deleted manifest first, then its files.
- :func:`copy_steps` and :func:`import_dcp` write a step's files first and its manifest last (a
  staging directory renamed into place on POSIX, the manifest object written last on object
  stores), so a crash leaves an uncommitted leftover, never a listed step with missing files.
- Nothing here holds more than about the largest tensor (export, import) or one read buffer
  (verify, copy) in memory.
- Steps saved with ``reuse_unchanged=True`` reference shared chunks of their root
  (``chunks/<32 hex>``, docs/byte-format.md): :func:`verify_steps` checks each one (once per
  run, its damage reported against every step that references it), :func:`copy_steps` copies
  the ones a step references before its manifest (the copy stands alone), and
  :func:`prune_steps` removes only those no committed step references, through the step store's
  one fenced door (:meth:`~ckptmgr.step_store.StepStore.remove_unreferenced_chunks`).

One module per command family: :mod:`~ckptmgr.tools.inspect` (list, inspect, verify),
:mod:`~ckptmgr.tools.prune`, :mod:`~ckptmgr.tools.export` (writing the formats of
:mod:`ckptmgr.formats`) and :mod:`~ckptmgr.tools.copy`; what they share is in ``_common``.
:func:`import_dcp` is :mod:`ckptmgr.formats.plain_dcp`'s, the one home of plain-DCP support.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptmgr.progress import Progress

if TYPE_CHECKING:
    from ckptmgr.formats.plain_dcp import import_dcp
    from ckptmgr.tools.copy import CopyResult, copy_steps
    from ckptmgr.tools.export import ExportResult, HfExportResult, export_hf, export_step
    from ckptmgr.tools.inspect import (
        Problem,
        StepDetails,
        StepVerification,
        TensorEntry,
        ValueEntry,
        inspect_step,
        verify_steps,
    )
    from ckptmgr.tools.listing import (
        SharedUsage,
        StepListing,
        format_bytes,
        list_steps,
        shared_usage,
    )
    from ckptmgr.tools.prune import PruneResult, prune_steps

# Each name is imported from its module on first use (PEP 562): ``ckptmgr ls``, ``prune``, ``cp``,
# ``inspect``, ``verify`` and ``--help`` start without torch (listing, prune, copy, inspect and
# _common never import it; export and import do: they handle tensors).
_MODULES = {
    "listing": ("SharedUsage", "StepListing", "format_bytes", "list_steps", "shared_usage"),
    "copy": ("CopyResult", "copy_steps"),
    "ckptmgr.formats.plain_dcp": ("import_dcp",),
    "export": ("ExportResult", "HfExportResult", "export_hf", "export_step"),
    "inspect": ("Problem", "StepDetails", "StepVerification", "TensorEntry", "ValueEntry",
                "inspect_step", "verify_steps"),
    "prune": ("PruneResult", "prune_steps"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptmgr.tools' has no attribute {name!r}")
    path = module if module.startswith("ckptmgr.") else f"ckptmgr.tools.{module}"
    value = getattr(importlib.import_module(path), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CopyResult",
    "ExportResult",
    "HfExportResult",
    "Problem",
    "Progress",
    "PruneResult",
    "SharedUsage",
    "StepDetails",
    "StepListing",
    "StepVerification",
    "TensorEntry",
    "ValueEntry",
    "copy_steps",
    "export_hf",
    "export_step",
    "format_bytes",
    "import_dcp",
    "inspect_step",
    "list_steps",
    "prune_steps",
    "shared_usage",
    "verify_steps",
]
