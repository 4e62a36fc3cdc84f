#!/usr/bin/env bash
# Sync all-reduce without overlap, with backward overlapped, and async all-reduce: time per
# step and time to 99% test accuracy, LeNet-5 on the vendored MNIST, 2 and 4 ranks (global
# batch 128), on loopback and on emulated links (a network namespace per rank, veth pairs to
# a bridge, tc netem on each rank's side: 1 Gbit/s and 100 Mbit/s, 1 ms delay each way).
#
# Usage: scripts/bench_allreduce_modes.sh            (from the checkout, after a release build)
# Env:   FLOTILLA_BIN (default $CARGO_TARGET_DIR/release/flotilla), OUT (default
#        /tmp/flotilla-bench-modes), LINKS_ONLY=1 (skip the loopback runs).
#
# Every run is a full run with target_accuracy 0.99 (evaluated each epoch, 8 epochs at
# most): steps and seconds to 99% and the step time (median over epochs). The links
# need root (ip netns, tc); without it the script says so and measures loopback only. The
# 1 ms delay needs the kernel's netem qdisc; without it the links are rate-shaped only
# (HTB) and the script says so. The namespaces come from scripts/netns_lib.sh.
# One run (async, 2 ranks, 100 Mbit/s) writes a Chrome timeline; the fraction of
# communication hidden behind compute is read from every timeline written.
set -u
cd "$(dirname "$0")/.."
B=${FLOTILLA_BIN:-${CARGO_TARGET_DIR:-target}/release/flotilla}
OUT=${OUT:-/tmp/flotilla-bench-modes}
export RAYON_NUM_THREADS=1
[ -x "$B" ] || { echo "no release binary at $B (cargo build --release)"; exit 1; }
rm -rf "$OUT"; mkdir -p "$OUT"

# The example's model, optimizer and schedule; 0.05 MiB buckets split LeNet-5's backward
# into 3 groups (both sync modes use the same buckets, so they compute the same numbers).
config() { # mode ranks extra...
  local mode=$1 n=$2; shift 2
  cat <<EOF
model: lenet5
data: data/mnist
batch_size: $((128 / n))
optimizer: {name: sgd, lr: 0.04, momentum: 0.9, weight_decay: 0.0005}
lr_schedule: cosine
warmup_steps: 300
seed: 42
world_size: $n
bucket_mb: 0.05
eval_every: 1
EOF
  case $mode in
    sync) echo "overlap: false" ;;
    overlap) echo "overlap: true" ;;
    async) echo "strategy: async_allreduce" ;;
  esac
  for kv in "$@"; do echo "$kv"; done
}

# Step time (ms, median over epochs of 128 samples / samples per second), steps and seconds to 99% (from
# the first epoch line at >= 0.99), best accuracy: parsed from rank 0's run.log.
summarize() { # run.log
  python3 - "$1" <<'PY'
import re, statistics, sys
per_step, hit, best = [], None, 0.0
for line in open(sys.argv[1]):
    m = re.search(r"\[\s*([\d.]+)s\] epoch \d+/\d+ step=(\d+) .*?(?:test_acc=([\d.]+))? samples/s=(\d+)", line)
    if not m:
        continue
    t, step, acc, sps = float(m[1]), int(m[2]), m[3], float(m[4])
    per_step.append(1000 * 128 / sps)
    if acc is not None:
        best = max(best, float(acc))
        if hit is None and float(acc) >= 0.99:
            hit = (step, t)
ms = statistics.median(per_step) if per_step else float("nan")
spread = f"{min(per_step):.1f}-{max(per_step):.1f}" if per_step else "-"
print(f"{ms:.2f} {spread} {hit[0] if hit else '-'} {hit[1] if hit else '-'} {best:.4f}")
PY
}

