"""The shared engine of the parser fuzzers (``tests/adversary/test_fuzz_*.py``): mutations,
sandbox, oracles.

Every parser of bytes that come from storage or from users is attacked two ways: structured
generation (hypothesis strategies build documents with chosen extreme fields) and mutation of valid
files that real saves produced (bit flips, truncation, splices of two valid files, extreme numbers,
deep nesting, huge counts, JSON type swaps). The property is the same everywhere: the public call
gives a correct result (what the bytes say; bit-exact for every region the mutation left alone)
or raises a :class:`ckptmgr.errors.CkptmgrError`, within a memory bound and a time bound.

Sandbox: each case runs in a process forked from a zygote that has torch, ckptmgr and this module
imported already (tests/_procs.py), so a case costs milliseconds, not an interpreter start. In
the child the address space is capped (``RLIMIT_AS``: an allocation of terabytes fails at once
instead of thrashing the machine), the peak resident memory is measured (``VmHWM`` after
resetting it through ``/proc/self/clear_refs``), and the parent kills the child when it runs
past the time bound, so a parser that blocks (a FIFO) shows up as a hang, not a stuck test run.
The target and its oracle run in the child; the parent gets a small :class:`Outcome`.

Long runs: ``CKPTMGR_FUZZ_EXAMPLES=<n>`` runs ``n`` examples per fuzz test with fresh random
seeds; unset, every test runs its small fixed budget, derandomized (CI sees the same cases on
every run). A failure prints the mutation (its operations, readable) and the exact bytes
(base64, and a file under ``CKPTMGR_FUZZ_OUT`` or the temp directory).

``python tests/_fuzz.py <target>`` runs a coverage-guided atheris loop over one in-process parser
(``manifest``, ``metadata``, ``values``, ``lease``, ``safetensors``, ``config``) when atheris is
installed: for long local runs only.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------------------
# Bounds and budgets

MEMORY_BOUND = 256 << 20
"""Peak resident memory one case may add (bytes): the inputs are kilobytes, so anything near this
means a parser allocated from a number it read instead of from the bytes it has."""
_AS_HEADROOM = 4 << 30
"""Address space a case may add before allocations fail: a hard stop far above MEMORY_BOUND (thread
stacks and malloc arenas reserve address space they never touch)."""
TIME_BOUND_S = float(os.environ.get("CKPTMGR_FUZZ_TIMEOUT_S", "30"))
"""Seconds one case may run before it is killed and reported as a hang (generous: the CI machine
has two cores and runs other tests beside these)."""
EXAMPLES_ENV = "CKPTMGR_FUZZ_EXAMPLES"


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings of one fuzz test: ``examples`` derandomized examples in CI, or
    ``$CKPTMGR_FUZZ_EXAMPLES`` random ones for a long run."""
    raw = os.environ.get(EXAMPLES_ENV, "").strip()
    long_run = bool(raw)
    return settings(
        max_examples=int(raw) if long_run else examples,
        derandomize=not long_run,
        database=None,  # nothing written into the work tree; a failure prints its reproducer
        deadline=None,  # the sandbox enforces the time bound, per case, with a kill
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much, HealthCheck.large_base_example],
        print_blob=long_run,
    )


# ---------------------------------------------------------------------------------------------
# Mutations: byte level

EXTREME_INTS: tuple[int, ...] = (
    0, 1, -1, 2, 255, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64,
    2**70, -(2**62), -(2**63), -(2**63) - 1, 10**30, 10**300, 10**400)
EXTREME_FLOATS: tuple[float, ...] = (
    0.5, -0.0, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), 5e-324, 1e16 + 0.5)
EXTREME_INT64: tuple[int, ...] = (
    0, 1, -1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63), -(2**62), 10**12, 10**15)
HUGE_COUNTS: tuple[int, ...] = (2, 3, 1000, 100_000)
DEPTHS: tuple[int, ...] = (17, 65, 101, 1000, 100_000)
_INSERTS: tuple[bytes, ...] = (
    b"\0" * 8, b"\xff" * 8, b'"', b"{", b"[", b"]", b"}", b"\\", b"9" * 40, b"-", b"\xc3",
    b"NaN", b"1e999", b",", b":", b"\n", b"../", b"\x00")


@dataclasses.dataclass(frozen=True)
class Mutated:
    """Mutated bytes and the operations that made them (the reproducer, readable)."""

    ops: tuple[str, ...]
    data: bytes

    def __repr__(self) -> str:
        return f"Mutated(ops={list(self.ops)!r}, {len(self.data)} bytes)"


@st.composite
def byte_mutations(draw: Any, valid: Sequence[bytes], *, max_ops: int = 3) -> Mutated:
    """1 to ``max_ops`` byte-level mutations of one of ``valid`` (the others are splice donors):
    bit flips, byte sets, truncation, deletion, insertion of interesting bytes, duplication of a
    slice, an extreme int64 written over 8 bytes, a splice with another valid file."""
    i = draw(st.integers(0, len(valid) - 1))
    data = bytearray(valid[i])
    ops = [f"start from valid[{i}] ({len(data)} bytes)"]
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(
            ("flip", "set", "truncate", "delete", "insert", "repeat", "int64", "splice")))
        n = len(data)
        pos = draw(st.integers(0, max(n - 1, 0)))
        if kind == "flip" and n:
            bit = draw(st.integers(0, 7))
            data[pos] ^= 1 << bit
            ops.append(f"flip bit {bit} of byte {pos}")
        elif kind == "set" and n:
            val = draw(st.sampled_from((0, 0xFF, 0x7F, 0x80, 0x22, 0x5C, 0x30, 0x39, 0x2D)))
            data[pos] = val
            ops.append(f"set byte {pos} to {val:#04x}")
        elif kind == "truncate":
            data = data[:pos]
            ops.append(f"truncate to {pos} bytes")
        elif kind == "delete":
            k = draw(st.integers(1, 16))
            del data[pos:pos + k]
            ops.append(f"delete {k} bytes at {pos}")
        elif kind == "insert":
            ins = draw(st.sampled_from(_INSERTS))
            data[pos:pos] = ins
            ops.append(f"insert {ins!r} at {pos}")
        elif kind == "repeat" and n:
            k = draw(st.integers(1, 64))
            times = draw(st.sampled_from(HUGE_COUNTS[:3]))
            piece = bytes(data[pos:pos + k])
            data[pos:pos] = piece * (times - 1)
            ops.append(f"repeat the {len(piece)} bytes at {pos} {times} times")
        elif kind == "int64" and n >= 8:
            pos = min(pos - pos % 8, n - 8)
            val = draw(st.sampled_from(EXTREME_INT64))
            data[pos:pos + 8] = struct.pack("<q", val)
            ops.append(f"write int64 {val} (little-endian) at {pos}")
        elif kind == "splice" and len(valid) > 1:
            j = draw(st.integers(0, len(valid) - 1))
            other = valid[j]
            cut = draw(st.integers(0, len(other)))
            data = data[:pos] + bytearray(other[cut:])
            ops.append(f"keep {pos} bytes, then valid[{j}] from byte {cut}")
        else:
            ops.append(f"({kind}: nothing to do on {n} bytes)")
    return Mutated(tuple(ops), bytes(data))


# ---------------------------------------------------------------------------------------------
# Mutations: JSON documents (also YAML mappings, safetensors headers, metadata headers)

Path = tuple[Any, ...]


