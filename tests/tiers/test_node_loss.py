"""Node loss with the local tier (issue 29): simulated nodes on one machine (tests/_nodes.py).

Four nodes of one rank each run tests/fixtures/node_train.py (real processes, gloo over loopback,
the state one int32 DTensor sharded over the ranks plus its step and version); the durable tier is
the moto S3 server behind the fault proxy (tests/_servers.py), shared by every node; each node's
``local_path`` is on its own disk. Every scenario runs twice: ``plain`` (ranks as plain processes,
distinct ``GROUP_RANK`` and local directories; node loss = SIGKILL of the node's processes and its
directory deleted) and ``namespaced`` (each node in its own user, PID, UTS and mount namespaces
with a private tmpfs as its disk, every node given the same ``local_path``; node loss = SIGKILL of
the namespace's init, the tmpfs gone with it), skipped with the reason where namespaces are not
allowed.

A restore is checked on every rank: the restored shard equals the values of the restored step and
version (nothing mixed within a rank), and every rank restored the same step and version (nothing
mixed across ranks).
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _nodes import TRAIN, Job, Node, Nodes, namespace_problem
from _servers import Fault, FaultProxy, MotoS3

pytestmark = pytest.mark.slow  # each case runs two or three 4-rank jobs: 10-40 s

NAMES = ("n0", "n1", "n2", "n3")
NUMEL = 4096  # int32 elements per rank: 16 KiB
BUCKET = "ckpt-tests"  # made by the moto_s3 fixture (conftest.py)


class Cluster:
    """Four live nodes (a lost one is replaced, with an empty disk, by :meth:`lose`) and the
    environment of their jobs."""

    def __init__(self, nodes: Nodes, env: dict[str, str], proxy: FaultProxy) -> None:
        self.nodes = nodes
        self.env = env
        self.proxy = proxy  # every rank reaches the S3 server through it
        self.live: list[Node] = nodes.start(NAMES)

    def lose(self, *indices: int) -> None:
        """Lose these nodes; a replacement of each (same name, empty disk) starts at once."""
        for i in indices:
            self.live[i].lose()
        for i in indices:
            self.live[i] = self.nodes.add(NAMES[i], wait=False)

    def start(self, spec: dict[str, Any], dir: Path, group_rank: bool = True) -> Job:
        """Start the job ``spec`` (tests/fixtures/node_train.py) on the live nodes."""
        for node in self.live:
            node.ready()
        return Job(self.live, [str(TRAIN), json.dumps(spec)], str(dir), env=self.env,
                   group_rank=group_rank)

    def run(self, spec: dict[str, Any], dir: Path, group_rank: bool = True) -> dict[int, Any]:
        """Run the job to its end; each rank's result."""
        job = self.start(spec, dir, group_rank)
        try:
            job.wait()
        finally:
            job.close()
        return job.results()


