"""Shared fixtures: checkpoint roots on every storage the default suite covers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _procs import Zygote

# Importing _servers sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before anything imports gcsfs.
from _servers import FakeGcs, MotoS3, SeaweedS3, ServerUnavailable

BUCKET = "ckpt-tests"


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    # pyproject.toml sets pytest-timeout's options (docs/testing.md, "Time-outs"). Without the
    # plugin (the XLA lane's pinned environment, or -p no:timeout) pytest would stop at start on
    # those unknown keys (filterwarnings = error); there they are declared here and unenforced.
    if not pluginmanager.hasplugin("timeout"):
        parser.addini("timeout", "per-test time limit (needs pytest-timeout; ignored here)")
        parser.addini("timeout_method", "how it is enforced (needs pytest-timeout; ignored here)")


def pytest_configure(config: pytest.Config) -> None:
    # aiohttp warns that a raw-bytes request body over 1 MiB "might lock the event loop"; gcsfs
    # sends upload chunks that way. The loop is fsspec's own I/O thread, which has nothing else
    # to do meanwhile, so the advice does not apply (docs/storage.md).
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Sending a large body directly with raw bytes:ResourceWarning")


def _start(request: pytest.FixtureRequest, cls: type[Any]) -> Any:
    """Start a server once per session; skip its tests with the reason when it cannot start."""
    try:
        server = cls()
    except ServerUnavailable as e:
        pytest.skip(f"{cls.__name__} unavailable: {e}")
    request.addfinalizer(server.stop)
    server.make_bucket(BUCKET)
    return server


@pytest.fixture(scope="session")
def moto_s3(request: pytest.FixtureRequest) -> MotoS3:
    """moto's threaded S3 server in this process (127.0.0.1), with bucket ``ckpt-tests``."""
    return _start(request, MotoS3)  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def seaweed_s3(request: pytest.FixtureRequest) -> SeaweedS3:
    """SeaweedFS ``weed mini`` (signature checks, real multipart), with bucket ``ckpt-tests``."""
    return _start(request, SeaweedS3)  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def fake_gcs(request: pytest.FixtureRequest) -> FakeGcs:
    """fake-gcs-server (in-memory backend, HTTP on 127.0.0.1), with bucket ``ckpt-tests``."""
    return _start(request, FakeGcs)  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """Forks real processes that run Python programs with torch and ckptmgr already imported
    (tests/_procs.py): examples, doc blocks and preemption runs skip seconds of start-up each."""
    z = Zygote()
    yield z
    z.close()


def _bucket_root(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                 kind: str) -> Iterator[str]:
    # The manager suite passes no storage_options: the backends' own conventions point them at
    # the servers (AWS_* variables for s3fs, fsspec's config for gcsfs), as a user's would.
    import fsspec.config

    if kind == "s3":
        server = request.getfixturevalue("moto_s3")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    else:
        server = request.getfixturevalue("fake_gcs")
        monkeypatch.setitem(fsspec.config.conf, "gs", {
            "endpoint_url": server.endpoint_url, "token": "anon", "project": "ckptmgr-test"})
        url = f"gs://{BUCKET}/{uuid.uuid4().hex}"
    yield url
    fs = server.fs()
    path = url.split("://", 1)[1]
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture(params=["local", "file", "memory", "s3", "gcs"])
def root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, empty checkpoint root URL: a plain local path, a file:// URL, a memory:// URL,
    an s3:// URL on moto or a gs:// URL on fake-gcs-server (servers started once per session)."""
    kind = request.param
    if kind in ("s3", "gcs"):
        yield from _bucket_root(request, monkeypatch, kind)
        return
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
