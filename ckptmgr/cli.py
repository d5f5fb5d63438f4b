"""The ``ckptmgr`` command line: ls, inspect, verify, prune, export, cp and import.

Each command is a thin layer over :mod:`ckptmgr.tools`. Conventions (docs/cli.md):
- the root is checked first, by one helper for every command (:func:`_check_root`): a missing
  path, a file, a step directory given as a root or a bucket without credentials is one error
  naming the fix, before torch is imported;
- the command's result goes to stdout: a table, or with ``--json`` one JSON document;
- logs, notes and the progress bar go to stderr; the bar (bytes, rate, ETA) is drawn only when
  stderr is a terminal (``--progress``/``--no-progress`` override);
- an error is one line on stderr (``ckptmgr: error: ...``; the traceback only with ``--debug``)
  and exit status 1; a usage error exits 2; ``verify`` exits 3 when it finds damage, naming the
  corrupt files;
- credentials in URLs (``user:pass@``, secret query values) and secret storage options never
  appear in any output;
- control characters never reach the terminal: names, metrics, metadata, file names and error
  messages come from storage, so every line printed goes through :func:`printable` (``--json``
  escapes them as JSON does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TextIO

from ckptmgr import tools
from ckptmgr._redact import redact, redact_url, register_options, register_url
from ckptmgr._version import __version__
from ckptmgr.codec.layout import (
    MANIFEST_NAME,
    SHARED_DIR,
    is_shared_chunk_name,
    is_shared_chunk_path,
    parse_staging_name,
    parse_step_name,
)
from ckptmgr.errors import CheckpointNotFoundError, CkptmgrError, ConfigError, StorageError
from ckptmgr.step_store import DCP_METADATA_NAME, is_our_file_name
from ckptmgr.storage import lacks_credentials, open_storage, split_scheme

__all__ = ["EXIT_CORRUPT", "EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "main", "printable"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3

_SHOWN_CHUNKS = 10  # shared chunks ``inspect`` lists by name (--json lists every one)


# C0 and C1 control characters (ESC starts terminal escape sequences; CR and BS overwrite what
# is on the line) and the Unicode direction overrides, which reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character written as its Python escape (``\\x1b``,
    ``\\n``, ``\\u202e``): a metric name, metadata or file name read from storage can hold
    terminal escape sequences, and the CLI prints them without letting them act."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def _human(n: float) -> str:
    return tools.format_bytes(n)  # from ckptmgr.tools.listing, which never imports torch


def _duration(s: float) -> str:
    s = max(0, int(s + 0.5))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class _Bar:
    """A one-line progress bar on a terminal: bytes done/total, rate, ETA (redrawn <= 10/s)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.total = 0
        self.done = 0
        self.label = ""
        self.t0 = 0.0
        self.drawn = 0.0
        self.active = False
        self.width = 0  # columns of the bar now on screen (0: none)

    def start(self, total: int, label: str) -> None:
        self.total, self.done, self.label = total, 0, label
        self.t0 = self.drawn = time.monotonic()
        self.active = total > 0
        if self.active:
            self._draw()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.active and now - self.drawn >= 0.1:
            self.drawn = now
            self._draw()

    def finish(self) -> None:
        if self.active:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        self.active = False
        self.width = 0

    def clear(self) -> None:
        """Blank the bar's line (before another line is printed on the terminal)."""
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0

    def redraw(self) -> None:
        if self.active:
            self._draw()

    def _draw(self) -> None:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        rate = self.done / elapsed
        eta = _duration((self.total - self.done) / rate) if rate > 0 else "--:--"
        tail = (f" {frac * 100:3.0f}% {_human(self.done)}/{_human(self.total)} "
                f"{_human(rate)}/s ETA {eta}")
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            width = 0
        if width < 40:  # unknown (0 on a fresh pty) or too narrow to be useful
            width = max(shutil.get_terminal_size((80, 24)).columns, 80)
        bar_w = max(10, min(40, width - len(self.label) - len(tail) - 4))
        filled = int(bar_w * frac)
        line = f"{self.label} [{'#' * filled}{'.' * (bar_w - filled)}]{tail}"
        self.width = max(width - 1, 20)
        self.stream.write("\r" + line[:self.width].ljust(self.width))
        self.stream.flush()


