#!/bin/bash
# Issue 22's whole table in one run on one GPU machine: the extraction job against a plain write on the
# same disk (1b and e2e shapes), the capture ratio at the 1b shape (4 client processes) and the e2e shape
# (8; 64 and 128 in flight), then what fresh pages cost the spool's file system (bench/spool_pages.py).
# Each bench's full output goes to OUT_DIR (default bench/results/table-<time>); a summary line per bench goes to stdout. Every item
# has its own time limit (together under 600 s) so one stuck bench leaves the others' figures.
#
#     bench/capture_and_extraction_table.sh [OUT_DIR] [DISK_DIR]
#
# DISK_DIR is where extraction writes its records (the disk under test; default a temp dir under /tmp).
set -u
cd "$(dirname "$0")/.." || exit 1
out=${1:-bench/results/table-$(date +%Y%m%d-%H%M%S)}
own_disk=""
disk=${2:-}
[ -z "$disk" ] && { disk=$(mktemp -d /tmp/exttable-XXXXXX) || exit 1; own_disk=$disk; }
mkdir -p "$out" "$disk" || exit 1
python=${PYTHON:-python3}
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); cores: $(nproc); disk under test: $(df -h "$disk" | tail -1)"

item() {  # item NAME LIMIT_S PATTERN BENCH ARGS...
  local name=$1 limit=$2 pattern=$3; shift 3
  local started=$SECONDS
  timeout "$limit" "$python" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  echo "=== $name: rc $rc, $((SECONDS - started)) s"
  grep -E "$pattern" "$out/$name.txt"
}

capture_lines="capture overhead ratio|median per-round|capture on:|capture off:"
item extraction_1b 130 "extraction write ratio" bench/extraction.py --size 1b --samples 240 --pairs 3 --skip-atomic --out-dir "$disk"
item capture_1b 140 "$capture_lines" bench/capture_overhead.py --size 1b --length 2048 --requests 384 --rounds 8 --clients 4 --concurrency 16 --max-batch 16
item capture_e2e 130 "$capture_lines" bench/capture_overhead.py --size e2e --length 512 --requests 768 --rounds 24 --clients 8 --concurrency 64 --max-batch 64
# The same with two batches' worth in flight: a full queue, so the batches' size no longer depends on how fast
# the clients turn answers into requests (session 28 saw 28 requests a batch of 64 on both sides above).
item capture_e2e_queue 100 "$capture_lines" bench/capture_overhead.py --size e2e --length 512 --requests 768 --rounds 16 --clients 8 --concurrency 128 --max-batch 64
item extraction_e2e 60 "extraction write ratio" bench/extraction.py --size e2e --samples 800 --concurrency 32 --skip-atomic --out-dir "$disk"
item spool_pages 20 "GB/s|reused / fresh" bench/spool_pages.py
[ -n "$own_disk" ] && rmdir "$own_disk"  # the benches remove their own files; a given DISK_DIR stays
