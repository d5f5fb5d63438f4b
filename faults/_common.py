"""What every fault driver shares: the deterministic training run, the roots, the checks.

The training run is a pure function of the step: a tiny model trained by SGD with momentum on data
seeded by the step, plus a 1 MiB ``blob`` drawn from a generator seeded by the step and Python
values naming the step. So the driver knows, for any step, the exact bytes that step's save held
(:class:`Trajectory` replays the run), and checks every listed step bit-exact against them.

The roots: ``local`` (a fresh directory) and ``s3`` (moto's S3 server on 127.0.0.1, started by
``tests/_servers.py``). Before the attack a foreign file is planted at the root and in a
step-named directory (:data:`FOREIGN`); ckptmgr must never touch either.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
if TESTS not in sys.path:  # the servers, the proxy's building blocks and the zygote live there
    sys.path.insert(0, TESTS)

BUCKET = "ckpt-faults"
DIM = 32
BLOB_SHAPE = (256, 1024)  # 1 MiB of float32: staging and writing take a measurable while
MAX_TO_KEEP = 3

# Files ckptmgr did not write: at the root, and in a directory named like a step (not committed,
# so a careless leftover clean-up would take it).
FOREIGN = {"NOTES-foreign.txt": b"the user's notes: never touched\n",
           "999999/notes.txt": b"a step-named directory ckptmgr did not write\n"}


class FaultFound(AssertionError):
    """A fault broke a promise of ckptmgr; the message says which, and how to reproduce it."""


# ------------------------------------------------------------------------- the training run


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer at step "-1" (before the first training step)."""
    g = torch.Generator().manual_seed(12345)
    model = torch.nn.Linear(DIM, DIM)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One SGD step on data seeded by ``step``."""
    g = torch.Generator().manual_seed(1_000_000 + step)
    x = torch.randn(16, DIM, generator=g)
    loss = (model(x) - x.flip(1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def blob(step: int) -> torch.Tensor:
    """The large tensor saved at ``step``."""
    return torch.randn(BLOB_SHAPE, generator=torch.Generator().manual_seed(step))


def extra(step: int) -> dict[str, Any]:
    """The Python values saved at ``step`` (an empty dict inside a list included, unless
    ``CKPTMGR_FAULTS_NO_EMPTY_DICT=1``: code that drops it, Trust I defect 10, fails every check
    at once, which hides whatever else a run would find there)."""
    plain = os.environ.get("CKPTMGR_FAULTS_NO_EMPTY_DICT") == "1"
    inner: dict[str, Any] = {"k": 1} if plain else {"empty": {}}
    return {"step": step, "tag": f"step-{step}", "nested": [step, inner, (1.5, None)]}


def state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """The state the trainer saves at ``step`` (after its training step)."""
    return {"model": model, "optim": opt, "blob": blob(step), "extra": extra(step)}


def target() -> dict[str, Any]:
    """A state to restore into: fresh model, primed optimizer, placeholders."""
    import ckptmgr

    model, opt = build()
    ckptmgr.prime_optimizer(opt)
    return {"model": model, "optim": opt, "blob": torch.zeros(BLOB_SHAPE),
            "extra": {"step": -1, "tag": "", "nested": [-1, {}, (0.0, None)]}}


class Trajectory:
    """The model and optimizer state after each step, replayed once and kept (tiny tensors)."""

    def __init__(self) -> None:
        self._model, self._opt = build()
        self._next = 0
        self._snap: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []

    def at(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(model state dict, optimizer state dict) after training step ``step``."""
        while self._next <= step:
            train_step(self._model, self._opt, self._next)
            self._snap.append((copy.deepcopy(self._model.state_dict()),
                               copy.deepcopy(self._opt.state_dict())))
            self._next += 1
        return self._snap[step]

    def mismatch(self, step: int, got: dict[str, Any]) -> str | None:
        """What differs between ``got`` (restored from ``step``) and that step's save."""
        model_sd, opt_sd = self.at(step)
        for k, v in model_sd.items():
            if not torch.equal(got["model"].state_dict()[k], v):
                return f"model.{k} differs"
        want = opt_sd["state"]
        have = got["optim"].state_dict()["state"]
        if sorted(want) != sorted(have):
            return f"optimizer state keys {sorted(have)} != {sorted(want)}"
        for pid, st in want.items():
            for name, v in st.items():
                h = have[pid].get(name)
                if not (isinstance(v, torch.Tensor) and isinstance(h, torch.Tensor)
                        and torch.equal(h, v)) and not (
                        not isinstance(v, torch.Tensor) and h == v):
                    return f"optim.state[{pid}][{name}] differs"
        if not torch.equal(got["blob"], blob(step)):
            return "blob differs"
        if got["extra"] != extra(step):
            return f"extra {got['extra']!r} != {extra(step)!r}"
        return None


# -------------------------------------------------------------------------------- the roots


