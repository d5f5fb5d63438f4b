"""The fault catalogue's SIGKILL loop, short: 30 kills across local/S3 and thread/process mode.

Each variant kills a trainer that calls ``save_async`` every step at seeded random moments (and,
in process mode, its writer process too), restarts it on the same root, and after every kill
checks that every listed step restores bit-exact to what that step's save held, that no step
reported committed was lost except by retention, and that foreign files are untouched
(faults/kill_loop.py). The long run: ``python -m faults.kill_loop --kills 1000 ...``
(docs/testing.md). ``CKPTMGR_FAULTS_SEED`` picks another seed.
"""

from __future__ import annotations

import os
import sys

import pytest
from _procs import Zygote
from _servers import MotoS3

# Appended: a PYTHONPATH naming another ckptmgr (the code before a fix) still wins.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from faults import _common
from faults.kill_loop import kill_loop

SEED = int(os.environ.get("CKPTMGR_FAULTS_SEED", "0"))


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "mode", "kills"), [
    ("local", "thread", 12), ("s3", "thread", 10), ("local", "process", 4), ("s3", "process", 4)])
def test_sigkill_loop(backend: str, mode: str, kills: int, zygote: Zygote,
                      request: pytest.FixtureRequest) -> None:
    if backend == "s3":
        server: MotoS3 = request.getfixturevalue("moto_s3")
        _common.use_s3_server(server)
    report = kill_loop(kills, backend, mode, SEED, zygote=zygote)
    assert report.kills == kills
    # Progress: the root moved on between kills (kills are not all in the first save).
    assert report.steps_committed > 0, report.summary()
    if mode == "process":
        assert report.writer_kills > 0, report.summary()