def json_paths(doc: Any, limit: int = 5000) -> list[Path]:
    """Every node of ``doc`` as a path of keys and indices (the root is ``()``), breadth first,
    at most ``limit``."""
    out: list[Path] = []
    queue: list[tuple[Path, Any]] = [((), doc)]
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        out.append(path)
        if isinstance(node, dict):
            queue.extend(((*path, k), v) for k, v in node.items())
        elif isinstance(node, list):
            queue.extend(((*path, i), v) for i, v in enumerate(node))
    return out


def _get(doc: Any, path: Path) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _set(doc: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


class _Raw:
    """A placeholder for text that json.dumps cannot write (deep nesting): replaced after."""

    def __init__(self, text: str) -> None:
        self.text = text


_SWAPS: tuple[Any, ...] = (None, True, False, "", "x", "12", [], {}, 0, -1, 1.5)
_STRINGS: tuple[str, ...] = (
    "..", ".", "/etc/passwd", "../x", "a/../../b", "a\x00b", "\u202e\x1b[31m", "__tuple__",
    "A" * 100_000, "xxh3_64:" + "0" * 16, "NaN", "\ud800")


@st.composite
def json_mutations(draw: Any, doc: Any, *, max_ops: int = 2) -> tuple[tuple[str, ...], Any]:
    """(ops, mutated copy of ``doc``): 1 to ``max_ops`` structure-aware changes at chosen nodes:
    an extreme number, a type swap, a removed node, a list entry repeated a huge number of times,
    deep nesting, odd strings, a renamed or added key. The copy may hold :class:`_Raw` nodes:
    write it with :func:`dump_json`."""
    doc = copy.deepcopy(doc)
    ops: list[str] = []
    for _ in range(draw(st.integers(1, max_ops))):
        paths = json_paths(doc)
        path = draw(st.sampled_from(paths))
        node = _get(doc, path)
        kind = draw(st.sampled_from(
            ("int", "float", "swap", "drop", "dup", "nest", "string", "key", "add", "digits")))
        if kind == "digits":  # more digits than Python converts by default (4300)
            n = draw(st.sampled_from((4301, 100_000)))
            doc = _set(doc, path, _Raw("9" * n))
            ops.append(f"{list(path)} = an integer of {n} digits")
        elif kind == "int":
            v = draw(st.sampled_from(EXTREME_INTS))
            doc = _set(doc, path, v)
            ops.append(f"{list(path)} = {v}")
        elif kind == "float":
            v = draw(st.sampled_from(EXTREME_FLOATS))
            doc = _set(doc, path, v)
            ops.append(f"{list(path)} = {v!r}")
        elif kind == "swap":
            v = draw(st.sampled_from((*_SWAPS, "wrap-list", "wrap-dict", "str")))
            new = ([node] if v == "wrap-list" else {"k": node} if v == "wrap-dict"
                   else str(node) if v == "str" else copy.deepcopy(v))
            doc = _set(doc, path, new)
            ops.append(f"{list(path)} = {_short(new)} (type swap)")
        elif kind == "drop" and path:
            parent = _get(doc, path[:-1])
            del parent[path[-1]]
            ops.append(f"delete {list(path)}")
        elif kind == "dup" and path and isinstance(_get(doc, path[:-1]), list):
            parent = _get(doc, path[:-1])
            times = draw(st.sampled_from(HUGE_COUNTS))
            parent[path[-1]:path[-1] + 1] = [node] * times
            ops.append(f"repeat {list(path)} {times} times")
        elif kind == "nest":
            depth = draw(st.sampled_from(DEPTHS))
            doc = _set(doc, path, _Raw("[" * depth + "]" * depth))
            ops.append(f"{list(path)} = list nested {depth} deep")
        elif kind == "string":
            v = draw(st.sampled_from(_STRINGS))
            doc = _set(doc, path, v)
            ops.append(f"{list(path)} = {_short(v)}")
        elif kind == "key" and path and isinstance(_get(doc, path[:-1]), dict):
            parent = _get(doc, path[:-1])
            new_key = draw(st.sampled_from(("", "__tuple__", "x", "..", "0", "-1", "01")))
            value = parent.pop(path[-1])
            parent[new_key] = value
            ops.append(f"rename key {list(path)} to {new_key!r}")
        elif kind == "add" and isinstance(node, dict):
            key = draw(st.sampled_from(("extra", "__bytes__", "format", "0")))
            node[key] = draw(st.sampled_from(_SWAPS))
            ops.append(f"{[*path, key]} added = {_short(node[key])}")
        else:
            ops.append(f"({kind}: not applicable at {list(path)})")
    return tuple(ops), doc


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else f"{r[:40]}...({len(r)} chars)"


def dump_json(doc: Any) -> bytes:
    """``doc`` as JSON bytes (NaN and Infinity as Python writes them), :class:`_Raw` nodes
    written as their text."""
    raws: list[str] = []

    def enc(o: Any) -> Any:
        if isinstance(o, _Raw):
            raws.append(o.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(o, dict):
            return {k: enc(v) for k, v in o.items()}
        if isinstance(o, list):
            return [enc(v) for v in o]
        return o

    text = json.dumps(enc(doc), ensure_ascii=False)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def json_file_mutations(draw: Any, valid: Sequence[bytes]) -> Mutated:
    """A JSON file mutated: structure-aware changes, byte-level ones, or both."""
    mode = draw(st.sampled_from(("json", "bytes", "both")))
    if mode == "bytes":
        return draw(byte_mutations(valid))  # type: ignore[no-any-return]
    i = draw(st.integers(0, len(valid) - 1))
    ops, doc = draw(json_mutations(json.loads(valid[i])))
    data = dump_json(doc)
    m = Mutated((f"start from valid[{i}]", *ops), data)
    if mode == "both":
        b = draw(byte_mutations([data]))
        m = Mutated(m.ops + b.ops[1:], b.data)
    return m


# ---------------------------------------------------------------------------------------------
# Containers: JSON inside binary framing (metadata format 2, safetensors)

MAGIC_V2 = b"CKPTMDv2"


def split_v2(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, body) of format-2 metadata (docs/byte-format.md), read independently of ckptmgr."""
    if data[:8] != MAGIC_V2:
        raise ValueError("not format 2")
    n = int.from_bytes(data[8:16], "little")
    head = json.loads(data[16:16 + n])
    start = 16 + n + (-(16 + n) % 8)
    return head, data[start:]


def join_v2(header: Any, body: bytes, *, header_bytes: bytes | None = None) -> bytes:
    """Format-2 metadata from a header and a body (the inverse of :func:`split_v2`)."""
    head = dump_json(header) if header_bytes is None else header_bytes
    out = bytearray(MAGIC_V2) + len(head).to_bytes(8, "little") + head
    out += b"\0" * (-len(out) % 8)
    return bytes(out + body)


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def join_safetensors(header: Any, body: bytes) -> bytes:
    head = dump_json(header)
    return struct.pack("<Q", len(head)) + head + body


@st.composite
def framed_mutations(draw: Any, valid: Sequence[bytes],
                     split: Callable[[bytes], tuple[Any, bytes]],
                     join: Callable[[Any, bytes], bytes], *, body_int64: bool = False,
                     ) -> Mutated:
    """A file of JSON header plus binary body mutated: the header structure-aware (re-framed with
    its true length), the body's int64 slots set to extremes, raw bytes, or a mix."""
    mode = draw(st.sampled_from(("header", "header", "body", "bytes", "header+bytes")))
    if mode == "bytes" or (mode == "body" and not body_int64):
        return draw(byte_mutations(valid))  # type: ignore[no-any-return]
    i = draw(st.integers(0, len(valid) - 1))
    header, body = split(valid[i])
    if mode == "body":
        slots = len(body) // 8
        if not slots:
            return Mutated((f"start from valid[{i}]", "(empty body)"), valid[i])
        ops = []
        new = bytearray(body)
        for _ in range(draw(st.integers(1, 3))):
            k = draw(st.integers(0, slots - 1))
            v = draw(st.sampled_from(EXTREME_INT64))
            new[8 * k:8 * k + 8] = struct.pack("=q", v)
            ops.append(f"body int64 slot {k} = {v}")
        return Mutated((f"start from valid[{i}]", *ops), join(header, bytes(new)))
    ops, header = draw(json_mutations(header))
    data = join(header, body)
    m = Mutated((f"start from valid[{i}]", *(f"header {o}" for o in ops)), data)
    if mode == "header+bytes":
        b = draw(byte_mutations([data]))
        m = Mutated(m.ops + b.ops[1:], b.data)
    return m


# ---------------------------------------------------------------------------------------------
# The sandbox (parent side)


@dataclasses.dataclass
class Outcome:
    """What one case did in its child process."""

    kind: str  # "ok", "raised", "wrong" (the oracle failed), "hang", "crash"
    exc_type: str = ""
    ours: bool = False
    message: str = ""
    tb: str = ""
    peak_bytes: int = 0
    seconds: float = 0.0
    info: Any = None
    stderr: str = ""

    def describe(self) -> str:
        head = {"ok": "returned", "raised": f"raised {self.exc_type}",
                "wrong": "returned a wrong result", "hang": "did not finish",
                "crash": "died"}[self.kind]
        out = [f"{head}: {self.message}"[:3000],
               f"(peak memory +{self.peak_bytes / 2**20:.1f} MiB, {self.seconds:.2f} s)"]
        if self.tb:
            out.append(self.tb[-4000:])
        if self.kind in ("crash", "hang") and self.stderr:
            out.append("stderr: " + self.stderr[-2000:])
        return "\n".join(out)


class FuzzFailure(AssertionError):
    """A case broke the property; the message holds the reproducer."""


class Sandbox:
    """Runs cases in children of a zygote that has torch, ckptmgr and this module imported."""

    def __init__(self, scratch: str) -> None:
        from _procs import PRELOAD, Zygote

        self.scratch = scratch
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = TESTS_DIR + (os.pathsep + old if old else "")
        try:
            self._zygote = Zygote(preload=(*PRELOAD, *_PRELOAD))
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        self._n = 0

    def close(self) -> None:
        self._zygote.close()

    def run(self, target: str, *, timeout: float = TIME_BOUND_S, **kwargs: Any) -> Outcome:
        """Run ``TARGETS[target](**kwargs)`` in a fresh child; its :class:`Outcome`."""
        self._n += 1
        case = os.path.join(self.scratch, f"case-{self._n}.pkl")
        result = os.path.join(self.scratch, f"result-{self._n}.pkl")
        with open(case, "wb") as f:
            pickle.dump((target, kwargs), f)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTMGR_")}
        env["TMPDIR"] = self.scratch
        t0 = time.monotonic()
        proc = self._zygote.spawn([case, result], env=env, code=_CHILD_CODE)
        try:
            _, err = proc.communicate(timeout)
        except subprocess.TimeoutExpired:
            for pipe in (proc.stdout, proc.stderr):  # communicate leaves them open then
                if pipe is not None:
                    pipe.close()
            return Outcome("hang", message=f"killed after {timeout:.0f} s (the time bound)",
                           seconds=time.monotonic() - t0)
        finally:
            os.unlink(case)
        try:
            with open(result, "rb") as f:
                out: Outcome = pickle.load(f)
            os.unlink(result)
        except FileNotFoundError:
            return Outcome("crash", message=f"the child exited with status {proc.returncode} "
                           "and no result", stderr=err, seconds=time.monotonic() - t0)
        out.stderr = err
        return out


# What the targets import on first use (ckptmgr imports its manager lazily): imported once in the
# zygote, so that a case costs its own work only.
_PRELOAD = ("ckptmgr.manager", "ckptmgr.initial", "ckptmgr.config", "ckptmgr.lease",
            "ckptmgr.dcp.reader", "ckptmgr.dcp.metadata", "safetensors.torch", "yaml",
            "_fuzz")
_CHILD_CODE = "import sys, _fuzz; _fuzz.child_main(sys.argv[1], sys.argv[2])"


def save_reproducer(name: str, data: bytes) -> str:
    """Write failing bytes where a developer can pick them up; the path."""
    out = os.environ.get("CKPTMGR_FUZZ_OUT") or os.path.join(tempfile.gettempdir(),
                                                              "ckptmgr-fuzz")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}-{hashlib.sha1(data).hexdigest()[:12]}.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path


def check(outcome: Outcome, what: str, *, data: bytes | None = None, ops: Sequence[str] = (),
          allow: Callable[[Outcome], bool] | None = None) -> None:
    """Assert the property: ``ok``, or a CkptmgrError (or what ``allow`` accepts), within the
    memory bound (the time bound is the sandbox's kill); else :class:`FuzzFailure` with the
    reproducer."""
    with contextlib.suppress(InvalidArgument):  # outside @given: no statistics to add to
        event(f"{what}: {outcome.kind} {outcome.exc_type.rsplit('.', 1)[-1]}".rstrip())
    good = outcome.kind == "ok" or (outcome.kind == "raised" and outcome.ours) or (
        allow is not None and outcome.kind in ("ok", "raised") and allow(outcome))
    if good and outcome.peak_bytes <= MEMORY_BOUND:
        return
    lines = [f"{what}: the property broke", outcome.describe()]
    if good:
        lines.insert(1, f"peak memory {outcome.peak_bytes} bytes > bound {MEMORY_BOUND}")
    if ops:
        lines.append("mutation: " + "; ".join(ops))
    if data is not None:
        lines.append(f"bytes ({len(data)}): saved to {save_reproducer(what, data)}")
        if len(data) <= 3000:
            lines.append(f"base64: {base64.b64encode(data).decode()}")
    raise FuzzFailure("\n".join(lines))


# One sandbox and one set of templates for the whole session. Each test module imports the
# fixtures below, and pytest makes a separate session fixture per importing module; so the objects
# live here, made by whichever module asks first, closed by the last finalizer at session end.
_SHARED: dict[str, Any] = {}


@pytest.fixture(scope="session", name="fuzz_sandbox")
def sandbox_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """The sandbox every fuzz test of the session shares."""
    if "sandbox" not in _SHARED:
        _SHARED["sandbox"] = Sandbox(str(tmp_path_factory.mktemp("fuzz")))
    yield _SHARED["sandbox"]
    box = _SHARED.pop("sandbox", None)
    _SHARED.pop("templates", None)
    if box is not None:
        box.close()


@pytest.fixture(scope="session", name="fuzz_templates")
def templates_fixture(fuzz_sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory,
                   ) -> Templates:
    """The valid files the mutations start from, made by real saves (made once, in a child)."""
    if "templates" not in _SHARED:
        where = str(tmp_path_factory.mktemp("fuzz-templates"))
        out = fuzz_sandbox.run("make_templates", where=where, timeout=300)
        if out.kind != "ok":
            raise RuntimeError("making the fuzz templates failed:\n" + out.describe())
        _SHARED["templates"] = Templates(out.info)
    templates: Templates = _SHARED["templates"]
    return templates


class Templates(dict):  # type: ignore[type-arg]
    """The template files by name (a short repr: hypothesis prints the test's arguments)."""

    def __repr__(self) -> str:
        return f"<fuzz templates in {self.get('where')}>"


# ---------------------------------------------------------------------------------------------
# The child side: run one case, report


class OracleError(AssertionError):
    """The call returned, but not what the bytes say."""


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


@contextlib.contextmanager
def case_tempdir() -> Iterator[str]:
    """A fresh directory for everything one case writes (``tempfile`` defaults to it), removed
    afterwards: long runs make millions of cases."""
    old = tempfile.tempdir
    d = tempfile.mkdtemp(prefix="case-")
    tempfile.tempdir = d
    try:
        yield d
    finally:
        tempfile.tempdir = old
        shutil.rmtree(d, ignore_errors=True)


def child_main(case_path: str, result_path: str) -> None:
    """(in the child) Run the case in ``case_path``; write its :class:`Outcome` to
    ``result_path``; exit without running atexit hooks or joining threads."""
    import resource

    with open(case_path, "rb") as f:
        target, kwargs = pickle.load(f)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + _AS_HEADROOM, hard))
    _reset_peak()
    rss0 = _status("VmRSS")
    t0 = time.perf_counter()
    out = Outcome("ok")
    try:
        with case_tempdir():
            out.info = resolve_target(target)(**kwargs)
    except OracleError as e:
        out = Outcome("wrong", exc_type="OracleError", message=str(e),
                      tb=traceback.format_exc())
    except BaseException as e:  # everything is reported: the parent judges
        from ckptmgr.errors import CkptmgrError

        out = Outcome("raised", exc_type=f"{type(e).__module__}.{type(e).__qualname__}",
                      ours=isinstance(e, CkptmgrError), message=str(e)[:3000],
                      tb=traceback.format_exc())
    out.seconds = time.perf_counter() - t0
    out.peak_bytes = max(0, _status("VmHWM") - rss0)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    with open(result_path + ".part", "wb") as f:
        pickle.dump(out, f)
    os.replace(result_path + ".part", result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------- the state that saves produce


def saved_state() -> dict[str, Any]:
    """The state every template checkpoint holds (deterministic)."""
    g = torch.Generator().manual_seed(27)
    return {
        "model": {
            "w": torch.randn(4, 6, generator=g),
            "b": torch.arange(8, dtype=torch.float32) + 0.5,
            "h": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "i": torch.arange(5, dtype=torch.int64) * (2**40 + 3),
        },
        # No empty dict inside a list: dropping one on save is Trust I defect 10, which the
        # stateful model covers; here it would hide every parser failure behind it.
        "extra": {"epoch": 7, "name": "run-\u03b1", "t": (1, 2.5, None), "l": [1, [2, {"k": None}]],
                  "blob": b"\x00\xff", "d": {3: "three"}},
    }


SENTINEL = {torch.float32: 12345.0, torch.bfloat16: -77.0, torch.int64: -7777,
            torch.float16: 99.0}


def sentinel_like(state: Any, strided: bool = False) -> Any:
    """``state`` with every tensor replaced by one of its shape and dtype filled with a sentinel,
    and every value replaced by a placeholder (so an untouched region is seen). ``strided``:
    each tensor is a non-contiguous view (every other element of a larger one)."""
    if isinstance(state, torch.Tensor):
        fill = SENTINEL.get(state.dtype, 3)
        if strided:
            return torch.full((*state.shape, 2), fill, dtype=state.dtype)[..., 0]
        return torch.full(state.shape, fill, dtype=state.dtype)
    if type(state) is dict:
        return {k: sentinel_like(v, strided) for k, v in state.items()}
    return "<placeholder>"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaNs with the same payload are equal)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and bytes(a.contiguous().view(torch.uint8).flatten().numpy())
            == bytes(b.contiguous().view(torch.uint8).flatten().numpy()))


