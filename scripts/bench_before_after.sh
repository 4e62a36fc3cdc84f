#!/usr/bin/env bash
# Interleaved comparison of two flotilla binaries on an idle machine: all-reduce bandwidth
# (2 rounds) and end-to-end samples/s of a 2-rank job (3 rounds).
# Usage: scripts/bench_before_after.sh BEFORE_BINARY AFTER_BINARY
set -u
if [ $# -ne 2 ]; then
  echo "usage: $0 BEFORE_BINARY AFTER_BINARY" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
bin_of() { if [ "$1" = before ]; then echo "$BEFORE"; else echo "$AFTER"; fi; }
BEFORE=$1
AFTER=$2
for round in 1 2; do
  for which in before after; do
    echo "=== allreduce $which round $round $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    timeout 600 "$(bin_of $which)" bench allreduce -n 2,4 --sizes 4K,1M,16M,64M --iters 20 2>&1 | grep -v "^#"
  done
done
for round in 1 2 3; do
  for which in before after; do
    out=$(mktemp -d)
    timeout 600 "$(bin_of $which)" launch -n 2 --train-limit 25600 --epochs 3 --output "$out" >/dev/null 2>&1
    echo "=== e2e $which round $round: $(python3 -c "
import json, sys
print(' '.join(str(round(json.loads(l).get('samples_per_s', 0))) for l in open(sys.argv[1])))" "$out/metrics.jsonl")"
    rm -rf "$out"
  done
done
