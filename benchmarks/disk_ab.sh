#!/usr/bin/env bash
# The byte-path A/B runs of docs/performance.md ("Choosing the byte path") on another machine's
# disk, in one command (about 3.5 minutes on a 16-core host): the two write floors, direct against
# buffered and against the measured choice, writes in flight, the head copy, restore against
# dcp.load and against the read floor; 1 GiB, 10 interleaved pairs each (benchmarks/ab.py).
#
#   OUT=/path/for/results benchmarks/disk_ab.sh      (JSON per comparison and log.txt in $OUT)
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
run() { name=$1; shift; echo "== $name ($(date -u +%T))"
  timeout 60 "$py" "$repo/benchmarks/ab.py" "$@" --size 1GiB --pairs 10 --dir "$scratch" --out "$out/$name.json" 2>&1 | tail -9; }
run floors --a floor.write_stream --b floor.write_direct
run save-direct-vs-buffered --a "ckptmgr.storage.local.DIRECT_IO=True" --b "ckptmgr.storage.local.DIRECT_IO=False"
run save-direct-vs-auto --a "ckptmgr.storage.local.DIRECT_IO=True" --b "ckptmgr.storage.local.DIRECT_IO=None"
run save-threads-4-vs-8 --a "ckptmgr.storage.local.DIRECT_IO=True ckptmgr.storage.local._DIRECT_THREADS=4" --b "ckptmgr.storage.local.DIRECT_IO=True ckptmgr.storage.local._DIRECT_THREADS=8"
run copy-heads-off-vs-on --a "ckptmgr.storage.local.DIRECT_IO=True ckptmgr.storage.local._COPY_BELOW=0" --b "ckptmgr.storage.local.DIRECT_IO=True"
run save-threads-4-vs-1 --a "ckptmgr.storage.local.DIRECT_IO=True ckptmgr.storage.local._DIRECT_THREADS=4" --b "ckptmgr.storage.local.DIRECT_IO=True ckptmgr.storage.local._DIRECT_THREADS=1"
run restore-vs-dcp --a ckptmgr.restore --b dcp.load
run floor-read-vs-restore --a floor.read --b ckptmgr.restore
rm -rf "$scratch"
echo "== done $(date -u +%T)"
