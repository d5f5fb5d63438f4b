"""Our DCP planners: DCP's default planning over the flat state dicts of :mod:`.state`.

Python values never go through ``torch.save``/``torch.load``: the writer encodes the object it looks
up, and the reader hands decoded values to :meth:`CkptLoadPlanner.load_value`.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem

from ckptmgr.errors import UnsafeCheckpointError

__all__ = ["CkptLoadPlanner", "CkptSavePlanner"]


class CkptSavePlanner(DefaultSavePlanner):
    """DCP's default save planning (balanced dedup of replicated items) on a flat state dict."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True)


class CkptLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planning (resharding) on a flat state dict; collects Python values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True,
                         allow_partial_load=False)
        self.values: dict[str, Any] = {}

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Record the decoded Python value of ``read_item``."""
        self.values[read_item.dest_index.fqn] = value

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Only a foreign reader would call this, with pickle bytes: refuse rather than unpickle.
        raise UnsafeCheckpointError(
            f"refusing to unpickle {read_item.dest_index.fqn!r} from a foreign storage reader")
