"""A disk that fills up mid-save, and a root that becomes read-only (Linux, as root, ``mount``).

**Disk full** (:func:`disk_full`): the root lies on a size-limited tmpfs. Each round fills the
file system with a ballast file (outside the root) until a seeded random amount below one save's
size is left, then saves (``save``, or ``save_async`` and ``wait_until_finished``): the save must
fail with our error (or fit and commit). Then every listed step must still restore bit-exact and
the foreign files be untouched; the ballast is removed and the same manager must save again.

**Read-only root** (:func:`read_only_root`): a few steps are committed on a tmpfs, then it is
remounted read-only (root ignores permission bits, so ``chmod`` would not stop it). Saves must
fail with our errors, restores (the writer's manager and a reader's) must still return exact
data; the outage lasts past the writer's lease (a 2 s TTL); after remounting read-write nothing
committed is damaged and the same manager saves again (it takes its expired lease back).

``python -m faults.disk_loop --rounds 50 [--seed N]`` (exit status 2 when tmpfs cannot be
mounted here: not root, or no permission).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
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
    plant_foreign,
    state,
    target,
    train_step,
    verify_root,
)


class MountUnavailable(RuntimeError):
    """tmpfs cannot be mounted here; the message says why."""


def _mount(*args: str) -> None:
    res = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise MountUnavailable(f"mount {' '.join(args)}: {res.stderr.strip() or res.returncode}")


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[str]:
    """A fresh tmpfs of ``size`` (e.g. ``8m``) mounted on a temporary directory."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise MountUnavailable("mounting tmpfs needs root")
    if shutil.which("mount") is None:
        raise MountUnavailable("no mount command")
    where = tempfile.mkdtemp(prefix="ckptmgr-tmpfs-")
    try:
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", where)
    except MountUnavailable:
        os.rmdir(where)
        raise
    try:
        yield where
    finally:
        # Lazily: a process we started may still hold a file open there for a moment.
        subprocess.run(["umount", "-l", where], capture_output=True, check=False)
        with contextlib.suppress(OSError):
            os.rmdir(where)


@dataclass
class DiskReport:
    """What the disk drivers did."""

    seed: int
    rounds: int = 0
    save_errors: Counter[str] = field(default_factory=Counter)
    fitted: int = 0
    recovered: int = 0
    readonly_errors: Counter[str] = field(default_factory=Counter)
    readonly_restores: int = 0
    readonly_same_manager_saved_after: bool | None = None
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"seed": self.seed, "rounds": self.rounds, "save_errors": dict(self.save_errors),
                "fitted": self.fitted, "recovered": self.recovered,
                "readonly_errors": dict(self.readonly_errors),
                "readonly_restores": self.readonly_restores,
                "readonly_same_manager_saved_after": self.readonly_same_manager_saved_after,
                "seconds": round(self.seconds, 1)}


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _save(mgr: Any, step: int, st: dict[str, Any], use_async: bool) -> None:
    if use_async:
        mgr.save_async(step, st, force=True)
        mgr.wait_until_finished()
    else:
        mgr.save(step, st, force=True)


def _ours(e: BaseException, what: str) -> str:
    from ckptmgr.errors import CkptmgrError

    if not isinstance(e, CkptmgrError):
        raise FaultFound(f"{what} raised {type(e).__module__}.{type(e).__name__}, not one of "
                         f"our errors: {e}") from e
    return type(e).__name__


def disk_full(rounds: int, seed: int = 0, *, report: DiskReport | None = None) -> DiskReport:
    """Fill the disk under the root mid-save, ``rounds`` times; see the module docstring.

    Raises:
        MountUnavailable: no tmpfs here.
        FaultFound: a promise broken.
    """
    rng = random.Random(seed)
    report = report or DiskReport(seed)
    traj = Trajectory()
    model, opt = build()
    committed: set[int] = set()
    t0 = time.monotonic()
    with tmpfs("8m") as fs_dir:
        root = Root("local", os.path.join(fs_dir, "run"), None, path=os.path.join(fs_dir, "run"))
        plant_foreign(root)
        ballast = os.path.join(fs_dir, "ballast")
        mgr = root.manager(read_only=False, max_to_keep=MAX_TO_KEEP)
        try:
            for r in range(rounds):
                step = r
                where = f"seed {seed}, disk full, round {r}"
                train_step(model, opt, step)
                st = state(model, opt, step)
                # Leave a random room around one save's size (~1.1 MB of data plus
                # metadata): most saves run out of space part-way, some fit.
                room = int(rng.uniform(0.0, 1.4) * 1024 * 1024)
                with open(ballast, "wb") as f:
                    f.write(b"\0" * max(0, _free(fs_dir) - room))
                use_async = rng.random() < 0.5
                report.rounds += 1
                try:
                    _save(mgr, step, st, use_async)
                    committed.add(step)
                    report.fitted += 1
                except Exception as e:
                    report.save_errors[_ours(e, f"{where}: a save on a full disk")] += 1
                verify_root(root, traj, where, reported=committed)
                os.unlink(ballast)
                if step not in committed:
                    try:  # the space is back: the same manager saves again
                        _save(mgr, step, st, use_async)
                    except Exception as e:
                        raise FaultFound(f"{where}: after the space was freed, save({step}) "
                                         f"failed: {type(e).__name__}: {e}") from e
                    committed.add(step)
                    report.recovered += 1
                    verify_root(root, traj, f"{where}, after freeing", reported=committed)
        finally:
            with contextlib.suppress(Exception):
                mgr.close()
    report.seconds += time.monotonic() - t0
    return report


