"""Saves and restores through the chaos proxy (:mod:`faults.proxy`) in front of the S3 server.

A manager writes through the proxy with seeded random faults on a share of the requests
(connection resets before and after the request took effect, 500/503 answers, slow answers,
truncated bodies): each step is trained (the run of :mod:`faults._common`) and saved with
``save`` or ``save_async`` (seeded choice), and every few steps every listed step is restored
through the proxy too. The promises checked:

- every public call returns normally or raises one of our errors (``CkptmgrError``: ``SaveError``,
  ``AsyncSaveError``, ``StorageError``, ...), never a raw backend error;
- a restore through the proxy returns the exact bytes of that step's save or raises our error;
- at the end, read straight from the server: every listed step restores bit-exact, every step
  reported committed is listed unless retention removed it, the foreign files are untouched.

ckptmgr's retry policy is shortened and the clients' own retries are turned off (as
``tests/storage/test_buckets_faults.py`` does), so what is attacked is ckptmgr's handling, in
seconds.

And :func:`outage`: the server gone for good during a save and a restore; each must fail with
our error within the retry budget of one operation.

``python -m faults.proxy_loop --saves 500 --rate 0.05 [--seed N]``, ``... --outage``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from faults._common import (
    MAX_TO_KEEP,
    FaultFound,
    Root,
    Trajectory,
    build,
    open_root,
    plant_foreign,
    state,
    target,
    train_step,
    verify_root,
)
from faults.proxy import KINDS, ChaosProxy


@dataclass
class ProxyReport:
    """What one proxy loop did."""

    seed: int
    rate: float
    saves: int = 0
    save_errors: Counter[str] = field(default_factory=Counter)
    restores: int = 0
    restore_errors: Counter[str] = field(default_factory=Counter)
    reopened: int = 0
    committed: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"seed": self.seed, "rate": self.rate, "saves": self.saves,
                "save_errors": dict(self.save_errors), "restores": self.restores,
                "restore_errors": dict(self.restore_errors), "reopened": self.reopened,
                "committed": self.committed, "requests": self.requests,
                "injected": dict(self.injected), "seconds": round(self.seconds, 1)}


@contextlib.contextmanager
def fast_retries(budget_s: float = 20.0, max_attempts: int = 4) -> Iterator[None]:
    """ckptmgr's retry policy shortened (``budget_s`` for one operation's failures), s3fs's own
    retry loop off (restored afterwards)."""
    import s3fs

    from ckptmgr.storage import _retry

    saved = _retry.DEFAULT_POLICY, s3fs.S3FileSystem.retries
    _retry.DEFAULT_POLICY = _retry.RetryPolicy(max_attempts=max_attempts,
                                               initial_backoff_s=0.02, max_backoff_s=0.1,
                                               total_timeout_s=budget_s)
    s3fs.S3FileSystem.retries = 1
    try:
        yield
    finally:
        _retry.DEFAULT_POLICY, s3fs.S3FileSystem.retries = saved


def _ours(e: BaseException, what: str, report_to: Counter[str]) -> None:
    from ckptmgr.errors import CkptmgrError

    if not isinstance(e, CkptmgrError):
        raise FaultFound(f"{what} raised {type(e).__module__}.{type(e).__name__}, not one of "
                         f"our errors: {e}") from e
    report_to[type(e).__name__] += 1


def proxy_loop(saves: int, seed: int = 0, *, rate: float = 0.05,
               kinds: tuple[str, ...] = KINDS, restore_every: int = 4,
               log: Any = None) -> ProxyReport:
    """``saves`` saves (and restores) through the chaos proxy; see the module docstring.

    Raises:
        FaultFound: a promise broken, with the seed and the step.
    """
    from ckptmgr.events import CheckpointListener

    rng = random.Random(seed)
    report = ProxyReport(seed, rate)
    traj = Trajectory()
    committed: set[int] = set()

    class Report(CheckpointListener):
        def on_save_end(self, stats: Any) -> None:
            committed.add(int(stats.step))

    t0 = time.monotonic()
    with fast_retries(), open_root("s3") as root:
        plant_foreign(root)
        proxy = ChaosProxy(root.server.endpoint_url, seed=seed, rate=rate, kinds=kinds)
        opts = root.server.storage_options(endpoint_url=proxy.url,
                                           config_kwargs={"retries": {"max_attempts": 0}})
        chaos = Root("s3", root.url, opts)
        mgr: Any = None
        model, opt = build()
        try:
            for step in range(saves):
                where = f"seed {seed}, rate {rate}, step {step}"
                train_step(model, opt, step)
                if mgr is None:
                    try:
                        mgr = chaos.manager(read_only=False, max_to_keep=MAX_TO_KEEP)
                        mgr.add_listener(Report())
                    except Exception as e:
                        _ours(e, f"{where}: opening the root", report.save_errors)
                        continue
                save = mgr.save_async if rng.random() < 0.5 else mgr.save
                report.saves += 1
                try:
                    save(step, state(model, opt, step))
                except Exception as e:
                    _ours(e, f"{where}: {save.__name__}", report.save_errors)
                    if type(e).__name__ == "LeaseError":  # fenced: a new manager takes over
                        with contextlib.suppress(Exception):
                            mgr.close()
                        mgr, report.reopened = None, report.reopened + 1
                if mgr is not None and step % restore_every == restore_every - 1:
                    _restore_all(mgr, traj, where, report)
            if mgr is not None:
                try:
                    mgr.close()
                except Exception as e:
                    _ours(e, f"seed {seed}: close", report.save_errors)
                mgr = None
        finally:
            if mgr is not None:
                with contextlib.suppress(Exception):
                    mgr.close()
            proxy.enabled = False
            report.injected, report.requests = proxy.injected, proxy.requests
            proxy.stop()
        # At rest, straight from the server: nothing committed is wrong or lost.
        verdict = verify_root(root, traj, f"seed {seed}, rate {rate}, at the end",
                              reported=committed)
        if log is not None:
            log(f"listed {verdict.listed}, leftovers {verdict.leftovers}")
    report.committed = len(committed)
    report.seconds = time.monotonic() - t0
    return report


@dataclass
class OutageReport:
    """What one outage did: how long each failing call took against the budget."""

    seed: int
    budget_s: float
    save_error: str = ""
    save_s: float = 0.0
    restore_error: str = ""
    restore_s: float = 0.0
    saved_after: bool = False

    def summary(self) -> dict[str, Any]:
        return {"seed": self.seed, "budget_s": self.budget_s, "save_error": self.save_error,
                "save_s": round(self.save_s, 2), "restore_error": self.restore_error,
                "restore_s": round(self.restore_s, 2), "saved_after": self.saved_after}


def outage(seed: int = 0, *, budget_s: float = 4.0, use_async: bool = True,
           kinds: tuple[str, ...] = ("503", "reset"),
           client_timeout_s: float | None = None) -> OutageReport:
    """The S3 server becomes unreachable for good (every request through the proxy answered 503
    or reset, except the lease file's, so that the save gets past its lease check and meets the
    outage in its writes) during a save and a restore: each must fail with our error, and the
    time each took is recorded (:func:`check_outage` compares it with the retry budget); when
    the server is back, the same manager saves again.

    ``kinds=("hang",)``: the server hangs instead of refusing (requests accepted, never
    answered), so each request ends only at the client's time-out; ``client_timeout_s`` sets the
    S3 client's connect and read time-outs (botocore's ``connect_timeout``/``read_timeout``,
    through ``storage_options``' ``config_kwargs``; default 60 s each, which is what made a
    hanging store's save take 124-141 s against a 90 s budget, Trust I defect 15).

    Raises:
        FaultFound: a save or restore succeeded, raised a foreign error, or the same manager
            could not save after the outage.
    """
    from ckptmgr.errors import CkptmgrError

    rep = OutageReport(seed, budget_s)
    traj = Trajectory()
    model, opt = build()
    # Many attempts: the budget, not the count of attempts, must end each failing call.
    with fast_retries(budget_s, max_attempts=1000), open_root("s3") as root:
        plant_foreign(root)
        proxy = ChaosProxy(root.server.endpoint_url, seed=seed, rate=1.0, kinds=kinds,
                           spare=lambda method, path: path.split("?")[0].endswith(LEASE))
        proxy.enabled = False
        config: dict[str, Any] = {"retries": {"max_attempts": 0}}
        if client_timeout_s is not None:
            config.update(connect_timeout=client_timeout_s, read_timeout=client_timeout_s)
        opts = root.server.storage_options(endpoint_url=proxy.url, config_kwargs=config)
        mgr = Root("s3", root.url, opts).manager(read_only=False, max_to_keep=MAX_TO_KEEP)
        try:
            train_step(model, opt, 0)
            mgr.save(0, state(model, opt, 0))
            train_step(model, opt, 1)
            proxy.enabled = True
            t = time.monotonic()
            try:
                if use_async:
                    mgr.save_async(1, state(model, opt, 1))
                    mgr.wait_until_finished()
                else:
                    mgr.save(1, state(model, opt, 1))
                raise FaultFound(f"seed {seed}: a save with the server gone reported success")
            except CkptmgrError as e:
                rep.save_error = type(e).__name__
            except Exception as e:
                raise FaultFound(f"seed {seed}: a save with the server gone raised "
                                 f"{type(e).__name__}, not our error: {e}") from e
            rep.save_s = time.monotonic() - t
            t = time.monotonic()
            try:
                mgr.restore(0, target())
                raise FaultFound(f"seed {seed}: a restore with the server gone succeeded")
            except CkptmgrError as e:
                rep.restore_error = type(e).__name__
            except Exception as e:
                raise FaultFound(f"seed {seed}: a restore with the server gone raised "
                                 f"{type(e).__name__}, not our error: {e}") from e
            rep.restore_s = time.monotonic() - t
            proxy.enabled = False
            train_step(model, opt, 2)
            try:
                mgr.save(2, state(model, opt, 2))
                rep.saved_after = True
            except CkptmgrError as e:
                raise FaultFound(f"seed {seed}: the server is back, but save(2) failed: "
                                 f"{type(e).__name__}: {e}") from e
        finally:
            with contextlib.suppress(Exception):
                mgr.close()
            proxy.stop()
        verify_root(root, traj, f"seed {seed}, after the outage", reported={0, 2})
    return rep


LEASE = ".ckptmgr-lease.json"


def check_outage(rep: OutageReport, what: str) -> None:
    """Raise :class:`FaultFound` if the failing ``what`` ("save" or "restore") of ``rep`` took
    longer than one retry budget (x1.25, plus a second of slack for the requests in flight):
    the budget bounds one operation, not each storage call in it (Trust I defect 15)."""
    took = rep.save_s if what == "save" else rep.restore_s
    bound = rep.budget_s * 1.25 + 1.0
    if took > bound:
        raise FaultFound(f"seed {rep.seed}: with the server gone, the failing {what} took "
                         f"{took:.1f} s against a retry budget of {rep.budget_s} s per operation "
                         f"(allowed: {bound:.1f} s)")


def _restore_all(mgr: Any, traj: Trajectory, where: str, report: ProxyReport) -> None:
    try:
        mgr.wait_until_finished()
    except Exception as e:
        _ours(e, f"{where}: wait_until_finished", report.save_errors)
    for step in list(mgr.all_steps()):
        got = target()
        report.restores += 1
        try:
            mgr.restore(step, got)
        except Exception as e:
            _ours(e, f"{where}: restore({step})", report.restore_errors)
            continue
        why = traj.mismatch(step, got)
        if why is not None:
            raise FaultFound(f"{where}: restore({step}) through the proxy returned wrong "
                             f"bytes without an error: {why}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m faults.proxy_loop",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.05, help="share of requests given a fault")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outage", action="store_true",
                   help="instead: the server gone for good during a save and a restore")
    p.add_argument("--hang", type=float, metavar="TIMEOUT_S", default=None,
                   help="with --outage: the server hangs instead of refusing; the S3 client's "
                        "connect/read time-outs are TIMEOUT_S")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    try:
        if a.outage:
            out = (outage(a.seed) if a.hang is None else
                   outage(a.seed, kinds=("hang",), client_timeout_s=a.hang))
            print(json.dumps(out.summary()))
            check_outage(out, "save")
            check_outage(out, "restore")
            return 0
        rep = proxy_loop(a.saves, a.seed, rate=a.rate, kinds=tuple(a.kinds.split(",")),
                         log=(lambda m: print(m, file=sys.stderr)) if a.verbose else None)
    except FaultFound as e:
        hang = f" --hang {a.hang}" if a.hang is not None else ""
        again = f"--outage{hang}" if a.outage else \
            f"--saves {a.saves} --rate {a.rate} --kinds {a.kinds}"
        print(f"FAULT FOUND: {e}\nreproduce: python -m faults.proxy_loop {again} "
              f"--seed {a.seed}", file=sys.stderr)
        return 1
    print(json.dumps(rep.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
