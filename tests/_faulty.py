"""A fault-injecting fsspec file system for tests: ``faulty://`` over the in-memory store.

Real backends cannot be made to fail on demand; this wrapper can. ``FaultyFS.fail_data`` makes
every new data file fail to open with ENOSPC; ``FaultyFS.delay_s`` slows each data-file write down.
"""

from __future__ import annotations

import errno
import time
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class FaultyFS(MemoryFileSystem):  # type: ignore[misc]
    """The memory file system with switchable faults on data files."""

    protocol = "faulty"
    fail_data: ClassVar[bool] = False
    delay_s: ClassVar[float] = 0.0
    data_opens: ClassVar[int] = 0

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if ("w" in mode or "x" in mode) and "/data-" in path:
            type(self).data_opens += 1
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.fail_data:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return super()._open(path, mode=mode, **kwargs)


def install() -> type[FaultyFS]:
    """Register ``faulty://`` with fsspec and reset its switches."""
    fsspec.register_implementation("faulty", FaultyFS, clobber=True)
    FaultyFS.fail_data = False
    FaultyFS.delay_s = 0.0
    FaultyFS.data_opens = 0
    return FaultyFS