LEASE_TTL_S = 2.0


def _outlast_lease(root: Root) -> None:
    """Return once the lease file's ``expires`` has passed (the outage outlasted the lease)."""
    raw = root.get(".ckptmgr-lease.json")
    expires = float(json.loads(raw)["expires"]) if raw else 0.0
    deadline = time.monotonic() + 10 * LEASE_TTL_S
    while time.time() <= expires + 0.1:
        if time.monotonic() > deadline:
            raise FaultFound(f"the lease file says it expires at {expires}, "
                             f"{expires - time.time():.0f} s from now, with a {LEASE_TTL_S} s TTL")
        time.sleep(0.05)  # a clock condition: the outage must last past the lease's expiry


def read_only_root(seed: int = 0, *, report: DiskReport | None = None) -> DiskReport:
    """Commit steps, remount the root read-only, attack, remount read-write; see the module
    docstring.

    Raises:
        MountUnavailable: no tmpfs here.
        FaultFound: a promise broken.
    """
    rng = random.Random(seed)
    report = report or DiskReport(seed)
    traj = Trajectory()
    model, opt = build()
    t0 = time.monotonic()
    with tmpfs("64m") as fs_dir:
        root = Root("local", os.path.join(fs_dir, "run"), None, path=os.path.join(fs_dir, "run"))
        plant_foreign(root)
        # A short lease, so that the outage outlasts it (Trust I defect 12: a writer whose lease
        # expired while nobody took it must take it back, not stop saving for good).
        saved_ttl = os.environ.get("CKPTMGR_LEASE_TTL_S")
        os.environ["CKPTMGR_LEASE_TTL_S"] = str(LEASE_TTL_S)
        try:
            mgr = root.manager(read_only=False, max_to_keep=MAX_TO_KEEP)
        finally:
            if saved_ttl is None:
                del os.environ["CKPTMGR_LEASE_TTL_S"]
            else:
                os.environ["CKPTMGR_LEASE_TTL_S"] = saved_ttl
        committed: set[int] = set()
        try:
            for step in range(3):
                train_step(model, opt, step)
                mgr.save(step, state(model, opt, step))
                committed.add(step)
            verify_root(root, traj, "read-only root, before", reported=committed)
            _mount("-o", "remount,ro", fs_dir)
            try:
                for step in range(3, 5):
                    train_step(model, opt, step)
                    try:
                        _save(mgr, step, state(model, opt, step), rng.random() < 0.5)
                        raise FaultFound(f"seed {seed}: save({step}) on a read-only root "
                                         "reported success")
                    except FaultFound:
                        raise
                    except Exception as e:
                        report.readonly_errors[_ours(e, f"save({step}), read-only root")] += 1
                # Restores go on: the writer's own manager, and a reader's.
                for step in sorted(committed):
                    got = target()
                    try:
                        mgr.restore(step, got)
                    except Exception as e:
                        raise FaultFound(f"seed {seed}: restore({step}) by the writer on a "
                                         f"read-only root failed: {type(e).__name__}: {e}"
                                         ) from e
                    why = traj.mismatch(step, got)
                    if why is not None:
                        raise FaultFound(f"seed {seed}: restore({step}), read-only: {why}")
                    report.readonly_restores += 1
                verify_root(root, traj, "read-only root, a reader", reported=committed)
                _outlast_lease(root)
            finally:
                _mount("-o", "remount,rw", fs_dir)
            verify_root(root, traj, "read-only root, after remounting read-write",
                        reported=committed)
            step = 5
            train_step(model, opt, step)
            try:
                _save(mgr, step, state(model, opt, step), False)
                report.readonly_same_manager_saved_after = True
            except Exception as e:
                _ours(e, "save after remounting read-write")
                report.readonly_same_manager_saved_after = False
                with contextlib.suppress(Exception):
                    mgr.close()
                mgr = root.manager(read_only=False, max_to_keep=MAX_TO_KEEP)
                try:  # a new manager (a restarted job) must save there
                    _save(mgr, step, state(model, opt, step), False)
                except Exception as e2:
                    raise FaultFound(f"seed {seed}: a new manager cannot save after the root "
                                     f"became writable again: {type(e2).__name__}: {e2}") from e2
            committed.add(step)
            verify_root(root, traj, "read-only root, saved after", reported=committed)
        finally:
            with contextlib.suppress(Exception):
                mgr.close()
    report.seconds += time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m faults.disk_loop",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="disk-full rounds")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        rep = disk_full(a.rounds, a.seed)
        read_only_root(a.seed, report=rep)
    except MountUnavailable as e:
        print(f"skipped: {e}", file=sys.stderr)
        return 2
    except FaultFound as e:
        print(f"FAULT FOUND: {e}\nreproduce: python -m faults.disk_loop --rounds {a.rounds} "
              f"--seed {a.seed}", file=sys.stderr)
        return 1
    print(json.dumps(rep.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
