"""SIGKILL loop: kill a trainer that calls ``save_async`` every step, at random moments, over and
over, on one root; after every kill the root must hold only steps that restore bit-exact.

One round: fork the trainer (:mod:`faults._trainer`) from a zygote, wait until it says it resumed
(a gate: its ``ready`` line), let it run for a seeded random delay (zero, short or up to a few
saves long, so kills land in staging, writing, the commit and retention), then SIGKILL it. In
``--mode process`` half the kills go to the writer process instead (the trainer's child running
``ckptmgr.writer_process``): the trainer must then report the failure (``failed``) and commit a
later step with a new writer, and is killed after that. Then the driver waits until the trainer is
reaped and its writer gone (the next trainer takes the dead holder's lease over) and checks the
root at rest (:func:`faults._common.verify_root`): every listed step bit-exact, no step reported
committed lost except by retention, the foreign files untouched.

``python -m faults.kill_loop --kills 1000 --backend local|s3 --mode thread|process [--seed N]``
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from faults._common import (
    MAX_TO_KEEP,
    REPO,
    FaultFound,
    Root,
    Trajectory,
    open_root,
    plant_foreign,
    verify_root,
)

TRAINER = "import sys; from faults._trainer import main; main(sys.argv[1:])"
STEPS_PER_LIFE = 1_000_000  # more than any life lasts: a trainer ends by its kill
START_TIMEOUT_S = 180.0


@dataclass
class KillReport:
    """What one kill loop did."""

    backend: str
    mode: str
    seed: int
    kills: int = 0
    writer_kills: int = 0
    landed: Counter[str] = field(default_factory=Counter)
    steps_committed: int = 0
    max_leftovers: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"backend": self.backend, "mode": self.mode, "seed": self.seed,
                "kills": self.kills, "writer_kills": self.writer_kills,
                "landed": dict(self.landed), "steps_committed": self.steps_committed,
                "max_leftovers": self.max_leftovers, "seconds": round(self.seconds, 1)}


class _Life:
    """One trainer process and the lines it printed (read by a thread: the pipe never fills)."""

    def __init__(self, zygote: Any, root: Root, mode: str) -> None:
        argv = [root.url, mode, json.dumps(root.storage_options or {}), str(STEPS_PER_LIFE)]
        env = dict(os.environ)
        # faults last: a PYTHONPATH naming another ckptmgr (the code before a fix) still wins.
        env["PYTHONPATH"] = os.pathsep.join([*env.get("PYTHONPATH", "").split(os.pathsep),
                                             REPO]).lstrip(os.pathsep)
        self.run = zygote.spawn(argv, code=TRAINER, cwd=REPO, env=env)
        self.lines: queue.Queue[list[str] | None] = queue.Queue()
        self.seen: list[list[str]] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._readers:
            t.start()

    def end(self) -> None:
        """Kill the trainer if it still runs, reap it, close its pipes."""
        if self.run.poll() is None:
            self.run.kill()
            self.run.wait(60)
        for t in self._readers:
            t.join(60)  # the pipes reach EOF once the trainer and its writer are gone
        for f in (self.run.stdout, self.run.stderr):
            if f is not None:
                f.close()

    def _read(self) -> None:
        assert self.run.stdout is not None
        for line in self.run.stdout:
            self.lines.put(line.split())
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.run.stderr is not None
        for line in self.run.stderr:
            self.err.append(line)
            del self.err[:-40]  # the tail is what a report needs

    def next_line(self, deadline: float) -> list[str] | None:
        """The next line before ``deadline`` ([] on time-out, None at end of output)."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return []
        if line is not None:
            self.seen.append(line)
        return line

    def wait_for(self, word: str, timeout: float, *, after: int = 0) -> list[str]:
        """Read lines until one starts with ``word`` (and, with ``after``, names a later step)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(deadline)
            if line is None or line == []:
                raise FaultFound(f"the trainer never said {word!r} "
                                 f"({'exited' if line is None else f'{timeout:.0f} s'}); "
                                 f"last lines {self.seen[-5:]}; stderr tail:\n"
                                 + "".join(self.err[-20:]))
            if line and line[0] == word and (not after or int(line[1]) > after):
                return line

    def drain_until(self, deadline: float) -> bool:
        """Read lines until ``deadline``; False if the trainer's output ended first."""
        while time.monotonic() < deadline:
            if self.next_line(deadline) is None:
                return False
        return True

    def committed(self) -> set[int]:
        return {int(x[1]) for x in self.seen if x and x[0] == "committed"}


