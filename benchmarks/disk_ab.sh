#!/usr/bin/env bash
# Issue 28's byte-path comparisons (docs/performance.md) on another machine's disk, in one command
# (about 7 minutes on a 16-core host): the two write floors against each other, save and
# save_async (until committed) against the floors, the measured choice of direct or buffered
# writes, streamed direct reads against buffered ones, restore against dcp.load and against the
# read floor; 1 GiB, 10 interleaved pairs each (benchmarks/ab.py); round 5's candidate changes
# against the default; the disk's own write patterns (benchmarks/write_patterns.py). With
# BENCH=1, then one same-run bench.py (floors, torch.save, dcp, safetensors, ckptmgr; 3
# repetitions).
#
#   OUT=/path/for/results [BENCH=1] [SKIP="name ..."] benchmarks/disk_ab.sh
#
# JSON per comparison and log.txt in $OUT; SKIP names comparisons (as printed after "==") not to
# run, for a host whose time is short.
#
# Offline hosts: dependencies missing from the host's Python come from benchmarks/.wheels (see
# gpu_check.sh --fetch-wheels). The scratch files go under the repository (.ab-scratch), removed
# at the end.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
out="${OUT:-/tmp/ab-out}"; mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
if ! "$py" -c "import pydantic, xxhash, yaml, fsspec" 2>/dev/null; then
  site=/tmp/ckptmgr-site; rm -rf "$site"
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$repo"/benchmarks/.wheels/*.whl
  export PYTHONPATH="$site:$repo"
else
  export PYTHONPATH="$repo"
fi
"$py" -c "import yaml, fsspec, torch, ckptmgr; print('torch', torch.__version__)" || { echo "env broken"; "$py" -m pip list 2>/dev/null | head -50; exit 1; }
scratch="$repo/.ab-scratch"; mkdir -p "$scratch"
echo "== disk"; df -hT "$scratch" /tmp; lsblk -o NAME,SIZE,ROTA,TYPE,MODEL,TRAN 2>/dev/null | head -20
dev=$(df --output=source "$scratch" | tail -1); echo "source $dev"; findmnt -T "$scratch"
nproc; uptime
run() { name=$1; shift
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "== $name: skipped (SKIP)"; return; fi
  echo "== $name ($(date -u +%T))"
  timeout 60 "$py" "$repo/benchmarks/ab.py" "$@" --size 1GiB --pairs 10 --dir "$scratch" --out "$out/$name.json" 2>&1 | tail -9; }
run floors --a floor.write_stream --b floor.write_direct
run save-vs-floor-direct --a floor.write_direct --b ckptmgr.save
run save-vs-floor-stream --a floor.write_stream --b ckptmgr.save
run save-async-vs-floor-direct --a floor.write_direct --b ckptmgr.save_async
run save-direct-vs-auto --a "ckptmgr.storage.local.DIRECT_IO=True" --b "ckptmgr.storage.local.DIRECT_IO=None"
run restore-buffered-vs-streamed --op ckptmgr.restore --a "ckptmgr.storage.local.DIRECT_READ=False" --b "ckptmgr.storage.local.DIRECT_READ=True"
run restore-vs-dcp --a ckptmgr.restore --b dcp.load
run floor-read-vs-restore --a floor.read --b ckptmgr.restore
# Round 5 (docs/performance.md): its default (four bounce buffers in flight) against the old,
# and its candidates, off by default because 2 cores showed no gain: work moved off the
# caller's thread, and larger buffers.
run save-cap-vs-no-cap --op ckptmgr.save --a "ckptmgr.storage.local.COPY_IN_FLIGHT=None" --b ""
run save-copies-on-io-threads --op ckptmgr.save --a "" --b "ckptmgr.storage.local.COPY_IN_IO_THREADS=True"
run save-hash-behind --op ckptmgr.save --a "" --b "ckptmgr.dcp.writer.HASH_BEHIND=True"
run save-both-behind --op ckptmgr.save --a "" --b "ckptmgr.storage.local.COPY_IN_IO_THREADS=True ckptmgr.dcp.writer.HASH_BEHIND=True"
run save-32mib-buffers --op ckptmgr.save --a "" --b "ckptmgr.storage.local._COPY_DIV=32"
echo "== write patterns ($(date -u +%T))"
timeout 150 "$py" "$repo/benchmarks/write_patterns.py" --dir "$scratch" --rounds 4 --out "$out/write-patterns.json" 2>&1 | tail -12
if [[ "${BENCH:-0}" == 1 ]]; then
  echo "== bench.py ($(date -u +%T))"
  timeout 200 "$py" "$repo/benchmarks/bench.py" --size 1GiB --reps 3 --warmup 1 --nice -10 \
    --methods floors,torch,dcp,safetensors,ckptmgr --dir "$scratch" --out "$out/bench" 2>&1 | tail -40
fi
rm -rf "$scratch"
echo "== done $(date -u +%T)"
