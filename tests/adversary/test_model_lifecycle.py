"""The stateful model of the step life cycle (issue 27): hypothesis drives a writer, its
successors and a reader on one root through random sequences of saves, async saves, overwrites,
retention, crashes at any storage operation of the commit protocol, take-overs, local-tier saves,
a wiped or damaged local tier and restores, and compares everything with a small reference model
(step -> the version saved there, and the retention rule of the configured policy).

Invariants, after every rule: every listed step restores bit-exact to the version saved at that
step (re-checked whenever its files change); no committed step disappears except by the retention
rule; the files planted at the start (a file in the root, a foreign directory, a file in a step
directory) and later (a file in a committed step) stay as they were; a writer that lost its lease
changes nothing; nothing uncommitted is ever listed.

One process; a crash is simulated (tests/_model.py :class:`Process`): from the chosen storage
operation on, everything the crashed manager does fails, then a new manager opens the root. The
variant with real SIGKILLs is in the fault catalogue. ``CKPTMGR_MODEL_EXAMPLES=N`` runs N random
examples per backend (S3: N/4) instead of the fixed CI set (docs/testing.md).
"""

from __future__ import annotations

import errno
import inspect
import itertools
import json
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import _faulty
import pytest
from _model import (
    Clock,
    Policy,
    Process,
    Tap,
    Version,
    blank_state,
    damage,
    data_files,
    make_state,
    newest,
    put,
    remove_tree,
    same_state,
    snapshot,
    tensors_from,
)
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import ckptmgr.storage
from ckptmgr import CheckpointManager
from ckptmgr.codec.checksum import checksum
from ckptmgr.codec.layout import MANIFEST_NAME, SHARED_DIR
from ckptmgr.errors import (
    AsyncSaveError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptmgrError,
    CorruptCheckpointError,
    LeaseError,
    SaveError,
    StorageError,
)
from ckptmgr.step_store import StepStore

FOREIGN_STEP = 6  # a step directory holding a user's file from the start: never ours
PLANTS = {"NOTES.txt": b"the user's notes\n", "user-data/a.bin": b"\x00\x01 not ours",
          f"{FOREIGN_STEP}/notes.txt": b"not a checkpoint\n",
          # In the shared chunks' directory, not named like a chunk: never removed.
          f"{SHARED_DIR}/notes.txt": b"not a chunk\n"}
LOCAL_KEEP = 2  # local_max_to_keep
TIME_INTERVAL = 10.0  # keep_time_interval (the model's clock advances 0, 4 or 11 s per save)

# close() saves the newest step given to save/save_async when newer than the newest committed
# one (save_on_close, DESIGN.md section 2); managers without the option never do.
SAVE_ON_CLOSE = "save_on_close" in inspect.signature(CheckpointManager.__init__).parameters

_LONG = int(os.environ.get("CKPTMGR_MODEL_EXAMPLES", "0") or 0)
# CKPTMGR_MODEL_SHRINK=0: report the first failing sequence as found (minutes faster).
_PHASES = [p for p in Phase if p is not Phase.shrink or os.environ.get(
    "CKPTMGR_MODEL_SHRINK", "1") != "0"]


# CKPTMGR_MODEL_SKIP=rule,rule: leave those rules out (to see what else the model finds).
_SKIP = frozenset(filter(None, os.environ.get("CKPTMGR_MODEL_SKIP", "").split(",")))


def _on(rule_name: str) -> bool:
    return rule_name not in _SKIP


def _settings(examples: int, steps: int) -> settings:
    return settings(max_examples=_LONG or examples, stateful_step_count=steps, deadline=None,
                    database=None, derandomize=not _LONG, phases=_PHASES,
                    suppress_health_check=list(HealthCheck))


@dataclass(frozen=True)
class Expect:
    """What one save call must do, by the reference model."""

    step: int
    version: Version
    returns: bool = False
    raises: type[BaseException] | None = None
    durable: str | None = None  # None, "new" or "overwrite"
    local: bool = False
    due: bool = False  # due or forced: the call reaches the save (and forgets a given step)


@dataclass(frozen=True)
class Given:
    """The newest step given to the writer's save/save_async and not saved (save_on_close)."""

    step: int
    version: Version
    changed: bool  # the state was modified after the call (save_async's scribbling)


@dataclass
class Env:
    """What the machine needs from the test around it."""

    backend: str
    tap: Tap
    clock: Clock
    tmp: str

    def new_root(self) -> str:
        name = uuid.uuid4().hex
        if self.backend == "local":
            return os.path.join(self.tmp, name, "run")
        if self.backend == "memory":
            return f"memory://model/{name}"
        return f"s3://ckpt-tests/{name}"


CONFIGS = st.fixed_dictionaries({
    "policy": st.sampled_from(["all", "latest", "period", "best", "time"]),
    "k": st.integers(1, 3),
    "period": st.integers(2, 4),
    "keep_best": st.integers(1, 2),
    "mode": st.sampled_from(["min", "max"]),
    "save_interval": st.sampled_from([1, 1, 2]),
    "overwrite": st.booleans(),
    "local_interval": st.sampled_from([None, None, 1, 3]),
    "reuse": st.booleans(),  # reuse_unchanged: the frozen tensor's chunk shared across steps
})