@pytest.fixture(scope="module", params=["plain", "namespaced"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            moto_s3: MotoS3) -> Iterator[Cluster]:
    namespaced = request.param == "namespaced"
    if namespaced and (why := namespace_problem()) is not None:
        pytest.skip(f"nodes in namespaces are not possible here: {why}")
    proxy = FaultProxy(moto_s3.endpoint_url)
    env = {"AWS_ENDPOINT_URL_S3": proxy.url, "AWS_ACCESS_KEY_ID": moto_s3.key,
           "AWS_SECRET_ACCESS_KEY": moto_s3.secret, "AWS_DEFAULT_REGION": "us-east-1",
           "CKPTMGR_COLLECTIVE_TIMEOUT_S": "60"}
    nodes = Nodes(str(tmp_path_factory.mktemp(f"nodes-{request.param}")), namespaced)
    try:
        yield Cluster(nodes, env, proxy)
    finally:
        try:
            nodes.close()
        finally:
            proxy.stop()


def _spec(run: str, **kw: Any) -> dict[str, Any]:
    """A job of run ``run`` (its durable root and local directories): durable every 100 steps,
    local every 2, two local steps kept, one replica of each rank's local step."""
    spec: dict[str, Any] = {
        "manager": {"path": f"s3://{BUCKET}/{run}", "save_interval": 100, "local_interval": 2,
                    "local_max_to_keep": 2, "local_replicas": 1, "chkpt_on_preemption": False,
                    "collective_timeout_s": 60},
        "local_sub": run, "numel": NUMEL}
    spec.update(kw)
    return spec


def _restored(results: dict[int, Any]) -> tuple[int, int, str]:
    """The (step, version, tier) every rank restored; asserts nothing was mixed."""
    seen = {(r["restored"]["step"], r["restored"]["version"], r["restored"]["tier"])
            for r in results.values()}
    assert len(seen) == 1, f"the ranks restored different saves: {results}"
    for rank, r in results.items():
        assert r["restored"]["consistent"], f"rank {rank} restored a mix: {r['restored']}"
    step, version, tier = seen.pop()
    return step, version, tier


def test_two_neighbours_lost_falls_back_to_durable(cluster: Cluster, tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    first = cluster.run(_spec(run, saves=[0, 2, 4], version=1), tmp_path / "first")
    assert all(r["final"]["all"] == [0, 2, 4] for r in first.values()), first
    # Nodes 1 and 2 are lost: rank 1's local step and the replica its neighbour held are both
    # gone, so some part of steps 2 and 4 has no copy left. Every rank restores step 0 from the
    # durable tier.
    cluster.lose(1, 2)
    second = cluster.run(_spec(run, restore="latest", version=2), tmp_path / "second")
    assert _restored(second) == (0, 1, "durable")
    assert all(r["opened"]["all"] == [0] for r in second.values()), second


def test_stale_node_never_mixed_in(cluster: Cluster, tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    cluster.run(_spec(run, saves=[0, 2, 4], version=1), tmp_path / "first")
    stale = str(tmp_path / "stale")
    cluster.live[1].copy_from_disk(run, stale)  # node 1's local directory as it was
    # The job saves steps 2 and 4 again, with other values (version 2), on every node.
    second = cluster.run(_spec(run, saves=[2, 4], version=2), tmp_path / "second")
    assert all(r["saved"] == [2, 4] for r in second.values()), second
    # Node 1 is replaced by one that comes back with the older saves of steps 2 and 4.
    cluster.lose(1)
    cluster.live[1].ready()
    cluster.live[1].copy_to_disk(stale, run)
    third = cluster.run(_spec(run, restore="latest", version=3), tmp_path / "third")
    step, version, tier = _restored(third)
    # Never version 1 of steps 2 or 4: the newest save of a local step (from the peers' replicas)
    # or the durable step 0.
    assert (step, version) in {(4, 2), (2, 2), (0, 1)}, (step, version, tier)
    assert tier == ("durable" if step == 0 else "local")


def test_one_node_lost_resumes_from_peers(cluster: Cluster, tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    # Namespaced nodes are told apart by host name alone (no GROUP_RANK).
    first = cluster.run(_spec(run, saves=[0, 2, 4], version=1), tmp_path / "first",
                        group_rank=not cluster.nodes.namespaced)
    assert all(r["final"]["all"] == [0, 2, 4] for r in first.values()), first
    cluster.lose(2)  # a replacement node with an empty disk takes its place
    second = cluster.run(_spec(run, restore="latest", version=2, saves=[6]), tmp_path / "second",
                         group_rank=not cluster.nodes.namespaced)
    # The newest local step, from the peers' replica of rank 2's part, bit-exact; the durable
    # tier lacks it.
    assert _restored(second) == (4, 1, "local")
    assert all(r["opened"]["tiers"]["4"] == ["local"] for r in second.values()), second
    assert all(r["final"]["all"] == [0, 4, 6] for r in second.values()), second


def test_node_lost_during_a_replica_transfer(cluster: Cluster, tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    job = cluster.start(_spec(run, saves=[0, 2, 4], version=1, hold_replicas=4),
                        tmp_path / "first")
    try:
        # Rank 2's replica of step 4 is on its way (header and manifest sent, no file yet) when
        # its node is lost; the launcher then kills the other ranks.
        job.wait_for("replicating", [2])
        cluster.lose(2)
    finally:
        job.close()
    second = cluster.run(_spec(run, restore="latest", version=2), tmp_path / "second")
    # No copy of rank 2's step 4 is left: step 4 is not whole. Step 2, whose replicas were
    # complete, is restored from the local tier (rank 2's part from its peer).
    assert _restored(second) == (2, 1, "local")
    assert all(r["opened"]["all"] == [0, 2] for r in second.values()), second


def _hold_uploads(cluster: Cluster, run: str, step: int) -> Fault:
    """A fault that holds the first data-file write of ``step`` to the durable tier (and then
    resets it, once released): the upload is in flight, its commit still to come."""
    where = re.compile(rf"/{BUCKET}/{run}/(\.tmp-)?{step}[-/][^?]*data-")
    return cluster.proxy.add(Fault(match=lambda m, p: m in ("PUT", "POST") and bool(
        where.search(p)), reset=True, hold=threading.Event()))


def test_upload_interrupted_by_node_loss(cluster: Cluster, tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    fault = _hold_uploads(cluster, run, 4)
    spec = _spec(run, saves=[0, 2, 4], version=1, async_save=True)
    spec["manager"]["save_interval"] = 4  # step 4 is due on both tiers: uploaded from local
    job = cluster.start(spec, tmp_path / "first")
    try:
        assert fault.arrived.wait(60), "the upload of step 4 never started"
        cluster.lose(1)
    finally:
        job.close()
        assert fault.hold is not None
        fault.hold.set()
    spec = _spec(run, restore="latest", version=2)
    spec["manager"]["save_interval"] = 4
    second = cluster.run(spec, tmp_path / "second")
    step, version, tier = _restored(second)
    # Step 4 from the local tier (rank 1's part from its replica), step 2 when the node died
    # before step 4's replicas were complete, or the durable step 0: never a mix.
    assert (step, version, tier) in {(4, 1, "local"), (2, 1, "local"), (0, 1, "durable")}, (
        step, version, tier)
    final = second[0]["final"]["tiers"]
    # The durable copy of step 4: uploaded after the restart (from the local files) or absent;
    # a fresh job with an empty local tier reads it whole from the durable tier.
    if "durable" in final.get("4", []):
        spec = _spec(run, restore=4, version=3, local_sub=uuid.uuid4().hex)
        spec["manager"]["save_interval"] = 4
        third = cluster.run(spec, tmp_path / "third")
        assert _restored(third) == (4, 1, "durable")


def test_upload_interrupted_by_job_kill_resumes_after_restart(cluster: Cluster,
                                                             tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    fault = _hold_uploads(cluster, run, 4)
    spec = _spec(run, saves=[0, 2, 4], version=1, async_save=True)
    spec["manager"]["save_interval"] = 4
    job = cluster.start(spec, tmp_path / "first")
    try:
        assert fault.arrived.wait(60), "the upload of step 4 never started"
    finally:
        job.close()  # every rank killed, every node (and disk) kept
        assert fault.hold is not None
        fault.hold.set()
    spec = _spec(run, restore="latest", version=2)
    spec["manager"]["save_interval"] = 4
    second = cluster.run(spec, tmp_path / "second")
    assert _restored(second) == (4, 1, "local")
    # The owed upload ran again after the restart, from the local files: the durable tier holds
    # step 4 once the job waited for it, whole and of the same save.
    assert all(r["final"]["tiers"]["4"] == ["durable", "local"] for r in second.values()), second
    spec = _spec(run, restore=4, version=3, local_sub=uuid.uuid4().hex)
    spec["manager"]["save_interval"] = 4
    third = cluster.run(spec, tmp_path / "third")
    assert _restored(third) == (4, 1, "durable")