def same_value(a: Any, b: Any) -> bool:
    """Exact equality of Python values, types included (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def _describe_tensor_diff(key: str, got: torch.Tensor, want: torch.Tensor) -> str:
    g = got.contiguous().flatten()
    w = want.contiguous().flatten()
    if g.shape != w.shape or g.dtype != w.dtype:
        return f"{key}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    gb = g.view(torch.uint8).reshape(g.numel(), -1) if g.numel() else g
    wb = w.view(torch.uint8).reshape(w.numel(), -1) if w.numel() else w
    diff = (gb != wb).any(dim=1).nonzero().flatten().tolist() if g.numel() else []
    sentinel = SENTINEL.get(got.dtype)
    untouched = int((g == sentinel).sum()) if sentinel is not None else 0
    return (f"{key}: {len(diff)} of {g.numel()} elements differ (first at flat index "
            f"{diff[:5]}), {untouched} still hold the sentinel {sentinel} (never written)")


def compare_state(got: Any, want: Any, prefix: str = "") -> list[str]:
    """Differences between a restored state and what it should hold, one line each."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or not same_bits(got, want):
            if isinstance(got, torch.Tensor):
                return [_describe_tensor_diff(prefix, got, want)]
            return [f"{prefix}: got {type(got).__name__}, want a tensor"]
        return []
    if type(want) is dict and type(got) is dict:
        out = []
        for k, v in want.items():
            if k not in got:
                out.append(f"{prefix}.{k}: missing")
            else:
                out.extend(compare_state(got[k], v, f"{prefix}.{k}" if prefix else k))
        return out
    if not same_value(got, want):
        return [f"{prefix}: got {_short(got)}, want {_short(want)}"]
    return []


