#!/usr/bin/env bash
# The TCP all-reduce between hosts, emulated: 4 ranks, one per network namespace, each
# namespace's link to a common bridge shaped by tc (an HTB class with small bursts: rate
# only, no added delay) to 1 Gbit/s and 10 Gbit/s. For each rate: first a raw TCP transfer
# between two namespaces (does tc shape what we think?), then `flotilla bench allreduce`'s
# ranks started by hand in the namespaces (RANK, WORLD_SIZE, MASTER_ADDR), all-reduces of
# 1, 16, 64 and 256 MiB. Printed: busbw = algbw * 2(n-1)/n against the bound B (the link
# rate: an all-reduce cannot beat t = 2(n-1)/n * S/B), as a fraction (goal >= 0.90), and
# against the raw TCP goodput measured on the same links, one stream alone and a ring of
# streams at once (busbw/ring: what the machine's cores carry, on few cores below B).
#
# Usage (root): scripts/bench_shaped_links.sh            (from the checkout, after a release build)
# Env: FLOTILLA_BIN (default $CARGO_TARGET_DIR/release/flotilla), RATES (default
#      "1gbit 10gbit"), SIZES (default 1M,16M,64M,256M), ITERS (timed iterations per size,
#      default 5), NETNS_PREFIX / NETNS_SUBNET (default fsl / 10.79.0), NETNS_MTU (default
#      1500; 9000 for jumbo frames), RANKS (default 4), and any
#      FLOTILLA_COMM__* setting of the ranks (e.g. FLOTILLA_COMM__CHUNK_KB) passes through.
# RANKS_PER_HOST=k (default 1) puts k consecutive ranks in each namespace (RANKS/k hosts, the
# ranks of one host on its shared memory) and measures each value of HIERARCHICAL (default
# "auto off" when k > 1): the hierarchical all-reduce (rows labelled hier) against the flat
# one over every rank (tcp). Its bound is the host's link: t >= 2 (H-1)/H * S/B with H hosts,
# printed as bound/t; busbw/B stays the per-rank formula.
# On a machine with few cores the 10 Gbit/s links are CPU-bound (4 ranks copy every byte
# through the kernel twice): the script prints the core count, and first the raw ring's
# goodput on links with no shaping at all, what the cores carry.
set -u
cd "$(dirname "$0")/.."
B=${FLOTILLA_BIN:-${CARGO_TARGET_DIR:-target}/release/flotilla}
RATES=${RATES:-1gbit 10gbit}
SIZES=${SIZES:-1M,16M,64M,256M}
ITERS=${ITERS:-5}
N=${RANKS:-4}
K=${RANKS_PER_HOST:-1}
H=$((N / K))
if [ "$K" -gt 1 ]; then HIER=${HIERARCHICAL:-auto off}; else HIER=${HIERARCHICAL:-auto}; fi
[ $((H * K)) = "$N" ] || { echo "RANKS ($N) must be a multiple of RANKS_PER_HOST ($K)"; exit 1; }
export NETNS_PREFIX=${NETNS_PREFIX:-fsl} NETNS_SUBNET=${NETNS_SUBNET:-10.79.0}
[ -x "$B" ] || { echo "no release binary at $B (cargo build --release)"; exit 1; }
if [ "$(id -u)" != 0 ] || ! command -v tc >/dev/null || ! ip netns list >/dev/null 2>&1; then
  echo "needs root with ip netns and tc"; exit 1
fi
. scripts/netns_lib.sh
SHAPER=htb
trap netns_teardown EXIT

# Link rate in bytes per second: 1gbit -> 125000000.
rate_bytes() {
  python3 -c "import re,sys; m=re.fullmatch(r'([\d.]+)([kmg]?)bit', sys.argv[1].lower()); print(int(float(m[1]) * {'':1,'k':1e3,'m':1e6,'g':1e9}[m[2]] / 8))" "$1"
}

# Raw TCP: a receiver in namespace $1 on port $2 prints its goodput (bytes/s) once the sender
# closes; a sender in namespace $1 writes 1 MiB blocks to $2:$3 for 2 s.
tcp_receiver() {
  timeout 30 ip netns exec "$1" python3 - "$2" <<'PY'
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
c, _ = s.accept(); got = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    got += len(b)
print(int(got / (time.perf_counter() - t0)))
PY
}
tcp_sender() {
  timeout 30 ip netns exec "$1" python3 - "$2" "$3" <<'PY'
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = b"x" * (1 << 20); end = time.perf_counter() + 2
while time.perf_counter() < end: s.sendall(buf)
s.close()
PY
}

# Raw TCP goodput (bytes/s) from namespace 1 to namespace 0.
raw_tcp() {
  local port=$((29900 + RANDOM % 90)) server
  tcp_receiver "${NETNS_PREFIX}0" "$port" &
  server=$!
  sleep 0.5
  tcp_sender "${NETNS_PREFIX}1" "$(netns_addr 0)" "$port"
  wait "$server"
}