class _Out:
    """Where a command writes: results to stdout, notes to stderr, all of it redacted."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(args.json)
        self.stdout = sys.stdout
        self.stderr = sys.stderr
        show = args.progress if args.progress is not None else _isatty(self.stderr)
        self.progress: tools.Progress | None = _Bar(self.stderr) if show else None

    def _write(self, stream: TextIO, text: str) -> None:
        # A progress bar on the terminal is cleared first and drawn again below the line, so a
        # line never lands on top of it.
        bar = self.progress if isinstance(self.progress, _Bar) else None
        if bar is not None:
            bar.clear()
        stream.write(text)
        if bar is not None and bar.active:
            stream.flush()
            bar.redraw()

    def line(self, text: str = "") -> None:
        self._write(self.stdout, printable(redact(text)) + "\n")

    def note(self, text: str) -> None:
        self._write(self.stderr, printable(redact(f"ckptmgr: {text}")) + "\n")

    def say(self, text: str) -> None:
        """A running account of what a command does: stdout in text mode, stderr with --json."""
        if self.json:
            self.note(text)
        else:
            self.line(text)

    def document(self, doc: Any) -> None:
        # Strict JSON: a NaN or infinite metric becomes the string "nan", "inf" or "-inf".
        self.stdout.write(redact(json.dumps(_finite(doc), indent=2, allow_nan=False)) + "\n")


def _finite(doc: Any) -> Any:
    if isinstance(doc, float) and not math.isfinite(doc):
        return "nan" if math.isnan(doc) else ("inf" if doc > 0 else "-inf")
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    return doc


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _table(rows: list[list[str]], right: Sequence[int] = ()) -> list[str]:
    rows = [[printable(c) for c in r] for r in rows]  # escaped first, so the columns line up
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def _metrics(m: dict[str, float] | Any) -> str:
    return ", ".join(f"{k}={v:.6g}" for k, v in sorted(dict(m).items())) or "-"


def _time(iso: str | None) -> str:
    if not iso:
        return "-"
    return iso.split(".")[0].replace("T", " ") + "Z" if "." in iso else iso



# ------------------------------------------------------------------------------ the root check


def _parent(url: str) -> str:
    """The URL one level up, as the user spelled it (``root/90`` -> ``root``, ``90`` -> ``.``)."""
    head, sep, _ = url.rstrip("/").rpartition("/")
    if not sep:
        return "."
    return head or "/"


def _credentials_error(e: StorageError, url: str, shown: str, flag: str) -> StorageError | None:
    """A StorageError naming the fix when ``e`` failed for want of credentials, else None."""
    if not lacks_credentials(e):
        return None
    if split_scheme(url)[0] in ("s3", "s3a"):
        return StorageError(
            f"no S3 credentials for {shown}: pass {flag} key=... {flag} secret=..., or set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials)")
    return StorageError(
        f"no credentials for {shown}: pass {flag} token=/path/to/key.json, or set "
        "GOOGLE_APPLICATION_CREDENTIALS (or run `gcloud auth application-default login`); other "
        f"stores: their credential options with {flag} KEY=VALUE")


def _check_root(args: argparse.Namespace, url: str, options: dict[str, Any] | None, *,
                must_exist: bool = True, flag: str = "-o") -> None:
    """Fail early, with the fix, when ``url`` cannot be the checkpoint root a command needs.

    One check for every command, before it reads anything (and before ``inspect``/``verify``/
    ``export`` import torch), so the same mistake gets the same message everywhere:
    - nothing there (``must_exist``): "... does not exist", not "no committed checkpoint";
    - a file: :func:`~ckptmgr.storage.open_storage` says so;
    - a step directory (it holds ``commit.json``, or is named like a step and holds files
      ckptmgr writes) or a staging directory: names the root above it and the command to run;
    - a bucket the client has no credentials for: how to pass them (``flag`` is the option
      that carries this URL's storage options: ``-o``, or ``--dst-option`` for a destination).

    Raises:
        CheckpointNotFoundError, ConfigError, StorageError, BackendNotInstalledError: exit 1.
    """
    shown = redact_url(url)
    try:
        storage = open_storage(url, options, writable=False)
        if not storage.exists(""):
            if must_exist:
                raise CheckpointNotFoundError(
                    f"{shown} does not exist: no checkpoint root there; check the path (a root "
                    "is the directory holding the step directories)", available=[])
            return
        files = storage.list_files("")
    except StorageError as e:
        better = _credentials_error(e, url, shown, flag)
        if better is None:
            raise
        raise better from e
    name = url.rstrip("/").rpartition("/")[2]
    if name == SHARED_DIR and any(is_shared_chunk_name(f) for f in files):
        root = redact_url(_parent(url))
        if args.command in ("cp", "import") and url != getattr(args, "src", None):
            cmd = f"ckptmgr {args.command} {redact_url(args.src)} {root}"
        else:
            cmd = f"ckptmgr {args.command} {root}" + ("" if args.command == "ls" else " ...")
        raise ConfigError(
            f"{shown} is the directory of shared chunks (reuse_unchanged=True) of the checkpoint "
            f"root {root}, not a checkpoint root: run `{cmd}`")
    step = parse_step_name(name)
    staged = parse_staging_name(name)
    ours = any(is_our_file_name(f) or f == DCP_METADATA_NAME for f in files)
    if MANIFEST_NAME not in files and not ((step is not None or staged is not None) and ours):
        return
    root = redact_url(_parent(url))
    cmd = f"ckptmgr {args.command} {root}"
    if args.command in ("inspect", "verify", "export") and (step is not None or staged is None):
        cmd += f" {step}" if step is not None else " STEP"
    if args.command == "export" or args.command == "prune":
        cmd += " ..."
    if args.command == "cp" and url == args.src:
        cmd += f" {redact_url(args.dst)}" + (f" --step {step}" if step is not None else "")
    elif args.command in ("cp", "import"):  # the destination: the source stays as given
        cmd = f"ckptmgr {args.command} {redact_url(args.src)} {root}"
    if staged is not None:
        what = f"the unfinished save of step {staged[0]} (a staging directory) in the root {root}"
    elif step is not None:
        what = f"step {step} of the checkpoint root {root}"
    else:
        what = f"a step directory (it holds {MANIFEST_NAME}) in the root {root}"
    raise ConfigError(f"{shown} is {what}, not a checkpoint root: run `{cmd}`")


# ------------------------------------------------------------------------------------ commands


def _cmd_ls(args: argparse.Namespace, out: _Out) -> int:
    _check_root(args, args.url, args.options)
    entries = tools.list_steps(args.url, storage_options=args.options, must_exist=True)
    if out.json:
        out.document([e.to_json() for e in entries])
        return EXIT_OK
    if not entries:
        out.note(f"no checkpoints in {redact_url(args.url)}")
        return EXIT_OK
    # Steps saved with reuse_unchanged reference shared chunks: a SHARED column, and what the
    # chunks take once, appear only then (a root without them prints as before).
    shared = any(e.shared_chunks for e in entries)
    rows = [["STEP", "STATUS", "TIME (UTC)", "SIZE", *(["SHARED"] if shared else []), "WORLD",
             "METRICS", "NOTE"]]
    for e in entries:
        note = e.error or ("" if e.name == str(e.step) else e.name)
        rows.append([str(e.step), e.status, _time(e.time), _human(e.total_bytes),
                     *([_human(e.shared_bytes) if e.shared_chunks else "-"] if shared else []),
                     "-" if e.world_size is None else str(e.world_size),
                     _metrics(e.metrics) if e.committed else "-", note])
    for row in _table(rows, right=(0, 3, 4, 5) if shared else (0, 3, 4)):
        out.line(row)
    if shared:
        use = tools.shared_usage(args.url, storage_options=args.options)
        referenced = sum(e.shared_bytes for e in entries)
        out.line(f"shared chunks: {use.chunks} in {SHARED_DIR}/, {_human(use.nbytes)} stored once "
                 f"({_human(referenced)} referenced by the steps above)")
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    _check_root(args, args.url, args.options)
    d = tools.inspect_step(args.url, args.step, storage_options=args.options)
    if out.json:
        out.document(d.to_json())
        return EXIT_OK
    i = d.info
    out.line(f"step {i.step} in {d.url}")
    per_rank = ", ".join(f"{r}: {_human(b)}" for r, b in sorted(i.bytes_per_rank.items()))
    for k, v in [("committed", i.time), ("world size", f"{i.world_size} (bytes per rank: "
                                                         f"{per_rank})"),
                 ("versions", ", ".join(f"{k} {v}" for k, v in i.versions.items())),
                 ("metrics", _metrics(i.metrics)),
                 ("metadata", json.dumps(dict(i.metadata)) if i.metadata else "-"),
                 ("attempt", d.attempt)]:
        out.line(f"  {k:<11} {v}")
    if i.mesh is not None:
        out.line(f"  {'mesh':<11} {json.dumps(i.mesh)}")
    out.line(f"files ({len(i.files)}, {_human(i.total_bytes)}):")
    for row in _table([[f.path, _human(f.size), f.checksum] for f in i.files], right=(1,)):
        out.line("  " + row)
    if d.shared:  # a step saved with reuse_unchanged: bytes it shares with other steps
        out.line(f"shared chunks ({len(d.shared)}, {_human(d.shared_bytes)}, under the root's "
                 f"{SHARED_DIR}/):")
        shown = d.shared[:_SHOWN_CHUNKS]
        for row in _table([[f.path, _human(f.size), f.checksum] for f in shown], right=(1,)):
            out.line("  " + row)
        if len(d.shared) > len(shown):
            out.line(f"  ... and {len(d.shared) - len(shown)} more (--json lists every one)")
    tbytes = sum(t.nbytes for t in d.tensors)
    out.line(f"tensors ({len(d.tensors)}, {_human(tbytes)}):")
    if d.tensors:
        extra = ["SHARED"] if d.shared else []
        rows = [["NAME", "DTYPE", "SHAPE", "BYTES", *extra, "SHARDING"]]
        rows += [[t.name, t.dtype, str(list(t.shape)), _human(t.nbytes),
                  *([_human(t.shared_bytes)] if extra else []), t.sharding]
                 for t in d.tensors]
        for row in _table(rows, right=(3, 4) if extra else (3,)):
            out.line("  " + row)
    out.line(f"values ({len(d.values)}):")
    if d.values:
        rows = [["NAME", "ENCODING", "BYTES"]]
        rows += [[v.name, v.encoding, _human(v.nbytes)] for v in d.values]
        for row in _table(rows, right=(2,)):
            out.line("  " + row)
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace, out: _Out) -> int:
    if args.all and args.steps:
        raise _UsageError("give steps or --all, not both")
    _check_root(args, args.url, args.options)
    results = tools.verify_steps(args.url, args.steps or None, all_steps=args.all,
                                 storage_options=args.options, progress=out.progress)
    if out.json:
        out.document({"url": redact_url(args.url), "ok": all(r.ok for r in results),
                      "steps": [r.to_json() for r in results]})
    else:
        if not results:
            out.note(f"no committed steps to verify in {redact_url(args.url)}")
        for r in results:
            shared = ""
            if r.shared_chunks:
                shared = (f"; {r.shared_chunks} shared chunks, {_human(r.shared_bytes)}"
                          + (f", {r.shared_checked_before} of them checked above"
                             if r.shared_checked_before else ""))
            if r.ok:
                out.line(f"step {r.step}: ok ({r.files_checked} files, "
                         f"{_human(r.bytes_checked)} read{shared})")
            else:
                out.line(f"step {r.step}: CORRUPT")
                for p in r.problems:
                    out.line(f"  {p.path}: {p.reason}")
    # A shared chunk is the root's, not one step's: named once, with the steps that need it.
    bad = [f"{r.step}/{f}" for r in results for f in r.corrupt_files
           if not is_shared_chunk_path(f)]
    users: dict[str, list[int]] = {}
    for r in results:
        for f in r.corrupt_files:
            if is_shared_chunk_path(f):
                users.setdefault(f, []).append(r.step)
    bad += [f"{f} (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"
            for f, steps in sorted(users.items())]
    if bad:
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        out.note(f"error: corrupt files in {redact_url(args.url)}: {shown}")
        return EXIT_CORRUPT
    return EXIT_OK


def _cmd_prune(args: argparse.Namespace, out: _Out) -> int:
    if args.keep_last is None and not args.incomplete:
        raise _UsageError("nothing to prune: give --keep-last K and/or --incomplete")
    if args.keep_last is None and (args.keep_every is not None or args.keep_best is not None):
        raise _UsageError("--keep-every and --keep-best refine --keep-last; give --keep-last")
    if (args.keep_best is None) != (args.best_metric is None):
        raise _UsageError("--keep-best and --best-metric go together")
    _check_root(args, args.url, args.options)
    r = tools.prune_steps(args.url, keep_last=args.keep_last, keep_every=args.keep_every,
                          keep_best=args.keep_best, best_metric=args.best_metric,
                          best_mode=args.best_mode, incomplete=args.incomplete,
                          dry_run=args.dry_run, storage_options=args.options, log=out.say)
    if out.json:
        out.document(r.to_json())
    else:
        kept = ", ".join(map(str, r.kept)) or "none"
        out.line(f"kept steps: {kept}" + (" (dry run: nothing was deleted)" if r.dry_run else ""))
    if r.failed:
        for f in r.failed:
            out.note(f"could not delete {f}")
        out.note(f"error: {len(r.failed)} deletions failed")
        return EXIT_ERROR
    return EXIT_OK


def _cmd_export(args: argparse.Namespace, out: _Out) -> int:
    # ``export URL STEP OUT`` or ``export URL --step N OUT`` (or ``export URL OUT``: the newest).
    pos = list(args.where)
    if len(pos) > (1 if args.step_opt is not None else 2):
        args.parser.error(f"too many positional arguments: {pos}")
    step = args.step_opt
    if len(pos) == 2:
        try:
            step = _step(pos.pop(0))
        except argparse.ArgumentTypeError as e:
            args.parser.error(str(e))
    _check_root(args, args.url, args.options)
    if args.format == "hf":
        h = tools.export_hf(args.url, step, pos[0], max_shard_size=args.max_shard_size,
                            prefix=args.only, dtype=args.dtype, storage_options=args.options,
                            progress=out.progress)
        if args.only is None:  # say which tensors the default took (issue 31)
            if h.prefix is None:
                out.note(f"no top-level 'model' entry beside training state only in step "
                         f"{h.step}: exported every tensor (--only PREFIX picks one entry)")
            else:
                out.note(f"exported the '{h.prefix}' entry, named without '{h.prefix}.' "
                         f"(left out: {', '.join(h.left_out) or 'nothing'}; --only PREFIX "
                         "picks another entry)")
        if out.json:
            out.document(h.to_json())
        else:
            out.line(f"wrote {h.index}: step {h.step}, {h.num_tensors} tensors in "
                     f"{len(h.shards)} shards, {_human(h.nbytes)} (hf)")
        return EXIT_OK
    r = tools.export_step(args.url, step, pos[0], only=args.only, dtype=args.dtype,
                          format=args.format, storage_options=args.options,
                          progress=out.progress)
    if r.skipped:
        shown = ", ".join(r.skipped[:10]) + (", ..." if len(r.skipped) > 10 else "")
        out.note(f"left out {len(r.skipped)} Python values (weights only): {shown}")
    if out.json:
        out.document(r.to_json())
    else:
        out.line(f"wrote {r.path}: step {r.step}, {r.num_tensors} tensors, {_human(r.nbytes)} "
                 f"({r.format})")
    return EXIT_OK


def _cmd_cp(args: argparse.Namespace, out: _Out) -> int:
    _check_root(args, args.src, args.options)
    _check_root(args, args.dst, args.dst_options, must_exist=False, flag="--dst-option")
    results = tools.copy_steps(args.src, args.dst, args.steps or None, src_options=args.options,
                               dst_options=args.dst_options, progress=out.progress,
                               log=out.say)
    if out.json:
        out.document([r.to_json() for r in results])
    else:
        copied = [r for r in results if r.status == "copied"]
        out.line(f"copied {len(copied)} steps ({_human(sum(r.nbytes for r in copied))}), "
                 f"skipped {len(results) - len(copied)}")
    return EXIT_OK


def _cmd_import(args: argparse.Namespace, out: _Out) -> int:
    _check_root(args, args.dst, args.dst_options, must_exist=False, flag="--dst-option")
    info = tools.import_dcp(args.src, args.dst, args.step, trusted=args.trusted,
                            storage_options=args.dst_options, progress=out.progress)
    if out.json:
        out.document({"step": info.step, "time": info.time, "world_size": info.world_size,
                      "total_bytes": info.total_bytes, "metadata": dict(info.metadata),
                      "files": [{"path": f.path, "size": f.size, "checksum": f.checksum}
                                for f in info.files]})
    else:
        out.line(f"imported {args.src} as step {info.step} of {redact_url(args.dst)} "
                 f"({_human(info.total_bytes)}, committed {info.time})")
    return EXIT_OK


# -------------------------------------------------------------------------------------- parser


class _UsageError(Exception):
    """A combination of arguments argparse cannot check by itself (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, printable(redact(f"{self.prog}: error: {message}")) + "\n")


def _step(text: str) -> int | None:
    if text == "latest":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a step is an int >= 0 or 'latest', got {text!r}")
    return int(text)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        return value

    return parse


def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {key!r}...")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def _common(suppress: bool) -> _Parser:
    """Options every command takes, before or after its name."""
    d: Any = argparse.SUPPRESS if suppress else None
    p = _Parser(add_help=False)
    p.add_argument("--json", action="store_true", default=d if suppress else False,
                   help="print one JSON document on stdout")
    p.add_argument("--debug", action="store_true", default=d if suppress else False,
                   help="show tracebacks and debug logs on stderr")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_const", const=True, default=d,
                   help="draw the progress bar even when stderr is not a terminal")
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                   default=d, help="never draw the progress bar")
    p.add_argument("-o", "--storage-option", dest="options", metavar="KEY=VALUE",
                   type=_option, action="append", default=d if suppress else [],
                   help="fsspec option for the root (SRC for cp); VALUE is JSON or a string")
    return p


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="ckptmgr", parents=[_common(False)],
        description="Inspect and manage ckptmgr checkpoint roots (local paths, file://, gs://, "
                    "s3://, any fsspec URL).",
        epilog="Exit status: 0 ok, 1 error, 2 usage error, 3 verify found corrupt files.")
    parser.add_argument("--version", action="version", version=f"ckptmgr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    common = [_common(True)]

    p = sub.add_parser("ls", parents=common, help="list steps, incomplete leftovers marked",
                       description="List committed steps (time, size, world size, metrics) and "
                                   "leftovers of saves that never committed.")
    p.add_argument("url", metavar="URL")
    p.set_defaults(func=_cmd_ls, parser=p)

    p = sub.add_parser("inspect", parents=common, help="show a step's manifest and tensors",
                       description="Show the manifest of a committed step and its tensors "
                                   "(name, dtype, shape, bytes, sharding) and Python values.")
    p.add_argument("url", metavar="URL")
    p.add_argument("step", metavar="STEP", type=_step, nargs="?", default=None,
                   help="a step number or 'latest' (default)")
    p.set_defaults(func=_cmd_inspect, parser=p)

    p = sub.add_parser("verify", parents=common, help="re-read files, check sizes and checksums",
                       description="Re-read every file of the steps and check sizes, whole-file "
                                   "and per-item checksums. Exit 3 naming the corrupt files.")
    p.add_argument("url", metavar="URL")
    p.add_argument("steps", metavar="STEP", type=_step, nargs="*",
                   help="steps to verify (default: the newest)")
    p.add_argument("--all", action="store_true", help="verify every committed step")
    p.set_defaults(func=_cmd_verify, parser=p)

    p = sub.add_parser("prune", parents=common, help="delete steps by retention policy",
                       description="Delete the committed steps the library's retention policy "
                                   "does not keep (never the newest), and with --incomplete the "
                                   "leftovers of saves that never committed.")
    p.add_argument("url", metavar="URL")
    p.add_argument("--keep-last", type=_int_at_least(0), metavar="K",
                   help="keep the K newest steps (0 keeps every step)")
    p.add_argument("--keep-every", type=_int_at_least(1), metavar="N",
                   help="also keep every step divisible by N")
    p.add_argument("--keep-best", type=_int_at_least(1), metavar="K",
                   help="also keep the K best steps by --best-metric")
    p.add_argument("--best-metric", metavar="NAME", help="metric for --keep-best")
    p.add_argument("--best-mode", choices=("min", "max"), default="min",
                   help="min (default): lower is better; max: higher is better")
    p.add_argument("--incomplete", action="store_true",
                   help="also remove uncommitted leftovers (not while a job saves here)")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.set_defaults(func=_cmd_prune, parser=p)

    p = sub.add_parser("export", parents=common, help="write a consolidated weights-only file",
                       description="Write a committed step's tensors into one consolidated "
                                   ".safetensors or .pt file (weights only, shards assembled), "
                                   "streaming tensor by tensor.")
    p.add_argument("url", metavar="URL")
    p.add_argument("where", metavar="[STEP] OUT", nargs="+",
                   help="a step number or 'latest' (or --step), then the output: a path ending "
                        "in .safetensors, .pt or .pth, or a directory with --format hf")
    p.add_argument("--step", dest="step_opt", metavar="N", type=_step,
                   help="the step (instead of the positional STEP)")
    p.add_argument("--only", "--prefix", metavar="PREFIX",
                   help="only keys under this prefix, named without it (e.g. model or model.)")
    p.add_argument("--dtype", metavar="DTYPE", help="cast floating tensors: bf16, fp16, fp32, fp64")
    p.add_argument("--format", choices=("safetensors", "pt", "hf"),
                   help="output format (default: from OUT's suffix); hf: a directory of "
                        "model-0000k-of-0000n.safetensors shards and their index")
    p.add_argument("--max-shard-size", metavar="SIZE", default="5GB",
                   help="hf: the largest shard, e.g. 5GB (default), 500MiB or bytes")
    p.set_defaults(func=_cmd_export, parser=p)

    p = sub.add_parser("cp", parents=common, help="copy committed steps between storages",
                       description="Copy committed steps (all, or --step) from SRC to DST, "
                                   "checking checksums; each step is committed at DST last.")
    p.add_argument("src", metavar="SRC_URL")
    p.add_argument("dst", metavar="DST_URL")
    p.add_argument("--step", dest="steps", type=_int_at_least(0), action="append", default=[],
                   metavar="N", help="copy step N (repeatable; default: every committed step)")
    p.add_argument("--dst-option", dest="dst_options", metavar="KEY=VALUE", type=_option,
                   action="append", default=[], help="fsspec option for DST_URL")
    p.set_defaults(func=_cmd_cp, parser=p)

    p = sub.add_parser("import", parents=common, help="import a plain DCP checkpoint",
                       description="Bring in a checkpoint written by plain "
                                   "torch.distributed.checkpoint (torch_xla, torchtitan, "
                                   "dcp.save) as committed step N of DST_URL.")
    p.add_argument("src", metavar="SRC", help="local DCP checkpoint directory (with .metadata)")
    p.add_argument("dst", metavar="DST_URL")
    p.add_argument("--step", type=_int_at_least(0), required=True, metavar="N")
    p.add_argument("--trusted", action="store_true",
                   help="required: DCP metadata is pickle, which can run code")
    p.add_argument("--dst-option", dest="dst_options", metavar="KEY=VALUE", type=_option,
                   action="append", default=[], help="fsspec option for DST_URL")
    p.set_defaults(func=_cmd_import, parser=p)
    return parser


def _register_secrets(args: argparse.Namespace) -> None:
    for name in ("url", "src", "dst", "out"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            register_url(value)
    for name in ("options", "dst_options"):
        pairs = getattr(args, name, None) or []
        opts = dict(pairs)
        register_options(opts)
        setattr(args, name, opts or None)


class _LogFormatter(logging.Formatter):
    """One redacted line per record; tracebacks only with --debug."""

    def __init__(self, debug: bool) -> None:
        super().__init__("ckptmgr: %(levelname)s: %(name)s: %(message)s")
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if not self.debug:
            record = logging.makeLogRecord(record.__dict__)
            record.exc_info = record.exc_text = record.stack_info = None
            text = " ".join(super().format(record).split("\n"))
        else:
            text = super().format(record)
        return "\n".join(printable(part) for part in redact(text).split("\n"))


@contextlib.contextmanager
def _logging_to_stderr(debug: bool) -> Iterator[None]:
    """ckptmgr's warnings on stderr; other libraries' logs only with --debug. Restores the
    logging setup afterwards (main may run inside another program, e.g. a test)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter(debug))
    root, ours = logging.getLogger(), logging.getLogger("ckptmgr")
    saved = (root.level, ours.level, list(root.handlers))
    for h in saved[2]:
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.stdout):
            root.removeHandler(h)  # a console handler would print records a second time
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.CRITICAL + 1)
    ours.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(handler)
        for h in saved[2]:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(saved[0])
        ours.setLevel(saved[1])


def _one_line(e: BaseException) -> str:
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    return text or type(e).__name__


def _write_traceback() -> None:
    lines = redact(traceback.format_exc()).split("\n")
    sys.stderr.write("\n".join(printable(line) for line in lines))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    _register_secrets(args)
    out = _Out(args)
    with _logging_to_stderr(args.debug):
        return _run(args, out, parser)


def _run(args: argparse.Namespace, out: _Out, parser: _Parser) -> int:
    func: Callable[[argparse.Namespace, _Out], int] = args.func
    try:
        return func(args, out)
    except _UsageError as e:
        usage: _Parser = getattr(args, "parser", parser)
        usage.error(str(e))
    except KeyboardInterrupt:
        if out.progress is not None:
            out.progress.finish()
        out.note("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, as tools killed by SIGPIPE do.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (CkptmgrError, OSError) as e:
        if args.debug:
            _write_traceback()
        out.note(f"error: {_one_line(e)}")
        return EXIT_ERROR
    except Exception as e:
        if args.debug:
            _write_traceback()
        out.note(f"internal error: {type(e).__name__}: {_one_line(e)} (run with --debug for the "
                 "traceback)")
        return EXIT_ERROR

if __name__ == "__main__":
    sys.exit(main())
