"""The checksum every ckptmgr file and item carries (xxh3-64, 9-12 GB/s on one core here).

Torch-free on purpose: ``ckptmgr cp`` checks whole-file checksums without tensors, and so starts
without importing torch; the tensor code hashes the byte views of
:mod:`ckptmgr.dcp.tensor_bytes` with it.
"""

from __future__ import annotations

import xxhash

__all__ = ["CHECKSUM_ALGO", "Hasher", "checksum", "content_digest"]

CHECKSUM_ALGO = "xxh3_64"


def checksum(data: memoryview | bytes) -> str:
    """``"xxh3_64:<16 hex>"`` of ``data``."""
    return f"{CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(data)}"


def content_digest(data: memoryview | bytes) -> str:
    """The 32 lowercase hex digits of xxh3-128 of ``data``: the name of a shared chunk
    (``reuse_unchanged=True``). 128 bits, so that two different chunks of one root never share
    a name by chance (about 2**-64 for 2**32 chunks); never a checksum of its own."""
    return xxhash.xxh3_128_hexdigest(data)


class Hasher:
    """Streaming :func:`checksum` over several chunks."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        """Add ``data``."""
        self._h.update(data)

    def value(self) -> str:
        """The checksum of everything added so far."""
        return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"