def _policy(c: dict[str, Any]) -> Policy:
    k = c["k"]
    return {
        "all": Policy(),
        "latest": Policy(max_to_keep=k),
        "period": Policy(max_to_keep=k, keep_period=c["period"]),
        "best": Policy(max_to_keep=k, best_metric="loss", best_mode=c["mode"],
                       keep_best=c["keep_best"]),
        "time": Policy(max_to_keep=k, keep_time_interval=TIME_INTERVAL),
    }[c["policy"]]


class Lifecycle(RuleBasedStateMachine):
    """The step life cycle of one root against the reference model."""

    env: Env

    def __init__(self) -> None:
        super().__init__()
        self.writer: CheckpointManager | None = None
        self.proc: Process | None = None
        self.reader: CheckpointManager | None = None
        self.durable: dict[int, Version] = {}  # committed in the root
        self.local: dict[int, Version] = {}  # whole in the local tier
        self.damaged: dict[int, Version] = {}  # local-only steps whose files were damaged
        self.wiped: set[int] = set()  # local steps whose directory was wiped
        self.maybe_listed: set[int] = set()  # may still be listed (stale local view)
        self.foreign_steps = {FOREIGN_STEP}
        # Local steps of another run given the same local_path (rule another_run): never
        # listed, restored or deleted here; a save of such a step skips the local tier.
        self.foreign_local: set[int] = set()
        self.other_roots: list[str] = []
        self.plants = dict(PLANTS)
        self.pending: Expect | None = None  # a save_async not joined yet
        self.given: Given | None = None
        self.verified: dict[int, Any] = {}  # step -> its files when last restored bit-exact
        self.seeds = itertools.count(1)
        self.hi = 0
        self.now = 1_700_000_000  # the model's clock: whole seconds
        self.root = self.local_root = ""

    # ------------------------------------------------------------------------------ set-up

    @initialize(c=CONFIGS)
    def setup(self, c: dict[str, Any]) -> None:
        self.cfg = c
        self.policy = _policy(c)
        self.root = self.env.new_root()
        self.local_root = tempfile.mkdtemp(dir=self.env.tmp, prefix="node-")
        with self.env.tap.process(None):
            self.durable_url = ckptmgr.storage.open_storage(self.root, writable=False).url
        for rel, data in self.plants.items():
            put(self.root, rel, data)
        self.writer = self._open()

    def teardown(self) -> None:
        for mgr in (self.writer, self.reader):
            if mgr is not None:
                with suppress(Exception), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mgr.close()
        if self.root:
            remove_tree(self.root)
            shutil.rmtree(self.local_root, ignore_errors=True)
        for other in self.other_roots:
            remove_tree(other)

    def _open(self, *, take_over: bool = False, unreadable: int | None = None
              ) -> CheckpointManager:
        """A new writer (a new process) on the root; its view is the root as it is now.
        ``unreadable``: the new process's first read of a data file of that local step fails
        (EIO: a read error, not a finding)."""
        c = self.cfg
        kw: dict[str, Any] = dict(chkpt_on_preemption=False, overwrite=c["overwrite"],
                                  take_over=take_over, reuse_unchanged=c["reuse"],
                                  **self.policy.kwargs())
        if c["local_interval"] is not None:
            kw.update(local_path=self.local_root, local_interval=c["local_interval"],
                      local_max_to_keep=LOCAL_KEEP)
        self.proc = proc = Process(self.durable_url)
        if unreadable is not None:
            before, left = proc.before, [1]

            def fail_once(storage: Any, op: str, path: str) -> None:
                if (left[0] and op == "read_bytes" and storage.url != self.durable_url
                        and path.startswith(f"{unreadable}/data-")):
                    left[0] = 0
                    raise StorageError(f"read failed for {storage.url}/{path} (injected)"
                                       ) from OSError(errno.EIO, "Input/output error", path)
                before(storage, op, path)

            proc.before = fail_once  # type: ignore[method-assign]
        with self.env.tap.process(self.proc):
            mgr = CheckpointManager(self.root, c["save_interval"], **kw)
            # A local step due on the durable tier and missing there (a crash interrupted its
            # upload, or the durable write after it) is uploaded in the background at
            # construction (docs/multitier.md): it ends first, so the root is what the model
            # resolves (the crashed save's step may then be committed).
            mgr.join()
        # A new local tier verifies every local step: damaged and wiped ones are gone.
        self.damaged, self.wiped, self.maybe_listed = {}, set(), set()
        self.given = None
        return mgr

    # ------------------------------------------------------------------------ the model

    def _draw_step(self, data: Any) -> int:
        kind = data.draw(st.sampled_from(["next", "next", "next", "listed", "older", "foreign"]),
                         label="which step")
        listed = sorted({*self.durable, *self.local})
        if kind == "listed" and listed:
            return int(data.draw(st.sampled_from(listed), label="step"))
        if kind == "older":
            return int(data.draw(st.integers(0, self.hi), label="step"))
        if kind == "foreign":
            return FOREIGN_STEP
        return self.hi + int(data.draw(st.integers(1, 3), label="step ahead"))

    def _next_step(self) -> int:
        step = self.hi + 1
        return step + 1 if step == FOREIGN_STEP else step

    def _expect(self, step: int, force: bool, data: Any, v: Version | None = None) -> Expect:
        """What saving ``step`` now must do (DESIGN.md sections 2 and 5, docs/multitier.md);
        ``v``: the version saved (default: a new one)."""
        if v is None:
            dt = int(data.draw(st.sampled_from([0, 4, 11]), label="seconds since last save"))
            loss = float(data.draw(st.sampled_from([0.5, 1.0, 2.0]), label="loss"))
            v = Version(next(self.seeds), self.now + dt, loss)
        self.hi = max(self.hi, step)
        c = self.cfg
        durable_due = force or step % c["save_interval"] == 0
        local_due = c["local_interval"] is not None and (force or step % c["local_interval"] == 0)
        if step in self.foreign_local:
            local_due = False  # another run's local step of that number is left alone
        durable = None
        if durable_due:
            if step in self.foreign_steps:  # never written into, even with overwrite
                if force:
                    return Expect(step, v, raises=CheckpointExistsError, due=True)
            elif step in self.durable:
                if c["overwrite"]:
                    durable = "overwrite"
                elif force:
                    return Expect(step, v, raises=CheckpointExistsError, due=True)
            else:
                durable = "new"
        if local_due and durable is None and (durable_due or step in self.durable
                                              or step in self.foreign_steps):
            local_due = False  # one step, one version: the durable tier keeps its copy
        if durable is None and not local_due:
            return Expect(step, v, due=durable_due or local_due)
        return Expect(step, v, returns=True, durable=durable, local=local_due, due=True)

    def _apply(self, e: Expect, *, retention: bool = True) -> None:
        """The model after ``e`` committed (``retention=False``: its writer lost the lease
        right after the commit, so it deletes nothing)."""
        if e.local:
            self.local[e.step] = e.version
            self.local = {s: self.local[s] for s in newest(self.local, LOCAL_KEEP)}
            # The agreement after a local save lists exactly what is whole on disk now.
            self.damaged, self.wiped, self.maybe_listed = {}, set(), set()
        if e.durable:
            self.durable[e.step] = e.version
            if retention:
                keep = self.policy.keeps(self.durable) | {e.step}
                self.durable = {s: v for s, v in self.durable.items() if s in keep}

    def _settle(self) -> None:
        """The model catches up with a pending save_async (the call about to be made joins
        it first; its failure would surface there)."""
        if self.pending is not None:
            e, self.pending = self.pending, None
            self._apply(e)

    def _quiesce(self) -> None:
        """Join the save in flight (it must succeed)."""
        assert self.writer is not None
        e, self.pending = self.pending, None
        self.writer.join()
        if e is not None:
            self._apply(e)

    def _note_given(self, e: Expect, asynchronous: bool) -> None:
        """The writer's record of the newest step given and not saved, for close()."""
        if e.due:
            if self.given is not None and self.given.step <= e.step:
                self.given = None  # the call reaches the save: it covers that step
        elif self.given is None or e.step >= self.given.step:
            self.given = Given(e.step, e.version, changed=asynchronous)

    def _close_writer(self) -> None:
        """Close the writer normally: with save_on_close, the newest step given and not saved
        is saved now if newer than the newest listed one (a RuntimeWarning instead when the
        state changed since)."""
        mgr, g = self.writer, self.given
        assert mgr is not None
        self.writer, self.given = None, None
        newest = mgr.latest_step()
        due = SAVE_ON_CLOSE and g is not None and (newest is None or g.step > newest)
        e = self._expect(g.step, True, None, g.version) if due and g and not g.changed else None
        err: CkptmgrError | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                mgr.close()
            except CkptmgrError as x:
                err = x
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                  and "close()" in str(w.message)]
        assert bool(warned) == (due and g is not None and g.changed), (
            f"close() with {g} given (newest listed: {newest}) warned {warned}")
        if e is not None and e.raises is not None:
            assert isinstance(err, e.raises), f"close() saving {g}: {err!r}; expected {e}"
            return
        assert err is None, f"close() raised {type(err).__name__}: {err}; expected {e}"
        if e is not None:
            self._apply(e)

    @contextmanager
    def _quiet_close(self) -> Iterator[None]:
        """For closing a manager whose storage is dead or whose lease was lost: its errors and
        its save_on_close warning are expected; what it changes is checked by the caller."""
        with suppress(CkptmgrError), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield

    def _save(self, mgr: CheckpointManager, e: Expect, *, asynchronous: bool,
              force: bool) -> bool:
        state = make_state(e.version.seed)
        self.now = e.version.time
        self.env.clock.times[e.version.seed] = e.version.time
        call = mgr.save_async if asynchronous else mgr.save
        got = call(e.step, state, force=force, metrics={"loss": e.version.loss},
                   metadata={"model_seed": e.version.seed})
        if asynchronous:
            # The state was captured: nothing done to it afterwards reaches the checkpoint.
            for v in state.values():
                if hasattr(v, "fill_"):
                    v.fill_(7)
            state["extra"]["tags"].append("changed after save_async")
        return bool(got)

    # ------------------------------------------------------------------------------ rules

    @precondition(lambda self: _on("save") and self.writer is not None)
    @rule(data=st.data(), asynchronous=st.booleans())
    def save(self, data: Any, asynchronous: bool) -> None:
        """save / save_async of a next, listed, older or foreign step, due or forced."""
        step = self._draw_step(data)
        force = bool(data.draw(st.sampled_from([False, False, True]), label="force"))
        self._save_and_check(step, force, asynchronous, data)

    @precondition(lambda self: _on("train") and self.writer is not None)
    @rule(data=st.data(), n=st.integers(1, 6), asynchronous=st.booleans())
    def train(self, data: Any, n: int, asynchronous: bool) -> None:
        """A training loop: ``n`` consecutive steps, each saved when due (retention at work)."""
        for _ in range(n):
            self._save_and_check(self.hi + 1, False, asynchronous, data)

    def _save_and_check(self, step: int, force: bool, asynchronous: bool, data: Any) -> None:
        assert self.writer is not None
        self._settle()
        e = self._expect(step, force, data)
        self._note_given(e, asynchronous)
        try:
            got = self._save(self.writer, e, asynchronous=asynchronous, force=force)
        except CkptmgrError as err:
            assert e.raises is not None and isinstance(err, e.raises), (
                f"save({step}, force={force}) raised {type(err).__name__}: {err}; the model "
                f"expected {e}")
            return
        assert e.raises is None, f"save({step}, force={force}) returned {got}; expected {e}"
        assert got == e.returns, f"save({step}, force={force}) returned {got}; expected {e}"
        if got and asynchronous:
            self.pending = e
        elif got:
            self._apply(e)

    @precondition(lambda self: _on("join") and self.pending is not None)
    @rule()
    def join(self) -> None:
        self._quiesce()

    @precondition(lambda self: _on("restore") and self.writer is not None)
    @rule(data=st.data())
    def restore(self, data: Any) -> None:
        """Restore a random listed step (sometimes one that is not listed)."""
        assert self.writer is not None
        # What is listed is drawn from: the background work (the save in flight, durable copies
        # made from local steps) ends first, as restore() waits for it anyway, so the draw never
        # depends on its timing (hypothesis replays a sequence only when it is deterministic).
        self._quiesce()
        listed = self.writer.all_steps()
        if listed and data.draw(st.integers(0, 5), label="listed?") > 0:
            step = int(data.draw(st.sampled_from(listed), label="step"))
        else:
            step = int(data.draw(st.integers(0, self.hi + 2), label="step"))
        self._check_restore(step)

    def _check_restore(self, step: int) -> None:
        assert self.writer is not None
        target, before = blank_state(), blank_state()
        version = self.local.get(step) or self.durable.get(step)
        try:
            self.writer.restore(step, target)
        except CkptmgrError as err:
            what = f"restore({step}) raised {type(err).__name__}: {err}"
            assert version is None, f"{what}; it holds version {version}"
            if step in self.damaged:  # issue 25 defect 11
                assert isinstance(err, CorruptCheckpointError), (
                    f"{what}; its local files were damaged: expected CorruptCheckpointError")
                bad = tensors_from(target, before, make_state(self.damaged[step].seed))
                assert not bad, f"{what}, and left {bad} holding the damaged bytes"
            elif step in self.wiped:
                assert isinstance(err, (CheckpointNotFoundError, CorruptCheckpointError)), (
                    f"{what}; its local directory was wiped")
                assert same_state(target, before), f"{what}, and changed the target"
            else:
                assert isinstance(err, CheckpointNotFoundError), what
            return
        if step in self.damaged and version is None:
            # The damage missed every byte a restore reads (padding): the old bytes came back.
            version = self.damaged[step]
        assert version is not None, f"restore({step}) succeeded; the model holds no such step"
        assert same_state(target, make_state(version.seed)), (
            f"restore({step}) is not bit-exact to version {version}")

    @precondition(lambda self: _on("crash") and self.writer is not None)
    @rule(data=st.data(), asynchronous=st.booleans())
    def crash(self, data: Any, asynchronous: bool) -> None:
        """The writer's process dies before its n-th storage operation of a save (the commit
        protocol, retention, leftover removal, the local tier); a new writer opens the root."""
        assert self.writer is not None and self.proc is not None
        self._quiesce()
        step = self._draw_step(data)
        force = bool(data.draw(st.booleans(), label="force"))
        e = self._expect(step, force, data)
        # A save makes 8 to 11 mutating storage operations, 9 more with the local tier, up to 8
        # more with reuse (two shared chunks written and renamed, their directory, the sweep).
        most = (12 if self.cfg["local_interval"] is None else 22) + (8 if self.cfg["reuse"]
                                                                      else 0)
        self.proc.crash_at = int(data.draw(st.integers(1, most), label="crash before op"))
        err: CkptmgrError | None = None
        got = False
        try:
            got = self._save(self.writer, e, asynchronous=asynchronous, force=force)
            self.writer.join()
        except CkptmgrError as x:  # anything else escaping a public call fails the test
            err = x
        crashed = self.proc.dead
        self.proc.kill()  # crashed now if not before: nothing it does reaches storage
        with self._quiet_close():
            self.writer.close()  # frees threads; its storage is dead
        self.writer = None
        uncertain: Expect | None = None
        if not crashed:
            if e.raises is not None:
                assert isinstance(err, e.raises), f"save({step}) gave {err!r}; expected {e}"
            else:
                assert err is None and got == e.returns, (
                    f"save({step}) gave {got}, {err!r}; expected {e}")
                if got:
                    self._apply(e)
        elif e.raises is None and e.returns:
            uncertain = e
        self.writer = self._open()
        self._resolve(uncertain)

    def _resolve(self, e: Expect | None) -> None:
        """After a crash during save ``e``: the new writer lists at least every step that was
        committed and not doomed by ``e``'s retention, at most those and ``e``'s, each
        bit-exact to one of its versions."""
        assert self.writer is not None
        cand: dict[int, list[Version]] = {s: [v] for s, v in self.durable.items()}
        gone: set[int] = set()
        if e is not None and e.durable:
            cand.setdefault(e.step, []).append(e.version)
            after = {**self.durable, e.step: e.version}
            gone = set(after) - self.policy.keeps(after) - {e.step}
        required = set(self.durable) - gone
        listed = self._committed()
        assert required <= listed <= set(cand), (
            f"after a crash saving {e}: the root lists {sorted(listed)}, the model requires "
            f"{sorted(required)} and allows {sorted(cand)}")
        self.durable = {s: self._match(s, cand[s], durable=True) for s in sorted(listed)}
        if self.cfg["local_interval"] is None:
            return
        lcand: dict[int, list[Version]] = {s: [v] for s, v in self.local.items()}
        lgone: set[int] = set()
        if e is not None and e.local:
            lcand.setdefault(e.step, []).append(e.version)
            after_steps = {*self.local, e.step}
            lgone = after_steps - newest(after_steps, LOCAL_KEEP)
        lrequired = set(self.local) - lgone - ({e.step} if e is not None else set())
        llisted = {s for s in self.writer.all_steps()
                   if "local" in self.writer.step_info(s).tiers}
        assert lrequired <= llisted <= set(lcand), (
            f"after a crash saving {e}: the local tier lists {sorted(llisted)}, the model "
            f"requires {sorted(lrequired)} and allows {sorted(lcand)}")
        self.local = {s: self._match(s, lcand[s], durable=False) for s in sorted(llisted)}

    def _match(self, step: int, versions: list[Version], *, durable: bool) -> Version:
        """The version ``step`` restores to (the durable tier: through a fresh reader)."""
        target = blank_state()
        if durable:
            with self._reader() as reader:
                reader.restore(step, target)
        else:
            assert self.writer is not None
            self.writer.restore(step, target)
        for v in versions:
            if same_state(target, make_state(v.seed)):
                return v
        raise AssertionError(f"step {step} ({'durable' if durable else 'local'}) restores to "
                             f"none of the versions saved there: {versions}")

    @precondition(lambda self: _on("take_over") and self.writer is not None)
    @rule(data=st.data(), asynchronous=st.booleans())
    def take_over(self, data: Any, asynchronous: bool) -> None:
        """A second writer takes the root over (take_over=True) while the first is alive; the
        first then tries to save: LeaseError, and nothing changes."""
        assert self.writer is not None
        self._quiesce()
        old = self.writer
        self.writer = self._open(take_over=True)
        step = self._draw_step(data)
        force = bool(data.draw(st.booleans(), label="force"))
        e = self._expect(step, force, data)
        before = self._snap()
        err: BaseException | None = None
        got = False
        try:
            got = self._save(old, e, asynchronous=asynchronous, force=force)
            old.join()
        except CkptmgrError as x:
            err = x
        if e.returns or e.raises is not None:
            durable_due = e.durable is not None or e.raises is not None
            ok = isinstance(err, LeaseError) or (not durable_due and isinstance(
                err, (SaveError, AsyncSaveError)) and "lease" in str(err))
            assert ok, (f"the writer that lost its lease saved {step} (force={force}): "
                        f"{got}, {err!r}; expected LeaseError")
        else:  # not due: nothing to do, or refused early
            assert not got and (err is None or isinstance(err, LeaseError)), (
                f"the writer that lost its lease, at a step that is not due: {got}, {err!r}")
        self._same_files(before, "after the fenced writer's save")
        with self._quiet_close():
            old.close()
        self._same_files(before, "after the fenced writer's close")

    @precondition(lambda self: _on("take_over_after_commit") and self.writer is not None)
    @rule(data=st.data())
    def take_over_after_commit(self, data: Any) -> None:
        """Issue 25 defect 1: writer A commits step n and is held right there; B takes the root
        over and starts saving n+1, held right before its commit; A goes on (its after-commit
        clean-up, retention, leftovers) and must change nothing; B's step commits whole."""
        assert self.writer is not None and self.proc is not None
        self._quiesce()
        a, proc_a = self.writer, self.proc
        ea = self._expect(self._next_step(), True, data)
        assert ea.durable == "new", ea
        gate_a, gate_b = _faulty.Gate(), _faulty.Gate()
        try:  # a failure opens both gates: no thread stays held behind it
            proc_a.hold_after_commit = (ea.step, gate_a)
            assert self._save(a, ea, asynchronous=True, force=True)
            gate_a.wait_arrived()
            self._apply(ea, retention=False)  # committed; A lost its lease before its retention
            self.writer = b = self._open(take_over=True)
            assert self.proc is not None
            eb = self._expect(self._next_step(), True, data)
            self.proc.hold_before_commit = (eb.step, gate_b)
            assert self._save(b, eb, asynchronous=True, force=True)
            gate_b.wait_arrived()
            before = self._snap()
            gate_a.open()
            try:
                a.join()
            except CkptmgrError as err:  # it committed; being told of the lost lease is fine
                assert isinstance(err, (LeaseError, AsyncSaveError)) and "lease" in str(err), err
            self._same_files(before, f"after writer A (fenced) finished its save of {ea.step}")
            with self._quiet_close():
                a.close()
            self._same_files(before, "after writer A (fenced) closed")
        finally:
            gate_a.open()
            gate_b.open()
        b.join()
        self._apply(eb)

    @precondition(lambda self: _on("take_over_during_upload") and self.writer is not None
                  and self.cfg["local_interval"] is not None)
    @rule(data=st.data())
    def take_over_during_upload(self, data: Any) -> None:
        """Issue 29 item 2: writer A's save_async of a step due on both tiers commits locally;
        its durable copy (made from the local files in the background) is held before it
        begins; B takes the root and the node's local directory over, finds the step owed and
        uploads it at construction; then A's copy goes on and must change nothing (fenced)."""
        assert self.writer is not None
        self._quiesce()
        a = self.writer
        step = self._next_step()
        while step % self.cfg["save_interval"] or step % self.cfg["local_interval"] or (
                step == FOREIGN_STEP or step in self.foreign_local):
            step += 1
        e = self._expect(step, False, data)
        assert e.durable == "new" and e.local, e
        uploads = a._uploads
        assert uploads is not None, "a writer with a local tier makes durable copies"
        gate = _faulty.Gate()
        real = uploads._try

        def held(job: Any) -> Any:  # the uploader thread, before it plans the copy
            gate.pass_()
            return real(job)

        setattr(uploads, "_try", held)  # noqa: B010 (an instance attribute over the method)
        try:
            self._note_given(e, True)
            assert self._save(a, e, asynchronous=True, force=False)
            gate.wait_arrived()  # A's local step is committed; its durable copy not begun
            self.writer = self._open(take_over=True)  # uploads the owed step, joined
            self._apply(e)
            before = self._snap()
            gate.open()
            try:
                a.join()
            except CkptmgrError as err:  # being told of the lost lease is fine
                assert isinstance(err, (LeaseError, AsyncSaveError)) and "lease" in str(err), err
            self._same_files(before, f"after writer A (fenced) finished its copy of {step}")
            with self._quiet_close():
                a.close()
            self._same_files(before, "after writer A (fenced) closed")
        finally:
            gate.open()

    @precondition(lambda self: _on("open_reader") and self.writer is not None)
    @rule()
    def open_reader(self) -> None:
        """A read_only manager beside the writer lists exactly the committed steps."""
        self._quiesce()
        if self.reader is not None:
            self.reader.close()
        self.reader = None
        with self.env.tap.process(None):
            self.reader = CheckpointManager(self.root, 1, read_only=True,
                                            chkpt_on_preemption=False)
        assert set(self.reader.all_steps()) == set(self.durable), (
            f"a reader lists {self.reader.all_steps()}; committed: {sorted(self.durable)}")

    @precondition(lambda self: _on("reader_restore") and self.reader is not None)
    @rule(data=st.data())
    def reader_restore(self, data: Any) -> None:
        """The reader restores a step it listed when it opened: the version there now, or
        CheckpointNotFoundError if retention deleted it since."""
        assert self.reader is not None
        self._quiesce()
        listed = self.reader.all_steps()
        if not listed:
            return
        step = int(data.draw(st.sampled_from(listed), label="step"))
        target = blank_state()
        try:
            self.reader.restore(step, target)
        except CkptmgrError as err:
            assert step not in self.durable and isinstance(err, CheckpointNotFoundError), (
                f"reader restore({step}) raised {type(err).__name__}: {err}")
            return
        assert step in self.durable, f"reader restored {step}, which is not committed"
        assert same_state(target, make_state(self.durable[step].seed)), (
            f"reader restore({step}) is not bit-exact to {self.durable[step]}")

    @precondition(lambda self: _on("reader_races_retention") and self.writer is not None
                  and bool(self.policy.max_to_keep))
    @rule(data=st.data())
    def reader_races_retention(self, data: Any) -> None:
        """Issue 25 defect 8: a reader restores a step that the writer's retention deletes
        while it is read (right before the reader first touches its metadata or a data file):
        CheckpointNotFoundError, never a raw storage error."""
        assert self.writer is not None
        self._quiesce()
        step = self._next_step()
        while step % self.cfg["save_interval"] or step == FOREIGN_STEP:
            step += 1
        e = self._expect(step, False, data)
        after = {**self.durable, step: e.version}
        doomed = sorted(set(after) - self.policy.keeps(after) - {step})
        if e.durable != "new" or not doomed:
            return
        victim = int(data.draw(st.sampled_from(doomed), label="step deleted while read"))
        part = f"{victim}/" + data.draw(st.sampled_from(["metadata-", "data-"]), label="when")
        ran: list[bool] = []

        def retention() -> None:
            assert self.writer is not None
            self._note_given(e, False)
            ran.append(self._save(self.writer, e, asynchronous=False, force=False))

        proc = Process(self.durable_url)
        proc.on_read = (part, retention)
        with self.env.tap.process(proc):
            reader = CheckpointManager(self.root, 1, read_only=True, chkpt_on_preemption=False)
        err: CkptmgrError | None = None
        try:
            reader.restore(victim, blank_state())
        except CkptmgrError as x:
            err = x
        finally:
            reader.close()
        assert ran == [True], f"the save of step {step} did not run inside the restore ({ran})"
        self._apply(e)
        assert isinstance(err, CheckpointNotFoundError), (
            f"a reader restoring step {victim} while retention deleted it ({part}...): "
            f"{err!r}; expected CheckpointNotFoundError")

    @precondition(lambda self: _on("plant_in_step")
                  and self.writer is not None and bool(self.durable))
    @rule(data=st.data())
    def plant_in_step(self, data: Any) -> None:
        """A user's file appears in a committed step: the step stays restorable, is never
        written into again, and the file survives its deletion."""
        self._quiesce()
        step = int(data.draw(st.sampled_from(sorted(self.durable)), label="step"))
        rel = f"{step}/user-{next(self.seeds)}.txt"
        self.plants[rel] = rel.encode()
        put(self.root, rel, rel.encode())
        self.foreign_steps.add(step)

    @precondition(lambda self: _on("wipe_local")
                  and self.writer is not None and self.cfg["local_interval"] is not None)
    @rule()
    def wipe_local(self) -> None:
        """The node-local directory disappears while the writer is open (a replaced disk)."""
        self._quiesce()
        shutil.rmtree(self.local_root, ignore_errors=True)
        self.wiped |= set(self.local)
        self.maybe_listed |= set(self.local)
        self.local = {}
        self.foreign_local = set()

    @precondition(lambda self: _on("damage_local")
                  and self.writer is not None and bool(self.local))
    @rule(data=st.data())
    def damage_local(self, data: Any) -> None:
        """Issue 25 defect 11: a data file of a local step is damaged while the writer is open;
        restoring it gives the durable copy, or CorruptCheckpointError leaving no damaged
        bytes in the target."""
        self._quiesce()
        step = int(data.draw(st.sampled_from(sorted(self.local)), label="step"))
        files = data_files(os.path.join(self.local_root, "rank-0", str(step)))
        assert files, f"local step {step} has no data file"
        damage(data.draw(st.sampled_from(files), label="file"),
               data.draw(st.sampled_from(["flip", "truncate"]), label="how"))
        v = self.local.pop(step)
        if step not in self.durable:
            self.damaged[step] = v
        self.maybe_listed.add(step)
        self._check_restore(step)

    @precondition(lambda self: _on("another_run") and self.writer is not None
                  and self.cfg["local_interval"] is not None)
    @rule(data=st.data(), n=st.integers(1, 4))
    def another_run(self, data: Any, n: int) -> None:
        """Another run (a fresh root of its own) is given this local_path while the writer is
        stopped, and force-saves ``n`` steps, this run's local step numbers among them. It lists
        and restores none of this run's local steps and changes none of their files (a step of
        the same number is saved to its durable tier only); this run's restart lists them
        again, and leaves that run's local steps alone from now on."""
        self._quiesce()
        self._close_writer()
        rank_dir = os.path.join(self.local_root, "rank-0")
        before = snapshot(rank_dir)
        mine = {rel.split("/")[0] for rel in before if rel.endswith(f"/{MANIFEST_NAME}")
                and rel.split("/")[0].isdigit()}
        other = self.env.new_root()
        self.other_roots.append(other)
        saved: dict[int, int] = {}
        with self.env.tap.process(None), CheckpointManager(
                other, self.cfg["save_interval"], chkpt_on_preemption=False,
                local_path=self.local_root, local_interval=self.cfg["local_interval"],
                local_max_to_keep=LOCAL_KEEP) as mgr:
            assert mgr.all_steps() == [], (
                f"another run lists {mgr.all_steps()} of this run's local steps")
            for _ in range(n):
                # Drawn from the model, never from the disk: which unlisted local steps are
                # still kept for their durable copy depends on timing, and a draw that depends
                # on timing cannot be replayed.
                ours = sorted(self.local)
                step = int(data.draw(st.sampled_from(ours), label="step") if ours and data.draw(
                    st.booleans(), label="this run's step?") else self.hi + data.draw(
                    st.integers(1, 4), label="step ahead"))
                if step in saved:
                    continue  # a forced save of a committed step is refused (no overwrite)
                seed = next(self.seeds)
                assert mgr.save(step, make_state(seed), force=True)
                saved[step] = seed
            assert mgr.all_steps() == sorted(saved), (mgr.all_steps(), sorted(saved))
            for step, seed in saved.items():
                target = blank_state()
                mgr.restore(step, target)
                assert same_state(target, make_state(seed)), f"the other run's step {step}"
                if str(step) in mine:
                    assert mgr.step_info(step).tiers == ("durable",), mgr.step_info(step)
        after = snapshot(rank_dir)
        changed = sorted(rel for rel, b in before.items()
                         if rel.split("/")[0] in mine and after.get(rel) != b)
        assert not changed, f"another run changed this run's local files {changed[:8]}"
        self.foreign_local |= {int(rel.split("/")[0]) for rel in after
                               if rel.endswith(f"/{MANIFEST_NAME}")
                               and rel.split("/")[0].isdigit()
                               and rel.split("/")[0] not in mine}
        self.writer = self._open()

    @precondition(lambda self: _on("unreadable_reopen") and self.writer is not None
                  and bool(self.local))
    @rule(data=st.data())
    def unreadable_reopen(self, data: Any) -> None:
        """A restart whose one read of a listed local step's data fails (EIO, once): that step
        was not whole when the tier opened, so it is never listed from the local tier again
        (its durable copy, if any, still is); no other step changes; an owed one is still
        copied (tests/tiers/test_owed_unreadable.py has the owed cases on two ranks)."""
        assert self.writer is not None
        self._quiesce()
        self._close_writer()
        step = int(data.draw(st.sampled_from(sorted(self.local)), label="step"))
        self.writer = self._open(unreadable=step)
        self.local.pop(step)

    @precondition(lambda self: _on("reopen") and self.writer is not None)
    @rule()
    def reopen(self) -> None:
        """A clean restart: close, open again; the same steps, the same versions."""
        assert self.writer is not None
        self._quiesce()
        self._close_writer()
        self.writer = self._open()

    # ------------------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        if self.writer is None or self.pending is not None:
            return  # the model applies a save_async when a call joins it
        # A save_async the model already applied may still run: a save of a step that is not
        # due returns at once, without joining it.
        self.writer.join()
        snap = snapshot(self.root)
        for rel, data in self.plants.items():
            assert snap.get(rel) == data, f"{rel}, not written by ckptmgr, was changed or removed"
        listed = set(self.writer.all_steps())
        required = set(self.durable) | set(self.local)
        assert required <= listed <= required | self.maybe_listed, (
            f"all_steps() is {sorted(listed)}; the model requires {sorted(required)}, allows "
            f"{sorted(required | self.maybe_listed)}")
        committed = self._committed()
        assert committed == set(self.durable), (
            f"the root commits {sorted(committed)}; the model: {sorted(self.durable)} (a step "
            "disappeared outside the retention rule, or one appeared)")
        for step in sorted(committed):  # every shared chunk a committed step lists is whole
            for chunk in _shared_of(snap, step):
                data = snap.get(chunk["path"])
                assert data is not None and len(data) == chunk["size"] and (
                    checksum(data) == chunk["checksum"]), (
                    f"step {step} lists shared chunk {chunk['path']}, which is "
                    f"{'missing' if data is None else 'damaged'}")
        local = snapshot(os.path.join(self.local_root, "rank-0")) if self.local else {}
        for step in sorted(required):
            files = (_files_of(snap, step), _files_of(local, step))
            if self.verified.get(step) == files:
                continue
            target = blank_state()
            self.writer.restore(step, target)
            version = self.local.get(step) or self.durable[step]
            assert same_state(target, make_state(version.seed)), (
                f"listed step {step} does not restore bit-exact to version {version}")
            if step in self.local and step in self.durable:
                self._match(step, [self.durable[step]], durable=True)
            self.verified[step] = files

    # ---------------------------------------------------------------------------- helpers

    def _committed(self) -> set[int]:
        """The committed steps of the root, listed now by a store of its own."""
        with self.env.tap.process(None):
            store = StepStore(ckptmgr.storage.open_storage(self.root, writable=False))
        return set(store.scan().committed)

    def _reader(self) -> CheckpointManager:
        with self.env.tap.process(None):
            return CheckpointManager(self.root, 1, read_only=True, chkpt_on_preemption=False)

    def _snap(self) -> dict[str, bytes]:
        local = {f"local/{k}": v for k, v in snapshot(self.local_root).items()}
        return {**snapshot(self.root), **local}

    def _same_files(self, before: dict[str, bytes], when: str) -> None:
        after = self._snap()
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert not changed, (f"a writer that lost its lease changed files {when}: "
                             f"{[(k, k in before, k in after) for k in changed[:8]]}")


