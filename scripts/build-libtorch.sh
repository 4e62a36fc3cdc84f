#!/usr/bin/env bash
# Build Flotilla with the LibTorch backend (cargo feature `libtorch` -> burn's `tch` backend)
# against the libtorch shipped inside a pip-installed PyTorch, then (unless --build-only) run a
# short training job on it: `flotilla launch -n 1 --device libtorch --max-steps 200`.
#
# Usage: scripts/build-libtorch.sh [--build-only] [--install] [--steps N] [--output DIR]
#   --install     pip-install the torch version that burn's tch crate expects if torch is missing
#   --build-only  stop after the build
#   --steps N     training steps of the check run (default 200)
#   --output DIR  output directory of the check run (default /tmp/flotilla-libtorch-run)
#
# Environment:
#   CARGO_TARGET_DIR  default /work/targets/libtorch: a SEPARATE target dir, because the
#                     feature changes burn's build and would invalidate a shared flex one.
#   PYTHON            default python3
#   LIBTORCH_BYPASS_VERSION_CHECK=1  lets torch-sys accept a torch other than the one it pins
#                     (burn 0.22.1 -> tch 0.22.0 -> torch 2.9.0); may or may not link/run.
#
# How it works: torch-sys (tch's build script) finds libtorch through the Python interpreter when
# LIBTORCH_USE_PYTORCH=1 (headers and libs under site-packages/torch), and the binary needs that
# torch/lib directory on LD_LIBRARY_PATH at run time (libtorch_cpu.so, libc10.so, libgomp...).
# The PyPI torch wheel for Linux x86_64 is the CUDA build (it also pulls nvidia-* wheels); it
# runs fine on a machine without a GPU, and Flotilla's `libtorch` device is the CPU device.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD_ONLY=0
INSTALL=0
STEPS=200
OUTPUT=/tmp/flotilla-libtorch-run
while [ $# -gt 0 ]; do
    case "$1" in
        --build-only) BUILD_ONLY=1 ;;
        --install) INSTALL=1 ;;
        --steps) STEPS=$2; shift ;;
        --output) OUTPUT=$2; shift ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

# The torch version torch-sys pins (read from the lock file's tch version -> known pin).
TCH_VERSION=$(awk '/^name = "tch"$/ {getline; gsub(/"/, "", $3); print $3}' Cargo.lock)
case "$TCH_VERSION" in
    0.22.*) WANT_TORCH=2.9.0 ;;
    0.21.*) WANT_TORCH=2.8.0 ;;
    0.20.*) WANT_TORCH=2.7.0 ;;
    *) WANT_TORCH="" ;;
esac

if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    if [ "$INSTALL" = 1 ] && [ -n "$WANT_TORCH" ]; then
        echo "== installing torch==$WANT_TORCH from PyPI (large: CUDA wheels come with it)"
        "$PYTHON" -m pip install "torch==$WANT_TORCH"
    else
        echo "error: PyTorch is not installed for $PYTHON." >&2
        echo "       pip install torch==${WANT_TORCH:-<the version tch $TCH_VERSION expects>}  (or rerun with --install)" >&2
        exit 1
    fi
fi

TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
TORCH_LIB=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
echo "== tch $TCH_VERSION (expects torch ${WANT_TORCH:-?}); found torch $TORCH_VERSION at $TORCH_LIB"
if [ -n "$WANT_TORCH" ] && [ "$TORCH_VERSION" != "$WANT_TORCH" ] && [ -z "${LIBTORCH_BYPASS_VERSION_CHECK:-}" ]; then
    echo "warning: torch $TORCH_VERSION != $WANT_TORCH: the build will fail the version check;" >&2
    echo "         pip install torch==$WANT_TORCH, or set LIBTORCH_BYPASS_VERSION_CHECK=1 to try anyway" >&2
fi

export LIBTORCH_USE_PYTORCH=1
# torch-sys's build script asks `python3` on PATH (`python` in a virtualenv) for the torch
# details: put $PYTHON's directory first, so that it asks the same interpreter.
PYTHON_DIR=$(dirname "$(command -v "$PYTHON")")
export PATH="$PYTHON_DIR:$PATH"
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/targets/libtorch}
# Do not let a LIBTORCH from the environment override the pip torch.
unset LIBTORCH LIBTORCH_INCLUDE LIBTORCH_LIB || true

echo "== cargo build --release -p flotilla --features libtorch (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
cargo build --release -p flotilla --features libtorch
BIN="$CARGO_TARGET_DIR/release/flotilla"
echo "== built $BIN"
[ "$BUILD_ONLY" = 1 ] && exit 0

if [ ! -d data/mnist ] || [ -z "$(ls -A data/mnist 2>/dev/null)" ]; then
    echo "note: data/mnist is empty or missing; the launch below uses the config's default data" >&2
fi
rm -rf "$OUTPUT"
# `--threads 1` (launch's default) only sets RAYON_NUM_THREADS; libtorch sizes its OpenMP pool
# from OMP_NUM_THREADS (default: all cores). Pin it to 1 thread per rank like flex: with 2
# OpenMP threads on a 2-core machine that is also busy with anything else, libtorch steps
# collapse (measured: 117 samples/s instead of ~6-12k). Override with OMP_NUM_THREADS=2.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "== OMP_NUM_THREADS=$OMP_NUM_THREADS $BIN launch -n 1 --device libtorch --max-steps $STEPS --output $OUTPUT"
"$BIN" launch -n 1 --device libtorch --max-steps "$STEPS" --output "$OUTPUT"
echo "== throughput lines from the run log"
grep -rh "samples/s\|samples_per_s" "$OUTPUT" 2>/dev/null | tail -5 || true