# ------------------------------------------------------------------------------- templates


def _xxh(data: bytes) -> str:
    return f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"


def _only_step_dir(root: str) -> str:
    steps = [d for d in os.listdir(root) if d.isdigit()]
    return os.path.join(root, steps[0])


def _manifest_files(step_dir: str) -> tuple[str, str]:
    """(metadata file name, data file name) of a template step."""
    with open(os.path.join(step_dir, "commit.json"), "rb") as f:
        man = json.load(f)
    data = [e["path"] for e in man["files"] if e["path"] != man["metadata_file"]]
    return man["metadata_file"], data[0]


def _target_make_templates(where: str) -> dict[str, Any]:
    import safetensors.torch
    import yaml

    import ckptmgr
    from ckptmgr.dcp.metadata import decode_metadata, encode_metadata

    out: dict[str, Any] = {"where": where}
    state = saved_state()
    root2 = os.path.join(where, "root-v2")
    with ckptmgr.CheckpointManager(root2, 1) as mgr:
        mgr.save(1, state, metrics={"loss": 0.25}, metadata={"note": "template"})
        with open(os.path.join(root2, ".ckptmgr-lease.json"), "rb") as f:
            out["lease"] = f.read()
    # The same step with format-1 metadata: what older ckptmgr wrote (still read).
    root1 = os.path.join(where, "root-v1")
    shutil.copytree(root2, root1)
    step1 = _only_step_dir(root1)
    meta_name, data_name = _manifest_files(step1)
    with open(os.path.join(step1, meta_name), "rb") as f:
        v2 = f.read()
    v1 = encode_metadata(decode_metadata(v2), version=1)
    _write_and_fix(step1, {meta_name: v1})
    step2 = _only_step_dir(root2)
    out.update(root_v2=root2, root_v1=root1, step=1, metadata_name=meta_name,
               data_name=data_name, metadata_v2=v2, metadata_v1=v1)
    with open(os.path.join(step2, "commit.json"), "rb") as f:
        out["manifest"] = f.read()
    with open(os.path.join(step2, data_name), "rb") as f:
        out["data"] = f.read()
    # The same state saved with reuse_unchanged=True, every tensor a shared chunk (threshold 0),
    # so that its manifest (format_version 2) lists shared chunks of the root.
    import ckptmgr.dcp.writer as writer

    root_reuse = os.path.join(where, "root-reuse")
    threshold, writer.SHARE_MIN_BYTES = writer.SHARE_MIN_BYTES, 0
    try:
        with ckptmgr.CheckpointManager(root_reuse, 1, reuse_unchanged=True) as mgr:
            mgr.save(1, state, metrics={"loss": 0.25}, metadata={"note": "template"})
    finally:
        writer.SHARE_MIN_BYTES = threshold
    out["root_reuse"] = root_reuse
    with open(os.path.join(_only_step_dir(root_reuse), "commit.json"), "rb") as f:
        out["manifest_reuse"] = f.read()
    # A second, different valid manifest (another step, metrics) for splices.
    root3 = os.path.join(where, "root-other")
    with ckptmgr.CheckpointManager(root3, 1) as mgr:
        mgr.save(2, {"x": torch.ones(3)}, metrics={"acc": 1.0, "loss": 3.0})
    with open(os.path.join(_only_step_dir(root3), "commit.json"), "rb") as f:
        out["manifest_other"] = f.read()
    # Safetensors: a single file, and a two-shard Hugging Face directory.
    flat = {"w": state["model"]["w"], "b": state["model"]["b"], "h": state["model"]["h"],
            "i": state["model"]["i"]}
    single = os.path.join(where, "model.safetensors")
    safetensors.torch.save_file(flat, single, metadata={"format": "pt"})
    with open(single, "rb") as f:
        out["safetensors"] = f.read()
    shard1 = safetensors.torch.save({"w": flat["w"], "b": flat["b"]})
    shard2 = safetensors.torch.save({"h": flat["h"], "i": flat["i"]})
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in flat.values())},
             "weight_map": {"w": names[0], "b": names[0], "h": names[1], "i": names[1]}}
    out["hf_shards"] = {names[0]: shard1, names[1]: shard2}
    out["hf_index"] = json.dumps(index, indent=2).encode()
    out["flat"] = {k: v.clone() for k, v in flat.items()}
    # torch.save: the zip format (nested dicts) and the legacy format.
    nested = {"w": flat["w"], "sub": {"b": flat["b"], "i": flat["i"]}, "h": flat["h"]}
    buf = io.BytesIO()
    torch.save(nested, buf)
    out["torch_zip"] = buf.getvalue()
    buf = io.BytesIO()
    torch.save(nested, buf, _use_new_zipfile_serialization=False)
    out["torch_legacy"] = buf.getvalue()
    # Config files: the repository's own, as users copy them.
    configs = os.path.join(os.path.dirname(TESTS_DIR), "configs")
    out["configs"] = {}
    for name in sorted(os.listdir(configs)):
        with open(os.path.join(configs, name), "rb") as f:
            raw = f.read()
        yaml.safe_load(raw)  # each is valid YAML to start from
        out["configs"][name] = raw
    return out


