"""A file system registered in code under its own scheme (tests of the writer process)."""

from __future__ import annotations

from fsspec.implementations.local import LocalFileSystem


class AliasFileSystem(LocalFileSystem):
    """The local file system under the ``ckptalias://`` scheme."""

    protocol = ("ckptalias",)
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:  # type: ignore[override]
        if path.startswith("ckptalias://"):
            path = path[len("ckptalias://"):]
        return LocalFileSystem._strip_protocol(path)
