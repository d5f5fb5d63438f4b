#!/usr/bin/env bash
# Run PyTorch Lightning's own checkpointing tests (tests_pytorch/checkpointing) three times: with
# Lightning's default checkpoint I/O; with ckptmgr's CkptmgrCheckpointIO swapped in as every
# strategy's default (the plugin's defaults); and, a diagnostic, swapped in with root= outside the
# checkpoint directories and torch.load made to read our pointer files, so the tests that list the
# directory or open the .ckpt file themselves still check what the plugin saves and restores.
# Prints the counts and writes WORK/lost.txt: each test that passes with the default I/O and not
# with ours, its first error, and its outcome in the diagnostic (docs/integrations.md, section 3).
#
# Nothing of Lightning's code enters this repository: its tests are unpacked into WORK (default
# /tmp/ckptmgr-lightning-suite) at the tag of the installed lightning (or the newest tag below it
# when that one is not in the source), and the few packages its tests import that ckptmgr's test
# extras lack go into WORK/deps (pip --target; the project's environment is left alone).
#
# Usage: scripts/lightning_suite.sh          (PYTEST_ARGS: more pytest arguments, e.g. "-k top_k")
#   PYTHON            the interpreter with ckptmgr and lightning (default: .venv/bin/python)
#   LIGHTNING_GIT_DIR a clone (or bare git dir) of Lightning-AI/pytorch-lightning; without it the
#                     repository is cloned from GitHub into WORK/src
#   WORK              where everything is unpacked and run (default /tmp/ckptmgr-lightning-suite)
#   SUITE_TIMEOUT     seconds for each of the three runs (default 3600); each test gets 300 s
# CPU heavy (three runs of about 160 tests, about 2 minutes each on 2 cores): run it once,
# not in a loop.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
WORK="${WORK:-/tmp/ckptmgr-lightning-suite}"
SUITE_TIMEOUT="${SUITE_TIMEOUT:-3600}"
mkdir -p "$WORK"

version="$("$PYTHON" -c 'import lightning; print(lightning.__version__)')"
if [ -z "${LIGHTNING_GIT_DIR:-}" ]; then
    LIGHTNING_GIT_DIR="$WORK/src/.git"
    [ -d "$LIGHTNING_GIT_DIR" ] || git clone --quiet --bare \
        https://github.com/Lightning-AI/pytorch-lightning "$LIGHTNING_GIT_DIR"
fi
git_() { git --git-dir="$LIGHTNING_GIT_DIR" "$@"; }
tag="$version"
if ! git_ rev-parse --verify --quiet "refs/tags/$tag" >/dev/null; then
    # the newest release tag at or below the installed version
    tag="$(git_ tag --list '[0-9]*.[0-9]*.[0-9]*' | grep -E '^[0-9]+\.[0-9]+\.[0-9]+$' |
           "$PYTHON" -c "import sys; v = tuple(map(int, '$version'.split('.')[:3])); \
ts = [t.strip() for t in sys.stdin if tuple(map(int, t.split('.'))) <= v]; \
print(max(ts, key=lambda t: tuple(map(int, t.split('.')))))")"
    echo "lightning $version is installed; its tag is not in the source: using $tag"
fi
rm -rf "$WORK/lightning"
mkdir -p "$WORK/lightning"
git_ archive "$tag" tests/tests_pytorch pyproject.toml | tar -x -C "$WORK/lightning"

# What Lightning's tests import beyond ckptmgr's test extras (no dependencies pulled: the
# project's environment already has them).
[ -d "$WORK/deps/jsonargparse" ] || "$PYTHON" -m pip install -q --no-deps --target "$WORK/deps" \
    jsonargparse cloudpickle pytest-timeout

# The swap: every strategy's default checkpoint I/O becomes CkptmgrCheckpointIO (Lightning's
# Strategy.checkpoint_io builds TorchCheckpointIO() when none was given).
cat > "$WORK/deps/ckptmgr_swap.py" <<'EOF'
"""pytest plugin: CKPTMGR_SWAP=1 makes CkptmgrCheckpointIO Lightning's default checkpoint I/O;
CKPTMGR_SWAP=2 (a diagnostic) also puts the run roots in CKPTMGR_SWAP_ROOT (the plugin's root=,
so the checkpoint directories hold only .ckpt files) and lets torch.load read our pointer files
through the plugin, so the tests that list the directory or open the .ckpt file themselves
still check what the plugin saves and restores."""
import os