def _write_and_fix(step_dir: str, edits: Mapping[str, bytes | None],
                   fix: Sequence[str] | None = None) -> None:
    """Write ``edits`` (file name -> bytes, None deletes) into a step directory, then make the
    manifest's size and checksum of the files in ``fix`` (default: every edited file but the
    manifest) match their new bytes: an attacker who writes a file can write the manifest too."""
    for name, data in edits.items():
        path = os.path.join(step_dir, name)
        if data is None:
            os.unlink(path)
            continue
        with open(path, "wb") as f:
            f.write(data)
    names = [n for n in (edits if fix is None else fix) if n != "commit.json"]
    if not names:
        return
    man_path = os.path.join(step_dir, "commit.json")
    with open(man_path, "rb") as f:
        man = json.load(f)
    for e in man["files"]:
        if e["path"] in names:
            with open(os.path.join(step_dir, e["path"]), "rb") as f:
                data = f.read()
            e["size"] = len(data)
            e["checksum"] = _xxh(data)
    man["total_bytes"] = sum(e["size"] for e in man["files"])
    man["bytes_per_rank"] = {"0": man["total_bytes"]}
    with open(man_path, "w") as f:
        json.dump(man, f, indent=1)


def _fresh_copy(root: str) -> str:
    dst = os.path.join(tempfile.mkdtemp(), "root")
    shutil.copytree(root, dst)
    return dst


# ------------------------------------------------------------------------------- restore


def _target_restore(root: str, step: int, edits: Mapping[str, bytes | None],
                    fix: Sequence[str] | None = None, expect: Any = None,
                    info_checks: bool = True) -> dict[str, Any]:
    """Restore step ``step`` of a copy of ``root`` whose step directory got ``edits`` (manifest
    entries fixed for ``fix``, by default every edited file). Oracle: on success every tensor is
    bit-exact to the saved one and every value is ``expect`` (default: as saved)."""
    import ckptmgr
    from ckptmgr.storage import local

    root = _fresh_copy(root)
    step_dir = os.path.join(root, str(step))
    _write_and_fix(step_dir, edits, fix)
    want = saved_state() if expect is None else expect
    # Half the cases (by their bytes, so a case replays alike) read through the streamed direct
    # reads a large cold restore uses, the others through the buffered reads (this child only).
    digest = hashlib.sha256(repr(sorted((k, v) for k, v in edits.items())).encode()).digest()
    local.DIRECT_READ = bool(digest[0] & 1)
    staged = bool(digest[1] & 1)
    if staged:
        # Half the cases restore into strided views, which the reader stages: through windows
        # of 64 bytes, the next read while the last is copied out (ckptmgr.dcp.reader).
        from ckptmgr.dcp import reader

        reader._WINDOW, reader._MAX_BUFFERED = 64, 128
    with ckptmgr.CheckpointManager(root, 1, read_only=True) as mgr:
        steps = mgr.all_steps()
        if info_checks and step in steps:
            info = mgr.step_info(step)
            if info.step != step or not isinstance(info.total_bytes, int):
                raise OracleError(f"step_info({step}) gave {info!r}")
        target = sentinel_like(want, strided=staged)
        mgr.restore(step, target)
    diffs = compare_state(target, want)
    if diffs:
        raise OracleError("restore returned, but the state is not what was saved:\n"
                          + "\n".join(diffs[:20]))
    return {"steps": steps}


# ------------------------------------------------------- metadata crafted by structure (chunks)


def _target_crafted_chunks(root: str, step: int, metadata_name: str, fqn: str,
                           chunks: Sequence[tuple[Sequence[int], Sequence[int]]], fmt: int,
                           column: str) -> dict[str, Any]:
    """Restore after replacing the chunk list of tensor ``fqn`` by ``chunks``
    (:func:`crafted_chunks_metadata`)."""
    meta = crafted_chunks_metadata(root, step, metadata_name, fqn, chunks, fmt, column)
    return _target_restore(root, step, {metadata_name: meta})


