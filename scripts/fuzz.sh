#!/usr/bin/env bash
# Fuzzes Flotilla's decoders and parsers (the cargo-fuzz targets in fuzz/) for SECONDS each,
# one target after the other, each in a single libFuzzer job; then prints a table of
# executions, executions per second and crashes per target.
#
#   scripts/fuzz.sh SECONDS [TARGET...]
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). Builds into
# $CARGO_TARGET_DIR (default fuzz/target). The corpus grows in fuzz/corpus/<target> (seeded
# from fuzz/seeds/<target>, regenerate those with `python3 fuzz/seeds.py`); logs and any
# crash/oom/timeout reproducer go to fuzz/runs/<time>/<target>/. Memory is capped
# (-rss_limit_mb=2048, -malloc_limit_mb=512), so allocating from a claimed length is a
# finding; so is an input that takes more than 10 s.
set -euo pipefail

secs="${1:?usage: scripts/fuzz.sh SECONDS [TARGET...]}"
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/fuzz/target}"

cargo +nightly fuzz build --target-dir "$CARGO_TARGET_DIR"
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
bin_dir="$CARGO_TARGET_DIR/$(rustc +nightly -vV | sed -n 's/^host: //p')/release"
runs="$root/fuzz/runs/$(date +%Y%m%d-%H%M%S)"

# Executions of a finished run: libFuzzer's final statistics, else its last status line.
executions() {
    local n
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$1" | tail -1)
    [ -n "$n" ] || n=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$1" | tail -1)
    [ -n "$n" ] || n=$(sed -n 's/^#\([0-9]*\).*/\1/p' "$1" | tail -1)
    echo "${n:-0}"
}

rows=()
total=0
for t in "${targets[@]}"; do
    dir="$runs/$t"
    mkdir -p "$dir" "fuzz/corpus/$t" "fuzz/seeds/$t"
    echo "== $t: ${secs}s" >&2
    dict=()
    case "$t" in
        model_spec | topology | train_config) dict=(-dict="$root/fuzz/dicts/yaml.dict") ;;
    esac
    # -jobs=1 -workers=1: one fuzzing process; libFuzzer logs it to fuzz-0.log in $dir.
    (cd "$dir" && "$bin_dir/$t" "${dict[@]}" -jobs=1 -workers=1 -max_total_time="$secs" \
        -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$dir/" "$root/fuzz/corpus/$t" "$root/fuzz/seeds/$t" \
        >"$dir/driver.log" 2>&1) || true
    log="$dir/fuzz-0.log"
    [ -f "$log" ] || log="$dir/driver.log"
    n=$(executions "$log")
    crashes=$(find "$dir" -maxdepth 1 \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' \
        -o -name 'leak-*' \) | wc -l)
    rows+=("$(printf '%-16s %14s %10s %8s' "$t" "$n" "$((n / secs))" "$crashes")")
    total=$((total + n))
done

printf '\n%-16s %14s %10s %8s\n' target executions exec/s crashes
printf '%s\n' "${rows[@]}"
printf '%-16s %14s\n' total "$total"
echo "logs and reproducers: ${runs#"$root"/}"