if os.environ.get("CKPTMGR_SWAP") in ("1", "2"):
    import lightning.pytorch.strategies.strategy as _strategy

    from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

    class _SwappedIO(CkptmgrCheckpointIO):
        """The plugin with its defaults, where Lightning would make a TorchCheckpointIO."""

        def __init__(self, **kwargs):
            kwargs.setdefault("root", os.environ.get("CKPTMGR_SWAP_ROOT") or None)
            super().__init__(**kwargs)

    _strategy.TorchCheckpointIO = _SwappedIO

if os.environ.get("CKPTMGR_SWAP") == "2":
    import torch

    _torch_load = torch.load

    def _pointer_path(f):
        """The path of a ckptmgr pointer file given as a path or an open file, else None."""
        path = f if isinstance(f, (str, os.PathLike)) else (
            getattr(f, "path", None) or getattr(f, "name", None))
        if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
            return None
        with open(path, "rb") as fh:
            return os.fspath(path) if fh.read(15) == b'{"ckptmgr_step"' else None

    def _load(f, *args, **kwargs):
        path = _pointer_path(f)
        if path is None:
            return _torch_load(f, *args, **kwargs)
        io = CkptmgrCheckpointIO()
        try:
            return io.load_checkpoint(path)
        finally:
            io.teardown()

    torch.load = _load
EOF

run() {  # run NAME SWAP [ROOT]: one pass over the suite, junit XML into WORK/NAME.xml
    (cd "$WORK/lightning/tests" &&
     CKPTMGR_SWAP="$2" CKPTMGR_SWAP_ROOT="${3:-}" PYTHONPATH="$WORK/deps:$WORK/lightning/tests${PYTHONPATH:+:$PYTHONPATH}" \
     timeout "$SUITE_TIMEOUT" "$PYTHON" -m pytest tests_pytorch/checkpointing -q \
        -p no:cacheprovider -p ckptmgr_swap --timeout 300 --color=no \
        --ignore=tests_pytorch/checkpointing/test_legacy_checkpoints.py \
        -c "$WORK/lightning/pyproject.toml" --rootdir "$WORK/lightning/tests" \
        --junitxml "$WORK/$1.xml" ${PYTEST_ARGS:-} > "$WORK/$1.log" 2>&1) || true
    tail -1 "$WORK/$1.log"
}
echo "== default I/O";         run default 0
echo "== CkptmgrCheckpointIO"; run ckptmgr 1
echo "== CkptmgrCheckpointIO, root= elsewhere, pointer-aware torch.load (diagnostic)"
rm -rf "$WORK/roots"
run reading 2 "$WORK/roots"

"$PYTHON" - "$WORK" <<'EOF'
"""Compare the two runs: counts, and each test that only our I/O fails, with its first error."""
import sys
import xml.etree.ElementTree as ET

work = sys.argv[1]


def outcomes(name):
    out = {}
    for case in ET.parse(f"{work}/{name}.xml").iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            text = (bad.get("message") or bad.text or "").strip().splitlines()
            out[key] = ("failed", text[0][:200] if text else "")
        elif case.find("skipped") is not None:
            out[key] = ("skipped", "")
        else:
            out[key] = ("passed", "")
    return out


base, ours, reading = outcomes("default"), outcomes("ckptmgr"), outcomes("reading")
for name, res in (("default I/O", base), ("CkptmgrCheckpointIO", ours),
                  ("diagnostic: root= elsewhere, pointer-aware torch.load", reading)):
    counts = {k: sum(1 for v in res.values() if v[0] == k) for k in ("passed", "failed", "skipped")}
    print(f"{name}: {counts}")
lost = sorted(k for k, v in base.items() if v[0] == "passed" and ours.get(k, ("?",))[0] != "passed")
print(f"pass with the default I/O, not with ours: {len(lost)} (listed in {work}/lost.txt)")
with open(f"{work}/lost.txt", "w") as f:
    for k in lost:  # the error with our I/O, then the outcome when torch.load reads pointers
        f.write(f"{k}\t{ours.get(k, ('missing', ''))[1]}\t"
                f"{reading.get(k, ('missing', ''))[0]}: {reading.get(k, ('', ''))[1]}\n")
EOF
