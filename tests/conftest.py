"""Shared fixtures: checkpoint roots on every storage the default suite covers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["local", "file", "memory"])
def root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh, empty checkpoint root URL: a plain local path, a file:// URL or a memory:// URL."""
    kind = request.param
    if kind == "memory":
        url = f"memory://ckpt-tests/{uuid.uuid4().hex}"
        yield url
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
        return
    path = tmp_path_factory.mktemp("ckpt") / "run"
    yield str(path) if kind == "local" else f"file://{path}"


@pytest.fixture
def local_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh local checkpoint root path."""
    return str(tmp_path_factory.mktemp("ckpt") / "run")