def _files_of(snap: dict[str, bytes], step: int) -> dict[str, bytes]:
    """The files a step's restore reads: its own, and the shared chunks its manifest lists."""
    prefix = f"{step}/"
    own = {k: v for k, v in snap.items() if k.startswith(prefix)}
    for chunk in _shared_of(snap, step):
        own[chunk["path"]] = snap.get(chunk["path"], b"")
    return own


def _shared_of(snap: dict[str, bytes], step: int) -> list[dict[str, Any]]:
    """The shared chunks the manifest of ``step`` in ``snap`` lists (none without one)."""
    try:
        shared = json.loads(snap[f"{step}/{MANIFEST_NAME}"]).get("shared", [])
    except (KeyError, ValueError):
        return []
    return shared if isinstance(shared, list) else []


def _run(env: Env, examples: int, steps: int) -> None:
    machine = type(f"Lifecycle_{env.backend}", (Lifecycle,), {"env": env})
    run_state_machine_as_test(machine, settings=_settings(examples, steps))


@pytest.fixture
def env_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    monkeypatch.setattr(_faulty, "GATE_TIMEOUT_S", 30.0)  # a missed gate fails in 30 s

    def make(backend: str) -> Env:
        return Env(backend, Tap(monkeypatch), Clock(monkeypatch), str(tmp_path))

    return make


@pytest.mark.parametrize(("backend", "examples"), [("local", 8), ("memory", 10)])
def test_model(env_for: Any, backend: str, examples: int) -> None:
    _run(env_for(backend), examples=examples, steps=25)


def test_model_s3(env_for: Any, moto_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    env = env_for("s3")
    examples = max(1, _LONG // 4) if _LONG else 3
    machine = type("Lifecycle_s3", (Lifecycle,), {"env": env})
    run_state_machine_as_test(machine, settings=settings(
        _settings(examples, 12), max_examples=examples))