# Raw TCP goodput of a ring (bytes/s, the slowest link): every namespace sends to the next
# at once for 2 s, the traffic pattern of a ring all-reduce's steps. On few cores this, not
# the link rate, is what the machine can carry: the all-reduce is compared with it too.
raw_ring() {
  local port=$((29800 + RANDOM % 90)) i dir
  dir=$(mktemp -d)
  for i in $(seq 0 $((H - 1))); do
    tcp_receiver "${NETNS_PREFIX}$i" "$port" > "$dir/$i" &
  done
  sleep 0.5
  for i in $(seq 0 $((H - 1))); do
    tcp_sender "${NETNS_PREFIX}$(((i + H - 1) % H))" "$(netns_addr "$i")" "$port" &
  done
  wait
  cat "$dir"/* | sort -n | head -1
  rm -rf "$dir"
}

# The ranks of one measurement (rank i in namespace i / K; FLOTILLA_COMM__HIERARCHICAL=$2);
# prints rank 0's "@bench" lines (label tcp, or hier when the all-reduce was hierarchical).
run_ranks() { # out_prefix hierarchical
  local port=$((29700 + RANDOM % 200)) pids=() i
  for i in $(seq 0 $((N - 1))); do
    timeout 900 ip netns exec "$NETNS_PREFIX$((i / K))" env RANK=$i WORLD_SIZE=$N \
      MASTER_ADDR="$(netns_addr 0)" MASTER_PORT=$port RAYON_NUM_THREADS=1 \
      FLOTILLA_COMM__HIERARCHICAL="$2" \
      "$B" bench allreduce-worker --backend tcp --iters "$ITERS" --sizes "$SIZES" \
      > "$1.rank$i.out" 2> "$1.rank$i.err" &
    pids+=($!)
  done
  local ok=0
  for p in "${pids[@]}"; do wait "$p" || ok=1; done
  grep -E '^@bench (tcp|hier) ' "$1.rank0.out"
  return $ok
}

OUT=${OUT:-/tmp/flotilla-shaped-links}
rm -rf "$OUT"; mkdir -p "$OUT"
echo "# flotilla $("$B" --version 2>/dev/null) on $(nproc) cores, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $N ranks, $K per namespace ($H namespaces); links shaped by HTB (rate only, burst 15k), MTU $NETNS_MTU; busbw/B: against the link rate; bound/t: the host link's bound 2(H-1)/H S/B over the time"
# What the cores carry with no shaping at all (a 100 Gbit/s class): the raw ring's ceiling.
if netns_setup $H 100gbit; then
  ceiling=$(raw_ring)
  echo "# unshaped (100gbit class): raw TCP ring of $H namespaces at once, slowest link $(python3 -c "print(f'{${ceiling:-0}/1e9:.3f} GB/s')")"
fi
for rate in $RATES; do
  netns_setup $H "$rate" || { echo "## $rate: setup failed"; continue; }
  bound=$(rate_bytes "$rate")
  raw=$(raw_tcp)
  ring=$(raw_ring)
  echo "## link $rate: B = $(python3 -c "print(f'{$bound/1e9:.3f}')") GB/s; raw TCP goodput ns1->ns0 $(python3 -c "print(f'{${raw:-0}/1e9:.3f} GB/s = {${raw:-0}/$bound:.2f} B')"); raw TCP ring of $H namespaces at once, slowest link $(python3 -c "print(f'{${ring:-0}/1e9:.3f} GB/s = {${ring:-0}/$bound:.2f} B')")"
  for hier in $HIER; do
    echo "### hierarchical: $hier"
    printf "%5s %10s %6s %10s %12s %12s %8s %10s %8s %10s\n" kind size iters time_ms algbw_GB/s busbw_GB/s busbw/B busbw/raw bound/t busbw/ring
    rows=$(run_ranks "$OUT/$rate-$hier" "$hier") || { echo "## $rate $hier: ranks FAILED (see $OUT/$rate-$hier.rank*.err)"; continue; }
    echo "$rows" | while read -r _ kind bytes iters secs algbw busbw; do
      python3 -c "
b, i, s, a, u, B, raw, ring, H = $bytes, $iters, $secs, $algbw, $busbw, $bound, ${raw:-0}, ${ring:-0}, $H
t_min = 2 * (H - 1) / H * b / B if H > 1 else 0
print(f'{\"$kind\":>5} {b >> 20:>6} MiB {i:>6} {s * 1e3:>10.1f} {a:>12.3f} {u:>12.3f} {u * 1e9 / B:>8.2f} {u * 1e9 / raw if raw else 0:>10.2f} {t_min / s:>8.2f} {u * 1e9 / ring if ring else 0:>10.2f}')"
    done
  done
done