# Fraction of all-reduce time that overlaps forward/backward on the same rank.
hidden() { # timeline.json
  python3 - "$1" <<'PY'
import json, sys
events = json.load(open(sys.argv[1]))
if isinstance(events, dict):
    events = events.get("traceEvents", [])
def union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out
def inter(x, y):
    i = j = 0; tot = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        tot += max(0.0, b - a)
        if x[i][1] < y[j][1]: i += 1
        else: j += 1
    return tot
pids = sorted({e.get("pid") for e in events if e.get("ph") == "X"})
parts = []
for p in pids:
    span = lambda names: union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                               if e.get("ph") == "X" and e.get("pid") == p and e.get("name") in names])
    ar, comp = span({"all_reduce"}), span({"forward", "backward"})
    total = sum(b - a for a, b in ar)
    if total > 0:
        parts.append((inter(ar, comp) / total, total / 1e3))
print(" ".join(f"rank{i}:{f:.0%}_of_{ms:.0f}ms" for i, (f, ms) in enumerate(parts)) or "no all_reduce spans")
PY
}

echo "# flotilla $("$B" --version 2>/dev/null) on $(nproc) cores, $(date -u +%FT%TZ)"
if [ -z "${LINKS_ONLY:-}" ]; then
echo "## loopback: full runs to 99% (8 epochs at most)"
echo "mode ranks step_ms_median step_ms_range steps_to_99 s_to_99 best_acc"
for n in 2 4; do
  for mode in sync overlap async; do
    d=$OUT/lo-$mode-$n; mkdir -p "$d"
    config $mode $n "epochs: 8" "target_accuracy: 0.99" "output: $d" > "$d.yaml"
    "$B" launch "$d.yaml" > "$d.out" 2>&1 || { echo "$mode $n FAILED (see $d.out)"; continue; }
    echo "$mode $n $(summarize "$d/rank-0/run.log")"
  done
done
fi

if [ "$(id -u)" != 0 ] || ! command -v tc >/dev/null || ! ip netns list >/dev/null 2>&1; then
  echo "## emulated links: skipped (needs root with ip netns and tc; run as root)"
  exit 0
fi

. scripts/netns_lib.sh
netns_probe_netem
trap netns_teardown EXIT

# One rank per namespace, started torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR).
run_ns() { # dir config ranks [timeline]
  local d=$1 cfg=$2 n=$3 port=$((29700 + RANDOM % 200)) pids=()
  for i in $(seq 0 $((n - 1))); do
    ip netns exec "$NETNS_PREFIX$i" env RANK=$i WORLD_SIZE=$n MASTER_ADDR="$(netns_addr 0)" MASTER_PORT=$port \
      RAYON_NUM_THREADS=1 "$B" train "$cfg" > "$d.rank$i.out" 2>&1 &
    pids+=($!)
  done
  local ok=0
  for p in "${pids[@]}"; do wait "$p" || ok=1; done
  return $ok
}

for rate in 1gbit 100mbit; do
  netns_setup 4 $rate || { echo "## link $rate: setup failed"; continue; }
  if [ "$SHAPER" = netem ]; then
    echo "## link $rate, 1 ms delay each way (netem): full runs to 99%"
  else
    echo "## link $rate, NO added delay (this kernel has no sch_netem; HTB shapes the rate only): full runs to 99%"
  fi
  echo "mode ranks step_ms_median step_ms_range steps_to_99 s_to_99 best_acc"
  for n in 2 4; do
    for mode in sync overlap async; do
      d=$OUT/$rate-$mode-$n; mkdir -p "$d"
      extra=("epochs: 8" "target_accuracy: 0.99" "output: $d")
      if [ $rate = 100mbit ] && [ $n = 2 ]; then extra+=("timeline_path: $d/timeline.json"); fi
      config $mode $n "${extra[@]}" > "$d.yaml"
      run_ns "$d" "$d.yaml" $n || { echo "$mode $n FAILED (see $d.rank*.out)"; continue; }
      echo "$mode $n $(summarize "$d/rank-0/run.log")"
      if ls "$d"/rank-*/timeline.jsonl >/dev/null 2>&1; then
        "$B" trace merge --output "$d/timeline.json" "$d"/rank-*/timeline.jsonl >/dev/null 2>&1
      fi
      [ -f "$d/timeline.json" ] && echo "#   hidden communication ($mode $n, $rate): $(hidden "$d/timeline.json")"
    done
  done
done