def crafted_chunks_metadata(root: str, step: int, metadata_name: str, fqn: str,
                            chunks: Sequence[tuple[Sequence[int], Sequence[int]]], fmt: int,
                            column: str) -> bytes:
    """The step's metadata with the chunk list of tensor ``fqn`` replaced by ``chunks`` (offsets,
    sizes), each pointing at the bytes of the saved tensor that its box would hold (row-major, so
    the location is right for boxes of whole rows) with their true checksum: only the chunk list
    is a lie. Format 2 (chunk ``column`` kind "q" packed int64 or "r" JSON runs) or format 1."""
    step_dir = os.path.join(root, str(step))
    with open(os.path.join(step_dir, metadata_name), "rb") as f:
        v2 = f.read()
    header, body = split_v2(v2)
    entry = next(t for t in header["tensors"] if t["fqn"] == fqn)
    size = entry["size"]
    itemsize = torch.empty(0, dtype=getattr(torch, entry["dtype"])).element_size()
    pos0 = entry["loc"]["pos"]["c"]
    file_index = entry["loc"]["file"]["c"]
    data_name = header["files"][file_index]
    with open(os.path.join(step_dir, data_name), "rb") as f:
        data = f.read()
    nbytes = math.prod(size) * itemsize
    row = math.prod(size[1:]) * itemsize if size else itemsize
    locs = []
    for offsets, sizes in chunks:
        start = pos0 + (offsets[0] * row if offsets and 0 <= offsets[0] <= size[0] else 0)
        length = max(0, math.prod(sizes)) * itemsize
        end = min(start + min(length, nbytes), len(data))
        locs.append((start, _xxh(data[start:end]) if length <= nbytes else _xxh(b"")))
    if fmt == 2:
        flat = [x for o, s in chunks for x in (*o, *s)]
        new_body = bytearray(body)

        def packed(values: Sequence[int]) -> dict[str, int]:
            new_body.extend(b"\0" * (-len(new_body) % 8))
            off = len(new_body)
            new_body.extend(struct.pack(f"<{len(values)}q", *[_wrap64(v) for v in values]))
            return {"q": off}

        new = {k: v for k, v in entry.items() if k not in ("grid", "count", "table", "loc")}
        new["count"] = len(chunks)
        if column == "r" and flat:
            new["table"] = {"r": [flat, list(range(1, len(flat) + 1))]}
        else:
            new["table"] = packed(flat) if flat else {"c": 0}
        new["loc"] = {"file": {"c": file_index}, "pos": packed([p for p, _ in locs]) if locs
                      else {"c": 0},
                      "sum": packed([_wrap64(int(c[-16:], 16)) for _, c in locs]) if locs
                      else {"c": 0}}
        header["tensors"] = [new if t["fqn"] == fqn else t for t in header["tensors"]]
        meta = join_v2(header, bytes(new_body))
    else:
        doc = json.loads(_v1_of(v2))
        doc["tensors"][fqn]["chunks"] = [{"offsets": list(o), "sizes": list(s)}
                                         for o, s in chunks]
        doc["storage"] = [s for s in doc["storage"] if s["fqn"] != fqn] + [
            {"fqn": fqn, "offset": list(o), "file": data_name, "pos": p,
             "length": max(0, math.prod(s)) * itemsize, "checksum": c, "enc": "raw"}
            for (o, s), (p, c) in zip(chunks, locs, strict=True)]
        meta = json.dumps(doc).encode()
    return meta


def _wrap64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _v1_of(v2: bytes) -> bytes:
    from ckptmgr.dcp.metadata import decode_metadata, encode_metadata

    return encode_metadata(decode_metadata(v2), version=1)


# ------------------------------------------------------------------------ Python values


def ref_decode_value(data: bytes) -> Any:
    """The tagged-JSON value of ``data`` (docs/byte-format.md), decoded strictly and independently
    of ckptmgr: ValueError for anything that is not exactly what the format describes."""

    def dec(o: Any) -> Any:
        if isinstance(o, list):
            return [dec(v) for v in o]
        if not isinstance(o, dict):
            return o
        if len(o) == 1:
            (tag, payload), = o.items()
            if tag == "__tuple__":
                if not isinstance(payload, list):
                    raise ValueError("__tuple__ payload is not a list")
                return tuple(dec(v) for v in payload)
            if tag == "__float__":
                if payload not in ("nan", "inf", "-inf"):
                    raise ValueError("bad __float__")
                return float(payload)
            if tag == "__bytes__":
                if not isinstance(payload, str):
                    raise ValueError("__bytes__ payload is not a string")
                return base64.b64decode(payload.encode("ascii"), validate=True)
            if tag in ("__dict__", "__odict__"):
                if not isinstance(payload, list) or not all(
                        isinstance(p, list) and len(p) == 2 for p in payload):
                    raise ValueError(f"{tag} payload is not a list of pairs")
                pairs = [(dec(k), dec(v)) for k, v in payload]
                for k, _ in pairs:
                    hash(k)  # TypeError for a list or dict key
                from collections import OrderedDict

                return OrderedDict(pairs) if tag == "__odict__" else dict(pairs)
        return {k: dec(v) for k, v in o.items()}

    # NaN and Infinity are not JSON, and our encoder writes tags instead, but Python's reader
    # takes them and so does this one: the value is still what the bytes say.
    try:
        return dec(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, RecursionError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(str(e)) from e


def _target_value_roundtrip(value: Any) -> dict[str, Any]:
    """encode_value then decode_value gives the value back, exactly."""
    from ckptmgr.codec.values import decode_value, encode_value

    data = encode_value(value)
    back = decode_value(data)
    if not same_value(back, value):
        raise OracleError(f"{_short(value)} came back as {_short(back)}")
    if not same_value(ref_decode_value(data), value):
        raise OracleError(f"the bytes {data[:200]!r} do not say {_short(value)}")
    return {}


def _value_location(header: Mapping[str, Any], key: str) -> list[Any]:
    return next(v for v in header["values"] if v[0] == key)


def _target_value_bytes(root: str, step: int, metadata_name: str, key: str,
                        value_bytes: bytes) -> dict[str, Any]:
    """Restore after the stored bytes of Python value ``key`` became ``value_bytes`` (appended to
    its data file; the metadata's location and checksum and the manifest fixed to match). Oracle:
    on success the value is what a strict decoder reads from the bytes; a restore that returns
    although the bytes are not a tagged JSON value is wrong."""
    step_dir = os.path.join(root, str(step))
    with open(os.path.join(step_dir, metadata_name), "rb") as f:
        header, body = split_v2(f.read())
    loc = _value_location(header, key)
    data_name = header["files"][loc[1]]
    with open(os.path.join(step_dir, data_name), "rb") as f:
        data = f.read()
    loc[2], loc[3], loc[4] = len(data), len(value_bytes), _xxh(value_bytes)
    try:
        want_value = ref_decode_value(value_bytes)
        valid = True
    except (ValueError, TypeError):
        want_value, valid = None, False
    want = saved_state()
    *parents, last = key.split(".")
    node: Any = want
    for part in parents:
        node = node[part]
    node[last if last in node else int(last)] = want_value
    try:
        out = _target_restore(root, step, {data_name: data + value_bytes,
                                           metadata_name: join_v2(header, body)}, expect=want)
    except OracleError:
        if not valid:
            raise OracleError(f"restore returned although the bytes of {key!r} are not a tagged "
                              f"JSON value: {value_bytes[:300]!r}") from None
        raise
    if not valid:
        raise OracleError(f"restore returned although the bytes of {key!r} are not a tagged JSON "
                          f"value: {value_bytes[:300]!r}")
    return out


# --------------------------------------------------------------------- load_initial (files)


_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}


