"""Progress of a long operation (copying, exporting, importing, verifying): what the tools report
to, and the CLI draws as a bar on a terminal. Pure."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

__all__ = ["Progress", "phase"]


class Progress(Protocol):
    """Receives progress of a long operation (the CLI draws a bar on a terminal)."""

    def start(self, total: int, label: str) -> None:
        """A new phase of ``total`` bytes begins."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes were processed."""

    def finish(self) -> None:
        """The phase ended (successfully or not)."""


class _NoProgress:
    def start(self, total: int, label: str) -> None:
        return None

    def advance(self, nbytes: int) -> None:
        return None

    def finish(self) -> None:
        return None


@contextlib.contextmanager
def phase(progress: Progress | None, total: int, label: str) -> Iterator[Progress]:
    """One phase of ``total`` bytes reported to ``progress`` (nowhere when None); finished
    whether the body succeeds or not."""
    p: Progress = progress if progress is not None else _NoProgress()
    p.start(total, label)
    try:
        yield p
    finally:
        p.finish()
