"""Fuzzing the command line on a root with one bad step: ``ls``, ``verify --all``, ``inspect``.

A root holds three committed steps (1, 2, 3: copies of the fuzz template's step); step 2's
manifest is mutated (tests/_fuzz.py's JSON mutations: extreme numbers, type swaps, removed nodes,
odd strings with terminal escapes) or crafted (a file entry naming ``../../etc/passwd``, metric
names, metadata and file names holding escape sequences, carriage returns, direction overrides).
The commands run in-process (``ckptmgr.cli.main``, as tests/cli/test_cli.py runs them) in the fuzz
sandbox. Property (docs/cli.md):

- ``ls`` exits 0 and lists steps 1 and 3 as committed (the bad step is listed as ``unreadable``
  or however it parses: not our concern here);
- ``verify --all`` exits 0 or 3 (3 when a step is reported damaged; never 1 because one step is
  bad), and reports steps 1 and 3 ``ok``;
- ``inspect ROOT 2`` exits 0, 1 or 3, ``inspect ROOT 1`` exits 0;
- no control character from storage reaches stdout or stderr unescaped: C0 controls other than
  newline and tab, DEL, C1 controls, and the Unicode direction overrides and isolates.

Trust I defect 14: a manifest listing ``../../etc/passwd`` made ``ls`` and ``verify --all`` exit 1,
and metric names' escape sequences reached the terminal raw in ``inspect``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    OracleError,
    Outcome,
    Sandbox,
    check,
    fuzz_settings,
    json_file_mutations,
    sandbox_fixture,
    templates_fixture,
)
from hypothesis import given
from hypothesis import strategies as st

_RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u202a-\u202e\u2066-\u2069]")
"""Characters that must never reach a terminal unescaped (newline and tab are the CLI's own)."""
_ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"


def _raw_controls(text: str) -> list[str]:
    return sorted({repr(m.group()) for m in _RAW.finditer(text)})


def target_make_root(template_root: str, where: str) -> str:
    """(in the child) A root with steps 1, 2 and 3, copies of the template's step 1."""
    root = os.path.join(where, "cli-root")
    shutil.copytree(template_root, root)
    for step in (2, 3):
        d = os.path.join(root, str(step))
        shutil.copytree(os.path.join(root, "1"), d)
        path = os.path.join(d, "commit.json")
        with open(path) as f:
            man = json.load(f)
        man["step"] = step
        with open(path, "w") as f:
            json.dump(man, f, indent=1)
    return root


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def _cli(*argv: str) -> tuple[int, str, str]:
    from ckptmgr import cli

    with _captured() as (out, err):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = int(e.code or 0) if not isinstance(e.code, str) else 1
    return code, out.getvalue(), err.getvalue()


def target_cli(root: str, manifest: bytes) -> dict[str, Any]:
    """(in the child) Run ``ls``, ``verify --all`` and ``inspect`` on a copy of ``root`` whose
    step 2 has ``manifest`` as its commit.json. Oracle: the module docstring."""
    copy = os.path.join(tempfile.mkdtemp(), "root")
    shutil.copytree(root, copy)
    with open(os.path.join(copy, "2", "commit.json"), "wb") as f:
        f.write(manifest)
    problems: list[str] = []
    runs = {}
    for argv in (("ls", copy), ("verify", copy, "--all"), ("inspect", copy, "2"),
                 ("inspect", copy, "1"), ("ls", copy, "--json")):
        code, out, err = _cli(*argv)
        name = " ".join(a if a != copy else "ROOT" for a in argv)
        runs[name] = code
        for stream, text in (("stdout", out), ("stderr", err)):
            raw = _raw_controls(text)
            if raw:
                problems.append(f"{name}: {stream} holds raw control characters {raw}: "
                                f"{text[:600]!r}")
        rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s*(\d+)\s+(\S+)", out, re.M)}
        if argv[0] == "ls" and "--json" not in argv:
            if code != 0:
                problems.append(f"{name}: exit {code}, not 0: {err.strip()[-500:]!r}")
            for step in (1, 3):
                if rows.get(step) != "committed":
                    problems.append(f"{name}: step {step} is not listed as committed: {out!r}")
        elif argv[0] == "ls":
            try:
                listed = {e["step"]: e["status"] for e in json.loads(out)}
            except (ValueError, TypeError, KeyError) as e:
                problems.append(f"{name}: stdout is not the documented JSON ({e}): {out[:300]!r}")
                listed = {}
            if code != 0 or listed.get(1) != "committed" or listed.get(3) != "committed":
                problems.append(f"{name}: exit {code}, steps {listed}")
        elif argv[0] == "verify":
            oks = set(int(s) for s in re.findall(r"^step (\d+): ok", out, re.M))
            if code not in (0, 3):
                problems.append(f"{name}: exit {code}, not 0 or 3: {err.strip()[-500:]!r}")
            if not {1, 3} <= oks:
                problems.append(f"{name}: steps 1 and 3 not both ok: {out[:600]!r}")
            if code == 0 and re.search(r"^step \d+: (?!ok)", out, re.M):
                problems.append(f"{name}: a step reported not ok, but exit 0: {out[:600]!r}")
        elif argv[2] == "1" and code != 0:
            problems.append(f"{name}: exit {code}: {err.strip()[-500:]!r}")
        elif code not in (0, 1, 3):
            problems.append(f"{name}: exit {code}, not 0, 1 or 3: {err.strip()[-500:]!r}")
    if problems:
        raise OracleError("\n".join(problems))
    return runs


_TARGET = "adversary.test_fuzz_cli:target_cli"


@pytest.fixture(scope="module")
def cli_root(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
             tmp_path_factory: pytest.TempPathFactory) -> str:
    """The three-step root every case copies (made once, in a child)."""
    out = fuzz_sandbox.run("adversary.test_fuzz_cli:target_make_root",
                           template_root=fuzz_templates["root_v2"],
                           where=str(tmp_path_factory.mktemp("fuzz-cli")))
    if out.kind != "ok":
        raise RuntimeError("making the CLI root failed:\n" + out.describe())
    root: str = out.info
    return root


def _step2(t: dict[str, Any]) -> dict[str, Any]:
    man: dict[str, Any] = json.loads(t["manifest"])
    man["step"] = 2
    return man


def _check(out: Outcome, what: str, manifest: bytes, ops: list[str]) -> None:
    raw = _raw_controls(out.stderr)
    if raw:  # anything the CLI wrote past the in-process capture (a handler bound earlier)
        out = Outcome("wrong", message=f"the process's stderr holds raw control characters "
                      f"{raw}: {out.stderr[:600]!r}")
    check(out, what, data=manifest, ops=ops)


def _crafted(t: dict[str, Any]) -> list[tuple[str, bytes]]:
    cases = []
    man = _step2(t)
    man["files"].append({"path": "../../etc/passwd", "size": 10, "checksum": "xxh3_64:0"})
    cases.append(("a file entry naming ../../etc/passwd", man))
    man = _step2(t)
    man["files"][0]["path"] = "../../etc/passwd"
    cases.append(("the data file named ../../etc/passwd", man))
    man = _step2(t)
    man["metadata_file"] = "/etc/passwd"
    cases.append(("the metadata file named /etc/passwd", man))
    man = _step2(t)
    man["metrics"] = {f"loss{_ESC}": 0.5, "acc\r\u202e": 1.0}
    cases.append(("metric names with escape sequences", man))
    man = _step2(t)
    man["metadata"] = {f"note{_ESC}": f"x{_ESC}\u2066", "n": "\x00\x9b"}
    cases.append(("metadata with escape sequences", man))
    man = _step2(t)
    man["files"][0]["path"] = f"data{_ESC}.bin"
    cases.append(("a file name with escape sequences", man))
    man = _step2(t)
    man["versions"] = {"ckptmgr": f"9{_ESC}", "torch": "\r\u202e"}
    man["time"] = f"2026{_ESC}"
    cases.append(("versions and time with escape sequences", man))
    return [(what, json.dumps(m, indent=1).encode()) for what, m in cases]


_CASES = ("a file entry naming ../../etc/passwd", "the data file named ../../etc/passwd",
          "the metadata file named /etc/passwd", "metric names with escape sequences",
          "metadata with escape sequences", "a file name with escape sequences",
          "versions and time with escape sequences")


@pytest.mark.parametrize("case", _CASES)
def test_crafted_manifests(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any], cli_root: str,
                           case: str) -> None:
    """Trust I defect 14's cases and their relatives."""
    manifest = dict(_crafted(fuzz_templates))[case]
    out = fuzz_sandbox.run(_TARGET, root=cli_root, manifest=manifest)
    _check(out, "cli-crafted", manifest, [case])


@fuzz_settings(15)
@given(data=st.data())
def test_mutated_manifest(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any], cli_root: str,
                          data: st.DataObject) -> None:
    """Mutations of step 2's manifest (byte level and on the JSON inside)."""
    valid = json.dumps(_step2(fuzz_templates), indent=1).encode()
    m = data.draw(json_file_mutations([valid]), label="mutation")
    out = fuzz_sandbox.run(_TARGET, root=cli_root, manifest=m.data)
    _check(out, "cli-mutated", m.data, list(m.ops))
