"""Hardening on real bucket servers (issue 16): missing buckets, missing credentials, an
unreachable endpoint within the budget and without tracebacks from the backend's logger."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
import torch
from _servers import FakeGcs, MotoS3, free_port

from ckptmgr import CheckpointManager, ConfigError, StorageError


def test_missing_s3_bucket_is_config_error_and_never_created(moto_s3: MotoS3) -> None:
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    with pytest.raises(ConfigError, match="does not exist") as info:
        CheckpointManager(f"s3://{bucket}/run", save_interval=1, chkpt_on_preemption=False,
                          storage_options=moto_s3.storage_options())
    assert bucket in str(info.value)
    assert not moto_s3.fs().exists(bucket)


def test_missing_gcs_bucket_is_config_error(fake_gcs: FakeGcs) -> None:
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    with pytest.raises(ConfigError, match="does not exist"):
        CheckpointManager(f"gs://{bucket}/run", save_interval=1, chkpt_on_preemption=False,
                          storage_options=fake_gcs.storage_options())
    assert not fake_gcs.fs().exists(bucket)


def test_existing_bucket_still_saves(moto_s3: MotoS3, fake_gcs: FakeGcs) -> None:
    for url, opts in ((f"s3://ckpt-tests/{uuid.uuid4().hex}", moto_s3.storage_options()),
                      (f"gs://ckpt-tests/{uuid.uuid4().hex}", fake_gcs.storage_options())):
        with CheckpointManager(url, save_interval=1, chkpt_on_preemption=False,
                               storage_options=opts) as mgr:
            assert mgr.save(1, {"w": torch.ones(2)})
            assert mgr.all_steps() == [1]


def test_s3_without_credentials_says_where_they_come_from(
        moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError, match="AWS_ACCESS_KEY_ID") as info:
        CheckpointManager("s3://ckpt-tests/run", save_interval=1, chkpt_on_preemption=False,
                          storage_options={"endpoint_url": moto_s3.endpoint_url})
    assert "storage_options" in str(info.value) and "~/.aws" in str(info.value)


class _SkippedBackoff:
    """Stands in for the ``asyncio`` module in ``gcsfs.retry``, whose only use of it is the
    backoff sleep between gcsfs's own attempts (1 + 2 + 4 + 8 + 16 s, plus up to 1 s of jitter
    each): it records each sleep and returns at once, so the test counts those seconds instead
    of waiting them out (about 33 s)."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await asyncio.sleep(0)


def test_unreachable_gcs_endpoint_within_budget_and_quiet(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gcsfs.retry

    backoff = _SkippedBackoff()
    monkeypatch.setattr(gcsfs.retry, "asyncio", backoff)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with caplog.at_level(logging.DEBUG), pytest.raises(StorageError) as info:
        CheckpointManager("gs://ckpt-tests/run", save_interval=1, chkpt_on_preemption=False,
                          storage_options={"endpoint_url": url, "token": "anon", "project": "x"})
    # What the constructor would have taken: its own time plus the backoff skipped above.
    took = time.monotonic() - t0 + sum(backoff.slept)
    assert backoff.slept, "gcsfs never backed off: its retry loop was not exercised"
    assert took < 90, f"{took:.0f} s ({len(backoff.slept)} gcsfs backoffs)"
    assert "ckpt-tests" in str(info.value)
    out, err = capfd.readouterr()
    text = out + err + caplog.text
    assert "Traceback" not in text
    assert not [r for r in caplog.records if r.name.startswith("gcsfs") and r.exc_info]