def writer_pid(trainer: int) -> int | None:
    """The pid of ``trainer``'s writer process (its child running ckptmgr.writer_process)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != trainer:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"ckptmgr.writer_process" in f.read():
                    return int(name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` has exited (gone or a zombie nobody reaps); False on time-out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def _landed(life: _Life, root: Root, old_leftovers: list[str]) -> str:
    """Where the kill landed, judged from the trainer's last lines and the root right after
    (a staging directory that was not there before the kill: writing, or the commit)."""
    names = root.entries()
    steps = [n for n in names if n.isdigit() and n != "999999"
             and root.get(f"{n}/commit.json") is not None]
    partial = [n for n in names if n not in old_leftovers and (n.startswith(".tmp-") or (
        n.isdigit() and root.get(f"{n}/commit.json") is None))]
    if len(steps) > MAX_TO_KEEP:
        return "retention"  # committed, retention not done yet
    if any(n.isdigit() and steps and int(n) < max(map(int, steps)) for n in partial):
        return "retention"  # an old step half deleted (its manifest goes first)
    last = next((x for x in reversed(life.seen) if x and x[0] in ("saving", "queued")), None)
    # Inside save_async: staging, or waiting for the save in flight (then also "writing").
    staging = last is not None and last[0] == "saving"
    if partial:  # the data files or the commit of a new step
        return "staging+writing" if staging else "writing"
    return "staging" if staging else "between"


def kill_loop(kills: int, backend: str, mode: str, seed: int = 0, *, max_delay_s: float = 0.5,
              log: Any = None, zygote: Any = None) -> KillReport:
    """Run ``kills`` random kills on a fresh root of ``backend``; see the module docstring.
    ``zygote``: a ``tests/_procs.py`` zygote to fork trainers from (else one of its own).

    Raises:
        FaultFound: a promise broken, with the seed and the kill number.
    """
    from _procs import Zygote

    rng = random.Random(seed)
    report = KillReport(backend, mode, seed)
    traj = Trajectory()
    t0 = time.monotonic()
    own = zygote is None
    zygote = zygote or Zygote()
    try:
        with open_root(backend) as root:
            plant_foreign(root)
            reported: set[int] = set()
            listed: list[int] = []
            leftovers: list[str] = []
            while report.kills < kills:
                n = report.kills + 1
                where = f"seed {seed}, {backend}/{mode}, kill {n}"
                life = _Life(zygote, root, mode)
                try:
                    ready = life.wait_for("ready", START_TIMEOUT_S)
                    # The clock starts at the resume (a third of the kills: the first save,
                    # its planning included) or at this life's first commit (steady saving,
                    # where a kill lands in staging, writing, the commit or retention alike).
                    # From a commit on, half the kills come right after the trainer says
                    # "saving" (staging, or waiting for the save in flight) or "committed"
                    # (retention runs next), the others after a random delay.
                    anchor = "ready"
                    if rng.random() < 2 / 3:
                        life.wait_for("committed", START_TIMEOUT_S, after=int(ready[1]) - 1)
                        anchor = rng.choice(["delay", "delay", "saving", "committed"])
                    delay = rng.choice([0.0, rng.uniform(0, max_delay_s)])
                    if anchor in ("saving", "committed"):
                        life.wait_for(anchor, START_TIMEOUT_S)
                        delay = 0.0
                    hit_writer = mode == "process" and rng.random() < 0.5
                    target = life.run.pid
                    if hit_writer:
                        # The first save starts the writer; kill it once it is at work.
                        life.wait_for("saving", START_TIMEOUT_S)
                        target = writer_pid(life.run.pid) or life.run.pid
                        hit_writer = target != life.run.pid
                    if not life.drain_until(time.monotonic() + delay):
                        raise FaultFound(f"{where}: the trainer exited on its own; stderr "
                                         "tail:\n" + "".join(life.err[-20:]))
                    writer = None if hit_writer else writer_pid(life.run.pid)
                    os.kill(target, signal.SIGKILL)
                    report.kills += 1
                    if hit_writer:
                        report.writer_kills += 1
                        writer = target
                        report.landed["writer"] += 1
                        # The trainer must go on: a save it starts after the kill commits
                        # (through a new writer); the save the writer died in, if any, fails.
                        started = max(int(x[1]) for x in life.seen if x and x[0] == "saving")
                        life.wait_for("committed", START_TIMEOUT_S, after=started)
                        if any(x and x[0] == "failed" for x in life.seen):
                            report.landed["writer-failed-save"] += 1
                        life.run.kill()
                    life.run.wait(60)
                    if writer is not None and not wait_gone(writer, 60):
                        raise FaultFound(f"{where}: the writer process {writer} outlived its "
                                         "killed trainer by 60 s")
                    if not hit_writer:
                        report.landed[_landed(life, root, leftovers)] += 1
                finally:
                    life.end()
                reported |= life.committed()
                verdict = verify_root(root, traj, where, reported=reported, before=listed)
                listed, leftovers = verdict.listed, verdict.leftovers
                report.max_leftovers = max(report.max_leftovers, len(verdict.leftovers))
                if log is not None:
                    log(f"{where}: listed {listed}, leftovers {verdict.leftovers}")
            report.steps_committed = len(reported)
    finally:
        if own:
            zygote.close()
    report.seconds = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m faults.kill_loop", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--backend", choices=["local", "s3"], default="local")
    p.add_argument("--mode", choices=["thread", "process"], default="thread")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=0.5,
                   help="longest random delay before a kill (s), from the trainer's resume "
                   "or its first commit")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    try:
        rep = kill_loop(a.kills, a.backend, a.mode, a.seed, max_delay_s=a.max_delay,
                        log=(lambda m: print(m, file=sys.stderr)) if a.verbose else None)
    except FaultFound as e:
        print(f"FAULT FOUND: {e}\nreproduce: python -m faults.kill_loop --kills {a.kills} "
              f"--backend {a.backend} --mode {a.mode} --seed {a.seed} --max-delay {a.max_delay}"
              " (kill moments are random: the same seed draws the same delays and targets)",
              file=sys.stderr)
        return 1
    print(json.dumps(rep.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
