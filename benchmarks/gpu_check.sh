#!/usr/bin/env bash
# The GPU lane in one command (docs/performance.md, "The GPU lane"; benchmarks/README.md).
#
#   benchmarks/gpu_check.sh OUTDIR            on a GPU host, offline: the `cuda` tests, then the GPU
#                                             benchmark; writes OUTDIR/junit.xml, OUTDIR/gpu_bench.md,
#                                             OUTDIR/gpu_bench.json and OUTDIR/log.txt
#   benchmarks/gpu_check.sh --dry-run OUTDIR  anywhere (CI): the same steps on the CPU, the `cuda`
#                                             tests collected and skipped, the benchmark on a tiny
#                                             CPU state (under a minute on a 2-core machine)
#   benchmarks/gpu_check.sh --fetch-wheels    on a machine with a package registry: download what a
#                                             GPU host's image may lack (pydantic and its parts,
#                                             xxhash) as wheels for that host's Python into
#                                             benchmarks/.wheels (git-ignored); carry that folder
#
# Environment: PYTHON (default python3), CKPTMGR_GPU_SCRATCH (scratch directory for the benchmark's
# files, default /tmp/ckptmgr-gpu-scratch; needs about twice the state free), CKPTMGR_GPU_BENCH_ARGS
# (extra arguments for benchmarks/gpu_bench.py, e.g. "--size 2GiB --reps 3"), CKPTMGR_GPU_BUDGET_S
# (the benchmark's time budget, default 150 s), CKPTMGR_WHEEL_PLATFORM_PY (default 3.12).
# Exit status: 0 when every test passed (or was skipped in a dry run) and the benchmark finished;
# 1 otherwise (the log says which step failed).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
wheels="$here/.wheels"
py="${PYTHON:-python3}"

usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$wheels"
    pyver="${CKPTMGR_WHEEL_PLATFORM_PY:-3.12}"
    # Binary wheels for the GPU host's interpreter and platform; pip resolves the dependencies
    # (pydantic-core's exact pin included) for that target, not for this machine.
    "$py" -m pip download --quiet --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$wheels" \
        "pydantic>=2.6" "xxhash>=3.4" || exit 1
    ls -1 "$wheels"
    echo "wheels for Python $pyver in $wheels ($(du -sh "$wheels" | cut -f1)); carry this folder to the GPU host"
    exit 0
fi

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
[[ $# -eq 1 && "$1" != -* ]] || usage
out="$(mkdir -p "$1" && cd "$1" && pwd)"
log="$out/log.txt"
: >"$log"
exec > >(tee -a "$log") 2>&1

status=0
step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

step "environment"
# The wheels only fill gaps: an environment that already imports ckptmgr's dependencies (a CI
# virtual environment, a host that has them) uses its own.
if ! "$py" -c "import pydantic, xxhash, yaml, fsspec, numpy" 2>/dev/null \
        && [[ -d "$wheels" ]] && compgen -G "$wheels/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/ckptmgr-gpu-site"
    rm -rf "$site"
    "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$wheels"/*.whl || { echo "FAILED: installing $wheels"; exit 1; }
    export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(ls "$wheels" | wc -l) wheels from $wheels into $site"
else
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ $dry -eq 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # a dry run is a CPU run, also on a GPU host
fi
"$py" - <<'EOF' || { echo "FAILED: the environment cannot import torch and ckptmgr"; exit 1; }
import os, platform, torch, ckptmgr
print(f"python {platform.python_version()}, torch {torch.__version__}, ckptmgr {ckptmgr.__version__},"
      f" {os.cpu_count()} CPUs")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
else:
    print("GPU: none (the cuda tests will be skipped)")
EOF
if [[ $dry -eq 0 ]] && ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "FAILED: no CUDA device visible; use --dry-run on a machine without a GPU"
    exit 1
fi

step "cuda tests"
timeout_flag=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then timeout_flag=(--timeout 240); fi
# The GPU host's image brings its own versions of torch and other packages: their deprecation
# notices are reported in the log, not turned into failures as the suite's own settings do.
(cd "$repo" && "$py" -m pytest tests/cuda -m cuda -p no:cacheprovider -q -rA "${timeout_flag[@]}" \
    -W "default::DeprecationWarning" -W "default::FutureWarning" -W "default::UserWarning" \
    --junitxml "$out/junit.xml") || { echo "FAILED: cuda tests"; status=1; }

step "GPU benchmark"
scratch="${CKPTMGR_GPU_SCRATCH:-/tmp/ckptmgr-gpu-scratch}"
mkdir -p "$scratch"
bench=("$here/gpu_bench.py" --dir "$scratch" --out "$out" --budget-s "${CKPTMGR_GPU_BUDGET_S:-150}")
if [[ $dry -eq 1 ]]; then bench+=(--dry-run); fi
# shellcheck disable=SC2206  # word splitting of the extra arguments is intended
bench+=(${CKPTMGR_GPU_BENCH_ARGS:-})
(cd "$repo" && "$py" "${bench[@]}") || { echo "FAILED: GPU benchmark"; status=1; }
rm -rf "$scratch"

step "done: status $status"
ls -l "$out"
exit $status