@dataclass
class Root:
    """A checkpoint root under attack, with raw access to what lies under it."""

    kind: str
    url: str
    storage_options: dict[str, Any] | None
    fs: Any = None  # s3fs for s3 roots
    path: str = ""  # the local path, or the bucket path for s3
    server: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def put(self, rel: str, data: bytes) -> None:
        if self.fs is None:
            full = os.path.join(self.path, rel)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
        else:
            self.fs.pipe_file(f"{self.path}/{rel}", data)

    def get(self, rel: str) -> bytes | None:
        try:
            if self.fs is None:
                with open(os.path.join(self.path, rel), "rb") as f:
                    return f.read()
            return bytes(self.fs.cat_file(f"{self.path}/{rel}"))
        except (FileNotFoundError, IsADirectoryError):
            return None

    def entries(self) -> list[str]:
        """The names right under the root."""
        if self.fs is None:
            return sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
        self.fs.invalidate_cache()
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path))
        except FileNotFoundError:
            return []

    def manager(self, **kwargs: Any) -> Any:
        """A manager on this root (a reader unless told otherwise)."""
        import ckptmgr

        kwargs.setdefault("read_only", True)
        return ckptmgr.CheckpointManager(self.url, 1, chkpt_on_preemption=False,
                                         storage_options=self.storage_options, **kwargs)


_S3: Any = None


def use_s3_server(server: Any) -> None:
    """Use ``server`` (a ``tests/_servers.py`` S3 server, e.g. the test session's) for s3 roots."""
    global _S3
    server.make_bucket(BUCKET)
    _S3 = server


def s3_server() -> Any:
    """moto's S3 server in this process (one per process), with the bucket made."""
    global _S3
    if _S3 is None:
        from _servers import MotoS3

        _S3 = MotoS3()
        _S3.make_bucket(BUCKET)
    return _S3


@contextlib.contextmanager
def open_root(kind: str, base: str | None = None) -> Iterator[Root]:
    """A fresh, empty root of ``kind`` (``local`` under ``base`` or a temporary directory,
    ``s3`` on moto), removed afterwards."""
    if kind == "local":
        tmp = tempfile.mkdtemp(prefix="ckptmgr-faults-", dir=base)
        try:
            yield Root("local", os.path.join(tmp, "run"), None, path=os.path.join(tmp, "run"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    if kind != "s3":
        raise ValueError(f"backend must be local or s3, got {kind!r}")
    server = s3_server()
    name = uuid.uuid4().hex
    opts = server.storage_options()
    root = Root("s3", f"s3://{BUCKET}/{name}", opts, fs=server.fs(), path=f"{BUCKET}/{name}",
                server=server)
    try:
        yield root
    finally:
        with contextlib.suppress(Exception):
            root.fs.rm(root.path, recursive=True)


def plant_foreign(root: Root) -> None:
    """Put :data:`FOREIGN` under the root."""
    for rel, data in FOREIGN.items():
        root.put(rel, data)


def check_foreign(root: Root, context: str) -> None:
    """Raise :class:`FaultFound` if a foreign file changed or vanished."""
    for rel, data in FOREIGN.items():
        got = root.get(rel)
        if got != data:
            raise FaultFound(f"{context}: the foreign file {rel} was "
                             f"{'deleted' if got is None else 'changed'}")


@dataclass
class Verdict:
    """What one check of a root found."""

    listed: list[int]
    leftovers: list[str]


def verify_root(root: Root, traj: Trajectory, context: str, *,
                reported: set[int] | None = None, before: list[int] | None = None,
                max_to_keep: int | None = MAX_TO_KEEP, mgr: Any = None) -> Verdict:
    """Check the root at rest: every listed step restores bit-exact to its save; a step reported
    committed (or listed before) is gone only by the retention rule (``max_to_keep`` newer
    steps listed); the foreign files are untouched.

    Raises:
        FaultFound: the first broken promise, with ``context``.
    """
    from ckptmgr.errors import CkptmgrError

    check_foreign(root, context)
    own = mgr is None
    try:
        if own:
            mgr = root.manager()
        listed = list(mgr.all_steps())
        if 999999 in listed:
            raise FaultFound(f"{context}: the foreign step-named directory is listed")
        for step in listed:
            got = target()
            try:
                mgr.restore(step, got)
            except CkptmgrError as e:
                raise FaultFound(f"{context}: listed step {step} does not restore: "
                                 f"{type(e).__name__}: {e}") from e
            why = traj.mismatch(step, got)
            if why is not None:
                raise FaultFound(f"{context}: step {step} restored wrong bytes: {why}")
    finally:
        if own and mgr is not None:
            mgr.close()
    for step in sorted((reported or set()) | set(before or [])):
        newer = [s for s in listed if s > step]
        if step not in listed and (max_to_keep is None or len(newer) < max_to_keep):
            raise FaultFound(f"{context}: committed step {step} disappeared (listed now: "
                             f"{listed}); retention keeps the {max_to_keep} newest")
    names = set(root.entries()) - {s.split("/")[0] for s in FOREIGN}
    leftovers = sorted(n for n in names if not n.startswith(".ckptmgr-lease")
                       and not (n.isdigit() and int(n) in listed))
    return Verdict(listed, leftovers)