def ref_safetensors(data: bytes) -> dict[str, torch.Tensor | str]:
    """Each tensor of a safetensors file as the format defines it (name -> tensor), read strictly
    and independently of ckptmgr; an entry that is not valid maps to the reason (str). Raises
    ValueError when the file as a whole is not safetensors."""
    if len(data) < 8:
        raise ValueError("shorter than 8 bytes")
    n = struct.unpack("<Q", data[:8])[0]
    if n > len(data) - 8:
        raise ValueError("header past the end")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    body = data[8 + n:]
    out: dict[str, torch.Tensor | str] = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict):
            out[name] = "entry is not an object"
            continue
        name_of_dtype = e.get("dtype")
        dtype = _ST_DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
        shape, offs = e.get("shape"), e.get("data_offsets")
        if dtype is None:
            out[name] = f"dtype {e.get('dtype')!r}"
        elif not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            out[name] = f"shape {shape!r}"
        elif not (isinstance(offs, list) and len(offs) == 2 and all(
                type(o) is int for o in offs) and 0 <= offs[0] <= offs[1] <= len(body)):
            out[name] = f"data_offsets {offs!r} (data section of {len(body)} bytes)"
        else:
            itemsize = torch.empty(0, dtype=dtype).element_size()
            if offs[1] - offs[0] != math.prod(shape) * itemsize:
                out[name] = f"{offs[1] - offs[0]} bytes for shape {shape}"
            else:
                raw = bytearray(body[offs[0]:offs[1]])
                out[name] = (torch.frombuffer(raw, dtype=dtype).reshape(shape) if raw
                             else torch.empty(shape, dtype=dtype))
    return out


def _mkfifo_safe(path: str) -> None:
    os.mkfifo(path)


def _write_tree(files: Mapping[str, bytes | str]) -> str:
    """A fresh directory holding ``files`` (name -> bytes; the string "fifo" makes a FIFO)."""
    d = tempfile.mkdtemp()
    _write_tree_into(d, files)
    return d


def _targets_like(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full(v.shape, SENTINEL.get(v.dtype, 3), dtype=v.dtype)
            for k, v in flat.items()}


def _load_initial(src: str, state: dict[str, Any]) -> None:
    import ckptmgr

    with ckptmgr.CheckpointManager(os.path.join(tempfile.mkdtemp(), "root"), 1,
                                   read_only=True) as mgr:
        mgr.load_initial(src, state)


def _check_loaded(state: Mapping[str, torch.Tensor], expected: Mapping[str, Any],
                  where: str) -> None:
    """Oracle of a load_initial that returned: each key of the state is untouched (still the
    sentinel: the source lacks it) or holds exactly what the source's bytes say, cast to its
    dtype; a source entry for that key that is not valid means the load should have failed."""
    problems = []
    for key, got in state.items():
        fill = torch.full(got.shape, SENTINEL.get(got.dtype, 3), dtype=got.dtype)
        want = expected.get(key)
        if want is None:
            if not same_bits(got, fill):
                problems.append(f"{key}: changed although {where} has no valid tensor of that "
                                "name")
            continue
        if isinstance(want, str):
            problems.append(f"{key}: load_initial returned although its entry in {where} is "
                            f"not valid ({want})")
            continue
        if tuple(want.shape) != tuple(got.shape):
            problems.append(f"{key}: load_initial returned although the source's shape is "
                            f"{list(want.shape)} and the state's {list(got.shape)}")
            continue
        cast = want.to(got.dtype)
        if not same_bits(got, cast):
            problems.append(_describe_tensor_diff(key, got, cast))
    if problems:
        raise OracleError("load_initial returned, but:\n" + "\n".join(problems[:20]))


def _target_safetensors_file(data: bytes, flat_like: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    d = _write_tree({"model.safetensors": data})
    state = _targets_like(flat_like)
    src = os.path.join(d, "model.safetensors")
    _load_initial(src, state)
    try:
        expected: Mapping[str, Any] = ref_safetensors(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise OracleError(f"load_initial returned although the file is not safetensors: {e}"
                          ) from None
    _check_loaded(state, expected, "the file")
    return {}


def _target_hf_dir(files: Mapping[str, bytes | str], flat: Mapping[str, torch.Tensor],
                   ) -> dict[str, Any]:
    """load_initial of a Hugging Face directory (index + shards, which may be mutated or odd
    files). Oracle: what the index names, read strictly."""
    d = _write_tree(files)
    state = _targets_like(flat)
    _load_initial(d, state)
    # What the bytes say: the shards the index names, each read strictly; a name that is not a
    # regular file inside the directory makes the whole source invalid.
    try:
        index = json.loads(files["model.safetensors.index.json"])
    except (ValueError, RecursionError) as e:
        raise OracleError(f"load_initial returned although the index is not JSON: {e}"
                          ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in
                                                     weight_map.values()):
        raise OracleError("load_initial returned although the index has no valid weight_map: "
                          f"{_short(index)}")
    expected: dict[str, Any] = {}
    for name in sorted(set(weight_map.values())):
        path = os.path.join(d, name)
        if os.path.basename(name) != name or name in ("", ".", "..") or not os.path.isfile(
                path) or stat.S_ISFIFO(os.stat(path).st_mode):
            raise OracleError(f"load_initial returned although the index names {name!r}, not "
                              "a regular file in the directory")
        with open(path, "rb") as f:
            try:
                tensors = ref_safetensors(f.read())
            except (ValueError, UnicodeDecodeError) as e:
                raise OracleError(f"load_initial returned although shard {name!r} is not "
                                  f"safetensors: {e}") from None
        for k, v in tensors.items():
            expected[k] = v if k not in expected else "named by two shards"
    _check_loaded(state, expected, "the shards the index names")
    return {}


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)


def _target_torch_file(data: bytes, name: str, flat: Mapping[str, torch.Tensor],
                       ) -> dict[str, Any]:
    """load_initial of a torch.save file. Oracle: torch.load(weights_only=True) of the same
    bytes, fully in memory, is what the bytes say; when it fails, the load must fail too."""
    d = _write_tree({name: data})
    state = _nested_like(flat)
    _load_initial(os.path.join(d, name), state)
    try:
        ref = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise OracleError(f"load_initial returned although torch.load(weights_only=True) "
                          f"fails on the bytes: {type(e).__name__}: {str(e)[:300]}") from None
    expected: dict[str, Any] = {}
    _flatten(ref, "", expected)
    got: dict[str, Any] = {}
    _flatten(state, "", got)
    _check_loaded(got, expected, "torch.load's reading of the file")
    return {}


def _nested_like(flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    t = _targets_like(flat)
    return {"w": t["w"], "sub": {"b": t["b"], "i": t["i"]}, "h": t["h"]}


# ------------------------------------------------------------------------------------ lease


def _target_lease(lease: bytes | str, expect: str | None) -> dict[str, Any]:
    """Open a writer on a root whose lease file holds ``lease`` (or is a FIFO: "fifo").
    ``expect``: "live" (LeaseError is the only right answer), "dead" (the lease must be taken
    over), or None (either). After a take-over the lease file must name this process."""
    import ckptmgr
    from ckptmgr.errors import LeaseError

    root = os.path.join(tempfile.mkdtemp(), "root")
    os.makedirs(root)
    _write_tree_into(root, {".ckptmgr-lease.json": lease})
    try:
        mgr = ckptmgr.CheckpointManager(root, 1)
    except LeaseError:
        if expect == "dead":
            raise OracleError("the lease names a holder that cannot be alive, yet the "
                              "constructor raised LeaseError (it must take the lease over)"
                              ) from None
        raise
    try:
        if expect == "live":
            raise OracleError("the constructor took the lease of a live holder")
        with open(os.path.join(root, ".ckptmgr-lease.json"), "rb") as f:
            doc = json.loads(f.read())
        if not (isinstance(doc, dict) and doc.get("host") == socket.gethostname()
                and doc.get("pid") == os.getpid() and isinstance(doc.get("expires"), (int, float))
                and doc["expires"] > time.time()):
            raise OracleError(f"after taking the lease over, the file holds {_short(doc)}")
    finally:
        mgr.close()
    return {}


def _write_tree_into(d: str, files: Mapping[str, bytes | str]) -> None:
    for name, data in files.items():
        path = os.path.join(d, name)
        if data == "fifo":
            _mkfifo_safe(path)
        else:
            assert isinstance(data, bytes)
            with open(path, "wb") as f:
                f.write(data)


def pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except OSError:
        return 4194304


# ----------------------------------------------------------------------------------- config


def _target_config(text: bytes) -> dict[str, Any]:
    """load_config of a YAML file (what CheckpointManager.from_config reads before it builds the
    manager), then the keyword arguments it would pass and its repr."""
    from ckptmgr.config import load_config

    d = tempfile.mkdtemp()
    path = os.path.join(d, "config.yaml")
    with open(path, "wb") as f:
        f.write(text)
    cfg = load_config(path)
    kwargs = cfg.to_kwargs()
    r = repr(cfg)
    if len(r) > 1 << 20:
        raise OracleError(f"repr of the config is {len(r)} characters")
    return {"keys": sorted(kwargs)}


def resolve_target(name: str) -> Callable[..., Any]:
    """``TARGETS[name]``, or ``module:function`` for a target kept beside its test (imported in
    the child: tests/ is on its path, so a module in a folder is named ``folder.module``)."""
    if ":" in name:
        import importlib

        module, func = name.split(":", 1)
        fn: Callable[..., Any] = getattr(importlib.import_module(module), func)
        return fn
    return TARGETS[name]


TARGETS: dict[str, Callable[..., Any]] = {
    "make_templates": _target_make_templates,
    "restore": _target_restore,
    "crafted_chunks": _target_crafted_chunks,
    "value_roundtrip": _target_value_roundtrip,
    "value_bytes": _target_value_bytes,
    "safetensors_file": _target_safetensors_file,
    "hf_dir": _target_hf_dir,
    "torch_file": _target_torch_file,
    "lease": _target_lease,
    "config": _target_config,
}


# ---------------------------------------------------------------------------------------------
# Zip archives (torch.save): mutate one member and re-zip with valid CRCs


def zip_members(data: bytes) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i, z.read(i)) for i in z.infolist()]


def rezip(members: Sequence[tuple[zipfile.ZipInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info, data in members:
            z.writestr(info.filename, data)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# atheris: coverage-guided, in-process, for long local runs (python tests/_fuzz.py <target>)


def _atheris_targets(t: Mapping[str, Any]) -> dict[str, tuple[Callable[[bytes], Any],
                                                                 list[bytes]]]:
    """name -> (the target of one input, its seeds): the pytest fuzzers' targets and oracles, run
    in process on the templates ``t``."""
    return {
        "manifest": (lambda b: _target_restore(t["root_v2"], 1, {"commit.json": b}),
                     [t["manifest"], t["manifest_other"]]),
        "metadata": (lambda b: _target_restore(t["root_v2"], 1, {t["metadata_name"]: b}),
                     [t["metadata_v2"], t["metadata_v1"]]),
        "values": (lambda b: _target_value_bytes(t["root_v2"], 1, t["metadata_name"], "extra.t",
                                                 b),
                   [b'{"__tuple__":[1,2.5,null]}', b'{"__dict__":[[3,"x"]]}', b"[1,{}]"]),
        "safetensors": (lambda b: _target_safetensors_file(b, t["flat"]),
                        [t["safetensors"], *t["hf_shards"].values()]),
        "hf-index": (lambda b: _target_hf_dir({**t["hf_shards"],
                                               "model.safetensors.index.json": b}, t["flat"]),
                     [t["hf_index"]]),
        "torch": (lambda b: _target_torch_file(b, "model.pt", t["flat"]),
                  [t["torch_zip"], t["torch_legacy"]]),
        "lease": (lambda b: _target_lease(b, None), [t["lease"]]),
        "config": (_target_config, list(t["configs"].values())),
    }


def _atheris_main(argv: list[str]) -> int:
    """Coverage-guided fuzzing of one target in process (libFuzzer's ``-rss_limit_mb`` and
    ``-timeout`` are the bounds); a corpus directory is seeded with the templates when empty."""
    try:
        import atheris  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        print("atheris is not installed (pip install atheris); the pytest fuzzers run without "
              "it: CKPTMGR_FUZZ_EXAMPLES=10000 pytest tests/adversary/test_fuzz_*.py",
              file=sys.stderr)
        return 2
    names = ("manifest", "metadata", "values", "safetensors", "hf-index", "torch", "lease",
             "config")
    if len(argv) < 2 or argv[1] not in names:
        print(f"usage: python tests/_fuzz.py {{{','.join(names)}}} [CORPUS_DIR] "
              "[libFuzzer options]", file=sys.stderr)
        return 2
    name = argv.pop(1)
    with atheris.instrument_imports(include=["ckptmgr"]):
        pass
    from ckptmgr.errors import CkptmgrError

    t = _target_make_templates(tempfile.mkdtemp(prefix="ckptmgr-fuzz-templates-"))
    fn, seeds = _atheris_targets(t)[name]
    corpus = next((a for a in argv[1:] if not a.startswith("-")), None)
    if corpus is not None and not os.listdir(corpus):
        for i, seed in enumerate(seeds):
            with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
                f.write(seed)

    def one(data: bytes) -> None:
        with contextlib.suppress(CkptmgrError), case_tempdir():
            fn(data)

    atheris.Setup(argv, one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    raise SystemExit(_atheris_main(sys.argv))


__all__ = [
    "EXTREME_INT64", "EXTREME_INTS", "MEMORY_BOUND", "TIME_BOUND_S", "FuzzFailure", "Mutated",
    "Outcome", "Sandbox", "byte_mutations", "check", "dump_json", "framed_mutations",
    "fuzz_settings", "sandbox_fixture", "templates_fixture", "join_safetensors", "join_v2",
    "json_file_mutations", "json_mutations", "json_paths", "pid_max", "re", "ref_decode_value",
    "ref_safetensors", "rezip", "saved_state", "split_safetensors", "split_v2", "zip_members",
]
